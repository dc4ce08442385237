"""hixl against the strongest C configuration on the same device, every timed byte checked.

Cases (``--cases``, each a list of rows measured in alternating order, round after round,
in one boot):

* ``put``: hixl ``put_async`` streams at each ``--sizes`` size, ``--depth`` in flight,
  every message at its own offset of fresh random bytes (filled before the clock),
  the destination compared with the source after the clock, every round.  Rows: the
  engine as it comes (Python's own GIL switch interval), the same with the interval at
  0.5 ms (what ``Engine(gil_switch_interval=0.0005)`` asks for), the same arguments
  repeated (one offset: the engine's template shortcut), and an engine with ``lanes=1``.
  Yardstick: the best of plain ``ib_write_bw``, ``ib_write_bw -l DEPTH`` and LANES pairs
  of ``ib_write_bw`` at once (their bandwidths added); ``lanes=1`` is also set against
  ``ib_write_bw -l DEPTH`` alone.
* ``get``: the same for ``get_async`` against ``ib_read_bw``, ``-o`` set to the reads
  hixl keeps in flight in all (16 per queue pair, LANES queue pairs).
* ``layer``: one blocking ``put`` of 8192 rows of 256 bytes (stride 320 on both sides) in
  a fresh process, so the time includes planning and building its first chain, against
  ``ib_write_bw -s 256 -n 8192`` with a post list of 64 (and without).
* ``lat``: a ping-pong of 4 KiB writes at a new offset every round trip (fresh random
  bytes, both buffers compared after the clock) against ``ib_write_lat``.

A round whose bytes do not match fails the run (exit 1).  Ratios are medians of the
per-round ratios against the C configuration with the best median, which is named next
to each.  perftest runs with a timeout and retries (small messages can hang under
emulation); ``--perform_warm_up`` hangs on rxe, so perftest has no warm-up, and hixl's
warm-up is a few untimed transfers before each timed one.

    python benchmarks/bench_fair.py --cases put --sizes 4K,64K --repeat 5
    /work/vmrun.sh .venv/bin/python benchmarks/bench_fair.py --cases lat,layer --json -
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from hixl import Access, ContiguousDesc, Engine, StridedDesc
from hixl.testbed.net import free_tcp_port

from .. import entry
from ..backends.perftest import Perftest, PerftestRun, bw_wall_check, parse_lat, sum_bw
from ..common import (
    MIB,
    BenchError,
    command_line,
    expect_line,
    fmt_rate,
    fmt_ratio,
    fmt_size,
    fmt_us,
    gather_setup,
    json_out,
    markdown_table,
    median,
    parse_size,
    parse_sizes,
    print_header,
    quiet_logs,
    send_line,
    write_json,
)
from ..common.yardstick import CConfig, Yardstick, against_best, bw_configs

CASES = ("put", "get", "layer", "lat")
RD_PER_QP = 16  # the reads in flight hixl's queue pairs ask for (QueuePair.connect)
LAYER_ROWS, LAYER_BYTES, LAYER_STRIDE = 8192, 256, 320
LAYER_POST_LIST = 64
MARK = "FAIR-JSON "
DEFAULT_ROW = "hixl (GIL interval as the process has it)"
FIRST_LAYER = "hixl layer put, first in a fresh process (plan + build included)"
LAT_ROW = "hixl put ping-pong, a new offset every call"
#: The hixl rows of a stream case, each measured once per round.
STREAM_ROWS = (
    DEFAULT_ROW,
    "hixl, GIL switch interval 0.5 ms",
    "hixl, the same arguments repeated",
    "hixl lanes=1",
)
#: The targets: (case, size, row, yardstick or None for the best, bound, higher is better).
TARGETS = (
    ("write", 64 * 1024, DEFAULT_ROW, None, 0.95, True),
    ("write", 4 * 1024, DEFAULT_ROW, None, 0.6, True),
    ("layer", 2 * MIB, FIRST_LAYER, "ib_write_bw -s 256 -n 8192 -t 128 -l 64", 0.9, True),
    ("lat", 4 * 1024, LAT_ROW, None, 1.5, False),
)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target measured in ``rows``: the ratio, its yardstick, met or not."""
    out = []
    for case, size, row, stick, bound, higher in TARGETS:
        for r in rows:
            if (r["case"], r["size"], r["row"]) != (case, size, row) or r["ratio"] is None:
                continue
            if stick is not None and r["yardstick"] != stick:
                continue
            met = r["ratio"] >= bound if higher else r["ratio"] <= bound
            sign = ">=" if higher else "<="
            out.append(
                f"{case} {fmt_size(size)}, {row}: {fmt_ratio(r['ratio'])} of "
                f"`{r['yardstick']}` (target {sign} {bound}x): "
                f"{'**met**' if met else '**not met**'}"
            )
            break
    return out


