"""Send completions: matched to their chunks and handles, failures and deadlines.

One :class:`SendReaper` per engine, called with the engine lock held by whichever
thread polled the send CQ (the progress thread, or a waiter reaping on its own thread).
It owns no table: it works on the engine's QPN index and pending handles, which it is
given, and talks back through :class:`ReapingHost`, a protocol defined here.
"""

from __future__ import annotations

from typing import Protocol

from hixl.core.window import Chunk
from hixl.engine.connection import Connection, Lane
from hixl.engine.handles import TransferHandle
from hixl.engine.posting import Poster
from hixl.errors import CompletionError, ConnectionFailed, HixlError, TransferTimeout
from hixl.verbs import adapter as verbs

__all__ = ["ReapingHost", "SendReaper", "deadline_error"]


class ReapingHost(Protocol):
    """What a :class:`SendReaper` needs of its engine (lock held for every call)."""

    def fail(
        self,
        conn: Connection,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
    ) -> None: ...

    def release_notify(self, chunk: Chunk) -> None: ...

    def connection_of(self, peer: str) -> Connection | None: ...


class SendReaper:
    """Handles send completions and expired transfers (engine lock)."""

    def __init__(
        self,
        lanes: dict[int, Lane],
        handles: set[TransferHandle],
        poster: Poster,
        host: ReapingHost,
    ) -> None:
        self._lanes = lanes  # the engine's index of every lane made, by QPN
        self._handles = handles  # the engine's pending handles
        self._poster = poster
        self._host = host

    def reap_send(self, wcs: list[tuple[int, int, int, int]]) -> int:
        """Handle send completions, rows of ``CompletionQueue.poll_rows``; return how many.

        One completion per signal group, not per work request.  Connections that freed
        send-queue room post more of their backlog once, after the whole batch.
        """
        if not wcs:
            return 0
        pump: dict[int, Lane] = {}
        for wr_id, status, vendor_err, qpn in wcs:
            lane = self._lanes.get(qpn)
            if lane is None:
                continue
            conn = lane.conn
            got = lane.window.completed(wr_id)
            if not got:
                continue  # completion of a chunk that was already failed
            if status != 0:
                chunk = got[-1][0]  # the failed WR's own chunk; those before it are done
                for early, _ in got[:-1]:
                    self.chunk_done(early)
                op = "RDMA transfer" if chunk.notify_slot is None else "notification"
                self._host.release_notify(chunk)
                name = verbs.WC_STATUS_NAMES.get(status, f"IBV_WC_STATUS_{status}")
                err = CompletionError(f"{op} to {conn.peer}", status, name, wr_id, vendor_err)
                if chunk.ring is not None:  # a group of messages: the members before it landed
                    group = chunk.handle
                    group.fail_at = wr_id - chunk.first_id
                    group.rest = ConnectionFailed(
                        f"connection to {conn.peer} failed: completion error {name}"
                    )
                for other in conn.all_lanes:
                    pump.pop(other.qpn, None)
                self._host.fail(conn, f"completion error {name}", err, culprit=chunk.handle)
                continue
            pump[qpn] = lane
            for chunk, finished in got:
                if finished:
                    self.chunk_done(chunk)
        for lane in pump.values():
            conn = lane.conn
            if conn.held and lane.index and conn.release_held():
                first = conn.lanes[0]
                if not first.window.poster:
                    self._poster.want_post(first)
            if lane.window.backlog and not lane.window.poster:
                self._poster.want_post(lane)
        return len(wcs)

    def chunk_done(self, chunk: Chunk) -> None:
        if chunk.notify_slot is not None:
            self._host.release_notify(chunk)
        handle = chunk.handle
        if handle is not None:
            left = handle.chunks_left - 1
            handle.chunks_left = left
            if not left:
                handle.finish(None)
                self._handles.discard(handle)

    def expire(self, now: float) -> None:
        for h in [h for h in self._handles if h.deadline <= now]:
            err = deadline_error(h)
            conn = self._host.connection_of(h.peer)
            if conn is not None:
                self._host.fail(conn, "a transfer timed out", err, culprit=h)
            else:
                h.finish(err)
                self._handles.discard(h)


def deadline_error(h: TransferHandle) -> TransferTimeout:
    """The error of a transfer past its deadline (queued or posted directly)."""
    return TransferTimeout(
        f"transfer to {h.peer} did not complete within its deadline "
        f"({h.nbytes} bytes, {h.num_wrs} work requests); the connection is marked "
        "failed because its requests cannot be recalled"
    )
