"""Native cost of turning a plan into work requests (no device needed).

Two KV-layer shapes of 2 MiB: the *layer* form, 8192 rows of 256 bytes 320 bytes apart
on both sides (8192 WRs of one SGE), and the *gather* form, the same rows gathered into
one contiguous remote range (256 WRs of 32 SGEs). For each, in one run:

* ``plan``: ``plan_transfer`` from the descriptors (the engine caches it per layout);
* ``build``: a new :class:`hixl.verbs.chain.SendChain` filled from the plan by numpy (C
  arrays of ``ibv_send_wr``/``ibv_sge``, no Python object per WR);
* ``refill``: the same, into an existing chain's memory (what the engine does for a new
  layout of a size it built before: it fills an earlier transfer's idle chain, which was
  signalled for that transfer, so the fill also clears its ``wr_id``s and flags);
* ``reuse``: what a repeated layout costs the engine -- only ``wr_id``s and signal flags
  rewritten (:meth:`SendChain.set_signals`, one signal per 64 WRs);
* ``pyverbs``: building pyverbs ``SGE``/``SendWR`` objects for the same WRs, the data
  path hixl had before (when pyverbs imports).

Targets: plan + build of each form within the wire time of 2 MiB at 100 Gb/s
(168 us; moonshot 400 Gb/s, 42 us), and <= 20 ns per SGE for chains of >= 1000 SGEs.
Both are reported: plan + build (a new chain: the engine's first layout of a size) and
plan + refill (the engine's path for a new layout of a size it built before, which fills
an earlier transfer's idle chain).

With ``--device`` (a verbs device, e.g. in the VM), both forms are also sent by a
blocking ``put`` between two engines on one device, alternating with ``ib_write_bw``
moving the same bytes in the same number of work requests (``-s 256 -n 8192`` for the
layer, ``-s 8192 -n 256`` for the gather form), and the ratio of the medians is reported.

    python benchmarks/bench_build.py                 # medians, a table, the targets
    python benchmarks/bench_build.py --json results/build.json --repeat 500
    hixl run -- .venv/bin/python benchmarks/bench_build.py --device --device-repeat 3

``hixl bench`` (``make bench``) runs it twice: natively on the host before the VM boots
(the build costs), and with ``--device --device-only`` in the VM (the wire ratios); its
section (e) of the report shows both.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from hixl.core.descriptors import ContiguousDesc, Descriptor, StridedDesc
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.verbs.chain import SendChain

from ..common import (
    BenchError,
    command_line,
    fmt_ratio,
    fmt_size,
    fmt_us,
    gather_setup,
    json_out,
    markdown_table,
    median_of,
    print_header,
    write_json,
)

WIRE_100G_US = 2 * 1024 * 1024 * 8 / 100e9 * 1e6  # 2 MiB at 100 Gb/s: 167.8 us
WIRE_400G_US = WIRE_100G_US / 4
SGE_NS_TARGET = 20.0
SIGNAL_EVERY = 64
LADDR, RADDR, LKEY, RKEY = 0x7F00_0000_0000, 0x5500_0000_0000, 0x1234, 0x5678


def cases(rows: int, size: int, stride: int) -> list[tuple[str, Descriptor, Descriptor]]:
    strided = StridedDesc(offset=0, count=rows, size=size, stride=stride, alignment=None)
    contiguous = ContiguousDesc(offset=0, nbytes=rows * size, alignment=None)
    return [
        (f"layer: {rows} rows x {size} B, stride {stride}, both sides", strided, strided),
        (f"gather: {rows} rows x {size} B into one contiguous range", strided, contiguous),
    ]


def timed_after(
    before: Callable[[], object], fn: Callable[[], object], repeat: int, warmup: int = 3
) -> float:
    """Median wall time of ``fn`` in microseconds, ``before`` run (untimed) ahead of
    each call."""
    for _ in range(warmup):
        before()
        fn()
    out = []
    for _ in range(repeat):
        before()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return median_of(out)


def timed(fn: Callable[[], object], repeat: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in microseconds."""
    return timed_after(lambda: None, fn, repeat, warmup)