# --------------------------------------------------------------------------- hixl streams


class Pair:
    """A listening engine and a client engine in this process with ``span`` bytes each."""

    def __init__(self, span: int, lanes: int = 2) -> None:
        self.server = Engine(f"127.0.0.1:{free_tcp_port()}", lanes=lanes)
        self.client = Engine("127.0.0.1:0", lanes=lanes)
        self.span = span
        self.remote = np.zeros(span, np.uint8)
        self.src = np.zeros(span, np.uint8)
        self.dst = np.zeros(span, np.uint8)
        self.server.register(
            self.remote, access=Access.REMOTE_WRITE | Access.REMOTE_READ, name="bench"
        )
        self.r_src = self.client.register(self.src, access=Access.NONE)
        self.r_dst = self.client.register(self.dst, access=Access.LOCAL_WRITE)
        self.peer = self.server.id
        self.client.connect(self.peer, timeout=30.0)

    def close(self) -> None:
        self.client.close()
        self.server.close()


def stream(
    pair: Pair,
    op: str,
    size: int,
    depth: int,
    rng: np.random.Generator,
    *,
    repeated: bool = False,
    warmup: int = 8,
) -> float:
    """One timed stream of ``span // size`` messages; its bandwidth in bytes per second.

    Fresh random bytes fill the source before the clock; message ``i`` goes to offset
    ``i * size`` on both sides (``repeated``: offset 0 every time, the same arguments).
    After the clock the destination must equal the source, else :class:`BenchError`.
    """
    n = pair.span // size
    eng = pair.client
    start = eng.put_async if op == "write" else eng.get_async
    local = pair.r_src if op == "write" else pair.r_dst
    source, dest = (pair.src, pair.remote) if op == "write" else (pair.remote, pair.dst)
    timeout = 60.0 + depth * size / 1e6
    peer = pair.peer
    w = ContiguousDesc(offset=0, nbytes=size)
    for h in [start(peer, local, "bench", local_desc=w, remote_desc=w) for _ in range(warmup)]:
        h.wait()
    source[:] = rng.integers(0, 256, pair.span, dtype=np.uint8)
    window: deque[Any] = deque()
    clock = time.perf_counter
    t0 = clock()
    for i in range(n):
        if len(window) >= depth:
            window.popleft().wait()
        off = 0 if repeated else i * size
        desc = ContiguousDesc(offset=off, nbytes=size)
        window.append(
            start(peer, local, "bench", local_desc=desc, remote_desc=desc, timeout=timeout)
        )
    while window:
        window.popleft().wait()
    wall = clock() - t0
    span = size if repeated else n * size
    if not np.array_equal(source[:span], dest[:span]):
        bad = int(np.flatnonzero(source[:span] != dest[:span])[0])
        raise BenchError(
            f"hixl {op} stream of {n} x {fmt_size(size)}: bytes differ after the clock "
            f"(first at byte {bad}, message {bad // size})"
        )
    return n * size / wall


# --------------------------------------------------------------------------- perftest


def run_c(perftest: Perftest, cfg: CConfig, size: int, iters: int) -> tuple[float, str]:
    """One configuration's bandwidth (bytes per second, pairs added) and its command."""
    pr = perftest.run_pairs(cfg.tool, cfg.args, cfg.pairs, check=bw_wall_check(size, iters))
    return sum_bw([r.output for r in pr.runs]), pr.command


def out_of_budget(args: argparse.Namespace, t0: float, rnd: int, log: Any) -> bool:
    """Whether round ``rnd`` (from 0) would end past ``--budget`` seconds from ``t0``,
    judged by the rounds so far (the first round always runs): a run that must end in
    a time slot stops between rounds and keeps what it measured, instead of being
    killed in the middle of one."""
    budget = args.budget
    if not rnd or budget is None:
        return False
    spent = time.monotonic() - t0
    if spent + spent / rnd <= budget:
        return False
    log(f"  (stopped after {rnd} rounds: another would end past the {budget:.0f} s budget)")
    return True


