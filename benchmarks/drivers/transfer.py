"""Bandwidth and latency: hixl put, get and latency beside perftest, same device, same run.

For each message size (default 4 KiB to 8 MiB) and each repeat, this runs, interleaved
(the order of the two flips every step, so drift in a noisy VM hits both alike):

* ``ib_write_bw`` and hixl ``put_async`` with the same number of messages in flight
  (``--depth``, perftest's ``-t``): the same contiguous ``size`` bytes are written again
  and again from one registered buffer to one remote buffer, as perftest does;
* ``ib_read_bw`` and hixl ``get_async``, likewise (perftest ``-o`` is set to the
  outstanding-read limit hixl's queue pairs use, 16);
* ``ib_write_lat`` and a hixl ping-pong made the same way: side A writes, side B polls the
  last byte of its buffer and writes back, A polls; a sample is half a round trip, and the
  typical value is the median. Each side waits for its own send completion before
  polling, as ``ib_write_lat`` does. B runs in a second process (one Python process would
  serialise both sides on the GIL). A's blocking put is timed on one round trip in
  ``PUT_EVERY``, which is then not a sample: no sample has a clock reading inside it.

Both hixl engines of the bandwidth tests live in this process, on the device perftest
uses (server listening on 127.0.0.1, client connecting): the same loopback perftest
measures. The result is the ratio hixl / perftest of the medians over repeats; absolute
numbers are printed as context only. hixl does ``--warmup`` untimed transfers before each
timed run (perftest's ``--perform_warm_up`` hangs on rxe at 4 KiB, so perftest has none).
perftest converts CPU cycles to time with a rate it calibrates at start-up, which often
fails under emulation on a busy host (``Correlation coefficient r^2 < 0.9``; it then prints
``inf`` or uses a wrong rate). A bandwidth run whose calibration failed or whose figure is
below the wall-clock bound is retried; ``ib_write_lat`` runs with ``-C`` (raw cycles), which
are converted with the kernel's TSC rate (``cpu MHz``), the rate perftest itself uses
whenever its calibration agrees with it within 2%.

    python benchmarks/bench_transfer.py                     # defaults (about 5 minutes in the VM)
    python benchmarks/bench_transfer.py --quick --json out.json
    python benchmarks/bench_transfer.py --sizes 64K,1M --repeat 5 --kinds write
    hixl run -- .venv/bin/python benchmarks/bench_transfer.py --quick   # without host rxe
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hixl import Access, Channel, ContiguousDesc, Engine
from hixl.testbed.net import free_tcp_port

from .. import entry
from ..backends.hixl import EnginePair, check_bytes, hixl_stream
from ..backends.perftest import Perftest, PerftestRun, bw_wall_check, parse_bw, parse_lat
from ..common import (
    KIB,
    MIB,
    BenchError,
    Progress,
    command_line,
    expect_line,
    fmt_rate,
    fmt_ratio,
    fmt_size,
    fmt_us,
    gather_setup,
    iterations_for,
    json_out,
    markdown_table,
    median,
    parse_sizes,
    print_header,
    quiet_logs,
    ratio,
    send_line,
    spread,
    write_json,
)
from .transfer_diagnose import diagnose, diagnosis_markdown

KINDS = ("write", "read", "lat", "chan")
LAT_KINDS = ("lat", "chan")  # ping-pongs against ib_write_lat: Engine.put, Channel.put
PERFTEST_TOOL = {
    "write": "ib_write_bw",
    "read": "ib_read_bw",
    "lat": "ib_write_lat",
    "chan": "ib_write_lat",
}
HIXL_NAME = {
    "write": "hixl put",
    "read": "hixl get",
    "lat": "hixl ping-pong",
    "chan": "hixl channel ping-pong",
}
BW_TARGET = 0.90
BW_TARGET_FROM = 64 * KIB
HIXL_RD_ATOMIC = 16  # what hixl's queue pairs ask for (hixl.verbs.adapter.QueuePair.connect)

DEFAULT_SIZES = "4K,64K,256K,1M,8M"
#: Sizes up to this many bytes get ``--small-repeat`` repeats.
SMALL_MAX = 16 * 1024
QUICK_SIZES = "4K,64K,1M"


# --------------------------------------------------------------------------- hixl: latency


def _spin(mv: memoryview, index: int, value: int, deadline: float) -> None:
    n = 0
    while mv[index] != value:
        n += 1
        if not n & 0x3FFF and time.monotonic() > deadline:
            raise BenchError(f"ping-pong: no answer (byte {index} != {value}) before deadline")


def pong_child(max_size: int) -> int:
    """Side B of the ping-pong: a second process, driven by lines on stdin."""
    eng = Engine(f"127.0.0.1:{free_tcp_port()}")
    dst = np.zeros(max_size, np.uint8)
    src = np.zeros(max_size, np.uint8)
    eng.register(dst, access=Access.REMOTE_WRITE, name="pong")
    r_src = eng.register(src, access=Access.NONE)
    dmv, smv = dst.data, src.data
    print("READY", eng.id, flush=True)
    peer = ""
    ch = None
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "QUIT":
                break
            if cmd[0] == "PEER":
                peer = cmd[1]
                deadline = time.monotonic() + 30
                while peer not in eng.peers:
                    if time.monotonic() > deadline:
                        raise BenchError(f"pong: {peer} never connected")
                    time.sleep(0.01)
                print("OK", flush=True)
            elif cmd[0] == "RUN":
                size, total = int(cmd[1]), int(cmd[2])
                channel = len(cmd) > 3 and cmd[3] == "chan"
                # A channel lives for one run: while one is open the engine's blocking
                # put leaves it the direct lane, so a kept channel would move later
                # Engine.put runs off their own path.
                ch = eng.channel(peer, r_src, "ping") if channel else None
                dmv[size - 1] = 0
                smv[size - 1] = 0
                desc = ContiguousDesc(offset=0, nbytes=size)
                print("GO", flush=True)
                deadline = time.monotonic() + 60 + total * size / 1e5
                for i in range(total):
                    v = i % 255 + 1
                    _spin(dmv, size - 1, v, deadline)
                    smv[size - 1] = v
                    if ch is not None:
                        ch.put(0, 0, size, timeout=60)
                    else:
                        eng.put(peer, r_src, "ping", local_desc=desc, remote_desc=desc, timeout=60)
                if ch is not None:
                    ch.close()
                    ch = None
                print("DONE", flush=True)
    finally:
        if ch is not None:
            ch.close()
        eng.close()
    return 0


PUT_EVERY = 4
""":meth:`PingPong.run` times the blocking put on one round trip in this many."""


class PingPong:
    """Side A of the ping-pong (this process) and its child process, side B."""

    def __init__(self, max_size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(entry("bench_transfer")), "--pong-child", str(max_size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.eng: Engine | None = None
        self.ch: Channel | None = None
        try:
            child_id = self._expect("READY", 60)[1]
            self.eng = Engine("127.0.0.1:0")
            self.src = np.zeros(max_size, np.uint8)
            self.dst = np.zeros(max_size, np.uint8)
            self.r_src = self.eng.register(self.src, access=Access.NONE)
            self.eng.register(self.dst, access=Access.REMOTE_WRITE, name="ping")
            self.eng.connect(child_id, timeout=30.0)
            self.peer = child_id
            self._send(f"PEER {self.eng.id}")
            self._expect("OK", 60)
        except BaseException:
            self.close()
            raise

    def _send(self, line: str) -> None:
        send_line(self.proc, line)

    def _expect(self, word: str, timeout: float) -> list[str]:
        return expect_line(self.proc, word, timeout, "ping-pong child")

    def run(
        self, size: int, iters: int, warmup: int, channel: bool = False
    ) -> tuple[list[float], list[float], int]:
        """Half round trips and this side's blocking ``put`` times, in microseconds, and
        how many of this side's :meth:`hixl.Engine.put` calls ran on the direct lane.

        ``iters`` round trips after ``warmup`` untimed ones; the put is timed on the
        first and then one in :data:`PUT_EVERY`, whose round trips are not among the
        half round trips.  With ``channel`` both sides write with
        :meth:`hixl.Channel.put` instead of :meth:`hixl.Engine.put`.
        """
        assert self.eng is not None
        total = warmup + iters
        smv, dmv = self.src.data, self.dst.data
        smv[size - 1] = 0
        dmv[size - 1] = 0
        desc = ContiguousDesc(offset=0, nbytes=size)
        self._send(f"RUN {size} {total} {'chan' if channel else 'put'}")
        self._expect("GO", 60)
        deadline = time.monotonic() + 60 + total * size / 1e5
        samples, puts = [], []
        clock = time.perf_counter
        put = self.eng.put
        lane0 = self.eng.diagnostics().lane_posts
        # One channel per run, closed after it (see pong_child): Engine.put runs on the
        # direct lane only while no channel holds it.
        self.ch = self.eng.channel(self.peer, self.r_src, "pong") if channel else None
        ch_put = self.ch.put if self.ch is not None else None
        # A round trip is timed from just before the put to just after the answer, with
        # no clock reading in between: the blocking put is timed on the first round trip
        # and then one in PUT_EVERY, whose second reading (after the put) would count
        # in the round trip, so those are left out of the round trips (in the VM each
        # reading is a system call that ib_write_lat's loop does not make).
        for i in range(total):
            v = i % 255 + 1
            smv[size - 1] = v
            timed_put = i >= warmup and not (i - warmup) % PUT_EVERY
            t0 = clock()
            if ch_put is not None:
                ch_put(0, 0, size, timeout=60)
            else:
                put(self.peer, self.r_src, "pong", local_desc=desc, remote_desc=desc, timeout=60)
            if timed_put:
                puts.append((clock() - t0) * 1e6)
            _spin(dmv, size - 1, v, deadline)
            if i >= warmup and not timed_put:
                samples.append((clock() - t0) / 2 * 1e6)
        if self.ch is not None:
            self.ch.close()
            self.ch = None
        self._expect("DONE", 60)
        return samples, puts, self.eng.diagnostics().lane_posts - lane0

    def close(self) -> None:
        if self.ch is not None:
            self.ch.close()
            self.ch = None
        if self.eng is not None:
            self.eng.close()
            self.eng = None
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._send("QUIT")
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- the run


def build_steps(
    sizes: list[int], kinds: list[str], repeat: int, small_repeat: int | None = None
) -> list[tuple[int, int, str, str]]:
    """``(repeat, size, kind, impl)`` in run order.  The pair's order flips from one point
    to the next and, for each point, from one repeat to the next: which of two streams
    run back to back goes first can move a ratio by several percent in the VM.  Sizes up
    to :data:`SMALL_MAX` get ``small_repeat`` repeats (default ``repeat``): their pairs are
    the shortest and scatter the most."""
    small = repeat if small_repeat is None else small_repeat
    steps = []
    for rep in range(max(repeat, small)):
        points = [
            (s, k) for s in sizes for k in kinds if rep < (small if s <= SMALL_MAX else repeat)
        ]
        for j, (size, kind) in enumerate(points):
            impls = ("perftest", "hixl") if (rep + j) % 2 == 0 else ("hixl", "perftest")
            steps += [(rep, size, kind, impl) for impl in impls]
    return steps


def repeats_for(size: int, args: argparse.Namespace) -> int:
    return int(args.small_repeat if size <= SMALL_MAX else args.repeat)


def iters_for(kind: str, size: int, args: argparse.Namespace) -> int:
    if kind in LAT_KINDS:
        return iterations_for(size, args.lat_bytes, 5, args.max_lat_iters)
    return iterations_for(size, args.bytes, 5, args.max_iters)


def summarize(measurements: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Per size and kind: each side's median over repeats, and the ratio hixl / perftest.

    ``ratio`` is the median of the per-repeat ratios (each pair was measured back to back,
    so slow phases of a shared machine cancel within a pair); ``ratio_of_medians`` is
    kept beside it. Bandwidth: > 1 is faster; latency: > 1 is slower.
    """
    rows = []
    for size in sizes:
        row: dict[str, Any] = {"size": size}
        for kind in KINDS:
            vals: dict[str, list[float]] = {"perftest": [], "hixl": []}
            by_rep: dict[int, dict[str, float]] = {}
            iters = None
            for m in measurements:
                if m["size"] == size and m["kind"] == kind and m.get("value") is not None:
                    vals[m["impl"]].append(m["value"])
                    by_rep.setdefault(m["repeat"], {})[m["impl"]] = m["value"]
                    iters = m["iters"]
            if not vals["perftest"] and not vals["hixl"]:
                continue
            paired = [
                r for r in (ratio(v.get("hixl"), v.get("perftest")) for v in by_rep.values()) if r
            ]
            row[kind] = {
                "perftest": spread(vals["perftest"]),
                "hixl": spread(vals["hixl"]),
                "ratio": median(paired),
                "paired_ratios": paired,
                "ratio_of_medians": ratio(median(vals["hixl"]), median(vals["perftest"])),
                "iters": iters,
            }
        rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's bandwidth target: put >= 90% of ib_write_bw from 64 KiB on."""
    checked = [
        (r["size"], r["write"]["ratio"])
        for r in rows
        if r["size"] >= BW_TARGET_FROM and "write" in r and r["write"]["ratio"] is not None
    ]
    misses = [{"size": s, "ratio": x} for s, x in checked if x < BW_TARGET]
    return {
        "put_vs_ib_write_bw": {
            "target": BW_TARGET,
            "from_size": BW_TARGET_FROM,
            "checked": len(checked),
            "met": bool(checked) and not misses,
            "misses": misses,
        }
    }


