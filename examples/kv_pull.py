#!/usr/bin/env python3
"""Pull a request's KV blocks, as vLLM's NixlConnector does, and check every byte.

Two processes. *Prefill* holds a paged KV cache (one FlashAttention tensor per layer,
``(2, num_blocks, block_size, kv_heads, head_dim)`` fp16), "computes" each request into
blocks of its own, and hands the decode side the request id and those block ids. It
*leases* the blocks: it frees them when the decode side's notification (named after the
request) arrives, or when the lease runs out.

*Decode* owns a cache of the same shape, allocates blocks for the request and pulls
everything with one call per request::

    engine.get_blocks(prefill_id, kv, "prefill", my_blocks, their_blocks, notify=request_id)

which reads the listed blocks of every layer and then sends the notification (after the
reads have completed: the prefill side may reuse the blocks at once). The last request is
abandoned by decode on purpose: prefill frees its blocks when the lease ends.

    python examples/kv_pull.py                  # both roles (decode is a child process)
    python examples/kv_pull.py --requests 8 --layers 4 --lease 2

Each process exits 0 only when every byte it checked is right (decode) and every
request's blocks were freed, by a notification or by its lease (prefill).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from kv_roles import done, parse_args, ready, requests, start_child, tell

from hixl import Engine, TransferTimeout

BLOCK, HEADS, HEAD_DIM = 16, 4, 64


def block_value(request: int, layer: int, block: int) -> np.ndarray[Any, Any]:
    """What prefill computes for a request's block of a layer (K and V), deterministic."""
    rng = np.random.default_rng([request, layer, block])
    return rng.standard_normal((2, BLOCK, HEADS, HEAD_DIM)).astype(np.float16)


def cache(layers: int, num_blocks: int) -> list[np.ndarray[Any, Any]]:
    return [np.zeros((2, num_blocks, BLOCK, HEADS, HEAD_DIM), np.float16) for _ in range(layers)]


def prefill(args: argparse.Namespace) -> int:
    layers = cache(args.layers, args.num_blocks)
    free = list(range(args.num_blocks))
    with Engine(f"127.0.0.1:{args.port}") as engine:
        kv = engine.register_kv("prefill", layers, block_axis=1, heads_axis=3)
        child = start_child(__file__, args, "decode", engine.id)
        if child is None:
            print("prefill: decode did not start")
            return 1
        # decode has connected: leases start now
        leases: dict[str, tuple[list[int], float]] = {}
        rng = np.random.default_rng(0)
        for r in range(args.requests):
            blocks = [free.pop(int(rng.integers(len(free)))) for _ in range(args.blocks)]
            for layer, t in enumerate(layers):
                for b in blocks:
                    t[:, b] = block_value(r, layer, b)
            rid = f"req-{r}"
            leases[rid] = (blocks, time.monotonic() + args.lease)
            tell(child, rid, blocks)
        done(child)
        freed_by = {}
        while leases:
            soonest = min(d for _, d in leases.values())
            for rid in list(leases):
                try:  # the request's notification: decode has read every block
                    engine.wait_notification(rid, timeout=0.01)
                except TransferTimeout:
                    continue
                free.extend(leases.pop(rid)[0])
                freed_by[rid] = "notification"
            now = time.monotonic()
            for rid, (blocks, deadline) in list(leases.items()):
                if deadline <= now:
                    free.extend(blocks)
                    del leases[rid]
                    freed_by[rid] = "lease"
            if leases and soonest > now:
                time.sleep(min(0.05, soonest - now))
        decode_ok = child.wait(timeout=60) == 0
        assert child.stdout is not None
        print(f"prefill: {json.dumps(freed_by)}; decode output: {child.stdout.read().strip()}")
        kv.close()
    last = f"req-{args.requests - 1}"
    ok = (
        decode_ok
        and sorted(free) == list(range(args.num_blocks))
        and freed_by.pop(last, None) == "lease"
        and all(v == "notification" for v in freed_by.values())
    )
    print("prefill: ok" if ok else "prefill: FAILED")
    return 0 if ok else 1


def decode(args: argparse.Namespace) -> int:
    layers = cache(args.layers, args.num_blocks)
    free = list(range(args.num_blocks))
    bad = 0
    with Engine("127.0.0.1:0") as engine:
        kv = engine.register_kv("decode", layers, block_axis=1, heads_axis=3)
        engine.connect(args.peer, timeout=30)
        ready()
        for rid, r, theirs in requests():
            if r == args.requests - 1:
                continue  # abandoned (a cancelled request): prefill's lease frees it
            mine = [free.pop() for _ in theirs]
            engine.get_blocks(args.peer, kv, "prefill", mine, theirs, notify=rid)
            for layer, t in enumerate(layers):
                for m, b in zip(mine, theirs, strict=True):
                    if t[:, m].tobytes() != block_value(r, layer, b).tobytes():
                        bad += 1
            free.extend(mine)  # the request finished decoding
    print(f"decode: {args.requests - 1} requests pulled, {bad} bad blocks")
    return 0 if bad == 0 else 1


def main() -> int:
    def lease(p: argparse.ArgumentParser) -> None:
        p.add_argument("--lease", type=float, default=3.0, help="prefill: lease seconds")

    args = parse_args(__doc__, "prefill", "decode", lease)
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    raise SystemExit(main())
