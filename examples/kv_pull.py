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
import subprocess
import sys
import time
from typing import Any

import numpy as np

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
        child = subprocess.Popen(
            [sys.executable, __file__, "--role", "decode", "--peer", engine.id, *_shape(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        if child.stdout.readline().strip() != "ready":  # decode connected: leases start now
            print("prefill: decode did not start")
            return 1
        leases: dict[str, tuple[list[int], float]] = {}
        rng = np.random.default_rng(0)
        for r in range(args.requests):
            blocks = [free.pop(int(rng.integers(len(free)))) for _ in range(args.blocks)]
            for layer, t in enumerate(layers):
                for b in blocks:
                    t[:, b] = block_value(r, layer, b)
            rid = f"req-{r}"
            leases[rid] = (blocks, time.monotonic() + args.lease)
            child.stdin.write(json.dumps({"request": rid, "blocks": blocks}) + "\n")
            child.stdin.flush()
        child.stdin.write(json.dumps({"done": True}) + "\n")
        child.stdin.close()
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
        print("ready", flush=True)
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("done"):
                break
            rid, theirs = msg["request"], msg["blocks"]
            r = int(rid.removeprefix("req-"))
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


def _shape(args: argparse.Namespace) -> list[str]:
    return [
        "--requests",
        str(args.requests),
        "--layers",
        str(args.layers),
        "--blocks",
        str(args.blocks),
        "--num-blocks",
        str(args.num_blocks),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--peer", help="decode: the prefill engine's id")
    p.add_argument("--port", type=int, default=None, help="prefill: listen port (default: any)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=6, help="blocks per request")
    p.add_argument("--num-blocks", type=int, default=64, help="blocks per cache")
    p.add_argument("--lease", type=float, default=3.0, help="prefill: lease seconds")
    args = p.parse_args()
    if args.role == "decode" and not args.peer:
        p.error("--role decode needs --peer")
    if args.role == "prefill" and args.port is None:
        from hixl.testbed.net import free_tcp_port

        args.port = free_tcp_port()
    return prefill(args) if args.role == "prefill" else decode(args)


if __name__ == "__main__":
    raise SystemExit(main())