def markdown(data: dict[str, Any]) -> str:
    """The ratio table (and context) of one run's JSON, as markdown."""
    p = data["params"]
    headers = [
        "size",
        "put / ib_write_bw",
        "get / ib_read_bw",
        "latency hixl / ib_write_lat",
        "channel latency / ib_write_lat",
        "ib_write_bw",
        "hixl put",
        "ib_read_bw",
        "hixl get",
        "ib_write_lat",
        "hixl lat",
        "hixl channel lat",
        "hixl blocking put",
        "µs/msg in put_async",
    ]
    rows = []
    for r in data["summary"]:

        def med(kind: str, impl: str, r: dict[str, Any] = r) -> float | None:
            x = r.get(kind, {}).get(impl, {}).get("median")
            return None if x is None else float(x)

        def rat(kind: str, r: dict[str, Any] = r) -> str:
            x = r.get(kind, {}).get("ratio")
            s = fmt_ratio(x)
            if kind == "write" and x is not None and r["size"] >= BW_TARGET_FROM:
                s += " ✓" if x >= BW_TARGET else " ✗"
            return s

        post = r.get("write", {}).get("post_us")
        rows.append(
            [
                fmt_size(r["size"]),
                rat("write"),
                rat("read"),
                rat("lat"),
                rat("chan"),
                fmt_rate(med("write", "perftest")),
                fmt_rate(med("write", "hixl")),
                fmt_rate(med("read", "perftest")),
                fmt_rate(med("read", "hixl")),
                fmt_us(med("lat", "perftest")),
                fmt_us(med("lat", "hixl")),
                fmt_us(med("chan", "hixl")),
                fmt_us(r.get("lat", {}).get("put_us")),
                "n/a" if post is None else f"{post:.0f}",
            ]
        )
    table = markdown_table(headers, rows, "l" + "r" * (len(headers) - 1))
    notes = [
        f"Ratios are hixl / perftest: the median over {p['repeat']} repeats of pairs measured "
        f"({p.get('small_repeat', p['repeat'])} up to {fmt_size(p.get('small_max', SMALL_MAX))}) "
        "back to back in this run (bandwidth: higher is better, target ≥ 0.90× from 64 KiB, "
        "✓/✗; latency: lower is better). Absolute columns are medians, context only "
        "(MB/s = 10^6 bytes/s).",
        f"In flight: hixl keeps {p['depth']} `put_async`/`get_async` outstanding; perftest runs "
        f"with `-t {p['depth']}` (both capped at the iteration count); reads: `-o "
        f"{HIXL_RD_ATOMIC}` = hixl's outstanding-read limit. Latency: both are write "
        'ping-pongs, half a round trip, median (perftest\'s t_typical); "hixl blocking put" '
        "is the median time of one `put()` inside it (post to completion seen by the caller). "
        "The channel ping-pong is the same with both sides writing through a `Channel` "
        "(`Engine.channel`: one work request per call on the connection's direct lane), "
        "paired with its own `ib_write_lat` run.",
        '"µs/msg in put_async": time the caller spends inside `put_async` per message: '
        "validation, planning, building and posting, plus rxe's own work, which sends (and, "
        "on loopback, delivers) packets inside `ibv_post_send`. Timed on one call in 16 and "
        "scaled (`hixl_stream`): a clock reading is a system call in the VM.",
    ]
    return table + "\n\n" + "\n".join(f"- {n}" for n in notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default=None, help=f"message sizes (default {DEFAULT_SIZES})")
    ap.add_argument("--kinds", default="write,read,lat,chan", help="any of write,read,lat,chan")
    ap.add_argument("--repeat", type=int, default=None, help="repeats per point (default 3)")
    ap.add_argument(
        "--small-repeat",
        type=int,
        default=None,
        help="repeats per point up to 16 KiB (default: at least 9): the shortest pairs, "
        "whose ratios scatter most (at 4 KiB one pair reads 0.5x-1.1x on a busy host)",
    )
    ap.add_argument(
        "--bytes",
        type=str,
        default=None,
        help="bytes per bandwidth run: iterations = bytes/size in [5, max-iters] (default 8M)",
    )
    ap.add_argument(
        "--lat-bytes", type=str, default=None, help="bytes per latency run, one way (default 512K)"
    )
    ap.add_argument(
        "--max-iters",
        type=int,
        default=2048,
        help="bandwidth iterations cap (default 2048: 4 KiB runs are 2048 messages, so "
        "filling and draining the window are a small part of them)",
    )
    ap.add_argument("--max-lat-iters", type=int, default=100, help="latency iterations cap")
    ap.add_argument(
        "--depth",
        type=int,
        default=128,
        help="messages in flight: hixl outstanding handles and perftest -t",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed hixl transfers before each timed run (default 8 for bandwidth, "
        "capped at the iterations; 2 ping-pongs for latency, 1 from 1 MiB)",
    )
    ap.add_argument(
        "--server-addr",
        default="127.0.0.1",
        help="address the perftest client connects to (out-of-band TCP)",
    )
    ap.add_argument("--device", default=None, help="verbs device (default: hixl's choice)")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="after the sweep, explain the put gap at --diagnose-sizes: ib_write_bw, hixl put "
        "with CPU per thread at a 0.5 ms GIL switch interval, the same at Python's 5 ms (the "
        "engine's default leaves it alone), a one-thread pyverbs "
        "loop, and cProfile of all threads",
    )
    ap.add_argument("--diagnose-sizes", default="4K,64K")
    ap.add_argument(
        "--profile-dir", type=Path, default=None, help="write the cProfile reports here"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {QUICK_SIZES}, 1 repeat, 1 MiB per run (a smoke test)",
    )
    ap.add_argument("--json", type=json_out, default=None, help="write results here")
    ap.add_argument("--pong-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quiet_logs()

    if args.pong_child is not None:
        return pong_child(args.pong_child)

    sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.small_repeat = args.small_repeat or (args.repeat if args.quick else max(args.repeat, 9))
    args.bytes = parse_sizes(args.bytes or ("1M" if args.quick else "8M"))[0]
    args.lat_bytes = parse_sizes(args.lat_bytes or ("256K" if args.quick else "512K"))[0]
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(set(kinds) - set(KINDS))}")
    if max(sizes) > 8 * MIB:
        ap.error("sizes above 8 MiB exceed rxe's max_msg_sz (one message per transfer)")

    setup = gather_setup(args.device)
    perftest = Perftest(setup["device"], setup["gid_index"], args.server_addr)
    mhz = setup.get("cpu_mhz")
    print_header(
        "hixl transfer benchmark: put/get bandwidth and latency vs perftest",
        setup,
        [
            f"sizes {','.join(fmt_size(s) for s in sizes)}; repeat {args.repeat} "
            f"({args.small_repeat} up to {fmt_size(SMALL_MAX)}); depth "
            f"{args.depth}; {fmt_size(args.bytes)} per bandwidth run, {fmt_size(args.lat_bytes)} "
            f"per latency run (iterations in [5, {args.max_iters}])",
            f"command: {command_line()}",
        ],
    )

    steps = build_steps(sizes, kinds, args.repeat, args.small_repeat)
    progress = Progress(len(steps), "transfer")
    measurements: list[dict[str, Any]] = []
    progress.note("[transfer] opening the engines and starting the ping-pong peer process")
    pair = EnginePair(max(sizes))
    pong = PingPong(max(sizes)) if set(kinds) & set(LAT_KINDS) else None
    checked: set[tuple[str, int]] = set()
    try:
        for rep, size, kind, impl in steps:
            iters = iters_for(kind, size, args)
            label = (
                f"{PERFTEST_TOOL[kind] if impl == 'perftest' else HIXL_NAME[kind]} "
                f"{fmt_size(size)} x{iters} (repeat {rep + 1}/{repeats_for(size, args)})"
            )
            progress.step(label)
            m: dict[str, Any] = {
                "repeat": rep,
                "size": size,
                "kind": kind,
                "impl": impl,
                "iters": iters,
            }
            try:
                if impl == "perftest":
                    m.update(run_perftest(perftest, kind, size, iters, args.depth, mhz))
                else:
                    m.update(run_hixl(pair, pong, kind, size, iters, args, checked))
            except BenchError as exc:
                m["error"] = str(exc)
                progress.note(f"  FAILED {label}: {exc}")
            measurements.append(m)
            progress.advance()
    finally:
        if pong is not None:
            pong.close()
        pair.close()
    progress.finish()

    summary = summarize(measurements, sizes)
    for r in summary:  # Python time per put_async call, and per blocking put: medians
        for kind, field in (("write", "post_us"), ("lat", "put_us"), ("chan", "put_us")):
            if kind in r:
                r[kind][field] = median(
                    [
                        m[field]
                        for m in measurements
                        if m["size"] == r["size"] and m["kind"] == kind and field in m
                    ]
                )

    diagnosis = []
    if args.diagnose:
        dsizes = parse_sizes(args.diagnose_sizes)
        dprog = Progress(len(dsizes), "transfer diagnosis")
        for size in dsizes:
            dprog.step(
                f"ib_write_bw, hixl put (+ GIL 5 ms), pyverbs loop, cProfile at {fmt_size(size)}"
            )
            try:
                diagnosis.append(
                    diagnose(
                        size,
                        iterations_for(size, 8 * MIB, 32, args.max_iters),
                        args.depth,
                        perftest,
                        args.profile_dir,
                    )
                )
            except BenchError as exc:
                dprog.note(f"  diagnosis failed: {exc}")
            dprog.advance()
        dprog.finish()

    data: dict[str, Any] = {
        "benchmark": "transfer",
        "setup": setup,
        "command": command_line(),
        "params": {
            "sizes": sizes,
            "kinds": kinds,
            "repeat": args.repeat,
            "small_repeat": args.small_repeat,
            "small_max": SMALL_MAX,
            "depth": args.depth,
            "bytes": args.bytes,
            "lat_bytes": args.lat_bytes,
            "max_iters": args.max_iters,
            "max_lat_iters": args.max_lat_iters,
            "warmup": args.warmup,
            "perftest_rd_atomic": HIXL_RD_ATOMIC,
        },
        "measurements": measurements,
        "summary": summary,
        "targets": check_targets(summary),
        "diagnosis": diagnosis,
    }
    print()
    print(markdown(data))
    if diagnosis:
        print("\nDiagnosis (back to back at one size):\n")
        print(diagnosis_markdown(diagnosis))
    t = data["targets"]["put_vs_ib_write_bw"]
    if not t["checked"]:
        verdict = "not measured in this run"
    elif t["met"]:
        verdict = "met"
    else:
        verdict = f"NOT met at {[fmt_size(x['size']) for x in t['misses']]}"
    print(
        f"\ntarget put >= {BW_TARGET:.0%} of ib_write_bw from {fmt_size(BW_TARGET_FROM)}: {verdict}"
    )
    if args.json is not None:
        write_json(args.json, data)
    errors = [m for m in measurements if "error" in m]
    return 1 if errors and len(errors) == len(measurements) else 0