def _pyverbs(plan: Plan) -> Callable[[], object] | None:
    try:
        import pyverbs.wr as pwr
    except ImportError:
        return None
    wrs = list(plan.wrs())

    def build() -> object:
        keep = []
        nxt = None
        for roff, sges in reversed(wrs):
            sg = [pwr.SGE(LADDR + o, n, LKEY) for o, n in sges]
            w = pwr.SendWR(wr_id=0, opcode=0, num_sge=len(sg), sg=sg, send_flags=0, next_wr=nxt)
            w.set_wr_rdma(RKEY, RADDR + roff)
            keep.append((w, sg))
            nxt = w
        return keep

    return build


def measure(name: str, ld: Descriptor, rd: Descriptor, repeat: int) -> dict[str, Any]:
    limits = DeviceLimits()
    plan = plan_transfer(ld, rd, Op.WRITE, limits)
    kw: dict[str, Any] = {
        "opcode": 0,
        "local_addr": LADDR,
        "lkey": LKEY,
        "remote_addr": RADDR,
        "rkey": RKEY,
    }
    chain = SendChain.for_plan(plan, **kw)
    t_plan = timed(lambda: plan_transfer(ld, rd, Op.WRITE, limits), max(20, repeat // 10))
    t_build = timed(lambda: SendChain.for_plan(plan, **kw), repeat)
    # An idle chain the engine fills anew was signalled for its last transfer: the fill
    # clears those ids and flags too.
    t_refill = timed_after(
        lambda: chain.set_signals(1, SIGNAL_EVERY), lambda: chain.fill_plan(plan, **kw), repeat
    )
    t_reuse = timed(lambda: chain.set_signals(1, SIGNAL_EVERY), repeat)
    old = _pyverbs(plan)
    t_pyverbs = timed(old, max(5, repeat // 100), warmup=1) if old is not None else None
    return {
        "name": name,
        "wrs": plan.num_wrs,
        "sges": plan.num_sges,
        "nbytes": plan.nbytes,
        "plan_us": t_plan,
        "build_us": t_build,
        "refill_us": t_refill,
        "reuse_us": t_reuse,
        "pyverbs_us": t_pyverbs,
        "plan_build_us": t_plan + t_build,
        "plan_refill_us": t_plan + t_refill,
        "build_ns_per_sge": t_build * 1e3 / plan.num_sges,
        "refill_ns_per_sge": t_refill * 1e3 / plan.num_sges,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--size", type=int, default=256, help="bytes per row")
    p.add_argument("--stride", type=int, default=320, help="bytes between rows")
    p.add_argument("--repeat", type=int, default=300, help="timed runs per step (median)")
    p.add_argument("--json", type=json_out, default=None, help="write results to this file")
    p.add_argument("--device", action="store_true", help="also put both forms vs ib_write_bw")
    p.add_argument("--device-repeat", type=int, default=5, help="pairs per form (median)")
    p.add_argument(
        "--device-only",
        action="store_true",
        help="with --device: only the wire ratios (the build costs under emulation say nothing)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 30 repeats, one pair")
    args = p.parse_args(argv)
    if args.device_only and not args.device:
        p.error("--device-only needs --device")
    if args.quick:
        args.repeat, args.device_repeat = min(args.repeat, 30), 1

    setup = gather_setup(need_device=False)
    print_header(
        "hixl work-request build cost (native, no device)",
        setup,
        [
            f"command: {command_line(argv)}",
            f"targets: plan+build <= {WIRE_100G_US:.0f} us (2 MiB at 100 Gb/s; moonshot "
            f"{WIRE_400G_US:.0f} us), <= {SGE_NS_TARGET:.0f} ns/SGE for >= 1000 SGEs",
        ],
    )
    results = (
        []
        if args.device_only
        else [
            measure(n, ld, rd, args.repeat)
            for n, ld, rd in cases(args.rows, args.size, args.stride)
        ]
    )
    print()
    if results:
        print(native_table(results))
        print()
    verdicts = []
    for r in results:
        pb = r["plan_build_us"]
        pr = r["plan_refill_us"]
        cached = r["build_us"]
        verdicts.append(
            {
                "name": r["name"],
                "plan_build_us": pb,
                "plan_build_within_100g": pb <= WIRE_100G_US,
                "plan_refill_us": pr,
                "plan_refill_within_100g": pr <= WIRE_100G_US,
                "build_within_100g": cached <= WIRE_100G_US,
                "build_within_400g": cached <= WIRE_400G_US,
                "reuse_within_400g": r["reuse_us"] <= WIRE_400G_US,
                "ns_per_sge_ok": r["sges"] < 1000 or r["build_ns_per_sge"] <= SGE_NS_TARGET,
            }
        )
        print(
            f"{r['name']}: plan+build {fmt_us(pb)} ({pb / WIRE_100G_US:.2f}x the 100 Gb/s wire "
            f"time; a chain of a new size), plan+refill {fmt_us(pr)} "
            f"({pr / WIRE_100G_US:.2f}x; a new layout of a size built before: the engine "
            f"fills an idle chain); build alone (plan cached) {fmt_us(cached)} "
            f"({cached / WIRE_100G_US:.2f}x); reuse {fmt_us(r['reuse_us'])} "
            f"({r['reuse_us'] / WIRE_400G_US:.2f}x the 400 Gb/s wire time); "
            f"{r['build_ns_per_sge']:.1f} ns/SGE"
        )
    wire: list[dict[str, Any]] = []
    if args.device:
        wire = device_section(args.rows, args.size, args.stride, args.device_repeat)
    if args.json is not None:
        write_json(
            args.json,
            {
                "setup": setup,
                "command": command_line(argv),
                "results": results,
                "verdicts": verdicts,
                "wire": wire,
            },
        )
        print(f"wrote {args.json}")
    return 0


def native_table(results: list[dict[str, Any]]) -> str:
    """The build costs of :func:`measure`'s results, one row per form."""
    rows = []
    for r in results:
        rows.append(
            [
                r["name"],
                f"{r['wrs']} x {r['sges'] // r['wrs']}",
                fmt_us(r["plan_us"]),
                fmt_us(r["build_us"]),
                fmt_us(r["plan_build_us"]),
                fmt_us(r["refill_us"]),
                fmt_us(r.get("plan_refill_us")),
                fmt_us(r["reuse_us"]),
                f"{r['build_ns_per_sge']:.1f}",
                fmt_us(r["pyverbs_us"]),
                fmt_ratio(r["pyverbs_us"] / r["build_us"] if r["pyverbs_us"] else None, 0),
            ]
        )
    return markdown_table(
        [
            "transfer",
            "WRs x SGEs",
            "plan",
            "build",
            "plan + build",
            "refill",
            "plan + refill",
            "reuse",
            "ns/SGE (build)",
            "pyverbs objects",
            "pyverbs / build",
        ],
        rows,
        "llrrrrrrrrr",
    )


def markdown(data: dict[str, Any]) -> str:
    """Section (e) of ``hixl bench``'s report: the native build costs (``data["native"]``,
    from the run on the host) and the wire ratios (``data["wire"]``, from the VM)."""
    parts: list[str] = []
    native = data.get("native") or data
    results = native.get("results") or []
    if results:
        host = native.get("setup", {})
        parts += [
            f"Natively on the host ({host.get('cpu_model') or 'CPU unknown'}, no device; "
            f"medians): planning and building the work requests of one 2 MiB layer. Targets: "
            f"plan + build <= {WIRE_100G_US:.0f} us (2 MiB at 100 Gb/s; moonshot "
            f"{WIRE_400G_US:.0f} us), <= {SGE_NS_TARGET:.0f} ns per SGE.",
            "",
            native_table(results),
            "",
            "- build: a new chain's C memory allocated and filled by numpy, what the engine "
            "pays for the first layout of its size; refill: into an existing chain, what it "
            "pays for a new layout of a size it built before (it fills the idle chain of an "
            "earlier transfer, `Diagnostics.chains_refilled`, and clears the ids and "
            "signals of that transfer); reuse: what it does for a "
            "repeated layout (its pooled chain's `wr_id`s and signals rewritten); pyverbs "
            "objects: the same WRs as pyverbs `SGE`/`SendWR` objects, the data path before "
            "cffi.",
            "",
        ]
    wire = data.get("wire") or []
    if wire:
        rows = [
            [
                w["form"],
                f"{w['wrs']} x {fmt_size(w['wr_bytes'])}",
                fmt_ratio(w["ratio"]),
                f"{w['hixl_Bps'] / 1e6:.1f} MB/s",
                f"{w['ib_write_bw_Bps'] / 1e6:.1f} MB/s",
            ]
            for w in wire
        ]
        parts += [
            "On the wire (one blocking `put` of the whole layer vs `ib_write_bw` moving the "
            "same bytes in as many work requests, alternating, medians; target >= 0.90x):",
            "",
            markdown_table(
                ["form", "WRs", "hixl / ib_write_bw", "hixl", "ib_write_bw"], rows, "llrrr"
            ),
            "",
        ]
    return "\n".join(parts)


def device_section(rows: int, size: int, stride: int, repeat: int) -> list[dict[str, Any]]:
    """Both forms put by hixl vs ib_write_bw with the same bytes and WR count, same run."""
    import numpy as np

    from hixl.engine import Access, Engine
    from hixl.testbed.net import free_tcp_port

    from ..backends.perftest import Perftest, bw_wall_check, parse_bw
    from ..common import median, quiet_logs, ratio

    quiet_logs()
    setup = gather_setup(need_device=True)
    perftest = Perftest(setup["device"], setup["gid_index"])
    server = Engine(f"127.0.0.1:{free_tcp_port()}", alignment=0)
    client = Engine("127.0.0.1:0", alignment=0)
    out = []
    try:
        src = np.random.default_rng(1).integers(0, 256, rows * stride, dtype=np.uint8)
        dst = np.zeros(rows * stride, dtype=np.uint8)
        r = client.register(src)
        server.register(dst, access=Access.REMOTE_WRITE, name="dst")
        client.connect(server.id, timeout=30.0)
        gather_wrs = rows * size // (32 * size)
        for name, (ld, rd), wr_size, wrs in zip(
            ("layer", "gather"),
            [(ld, rd) for _, ld, rd in cases(rows, size, stride)],
            (size, 32 * size),
            (rows, gather_wrs),
            strict=True,
        ):

            def put(ld: Descriptor = ld, rd: Descriptor = rd) -> None:
                client.put(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=120)

            put()  # plan and chain built once, as for every later layer
            hixl_bps: list[float] = []
            perf_bps: list[float] = []
            for i in range(repeat):
                for turn in (0, 1) if i % 2 == 0 else (1, 0):
                    if turn == 0:
                        run = perftest.run(
                            "ib_write_bw",
                            ["-s", str(wr_size), "-n", str(wrs), "-t", "128"],
                            check=bw_wall_check(wr_size, wrs),
                        )
                        perf_bps.append(parse_bw(run.output).avg_Bps)
                    else:
                        t0 = time.perf_counter()
                        put()
                        hixl_bps.append(rows * size / (time.perf_counter() - t0))
            want = src.reshape(rows, stride)[:, :size]
            got = dst.reshape(rows, stride)[:, :size] if name == "layer" else dst[: rows * size]
            if not np.array_equal(got.reshape(-1), want.reshape(-1)):
                raise BenchError(f"{name} put: destination differs from the source")
            h, pb = median(hixl_bps) or 0.0, median(perf_bps) or 0.0
            ratio_ = ratio(h, pb)
            out.append(
                {
                    "form": name,
                    "wrs": wrs,
                    "wr_bytes": wr_size,
                    "hixl_Bps": h,
                    "ib_write_bw_Bps": pb,
                    "ratio": ratio_,
                }
            )
            print(
                f"{name}: hixl put {rows * size} B in {wrs} WRs: {h / 1e6:.1f} MB/s; "
                f"ib_write_bw -s {wr_size} -n {wrs}: {pb / 1e6:.1f} MB/s; "
                f"ratio {fmt_ratio(ratio_)}"
            )
    finally:
        client.close()
        server.close()
    return out
