"""Carry out a KV request's chain in this process: each work request's pieces copied with
``memmove`` between the addresses the chain names.

The chain is the one :func:`hixl.engine.kv.build_request` makes for ``put_blocks`` and
``get_blocks``; on rxe the device does the copying (tests/rdma).  Here the point is what
the chain says: which bytes of which tensor go where.
"""

from __future__ import annotations

import ctypes

from hixl.core.plan import Op
from hixl.verbs.chain import SendChain


def replay(op: Op, chain: SendChain) -> int:
    """Copy every piece of ``chain`` (WRITE: local to remote; READ: remote to local);
    returns the bytes copied."""
    moved = 0
    sges = chain.sges
    for wr in chain.wrs:
        first = (int(wr["sg_list"]) - chain.sge_base) // sges.itemsize
        remote_addr = int(wr["remote_addr"])
        for sge in sges[first : first + int(wr["num_sge"])]:
            addr, n = int(sge["addr"]), int(sge["length"])
            src, dst = (addr, remote_addr) if op is Op.WRITE else (remote_addr, addr)
            ctypes.memmove(dst, src, n)
            remote_addr += n
            moved += n
    return moved
