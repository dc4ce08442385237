"""Overheads: planning time, and Python's cost per work request, against the wire.

Planning (pure; runs anywhere). ``plan_transfer`` for four shapes of transfer: one
contiguous message; a KV layer sent with strided descriptors (one work request per head
and plane); the same layer scattered token by token into a head-major layout (one work
request per token vector, the worst case); a paged request (random blocks gathered into a
contiguous buffer, 32 SGEs per work request). With a device, each transfer is also sent
with a blocking ``put`` in the same run, and the planning time is given as a share of it.

Posting (needs a device). Python's cost per work request at three depths of the stack:
building pyverbs' ``SGE``/``SendWR`` objects alone; ``QueuePair.post_send`` of chains of
1, 16 and 128 small RDMA WRITEs (the call only; completions are drained untimed); and
``Engine.put_async`` of a transfer planned into 256 work requests (validation, planning,
building and posting). The baselines, measured in the same run with ``ib_write_bw``: the
time per message at 64 bytes (rxe's message rate, C posting) and at 64 KiB (the wire time
a posted work request has to hide behind).

    python benchmarks/bench_overhead.py                 # with a device: all of it
    python benchmarks/bench_overhead.py --no-device     # planning only (no RDMA needed)
"""

from __future__ import annotations

import argparse
import functools
import time
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from hixl import (
    Access,
    BlockListDesc,
    ContiguousDesc,
    ContiguousKVLayout,
    DeviceLimits,
    Engine,
    Op,
    PagedKVLayout,
    plan_transfer,
)
from hixl.core.descriptors import Descriptor
from hixl.testbed.net import free_tcp_port

from ..backends.loopback import loopback_qp
from ..backends.perftest import Perftest, bw_wall_check, parse_bw
from ..common import (
    KIB,
    BenchError,
    Progress,
    command_line,
    fmt_ratio,
    fmt_size,
    fmt_us,
    gather_setup,
    json_out,
    markdown_table,
    median,
    median_of,
    print_header,
    quiet_logs,
    ratio,
    write_json,
)

CHAINS = (1, 16, 128)
ENGINE_WRS = 256


