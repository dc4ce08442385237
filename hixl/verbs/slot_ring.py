"""A ring of single-SGE send work requests, each slot written by one ``struct`` call.

:class:`SlotRing` serves the engine's stream of small messages (one WR of one SGE each):
a message goes into the next free slot, consecutive slots are posted as one range, and a
slot is free again once the post that carried it returned.  :data:`WR_SLOT` is the
``struct`` format of one slot, for callers that pack slots inline.
"""

from __future__ import annotations

import struct

import numpy as np

from hixl.verbs._ffi import address, ffi
from hixl.verbs.chain import SendChain
from hixl.verbs.structs import SGE_DTYPE, WR_BYTES, WR_DTYPE

__all__ = ["SLOT_SGE_OFFSET", "WR_BYTES", "WR_SLOT", "SlotRing"]

_WR_SIZE = WR_BYTES
_SGE_SIZE = SGE_DTYPE.itemsize

# One slot of a SlotRing in one ``struct.pack_into``: the WR's fields from ``wr_id`` to
# ``wr.rdma.rkey`` (contiguous, checked below), zeros up to the union of ``bind_mw`` and
# ``tso``, and the slot's SGE in that union's bytes.  A provider reads that union only for
# a memory-window bind or a TSO send (rdma-core's rxe and mlx5 alike), never for an RDMA
# READ or WRITE, and copies the SGE from wherever ``sg_list`` points during the post; so
# each slot's WR carries its own SGE and one call writes both.
#: Offset of a ring slot's SGE inside its ``struct ibv_send_wr`` (the anonymous union of
#: ``bind_mw`` and ``tso``).
SLOT_SGE_OFFSET = ffi.offsetof("struct ibv_send_wr", "bind_mw")
_SLOT_WR_END = 52  # wr.rdma.rkey ends here (checked below)
#: ``struct ibv_send_wr`` from ``wr_id`` to ``wr.rdma.rkey``, zeros to
#: :data:`SLOT_SGE_OFFSET`, then the ``struct ibv_sge``; packed at ``slot * WR_BYTES``.
WR_SLOT = struct.Struct(f"<QQQiiIIQI{SLOT_SGE_OFFSET - _SLOT_WR_END}xQII")
_WR_SLOT_FIELDS = (
    "wr_id",
    "next",
    "sg_list",
    "num_sge",
    "opcode",
    "send_flags",
    "imm_data",
    "remote_addr",
    "rkey",
)
_at = 0
_WR_FIELDS = WR_DTYPE.fields
assert _WR_FIELDS is not None
for _name, _size in zip(_WR_SLOT_FIELDS, (8, 8, 8, 4, 4, 4, 4, 8, 4), strict=True):
    if _WR_FIELDS[_name][1] != _at:  # pragma: no cover - a libibverbs ABI change
        raise ImportError(f"struct ibv_send_wr: {_name} is not at offset {_at}")
    _at += _size
if not (
    _at == _SLOT_WR_END
    and ffi.offsetof("struct ibv_send_wr", "qp_type") + 4 <= SLOT_SGE_OFFSET
    and SLOT_SGE_OFFSET + _SGE_SIZE <= _WR_SIZE
    and SLOT_SGE_OFFSET % 8 == 0
):  # pragma: no cover - a libibverbs ABI change
    raise ImportError(f"struct ibv_send_wr: no room for an SGE at offset {SLOT_SGE_OFFSET}")
del _at, _name, _size, _WR_FIELDS


class SlotRing:
    """A chain of ``capacity`` one-SGE work requests, each slot written on its own.

    The engine's stream of single messages (one WR and one SGE each) goes through one
    ring per queue pair: a message is written into the next free slot, consecutive
    slots go out as one range of one ``post_send``, and a slot is free again once the
    post that carried it has returned (the provider copied the WR).  A slot's SGE lies
    inside its WR, at :data:`SLOT_SGE_OFFSET`, and :meth:`write` stores the whole slot
    with one ``struct.pack_into`` into the C memory: no cffi attribute per field, no
    numpy.  Slot ``i`` links to slot ``i + 1`` and the last to nothing, so a range never
    wraps; the chain's ``regions`` are empty (the caller checks the regions of what it
    queued).
    """

    __slots__ = ("capacity", "chain", "links", "sge_lists", "wr_mem")

    def __init__(self, capacity: int) -> None:
        chain = SendChain(capacity, capacity)
        chain.fill(
            opcode=0,
            remote_addr=np.zeros(capacity, np.uint64),
            rkey=0,
            sge_start=np.arange(capacity + 1),
            sge_addr=np.zeros(capacity, np.uint64),
            sge_length=np.zeros(capacity, np.int64),
            lkey=0,
        )
        self.chain = chain
        self.capacity = capacity
        wrs = chain._views()[0]
        base = address(chain.head)
        wrs["sg_list"] = base + np.arange(capacity, dtype=np.uint64) * _WR_SIZE + SLOT_SGE_OFFSET
        # What a slot's WR keeps (its link and its SGE's address), and the C memory as a
        # buffer for WR_SLOT (see write(); the engine packs its slots the same way
        # inline, SinglePaths._ring_enqueuer).
        self.links = [int(x) for x in wrs["next"]]
        self.sge_lists = [int(x) for x in wrs["sg_list"]]
        self.wr_mem = memoryview(ffi.buffer(chain._wr_mem))
        chain._dirty = capacity  # the slots' wr_ids are written here, not by the chain
        chain._one_each = chain._rkey_n = 0  # and their sg_lists and keys
        chain._flags = None

    def write(
        self,
        slot: int,
        wr_id: int,
        opcode: int,
        local_addr: int,
        nbytes: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        """Slot ``slot`` becomes one unsignaled RDMA WR of one SGE.  The caller checked
        the values (a template's); ``struct`` still refuses one that does not fit."""
        WR_SLOT.pack_into(
            self.wr_mem,
            slot * _WR_SIZE,
            wr_id,
            self.links[slot],
            self.sge_lists[slot],
            1,
            opcode,
            0,
            0,
            remote_addr,
            rkey,
            local_addr,
            nbytes,
            lkey,
        )