def bw_case(
    op: str, sizes: list[int], args: argparse.Namespace, perftest: Perftest, log: Any
) -> list[dict[str, Any]]:
    tool = "ib_write_bw" if op == "write" else "ib_read_bw"
    lanes = args.lanes
    rows = []
    pair = Pair(args.bytes, lanes)
    pair1 = Pair(args.bytes, 1)
    rng = np.random.default_rng(int(time.time()))
    old = sys.getswitchinterval()
    try:
        for size in sizes:
            iters = args.bytes // size
            depth = min(args.depth, iters)
            outstanding = RD_PER_QP * lanes if op == "read" else None
            configs = bw_configs(tool, size, iters, depth, lanes, outstanding)
            one_out = RD_PER_QP if op == "read" else None
            single = bw_configs(tool, size, iters, depth, 1, one_out)[1]  # -l, one QP

            def h_default(s: int = size, d: int = depth) -> float:
                return stream(pair, op, s, d, rng)

            def h_switch(s: int = size, d: int = depth) -> float:
                sys.setswitchinterval(0.0005)
                try:
                    return stream(pair, op, s, d, rng)
                finally:
                    sys.setswitchinterval(old)

            def h_repeat(s: int = size, d: int = depth) -> float:
                return stream(pair, op, s, d, rng, repeated=True)

            def h_lanes1(s: int = size, d: int = depth) -> float:
                return stream(pair1, op, s, d, rng)

            hixl_rows = dict(
                zip(STREAM_ROWS, (h_default, h_switch, h_repeat, h_lanes1), strict=True)
            )
            c_rounds: list[dict[str, float]] = []
            single_rounds: list[dict[str, float]] = []
            h_rounds: dict[str, list[float | None]] = {k: [] for k in hixl_rows}
            commands: dict[str, str] = {}
            t0 = time.monotonic()
            for rnd in range(args.repeat):
                if out_of_budget(args, t0, rnd, log):
                    break
                items: list[tuple[str, Any]] = [("c", c) for c in configs]
                items += [("c1", single)] if single.args != configs[1].args else []
                items += [("h", k) for k in hixl_rows]
                if rnd % 2:
                    items.reverse()
                cr: dict[str, float] = {}
                sr: dict[str, float] = {}
                for kind, what in items:
                    if kind in ("c", "c1"):
                        try:
                            bps, cmd = run_c(perftest, what, size, iters)
                        except BenchError as exc:
                            log(f"  {what.name} {fmt_size(size)}: {exc}")
                            continue
                        commands[what.name] = cmd
                        (cr if kind == "c" else sr)[what.name] = bps
                        log(f"  {what.name} {fmt_size(size)}: {fmt_rate(bps)}")
                    else:
                        bps = hixl_rows[what]()
                        h_rounds[what].append(bps)
                        log(f"  {what} {fmt_size(size)}: {fmt_rate(bps)}")
                if single.args == configs[1].args and configs[1].name in cr:
                    sr[single.name] = cr[configs[1].name]
                c_rounds.append(cr)
                single_rounds.append(sr)
            for name, vals in h_rounds.items():
                if name == "hixl lanes=1":
                    ys = [against_best(vals, c_rounds), against_best(vals, single_rounds)]
                else:
                    ys = [against_best(vals, c_rounds)]
                for y in ys:
                    rows.append(_row(op, size, name, vals, y, commands))
    finally:
        pair1.close()
        pair.close()
    return rows


def _row(
    case: str,
    size: int,
    name: str,
    vals: list[float | None],
    y: Yardstick,
    commands: dict[str, str],
    unit: str = "B/s",
) -> dict[str, Any]:
    return {
        "case": case,
        "size": size,
        "row": name,
        "hixl_median": median([v for v in vals if v is not None]),
        "unit": unit,
        "yardstick": y.winner,
        "yardstick_command": commands.get(y.winner, y.winner),
        "yardstick_median": y.winner_median,
        "ratio": y.ratio,
        "rounds": y.rounds,
        "c_medians": dict(y.medians),
    }


# --------------------------------------------------------------------------- layer