def plan_cases(limits: DeviceLimits) -> list[dict[str, Any]]:
    """The transfers whose planning is timed: name, descriptors, the region sizes needed."""
    heads, tokens, head_dim = 32, 128, 128
    lay_l = ContiguousKVLayout(
        num_layers=1, num_heads=heads, num_tokens=2 * tokens, head_dim=head_dim
    )
    lay_r = ContiguousKVLayout(
        num_layers=1, num_heads=heads, num_tokens=4 * tokens, head_dim=head_dim
    )
    toks = range(tokens)
    block = 16
    paged = PagedKVLayout(
        num_layers=1,
        num_blocks=4 * tokens // block,
        block_size=block,
        num_heads=heads,
        head_dim=head_dim,
    )
    ids = np.random.default_rng(1).choice(paged.num_blocks, tokens // block, replace=False)
    n_blocks, block_bytes = 1024, 4 * KIB
    rng = np.random.default_rng(2)
    pool = 4 * n_blocks
    offs = rng.choice(pool, n_blocks, replace=False).astype(np.int64) * block_bytes
    cases: list[tuple[str, Descriptor, Descriptor, int, int]] = [
        (
            "contiguous 64 KiB",
            ContiguousDesc(offset=0, nbytes=64 * KIB),
            ContiguousDesc(offset=0, nbytes=64 * KIB),
            64 * KIB,
            64 * KIB,
        ),
        (
            f"KV layer, strided ({heads} heads, K+V, {tokens} tokens)",
            lay_l.descriptor(kv="kv", tokens=toks),
            lay_r.descriptor(kv="kv", tokens=toks),
            lay_l.nbytes,
            lay_r.nbytes,
        ),
        (
            f"KV layer, paged → head-major, token by token ({heads} heads)",
            paged.descriptor(ids, kv="kv"),
            lay_r.descriptor(kv="kv", tokens=toks, order="token"),
            paged.nbytes,
            lay_r.nbytes,
        ),
        (
            f"paged gather, {n_blocks} random blocks of {fmt_size(block_bytes)}",
            BlockListDesc(offsets=offs, lengths=np.full(n_blocks, block_bytes)),
            ContiguousDesc(offset=0, nbytes=n_blocks * block_bytes),
            pool * block_bytes,
            n_blocks * block_bytes,
        ),
        (
            # What a stream in batches submits (one put_async per batch): each message
            # at its own offsets on both sides, no two remote messages touching.
            f"batch of 32 messages of {fmt_size(block_bytes)}, block lists on both sides",
            BlockListDesc(offsets=offs[:32], lengths=np.full(32, block_bytes)),
            BlockListDesc(
                offsets=np.arange(32) * 2 * block_bytes, lengths=np.full(32, block_bytes)
            ),
            pool * block_bytes,
            pool * block_bytes,
        ),
    ]
    out = []
    for name, ld, rd, lsize, rsize in cases:
        plan = plan_transfer(ld, rd, Op.WRITE, limits)
        out.append(
            {
                "name": name,
                "local": ld,
                "remote": rd,
                "local_size": lsize,
                "remote_size": rsize,
                "nbytes": plan.nbytes,
                "wrs": plan.num_wrs,
                "sges": plan.num_sges,
            }
        )
    return out


def time_call(fn: Callable[[], object], repeat: int, min_sample_s: float = 0.02) -> list[float]:
    """Seconds per call: ``repeat`` samples, each looping enough calls to last ``min_sample_s``."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    t_one = timer.timeit(number) / number
    number = max(1, int(min_sample_s / max(t_one, 1e-9)))
    return [t / number for t in timer.repeat(repeat, number)]


# --------------------------------------------------------------------------- with a device


class Pair:
    """Two engines in this process, regions big enough for every planning case."""

    def __init__(self, local_size: int, remote_size: int) -> None:
        self.server = Engine(f"127.0.0.1:{free_tcp_port()}")
        self.client = Engine("127.0.0.1:0")
        self.local = np.random.default_rng(3).integers(0, 256, local_size, dtype=np.uint8)
        self.remote = np.zeros(remote_size, np.uint8)
        self.r_local = self.client.register(self.local, access=Access.NONE)
        self.server.register(self.remote, access=Access.REMOTE_WRITE, name="dst")
        self.peer = self.server.id
        self.client.connect(self.peer, timeout=30.0)

    def close(self) -> None:
        self.client.close()
        self.server.close()


def post_costs(repeat: int) -> list[dict[str, Any]]:
    """Per-WR cost of pyverbs objects and of ``QueuePair.post_send`` on a looped-back QP."""
    import pyverbs.wr as pwr

    from hixl.verbs import adapter as _verbs

    rows = []

    def objects() -> None:
        s = pwr.SGE(0x1000, 64, 1)
        w = pwr.SendWR(wr_id=1, opcode=_verbs.WR_RDMA_WRITE, num_sge=1, sg=[s], send_flags=0)
        w.set_wr_rdma(2, 0x2000)

    per = time_call(objects, repeat)
    rows.append(
        {
            "what": "pyverbs SGE + SendWR objects only",
            "us_per_wr": median_of(per) * 1e6,
            "samples_us": [x * 1e6 for x in per],
        }
    )

    dev = _verbs.open_device()
    try:
        cq = dev.create_cq(4096)
        depth = 2 * max(CHAINS)
        a, _peer = loopback_qp(dev, cq, depth, dev.caps.max_sge)
        src = np.ones(64, np.uint8)
        dst = np.zeros(64 * max(CHAINS), np.uint8)
        msrc = dev.register(src.ctypes.data, src.nbytes, _verbs.ACCESS_LOCAL_WRITE, src)
        rw = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE
        mdst = dev.register(dst.ctypes.data, dst.nbytes, rw, dst)
        wr_id = 0
        for n in CHAINS:
            samples = []
            for _ in range(repeat * 4):
                reqs = []
                for i in range(n):
                    wr_id += 1
                    reqs.append(
                        _verbs.SendRequest(
                            wr_id,
                            _verbs.WR_RDMA_WRITE,
                            [(msrc.addr, 64, msrc.lkey)],
                            mdst.addr + 64 * i,
                            mdst.rkey,
                            signaled=i == n - 1,
                        )
                    )
                t0 = time.perf_counter()
                a.post_send(reqs)
                samples.append((time.perf_counter() - t0) / n)
                _drain(cq, wr_id)
            rows.append(
                {
                    "what": f"QueuePair.post_send, chain of {n}",
                    "us_per_wr": median_of(samples) * 1e6,
                    "samples_us": [x * 1e6 for x in samples],
                }
            )
    finally:
        dev.close()
    return rows


def _drain(cq: Any, wr_id: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for wc in cq.poll(16):
            if not wc.ok:
                raise BenchError(f"post_send benchmark: completion error {wc.status_name}")
            if wc.wr_id == wr_id:
                return
    raise BenchError(f"post_send benchmark: no completion within {timeout} s")


def engine_post_cost(pair: Pair, repeat: int) -> dict[str, Any]:
    """``put_async`` time per work request for a transfer of ``ENGINE_WRS`` small WRs."""
    n = ENGINE_WRS
    offs = np.arange(n, dtype=np.int64) * 128
    ld = BlockListDesc(offsets=offs, lengths=np.full(n, 64))
    rd = BlockListDesc(offsets=offs, lengths=np.full(n, 64))
    plan_s = median(time_call(lambda: plan_transfer(ld, rd, Op.WRITE, pair.client.limits), repeat))
    samples = []
    wrs = 0
    for _ in range(repeat * 2):
        t0 = time.perf_counter()
        h = pair.client.put_async(pair.peer, pair.r_local, "dst", local_desc=ld, remote_desc=rd)
        samples.append(time.perf_counter() - t0)
        h.wait(60)
        wrs = h.num_wrs
    if wrs != n:
        raise BenchError(f"expected a plan of {n} work requests, got {wrs}")
    per = median(samples)
    assert per is not None and plan_s is not None
    return {
        "what": f"Engine.put_async, {n} WRs (validate + plan + build + post)",
        "us_per_wr": per / n * 1e6,
        "plan_us_per_wr": plan_s / n * 1e6,
        "samples_us": [x / n * 1e6 for x in samples],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=None, help="samples per point (default 7)")
    ap.add_argument(
        "--put-repeat",
        type=int,
        default=None,
        help="timed blocking puts per planning case (default 5)",
    )
    ap.add_argument("--no-device", action="store_true", help="planning only; no RDMA")
    ap.add_argument("--quick", action="store_true", help="3 samples per point")
    ap.add_argument("--json", type=json_out, default=None, help="write results here")
    args = ap.parse_args(argv)
    quiet_logs()
    args.repeat = args.repeat or (3 if args.quick else 7)
    args.put_repeat = args.put_repeat or (2 if args.quick else 5)

    setup = gather_setup(need_device=not args.no_device)
    device = setup.get("device") is not None and not args.no_device
    print_header(
        "hixl overheads: planning time and Python's per-work-request cost",
        setup,
        [
            f"repeat {args.repeat}; blocking puts per case {args.put_repeat}",
            f"command: {command_line()}",
        ],
    )
    limits = DeviceLimits()
    cases = plan_cases(limits)
    steps = len(cases) * (2 if device else 1) + (4 if device else 0)
    progress = Progress(steps, "overhead")

    for c in cases:
        progress.step(f"plan: {c['name']}")
        ld, rd = c["local"], c["remote"]
        samples = time_call(functools.partial(plan_transfer, ld, rd, Op.WRITE, limits), args.repeat)
        c["plan_s"] = median(samples)
        c["plan_samples_s"] = samples
        progress.advance()

    posting: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    if device:
        pair = Pair(max(c["local_size"] for c in cases), max(c["remote_size"] for c in cases))
        try:
            for c in cases:
                progress.step(f"put: {c['name']} ({fmt_size(c['nbytes'])}, {c['wrs']} WRs)")
                ld, rd = c["local"], c["remote"]
                pair.client.put(
                    pair.peer, pair.r_local, "dst", local_desc=ld, remote_desc=rd, timeout=120
                )
                times = []
                for _ in range(args.put_repeat):
                    t0 = time.perf_counter()
                    pair.client.put(
                        pair.peer, pair.r_local, "dst", local_desc=ld, remote_desc=rd, timeout=120
                    )
                    times.append(time.perf_counter() - t0)
                c["put_s"] = median(times)
                c["put_samples_s"] = times
                progress.advance()
            progress.step(f"Engine.put_async with {ENGINE_WRS} WRs")
            eng_row = engine_post_cost(pair, args.repeat)
            progress.advance()
        finally:
            pair.close()
        progress.step("pyverbs objects and QueuePair.post_send chains")
        posting = post_costs(args.repeat)
        posting.append(eng_row)
        progress.advance()
        perftest = Perftest(setup["device"], setup["gid_index"])
        for size, iters in ((64, 20000), (64 * KIB, 256)):
            progress.step(f"ib_write_bw -s {size} -n {iters}")
            try:
                run = perftest.run(
                    "ib_write_bw",
                    ["-s", str(size), "-n", str(iters), "-t", "128"],
                    check=bw_wall_check(size, iters),
                )
                bw = parse_bw(run.output)
                # From the average bandwidth: MsgRate is printed with too few digits.
                baseline[str(size)] = {
                    "us_per_msg": size / bw.avg_Bps * 1e6,
                    "avg_Bps": bw.avg_Bps,
                    "command": run.command,
                }
            except BenchError as exc:
                progress.note(f"  FAILED: {exc}")
            progress.advance()
        for row in posting:
            row["vs_c_64B"] = ratio(row["us_per_wr"], baseline.get("64", {}).get("us_per_msg"))
            row["vs_wire_64KiB"] = ratio(
                row["us_per_wr"], baseline.get(str(64 * KIB), {}).get("us_per_msg")
            )
    progress.finish()

    data = {
        "benchmark": "overhead",
        "setup": setup,
        "command": command_line(),
        "params": {
            "repeat": args.repeat,
            "put_repeat": args.put_repeat,
            "limits": {"max_sge": limits.max_sge, "max_msg_sz": limits.max_msg_sz},
        },
        "planning": [
            {k: v for k, v in c.items() if k not in ("local", "remote")}
            | {"plan_share_of_put": ratio(c["plan_s"], c.get("put_s"))}
            for c in cases
        ],
        "posting": posting,
        "baseline": baseline,
    }
    print()
    print(markdown(data))
    if args.json is not None:
        write_json(args.json, data)
    return 0


def markdown(data: dict[str, Any]) -> str:
    prow = []
    for c in data["planning"]:
        plan_us = c["plan_s"] * 1e6
        prow.append(
            [
                c["name"],
                fmt_size(c["nbytes"]),
                str(c["wrs"]),
                str(c["sges"]),
                fmt_us(plan_us),
                f"{plan_us / c['wrs']:.2f}",
                fmt_us(c["put_s"] * 1e6) if c.get("put_s") else "n/a",
                _pct(c.get("plan_share_of_put")),
            ]
        )
    out = markdown_table(
        [
            "transfer",
            "bytes",
            "WRs",
            "SGEs",
            "plan (median)",
            "plan µs/WR",
            "blocking put",
            "plan / put",
        ],
        prow,
        "lrrrrrrr",
    )
    if data["posting"]:
        qrow = [
            [
                r["what"],
                f"{r['us_per_wr']:.2f}",
                fmt_ratio(r.get("vs_c_64B")),
                _pct(r.get("vs_wire_64KiB")),
            ]
            for r in data["posting"]
        ]
        out += "\n\n" + markdown_table(
            [
                "Python per work request",
                "µs/WR",
                "vs ib_write_bw 64 B µs/msg",
                "share of a 64 KiB WR's wire time",
            ],
            qrow,
            "lrrr",
        )
        b = data["baseline"]
        ctx = ", ".join(f"{fmt_size(int(k))}: {fmt_us(v['us_per_msg'])}/msg" for k, v in b.items())
        out += f"\n\n- ib_write_bw time per message in this run (context): {ctx or 'n/a'}."
    out += (
        "\n- plan / put: planning time as a share of a blocking put of the same transfer, "
        "same run. Ratios are medians over repeats."
    )
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    raise SystemExit(main())
