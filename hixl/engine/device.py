"""What an engine opens before its parts exist: the device, the two completion queues
sized for its limits, the notification send slots and the listening socket.

:func:`open_engine_device` opens them in order and, when one step fails, closes what it
had opened before raising: the engine then has nothing to release.
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass

from hixl.core.plan import DeviceLimits
from hixl.core.window import MAX_BATCHES
from hixl.engine.config import EngineConfig
from hixl.engine.connection import RECV_SLOTS
from hixl.engine.datapath import NotifySlots, signal_interval
from hixl.verbs import adapter as verbs

__all__ = ["SEND_NOTIFY_SLOTS", "EngineDevice", "open_engine_device"]

SEND_NOTIFY_SLOTS = 256  # notifications in flight per engine


@dataclass(frozen=True, slots=True)
class EngineDevice:
    """An engine's device side.  ``id`` is the engine's id (a connect-only engine's gets a
    random ``~suffix``); ``every`` is how many work requests go between two signaled ones."""

    dev: verbs.Device
    id: str
    sq_depth: int
    every: int
    limits: DeviceLimits
    send_cq: verbs.CompletionQueue
    recv_cq: verbs.CompletionQueue
    notify_slots: NotifySlots
    listener: socket.socket | None


def open_engine_device(
    cfg: EngineConfig,
    engine_id: str,
    device: str | None,
    port: int | None,
    gid_index: int | None,
    *,
    send_queue_depth: int,
    completion_events: bool,
) -> EngineDevice:
    """Open the device and what hangs off it for an engine of options ``cfg``.

    Raises :class:`DeviceError` when no device is usable, :class:`OSError` when the
    address cannot be bound.
    """
    dev = verbs.open_device(device, port, gid_index)
    try:
        caps = dev.caps
        sq_depth = max(32, min(send_queue_depth, caps.max_qp_wr))
        every = signal_interval(sq_depth)
        limits = DeviceLimits(
            max_sge=caps.max_sge,
            max_sge_rd=caps.max_sge_rd,
            max_msg_sz=min(caps.max_msg_sz, 0xFFFF_FFFF),
        )
        # Signaled WRs of every lane of every peer (group ends, and batch ends, of which a
        # window lets at most MAX_BATCHES be out), plus room for one connection's flushed
        # WRs (a failed queue pair completes every outstanding WR, signaled or not).
        per_lane = sq_depth // every + MAX_BATCHES
        cq_depth = (cfg.max_peers * per_lane + sq_depth) * cfg.lanes
        send_cq = dev.create_cq(cq_depth, events=completion_events)
        recv_cq = dev.create_cq(cfg.max_peers * RECV_SLOTS + 16, events=completion_events)
        notify_slots = NotifySlots(dev, SEND_NOTIFY_SLOTS)
        listener: socket.socket | None = None
        if cfg.tcp_port:
            listener = socket.create_server((cfg.host, cfg.tcp_port), backlog=1024)
            listener.setblocking(False)
            engine_id_out = engine_id
        else:
            engine_id_out = f"{cfg.host}:0~{secrets.token_hex(4)}"
    except BaseException:
        dev.close()
        raise
    return EngineDevice(
        dev, engine_id_out, sq_depth, every, limits, send_cq, recv_cq, notify_slots, listener
    )