def layer_child() -> int:
    """A fresh process: two engines, one layer put timed from the call (first plan and
    chain build included), its bytes checked; then a second one (warm).  One JSON line."""
    quiet_logs()
    n = LAYER_ROWS * LAYER_STRIDE
    server = Engine(f"127.0.0.1:{free_tcp_port()}")
    client = Engine("127.0.0.1:0")
    try:
        src = np.zeros(n, np.uint8)
        dst = np.zeros(n, np.uint8)
        r = client.register(src)
        server.register(dst, access=Access.REMOTE_WRITE, name="dst")
        client.connect(server.id, timeout=30.0)
        desc = StridedDesc(offset=0, count=LAYER_ROWS, size=LAYER_BYTES, stride=LAYER_STRIDE)
        rng = np.random.default_rng()
        out = {}
        for label in ("first", "second"):
            src[:] = rng.integers(0, 256, n, dtype=np.uint8)
            t0 = time.perf_counter()
            client.put(server.id, r, "dst", local_desc=desc, remote_desc=desc, timeout=120)
            out[label] = time.perf_counter() - t0
            want = src.reshape(LAYER_ROWS, LAYER_STRIDE)[:, :LAYER_BYTES]
            got = dst.reshape(LAYER_ROWS, LAYER_STRIDE)[:, :LAYER_BYTES]
            if not np.array_equal(want, got):
                print(json.dumps({"error": f"layer put ({label}): bytes differ"}), flush=True)
                return 1
        print(json.dumps(out), flush=True)
        return 0
    finally:
        client.close()
        server.close()


