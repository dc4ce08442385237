#!/usr/bin/env python3
"""Push a request's KV blocks layer by layer, as Mooncake's connector does, and check
every byte.

Two processes. *Decode* owns a paged KV cache (separate K and V tensors per layer,
``(num_blocks, block_size, kv_heads, head_dim)`` fp16, as SGLang holds them), allocates
blocks for each incoming request and tells the prefill side their ids; then it waits for
one notification per request (named after it) and checks the blocks.

*Prefill* "computes" the request one layer at a time and writes each layer's blocks as
soon as that layer is done, without waiting for the write::

    engine.put_blocks_async(decode_id, kv, "decode", mine, theirs, tensors=[2 * l, 2 * l + 1])

and attaches ``notify=request_id`` to the last layer's call. The engine sends a
notification only after every earlier transfer on the connection has completed, so the
decode side sees it when all the request's layers have landed.

    python examples/kv_push.py                  # both roles (prefill is a child process)
    python examples/kv_push.py --requests 8 --layers 4

Each process exits 0 only when everything it checked is right.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from kv_roles import done, parse_args, ready, requests, start_child, tell

from hixl import Engine, TransferHandle

BLOCK, HEADS, HEAD_DIM = 16, 4, 64


def block_value(request: int, tensor: int, block: int) -> np.ndarray[Any, Any]:
    """What prefill computes for a request's block of one K or V tensor, deterministic."""
    rng = np.random.default_rng([request, tensor, block])
    return rng.standard_normal((BLOCK, HEADS, HEAD_DIM)).astype(np.float16)


def cache(layers: int, num_blocks: int) -> list[np.ndarray[Any, Any]]:
    shape = (num_blocks, BLOCK, HEADS, HEAD_DIM)
    return [np.zeros(shape, np.float16) for _ in range(2 * layers)]  # K0, V0, K1, V1, ...


def decode(args: argparse.Namespace) -> int:
    tensors = cache(args.layers, args.num_blocks)
    free = list(range(args.num_blocks))
    bad = 0
    with Engine(f"127.0.0.1:{args.port}") as engine:
        engine.register_kv("decode", tensors, heads_axis=2)
        child = start_child(__file__, args, "prefill", engine.id)
        if child is None:
            print("decode: prefill did not start")
            return 1
        rng = np.random.default_rng(1)
        pending: dict[str, list[int]] = {}
        for r in range(args.requests):
            mine = [free.pop(int(rng.integers(len(free)))) for _ in range(args.blocks)]
            rid = f"req-{r}"
            pending[rid] = mine
            tell(child, rid, mine)
        done(child)
        for rid, mine in pending.items():
            engine.wait_notification(rid, timeout=60)  # every layer of it has landed
            r = int(rid.removeprefix("req-"))
            for t, tensor in enumerate(tensors):
                for m in mine:  # prefill computed block m of decode's cache
                    if tensor[m].tobytes() != block_value(r, t, m).tobytes():
                        bad += 1
            free.extend(mine)
        prefill_ok = child.wait(timeout=60) == 0
    print(f"decode: {args.requests} requests, one notification each, {bad} bad blocks")
    return 0 if bad == 0 and prefill_ok else 1


def prefill(args: argparse.Namespace) -> int:
    tensors = cache(args.layers, args.num_blocks)
    free = list(range(args.num_blocks))
    with Engine("127.0.0.1:0") as engine:
        kv = engine.register_kv("prefill", tensors, heads_axis=2)
        engine.connect(args.peer, timeout=30)
        ready()
        for rid, r, theirs in requests():
            mine = [free.pop() for _ in theirs]
            handles: list[TransferHandle] = []
            for layer in range(args.layers):
                pair = [2 * layer, 2 * layer + 1]
                for t in pair:  # this layer's forward pass
                    for m, b in zip(mine, theirs, strict=True):
                        tensors[t][m] = block_value(r, t, b)
                last = layer == args.layers - 1
                handles.append(
                    engine.put_blocks_async(
                        args.peer,
                        kv,
                        "decode",
                        mine,
                        theirs,
                        tensors=pair,
                        notify=rid if last else None,
                    )
                )
            for h in handles:
                h.wait(60)
            free.extend(mine)
    return 0


def main() -> int:
    args = parse_args(__doc__, "decode", "prefill")
    return decode(args) if args.role == "decode" else prefill(args)


if __name__ == "__main__":
    raise SystemExit(main())
