"""hixl.compat's buffer-pool relay against direct transfers of registered memory.

Two ``hixl.compat.Hixl`` instances in one process share the verbs device (rxe in
the VM).  For each size, the same bytes are moved with ``transfer_sync``:

* direct: the local buffer was registered with ``register_mem``, so the engine
  posts RDMA straight from (READ: into) it;
* relay: the local buffer was never registered, so the transfer is staged
  through the buffer pool (``BufferPool`` "NUM:SIZE", MiB): copy into a staging
  buffer and RDMA WRITE, or RDMA READ into a staging buffer and copy out.

Both are timed in the same run, alternating, and the report gives medians and
the relay/direct bandwidth ratio.  Every transfer is checked byte for byte
once (outside the timing).  Needs a verbs device; ``--help`` does not.

    hixl run -- .venv/bin/python benchmarks/bench_compat_pool.py --sizes 1M,4M --iters 5
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"``, ``"4M"`` or a plain number of bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in UNITS else text
    if not number.isdigit() or int(number) * scale <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 64K, 4M or 1048576")
    return int(number) * scale


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--sizes",
        default="256K,1M,4M",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        help="transfer sizes, comma separated (default 256K,1M,4M)",
    )
    p.add_argument("--block", type=parse_size, default=16 << 10, help="bytes per desc (16K)")
    p.add_argument("--pool", default="4:8", help='BufferPool "NUM:SIZE" in MiB (default 4:8)')
    p.add_argument("--iters", type=int, default=5, help="timed transfers per case (5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers per case (1)")
    p.add_argument("--ops", default="write,read", help="write, read or both (default both)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    args.ops = [o.strip() for o in args.ops.split(",")]
    if not set(args.ops) <= {"write", "read"}:
        p.error("--ops takes write, read or write,read")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(fn: Callable[[], int], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        ret = fn()
        out.append(time.perf_counter() - start)
        if ret != 0:
            raise RuntimeError(f"transfer_sync returned {ret}")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from hixl import compat as hixl

    server, client = hixl.Hixl(), hixl.Hixl()
    try:
        ret = server.initialize(f"127.0.0.1:{free_port()}", {})
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"server initialize: {ret} {server.last_error}")
        ret = client.initialize("127.0.0.1", {hixl.OPTION_BUFFER_POOL: args.pool})
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client initialize: {ret} {client.last_error}")
        peer = server.engine_id
        assert peer is not None
        biggest = max(args.sizes)
        remote = np.zeros(biggest, np.uint8)
        ret, _ = server.register_mem(hixl.MemDesc(int(remote.ctypes.data), biggest), hixl.MEM_HOST)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"register remote: {server.last_error}")
        registered = np.random.default_rng(1).integers(0, 256, biggest, dtype=np.uint8)
        ret, _ = client.register_mem(
            hixl.MemDesc(int(registered.ctypes.data), biggest), hixl.MEM_HOST
        )
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"register local: {client.last_error}")
        loose = registered.copy()  # same bytes, never registered
        if client.connect(peer, 10_000) != hixl.SUCCESS:
            raise RuntimeError(f"connect: {client.last_error}")

        rows = []
        for size in args.sizes:
            block = min(args.block, size)
            for op_name in args.ops:
                op = hixl.WRITE if op_name == "write" else hixl.READ
                times: dict[str, list[float]] = {"direct": [], "relay": []}
                for mode, local in (("direct", registered), ("relay", loose)):
                    base = int(local.ctypes.data)
                    descs = [
                        hixl.TransferOpDesc(base + off, int(remote.ctypes.data) + off, block)
                        for off in range(0, size - size % block, block)
                    ]
                    remote[:] = 0
                    if op_name == "read":
                        remote[:size] = registered[:size]
                        local[:size] = 0
                    if client.transfer_sync(peer, op, descs, 60_000) != hixl.SUCCESS:
                        raise RuntimeError(f"{mode} {op_name}: {client.last_error}")
                    n = len(descs) * block
                    ok = np.array_equal(remote[:n], registered[:n]) and (
                        op_name == "write" or np.array_equal(local[:n], registered[:n])
                    )
                    if not ok:
                        raise RuntimeError(f"{mode} {op_name} {size}: bytes differ")
                    if op_name == "read":
                        local[:size] = registered[:size]

                    def once(d: list[Any] = descs, o: Any = op) -> int:
                        return int(client.transfer_sync(peer, o, d, 60_000))

                    times[mode] = timed(once, args.iters, args.warmup)
                med = {m: statistics.median(t) for m, t in times.items()}
                nbytes = (size - size % block) or block
                rows.append(
                    {
                        "op": op_name,
                        "size": nbytes,
                        "block": block,
                        "direct_s": med["direct"],
                        "relay_s": med["relay"],
                        "direct_MBps": nbytes / med["direct"] / 1e6,
                        "relay_MBps": nbytes / med["relay"] / 1e6,
                        "relay_vs_direct": med["direct"] / med["relay"],
                    }
                )
        pool = client.buffer_pool
        return {
            "setup": {
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "kernel": platform.release(),
                "pool": args.pool,
                "buffers_made": None if pool is None else pool.made,
                "iters": args.iters,
                "warmup": args.warmup,
            },
            "rows": rows,
        }
    finally:
        client.finalize()
        server.finalize()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    s = result["setup"]
    print(
        f"# hixl.compat buffer-pool relay vs direct (pool {s['pool']}, {s['iters']} iters, "
        f"{s['warmup']} warm-up, kernel {s['kernel']}, buffers made {s['buffers_made']})"
    )
    print("| op | size | block | direct MB/s | relay MB/s | relay/direct |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        print(
            f"| {r['op']} | {r['size']} | {r['block']} | {r['direct_MBps']:.1f} | "
            f"{r['relay_MBps']:.1f} | {r['relay_vs_direct']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
