"""The engine's pool of idle chains is bounded in bytes of memory, whatever the layouts."""

from __future__ import annotations

from typing import Any

from hixl.core.descriptors import StridedDesc
from hixl.core.plan import DeviceLimits, Op, plan_transfer
from hixl.engine.datapath import CHAIN_CACHE_BYTES, Built, Planner
from hixl.verbs.chain import ChainMemory, SendChain


def test_idle_chains_of_many_layouts_hold_at_most_the_cache_bound() -> None:
    """20000 layouts of 16 WRs each come back idle (each chain holds a 4 KiB block of WRs
    and one of SGEs): the pool keeps at most CHAIN_CACHE_BYTES of them, counted in the
    memory they hold, not in WRs (16-WR chains in 2**18 WRs would hold 128 MiB)."""
    desc = StridedDesc(offset=0, count=16, size=64, stride=128, alignment=None)
    plan = plan_transfer(desc, desc, Op.WRITE, DeviceLimits())
    assert plan.num_wrs == 16
    planner = Planner(DeviceLimits(), None)
    kw: dict[str, Any] = {
        "opcode": 0,
        "local_addr": 1 << 20,
        "lkey": 1,
        "remote_addr": 1 << 30,
        "rkey": 2,
    }
    per_chain = most = 0
    for i in range(20_000):
        chain = SendChain.for_plan(plan, memory=planner.memory, **kw)
        per_chain = ChainMemory.chain_bytes(chain)
        planner.give_back(Built(chain, plan.nbytes, ("layout", i), (0, 0)))
        del chain
        # Heap blocks out (the idle chains) and free ones kept for reuse.
        most = max(most, planner.memory.heap_kept)
    assert per_chain == 8192
    retain = 8 << 20  # ChainMemory's default: free blocks kept beyond the reserve
    assert most <= CHAIN_CACHE_BYTES + retain, f"up to {most / 2**20:.1f} MiB of chains kept"
    planner.close()


def test_a_closed_planner_gives_its_reserve_back_with_the_chain_formatted_in_it() -> None:
    """The planner formats one chain in its reserve when it is made; closing the planner
    lets go of that chain too, so the reserve goes back at once, not when the planner
    object is collected."""
    planner = Planner(DeviceLimits(), None)
    assert planner.memory.reserve_held
    planner.close()
    assert not planner.memory.reserve_held