def layer_case(args: argparse.Namespace, perftest: Perftest, log: Any) -> list[dict[str, Any]]:
    nbytes = LAYER_ROWS * LAYER_BYTES
    base = ("-s", str(LAYER_BYTES), "-n", str(LAYER_ROWS), "-t", "128")
    configs = [
        CConfig(
            name=f"ib_write_bw -s 256 -n 8192 -t 128 -l {LAYER_POST_LIST}",
            tool="ib_write_bw",
            args=(*base, "-l", str(LAYER_POST_LIST)),
        ),
        CConfig(name="ib_write_bw -s 256 -n 8192 -t 128", tool="ib_write_bw", args=base),
    ]
    first: list[float | None] = []
    second: list[float | None] = []
    c_rounds: list[dict[str, float]] = []
    commands: dict[str, str] = {}
    t0 = time.monotonic()
    for rnd in range(args.repeat):
        if out_of_budget(args, t0, rnd, log):
            break
        items: list[CConfig | None] = [*configs, None]
        if rnd % 2:
            items.reverse()
        cr: dict[str, float] = {}
        for cfg in items:
            if cfg is None:
                proc = subprocess.run(
                    [sys.executable, str(entry("bench_fair")), "--layer-child"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                res: dict[str, Any] = (
                    json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
                )
                if "error" in res or proc.returncode:
                    raise BenchError(f"layer child: {res.get('error', proc.returncode)}")
                first.append(nbytes / res["first"])
                second.append(nbytes / res["second"])
                log(
                    f"  hixl layer put: first {res['first'] * 1e3:.1f} ms, "
                    f"second {res['second'] * 1e3:.1f} ms"
                )
            else:
                try:
                    bps, cmd = run_c(perftest, cfg, LAYER_BYTES, LAYER_ROWS)
                except BenchError as exc:
                    log(f"  {cfg.name}: {exc}")
                    continue
                cr[cfg.name] = bps
                commands[cfg.name] = cmd
                log(f"  {cfg.name}: {fmt_rate(bps)}")
        c_rounds.append(cr)
    rows = []
    for name, vals in (
        (FIRST_LAYER, first),
        ("hixl layer put, second (warm)", second),
    ):
        best = against_best(vals, c_rounds)
        rows.append(_row("layer", nbytes, name, vals, best, commands))
        if best.winner != configs[0].name:  # the target's yardstick too, when it lost
            only = [{k: v for k, v in r.items() if k == configs[0].name} for r in c_rounds]
            rows.append(_row("layer", nbytes, name, vals, against_best(vals, only), commands))
    return rows


# --------------------------------------------------------------------------- latency


def _spin(mv: memoryview, index: int, value: int, deadline: float) -> None:
    n = 0
    while mv[index] != value:
        n += 1
        if not n & 0x3FFF and time.monotonic() > deadline:
            raise BenchError(f"ping-pong: no answer (byte {index} != {value}) before deadline")


def _side(size: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng().integers(0, 256, size * total, dtype=np.uint8)
    for i in range(total):  # the marker (last byte of each slot) the other side polls
        src[i * size + size - 1] = i % 255 + 1
    return src, np.zeros(size * total, np.uint8)


def pong_child() -> int:
    """Side B: answers each write at slot ``i`` with its own slot ``i``; reports CRCs."""
    quiet_logs()
    eng = Engine(f"127.0.0.1:{free_tcp_port()}")
    print("READY", eng.id, flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "QUIT":
                break
            size, total, peer = int(cmd[1]), int(cmd[2]), cmd[3]
            src, dst = _side(size, total)
            r_src = eng.register(src, access=Access.NONE)
            r_dst = eng.register(dst, access=Access.REMOTE_WRITE, name="pong")
            deadline = time.monotonic() + 60
            while peer not in eng.peers:
                if time.monotonic() > deadline:
                    raise BenchError(f"pong: {peer} never connected")
                time.sleep(0.01)
            print("GO", flush=True)
            dmv = dst.data
            deadline = time.monotonic() + 120 + total * size / 1e5
            for i in range(total):
                _spin(dmv, i * size + size - 1, i % 255 + 1, deadline)
                d = ContiguousDesc(offset=i * size, nbytes=size)
                eng.put(peer, r_src, "ping", local_desc=d, remote_desc=d, timeout=60)
            print("DONE", zlib.crc32(dst.data), zlib.crc32(src.data), flush=True)
            eng.deregister(r_src)
            eng.deregister(r_dst)
    finally:
        eng.close()
    return 0


def hixl_latency(size: int, iters: int, warmup: int) -> float:
    """Median half round trip (us) of a fresh ping-pong pair, a new offset every time."""
    total = warmup + iters
    proc = subprocess.Popen(
        [sys.executable, str(entry("bench_fair")), "--pong-child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    eng: Engine | None = None
    try:
        child = expect_line(proc, "READY", 120, "ping-pong child")[1]
        eng = Engine("127.0.0.1:0")
        src, dst = _side(size, total)
        r_src = eng.register(src, access=Access.NONE)
        eng.register(dst, access=Access.REMOTE_WRITE, name="ping")
        eng.connect(child, timeout=30.0)
        send_line(proc, f"RUN {size} {total} {eng.id}")
        expect_line(proc, "GO", 120, "ping-pong child")
        deadline = time.monotonic() + 120 + total * size / 1e5
        dmv = dst.data
        clock = time.perf_counter
        put = eng.put
        samples = []
        while "pong" not in {r.name for r in eng.connection(child).remote_regions}:
            if time.monotonic() > deadline:
                raise BenchError("pong's region was never announced")
            time.sleep(0.005)
        for i in range(total):
            d = ContiguousDesc(offset=i * size, nbytes=size)
            t0 = clock()
            put(child, r_src, "pong", local_desc=d, remote_desc=d, timeout=60)
            _spin(dmv, i * size + size - 1, i % 255 + 1, deadline)
            if i >= warmup:
                samples.append((clock() - t0) / 2 * 1e6)
        done = expect_line(proc, "DONE", 120, "ping-pong child")
        if int(done[1]) != zlib.crc32(src.data) or int(done[2]) != zlib.crc32(dst.data):
            raise BenchError(f"ping-pong of {total} x {fmt_size(size)}: bytes differ")
        send_line(proc, "QUIT")
        m = median(samples)
        assert m is not None
        return m
    finally:
        if eng is not None:
            eng.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def lat_case(
    args: argparse.Namespace, perftest: Perftest, mhz: float | None, log: Any
) -> list[dict[str, Any]]:
    size = 4096
    iters = args.lat_iters
    name = f"ib_write_lat -s {size} -n {iters} -C"
    if mhz is None:
        raise BenchError("no single cpu MHz in /proc/cpuinfo to convert perftest's cycles")
    h: list[float | None] = []
    c_rounds: list[dict[str, float]] = []
    t0 = time.monotonic()
    for rnd in range(args.repeat):
        if out_of_budget(args, t0, rnd, log):
            break
        cr: dict[str, float] = {}
        for turn in (0, 1) if rnd % 2 == 0 else (1, 0):
            if turn == 0:

                def lat_check(run: PerftestRun) -> None:
                    parse_lat(run.output)

                try:
                    run = perftest.run(
                        "ib_write_lat",
                        ["-s", str(size), "-n", str(iters), "-C"],
                        check=lat_check,
                        in_cycles=True,
                    )
                except BenchError as exc:
                    log(f"  {name}: {exc}")
                    continue
                cr[name] = parse_lat(run.output).t_typical_us / mhz
                log(f"  {name}: {fmt_us(cr[name])}")
            else:
                h.append(hixl_latency(size, iters, warmup=10))
                log(f"  hixl put ping-pong, new offset each: {fmt_us(h[-1])}")
        c_rounds.append(cr)
    y = against_best(h, c_rounds, higher_is_better=False)
    return [_row("lat", size, LAT_ROW, h, y, {name: name}, "us")]


# --------------------------------------------------------------------------- report


def markdown(rows: list[dict[str, Any]]) -> str:
    headers = [
        "case",
        "size",
        "hixl row",
        "hixl median",
        "yardstick (best C)",
        "C median",
        "ratio",
        "rounds",
    ]
    body = []
    for r in rows:
        lat = r["unit"] == "us"
        body.append(
            [
                r["case"],
                fmt_size(r["size"]),
                r["row"],
                fmt_us(r["hixl_median"]) if lat else fmt_rate(r["hixl_median"]),
                f"`{r['yardstick']}`",
                fmt_us(r["yardstick_median"]) if lat else fmt_rate(r["yardstick_median"]),
                fmt_ratio(r["ratio"]) + ("" if not lat else " (time)"),
                str(r["rounds"]),
            ]
        )
    return markdown_table(headers, body, "lrlrlrrr")


def report_markdown(data: dict[str, Any], targets: bool = True) -> str:
    """The table, the targets (unless ``targets`` is False), the command of every chunk."""
    chunks = data.get("chunks") or [data]
    lines = [markdown(data["rows"]), ""]
    v = verdicts(data["rows"]) if targets else []
    if v:
        lines += ["Targets:", "", *[f"- {x}" for x in v], ""]
    lines.append(
        "Ratios: median over rounds of hixl / the named C configuration in the same round "
        "(latency: time, lower is better); the named one had the best median of those "
        "tried (plain, `-l` at the same depth, as many pairs at once as hixl has lanes). "
        "Every hixl byte was checked after the clock, every round."
    )
    lines.append("")
    for c in chunks:
        cut = (
            "; cut short by a time cap, its finished rounds read from its output with `--from-log`"
            if c.get("from_log")
            else ""
        )
        lines.append(
            f"- `{c.get('command')}` ({c['setup'].get('date_utc')}, guest load "
            f"{c.get('load', 'n/a')}{cut})"
        )
    return "\n".join(lines)


_LOG_LINE = re.compile(r"^  (?P<name>.+?): (?P<value>[\d.]+) (?P<unit>µs|ms|MB/s)$")
_LOG_LAYER = re.compile(
    r"^  hixl layer put: first (?P<first>[\d.]+) ms, second (?P<second>[\d.]+) ms$"
)


_LOG_BW = re.compile(r"^  (?P<name>.+) (?P<size>\d+ (?:B|KiB|MiB)): (?P<value>[\d.]+) MB/s$")
_LOG_PARAMS = re.compile(
    r"depth (?P<depth>\d+); lanes (?P<lanes>\d+); (?P<bytes>\d+ \w+) per stream"
)


def _bw_rows_from_log(case: str, lines: list[str], params: str) -> list[dict[str, Any]]:
    """The rows of a ``put`` or ``get`` section from its progress lines (one line per
    row and round, every round the same rows in either order; ``params``: the header
    line with depth, lanes and bytes per stream).  Complete rounds only."""
    m = _LOG_PARAMS.search(params)
    if m is None:
        raise BenchError(f"no depth, lanes and stream size in {params!r}")
    depth, lanes, nbytes = int(m["depth"]), int(m["lanes"]), parse_size(m["bytes"].replace(" ", ""))
    op = "write" if case == "put" else "read"
    tool = "ib_write_bw" if op == "write" else "ib_read_bw"
    by_size: dict[int, list[tuple[str, float | None]]] = {}
    for line in lines:
        if line.startswith("  (stopped after"):
            continue
        got = _LOG_BW.match(line)
        if got is not None:
            size = parse_size(got["size"].replace(" ", ""))
            by_size.setdefault(size, []).append((got["name"], float(got["value"]) * 1e6))
            continue
        # A C configuration that failed: "  NAME SIZE: the error" (still one of the round's)
        failed = re.match(r"^  (?P<name>.+) (?P<size>\d+ (?:KiB|MiB|B)): ", line)
        if failed is None:
            raise BenchError(f"not a {case} line: {line!r}")
        size = parse_size(failed["size"].replace(" ", ""))
        by_size.setdefault(size, []).append((failed["name"], None))
    rows: list[dict[str, Any]] = []
    for size, items in by_size.items():
        iters = nbytes // size
        out = RD_PER_QP * lanes if op == "read" else None
        one_out = RD_PER_QP if op == "read" else None
        configs = bw_configs(tool, size, iters, min(depth, iters), lanes, out)
        single = bw_configs(tool, size, iters, min(depth, iters), 1, one_out)[1]
        best = {c.name for c in configs}
        k = len(best | {single.name}) + len(STREAM_ROWS)  # lines per round
        c_rounds: list[dict[str, float]] = []
        single_rounds: list[dict[str, float]] = []
        h_rounds: dict[str, list[float | None]] = {}
        for i in range(0, len(items) - k + 1, k):
            part = items[i : i + k]
            cr = {n: v for n, v in part if n in best and v is not None}
            sr = {n: v for n, v in part if n == single.name and v is not None}
            for n, v in part:
                if n in STREAM_ROWS:
                    h_rounds.setdefault(n, []).append(v)
            c_rounds.append(cr)
            single_rounds.append(sr)
        for name, vals in h_rounds.items():
            ys = [against_best(vals, c_rounds)]
            if name == "hixl lanes=1":
                ys.append(against_best(vals, single_rounds))
            rows += [_row(op, size, name, vals, y, {}) for y in ys]
    return rows


def rows_from_log(text: str) -> list[dict[str, Any]]:
    """The rows of a run from its progress lines, for a run that was cut short before it
    printed its JSON.  Each round printed one line per row (2 for ``lat``, 3 for
    ``layer``, one per C configuration and hixl row for ``put``/``get``, in either
    order); an incomplete last round is left out."""
    sections: dict[str, list[str]] = {}
    current = None
    params = ""
    for line in text.splitlines():
        if line.startswith("# cases "):
            params = line
        if re.fullmatch(r"\[\w+\]", line.strip()):
            current = line.strip()[1:-1]
            sections[current] = []
        elif current is not None and line.startswith("  "):
            sections[current].append(line.rstrip())
    rows: list[dict[str, Any]] = []
    for case in ("put", "get"):
        if sections.get(case):
            rows += _bw_rows_from_log(case, sections[case], params)
    lat = sections.get("lat", [])
    if lat:
        h: list[float | None] = []
        c_rounds: list[dict[str, float]] = []
        name = ""
        for i in range(0, len(lat) - 1, 2):
            cr: dict[str, float] = {}
            hv = None
            for line in lat[i : i + 2]:
                m = _LOG_LINE.match(line)
                if m is None:
                    raise BenchError(f"not a latency line: {line!r}")
                us = float(m["value"]) * (1000 if m["unit"] == "ms" else 1)
                if m["name"].startswith("hixl"):
                    hv = us
                else:
                    name = m["name"]
                    cr[name] = us
            h.append(hv)
            c_rounds.append(cr)
        y = against_best(h, c_rounds, higher_is_better=False)
        rows.append(_row("lat", 4096, LAT_ROW, h, y, {name: name}, "us"))
    layer = sections.get("layer", [])
    if layer:
        nbytes = LAYER_ROWS * LAYER_BYTES
        first: list[float | None] = []
        second: list[float | None] = []
        lc_rounds: list[dict[str, float]] = []
        for i in range(0, len(layer) - 2, 3):
            cr = {}
            for line in layer[i : i + 3]:
                m2 = _LOG_LAYER.match(line)
                if m2 is not None:
                    first.append(nbytes / (float(m2["first"]) / 1e3))
                    second.append(nbytes / (float(m2["second"]) / 1e3))
                    continue
                m = _LOG_LINE.match(line)
                if m is None or m["unit"] != "MB/s":
                    raise BenchError(f"not a layer line: {line!r}")
                cr[m["name"]] = float(m["value"]) * 1e6
            lc_rounds.append(cr)
        for label, vals in ((FIRST_LAYER, first), ("hixl layer put, second (warm)", second)):
            rows.append(_row("layer", nbytes, label, vals, against_best(vals, lc_rounds), {}))
    return rows


def merge(paths: list[Path]) -> dict[str, Any]:
    """Chunks of one boot's worth of cases, run one after another, as one result."""
    chunks = [json.loads(p.read_text()) for p in paths]
    if not chunks:
        raise BenchError("nothing to merge")
    # A chunk read back from a log knows only its date: the setup is a measured one's.
    setups = [c["setup"] for c in chunks if len(c["setup"]) > 1] or [chunks[0]["setup"]]
    return {
        "benchmark": "fair",
        "setup": setups[0],
        "command": "; ".join(str(c["command"]) for c in chunks),
        "rows": [r for c in chunks for r in c["rows"]],
        "chunks": [{k: v for k, v in c.items() if k != "rows"} for c in chunks],
        "targets": verdicts([r for c in chunks for r in c["rows"]]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", default="put,get,lat,layer", help=f"any of {','.join(CASES)}")
    ap.add_argument("--sizes", default="4K,64K", help="stream message sizes")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (alternating order)")
    ap.add_argument("--bytes", default="8M", help="bytes per timed stream")
    ap.add_argument("--depth", type=int, default=32, help="messages in flight (perftest -t/-l)")
    ap.add_argument("--lanes", type=int, default=2, help="hixl lanes = concurrent C pairs")
    ap.add_argument("--lat-iters", type=int, default=200, help="round trips per latency run")
    ap.add_argument("--perftest-timeout", type=float, default=60.0, help="seconds per try")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds per case and size: no round starts that would end past it",
    )
    ap.add_argument(
        "--json", type=json_out, default=None, help="write results here ('-' = stdout line)"
    )
    ap.add_argument("--quick", action="store_true", help="one round, 64 KiB, 1 MiB streams")
    ap.add_argument(
        "--merge", nargs="+", type=Path, default=None, help="join these runs' JSON into --json"
    )
    ap.add_argument(
        "--from-log",
        type=Path,
        default=None,
        help="the rows of a run cut short, from its output, into --json",
    )
    ap.add_argument("--layer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pong-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.layer_child:
        return layer_child()
    if args.pong_child:
        return pong_child()
    quiet_logs()
    if args.from_log:
        text = args.from_log.read_text()
        got = rows_from_log(text)
        head = [ln[2:] for ln in text.splitlines() if ln.startswith("# ")]
        data = {
            "benchmark": "fair",
            "setup": {"date_utc": next((h.split()[1] for h in head if h.startswith("date")), "")},
            "command": next((h[len("command: ") :] for h in head if h.startswith("command")), ""),
            "header": head,
            "load": next((h.rsplit("load ", 1)[1] for h in head if "; load " in h), "n/a"),
            "rows": got,
            "from_log": str(args.from_log),
        }
        print(markdown(got))
        if args.json:
            write_json(Path(args.json), data)
        return 0
    if args.merge:
        merged = merge(args.merge)
        print(report_markdown(merged))
        if args.json:
            write_json(Path(args.json), merged)
        return 0
    if args.quick:
        args.repeat, args.sizes, args.bytes, args.lat_iters = 1, "64K", "1M", 20
    cases = [c for c in args.cases.split(",") if c]
    if set(cases) - set(CASES):
        ap.error(f"--cases: unknown {sorted(set(cases) - set(CASES))}")
    args.bytes = parse_sizes(args.bytes)[0]
    sizes = parse_sizes(args.sizes)
    if args.bytes > 64 * MIB or any(args.bytes % s for s in sizes):
        ap.error("--bytes must be a multiple of every size, at most 64 MiB")
    setup = gather_setup()
    perftest = Perftest(setup["device"], setup["gid_index"], timeout=args.perftest_timeout)
    print_header(
        "hixl vs the best C configuration, bytes checked",
        setup,
        [
            f"cases {','.join(cases)}; sizes {args.sizes}; {args.repeat} rounds; depth "
            f"{args.depth}; lanes {args.lanes}; {fmt_size(args.bytes)} per stream; "
            f"load {os.getloadavg()[0]:.2f}",
            f"command: {command_line()}",
        ],
    )

    def log(msg: str) -> None:
        print(msg, flush=True)

    rows: list[dict[str, Any]] = []
    for case in cases:
        log(f"[{case}]")
        if case == "put":
            got = bw_case("write", sizes, args, perftest, log)
        elif case == "get":
            got = bw_case("read", sizes, args, perftest, log)
        elif case == "layer":
            got = layer_case(args, perftest, log)
        else:
            got = lat_case(args, perftest, setup.get("cpu_mhz"), log)
        rows += got
        if args.json == "-":  # each case as it ends: a run cut short keeps what it measured
            part = {"benchmark": "fair", "setup": setup, "command": command_line(), "rows": got}
            print(MARK + json.dumps(part, default=str), flush=True)
    data = {
        "benchmark": "fair",
        "setup": setup,
        "command": command_line(),
        "load": round(os.getloadavg()[0], 2),
        "targets": verdicts(rows),
        "rows": rows,
        "params": {k: v for k, v in vars(args).items() if not k.endswith("child")},
    }
    print()
    print(report_markdown(data))
    if args.json and args.json != "-":
        write_json(Path(args.json), data)
    return 0