def run_perftest(
    perftest: Perftest, kind: str, size: int, iters: int, depth: int, mhz: float | None
) -> dict[str, Any]:
    tool = PERFTEST_TOOL[kind]
    # No --perform_warm_up: with rxe it hangs at 4 KiB (perftest 6.06, kernel 6.1).
    args = ["-s", str(size), "-n", str(iters)]
    if kind in LAT_KINDS:
        # Raw cycle counts: perftest's own cycles-per-µs calibration fails often under TCG
        # on a busy host; the kernel's TSC rate (cpu MHz) converts them instead.
        args.append("-C")
    else:
        # perftest caps -t at -n itself, but sizes its buffers by -t first: 128 x 8 MiB.
        args += ["-t", str(min(depth, iters))]
    if kind == "read":
        args += ["-o", str(HIXL_RD_ATOMIC)]

    def lat_check(run: PerftestRun) -> None:
        parse_lat(run.output)

    if kind in LAT_KINDS:
        if mhz is None:
            raise BenchError("no single cpu MHz in /proc/cpuinfo to convert perftest's cycles")
        run = perftest.run(tool, args, check=lat_check, in_cycles=True)
    else:
        run = perftest.run(tool, args, check=bw_wall_check(size, iters))
    out: dict[str, Any] = {"command": run.command, "wall_s": run.wall_s, "side": run.side}
    if kind in LAT_KINDS:
        assert mhz is not None  # checked above
        lat = parse_lat(run.output)  # in cycles (-C), whatever the header says
        out.update(value=lat.t_typical_us / mhz, unit="us", perftest_cycles=lat, cpu_mhz=mhz)
    else:
        bw = parse_bw(run.output)
        out.update(
            value=bw.avg_Bps, unit="B/s", perftest=bw, wall_bound_Bps=size * iters / run.wall_s
        )
    return out


