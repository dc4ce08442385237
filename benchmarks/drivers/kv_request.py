"""The KV request bench_kv times, shared by its native sections (:mod:`.kv`) and its device
section (:mod:`.kv_device`): the two cache forms, one request through the engine's own
path, and the planner an engine makes."""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np

from hixl.core.kvblocks import KVGeometry, TensorGeometry
from hixl.core.plan import DeviceLimits, Op

FORMS = ("full", "tp4")
TOKENS, HEADS, HEAD_DIM, ITEM = 16, 8, 128, 2
LIMITS = DeviceLimits()  # rxe's: 32 SGEs per WR, 8 MiB per WR


def geometry(layers: int, num_blocks: int, heads: int) -> KVGeometry:
    """One FlashAttention tensor per layer, each its own region."""
    shape = (2, num_blocks, TOKENS, heads, HEAD_DIM)
    strides = []
    step = ITEM
    for n in reversed(shape):
        strides.append(step)
        step *= n
    t = tuple(
        TensorGeometry(
            dtype="float16",
            itemsize=ITEM,
            shape=shape,
            strides=tuple(reversed(strides)),
            region=k,
            block_axis=1,
            heads_axis=3,
        )
        for k in range(layers)
    )
    return KVGeometry(region_lengths=(step,) * layers, tensors=t)


def form(name: str, layers: int, num_blocks: int) -> dict[str, Any]:
    """The two caches, their regions' (address, key) and the head range of a form."""
    local = geometry(layers, num_blocks, HEADS)
    out: dict[str, Any] = {
        "local": local,
        "lreg": [(0x7F00_0000_0000 + k * (1 << 32), 0x1000 + k) for k in range(layers)],
        "rreg": [(0x5500_0000_0000 + k * (1 << 32), 0x2000 + k) for k in range(layers)],
    }
    if name == "full":
        return {**out, "remote": local, "heads": None}
    return {**out, "remote": geometry(layers, num_blocks, 2), "heads": (2, 4)}


def wire_us(nbytes: int, gbps: float) -> float:
    return nbytes * 8 / (gbps * 1e9) * 1e6


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_request(
    f: dict[str, Any], rng: np.random.Generator, blocks: int, num_blocks: int, plan: Any
) -> tuple[float, int, Any]:
    """Time the engine's path for one request with a new scattered block list; the chain
    goes back to ``plan``'s pool (the engine's :class:`Planner`) as a posted one does."""
    from hixl.engine.datapath import Built
    from hixl.engine.kv import build_request

    lids = rng.choice(num_blocks, blocks, replace=False)
    rids = rng.choice(num_blocks, blocks, replace=False)
    f0 = _faults()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    chain, nbytes, key, _, _, _ = build_request(
        Op.WRITE,
        f["local"],
        f["lreg"],
        f["remote"],
        f["rreg"],
        lids,
        rids,
        tensors=None,
        heads=f["heads"],
        remote_heads=None,
        limits=LIMITS,
        idle=lambda k: _chain_of(plan.take(k)),
        memory=plan.memory,
    )
    dt = (time.perf_counter() - t0) * 1e6
    cpu = (time.thread_time() - c0) * 1e6
    faults = _faults() - f0
    plan.give_back(Built(chain, nbytes, key, (0, 0)))
    return dt, faults, (chain.num_wrs, chain.num_sges, nbytes, cpu)


def _chain_of(built: Any) -> Any:
    return None if built is None else built.chain


def planner() -> Any:
    """What opening an engine makes for this path: its planner, with the chain pool and
    the kept, touched chain memory (and its warm-up of the chain code)."""
    from hixl.engine.datapath import Planner

    return Planner(LIMITS, 64)