def run_hixl(
    pair: EnginePair,
    pong: PingPong | None,
    kind: str,
    size: int,
    iters: int,
    args: argparse.Namespace,
    checked: set[tuple[str, int]],
) -> dict[str, Any]:
    cmd = command_line()
    if kind in LAT_KINDS:
        assert pong is not None
        warm = (2 if size < MIB else 1) if args.warmup is None else args.warmup
        samples, puts, on_lane = pong.run(size, iters, warm, channel=kind == "chan")
        return {
            "value": median(samples),
            "unit": "us",
            "put_us": median(puts),
            "lane_puts": on_lane,
            "samples_min_us": min(samples),
            "samples_max_us": max(samples),
            "warmup": warm,
            "command": cmd,
        }
    depth = min(args.depth, iters)
    warm = min(8, iters) if args.warmup is None else args.warmup
    if warm:
        hixl_stream(pair, kind, size, warm, depth)
    if (kind, size) not in checked:
        check_bytes(pair, kind, size)
        checked.add((kind, size))
    wall, in_call = hixl_stream(pair, kind, size, iters, depth)
    return {
        "value": size * iters / wall,
        "unit": "B/s",
        "wall_s": wall,
        "depth": depth,
        "warmup": warm,
        "post_us": in_call / iters * 1e6,
        "command": cmd,
    }


if __name__ == "__main__":
    raise SystemExit(main())
