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
import cProfile
import io
import pstats
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from hixl import Access, Channel, ContiguousDesc, Engine
from hixl.testbed.net import free_tcp_port

from .. import entry
from ..backends.hixl import EnginePair, check_bytes, hixl_stream
from ..backends.loopback import loopback_qp
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


# --------------------------------------------------------------------------- profiling


class ThreadProfiles:
    """cProfile the calling thread and every thread started after construction.

    Threads started later (the engines' progress threads) get a hook that does nothing
    until :meth:`arm` is called and then switches that thread to its own
    ``cProfile.Profile``, so engine set-up stays out of the numbers.
    """

    def __init__(self) -> None:
        self.profiles: dict[str, cProfile.Profile] = {}
        self._armed = threading.Event()
        self._lock = threading.Lock()
        threading.setprofile(self._hook)

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self._armed.is_set():
            return
        prof = cProfile.Profile()
        with self._lock:
            self.profiles[threading.current_thread().name] = prof
        prof.enable()  # replaces this hook for the thread

    def arm(self) -> None:
        main = cProfile.Profile()
        self.profiles["main"] = main
        self._armed.set()
        main.enable()

    def stop(self) -> None:
        if "main" in self.profiles:
            self.profiles["main"].disable()
        threading.setprofile(None)


def _top(prof: cProfile.Profile, n: int) -> tuple[str, list[dict[str, Any]], float]:
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    stats.sort_stats("tottime").print_stats(n)
    stats.sort_stats("cumulative").print_stats(n)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values()) or 1e-12
    waiting = sum(v[2] for k, v in raw.items() if _is_wait(k[2]))
    busy = max(total - waiting, 1e-12)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(
        raw.items(), key=lambda kv: -kv[1][2]
    )[:n]:
        where = f"{Path(file).name}:{line}({func})" if line else func
        wait = _is_wait(func)
        rows.append(
            {
                "function": where,
                "calls": nc,
                "tottime_s": tt,
                "cumtime_s": ct,
                "waiting": wait,
                "share_of_busy": None if wait else tt / busy,
            }
        )
    return stream.getvalue(), rows, busy


def _is_wait(func: str) -> bool:
    """Blocking calls: time in them is waiting (for completions, I/O), not Python work."""
    return any(
        w in func
        for w in (
            "acquire' of '_thread.lock",
            "select' of",
            "'poll' of 'select",
            "built-in method time.sleep",
        )
    )


class RawVerbs:
    """ib_write_bw's loop in Python over hixl's verbs adapter: one thread, no engine.

    One RC queue pair looped back to another on the same device; every message is one
    signaled RDMA WRITE posted on its own, at most ``depth`` in flight. It separates what
    Python and pyverbs cost per message from what the engine adds (threads, locks,
    validation, planning).
    """

    def __init__(self, max_size: int, depth: int) -> None:
        from hixl.verbs import adapter as _verbs

        self.v = _verbs
        self.dev = _verbs.open_device()
        try:
            self.cq = self.dev.create_cq(4 * depth + 16)
            wr = 2 * depth + 8
            self.qp, self.peer = loopback_qp(self.dev, self.cq, wr, 1)
            self.src = np.ones(max_size, np.uint8)
            self.dst = np.zeros(max_size, np.uint8)
            self.msrc = self.dev.register(self.src.ctypes.data, max_size, 0, self.src)
            rw = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE
            self.mdst = self.dev.register(self.dst.ctypes.data, max_size, rw, self.dst)
        except BaseException:
            self.dev.close()
            raise

    def stream(self, size: int, iters: int, depth: int) -> float:
        v, qp, cq = self.v, self.qp, self.cq
        sge = [(self.msrc.addr, size, self.msrc.lkey)]
        raddr, rkey = self.mdst.addr, self.mdst.rkey
        posted = done = 0
        deadline = time.monotonic() + 60 + iters * size / 1e5
        t0 = time.perf_counter()
        while done < iters:
            while posted < iters and posted - done < depth:
                posted += 1
                qp.post_send([v.SendRequest(posted, v.WR_RDMA_WRITE, sge, raddr, rkey)])
            for wc in cq.poll(64):
                if not wc.ok:
                    raise BenchError(f"pyverbs loop: completion error {wc.status_name}")
                done += 1
            if time.monotonic() > deadline:
                raise BenchError("pyverbs loop: completions stopped coming")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.dev.close()


def _rusage() -> tuple[float, float, float, float]:
    """(caller thread user, system, whole process user, system) CPU seconds so far."""
    t = resource.getrusage(resource.RUSAGE_THREAD)
    p = resource.getrusage(resource.RUSAGE_SELF)
    return t.ru_utime, t.ru_stime, p.ru_utime, p.ru_stime


def diagnose(
    size: int, iters: int, depth: int, perftest: Perftest, out_dir: Path | None
) -> dict[str, Any]:
    """Why hixl put is slower than ib_write_bw at ``size``: four measurements, one profile.

    Back to back at one size: ``ib_write_bw``; the hixl put stream with CPU time per
    thread (at a 0.5 ms GIL switch interval, as asked of the engine); the same at Python's 5 ms
    (does thread hand-off cost matter?); the plain one-thread pyverbs loop (what do Python
    and pyverbs alone cost?); and the hixl stream under cProfile, all threads.
    """
    out: dict[str, Any] = {"size": size, "iters": iters, "depth": depth}
    run = perftest.run(
        "ib_write_bw",
        ["-s", str(size), "-n", str(iters), "-t", str(min(depth, iters))],
        check=bw_wall_check(size, iters),
    )
    out["perftest_Bps"] = parse_bw(run.output).avg_Bps
    out["perftest_command"] = run.command

    pair = EnginePair(size)
    old = sys.getswitchinterval()
    try:
        # The first stream at 0.5 ms, as an application that asks the engine for it
        # (gil_switch_interval=0.0005) runs; the second at Python's own 5 ms (the default).
        sys.setswitchinterval(0.0005)
        hixl_stream(pair, "write", size, min(8, iters), depth)
        r0 = _rusage()
        wall, in_call = hixl_stream(pair, "write", size, iters, depth)
        r1 = _rusage()
        cpu = [b - a for a, b in zip(r0, r1, strict=True)]
        out["hixl"] = {
            "Bps": size * iters / wall,
            "wall_s": wall,
            "in_call_s": in_call,
            "caller_user_s": cpu[0],
            "caller_sys_s": cpu[1],
            "other_threads_cpu_s": cpu[2] + cpu[3] - cpu[0] - cpu[1],
        }
        sys.setswitchinterval(0.005)
        wall2, _ = hixl_stream(pair, "write", size, iters, depth)
        out["switch_interval_s"] = 0.0005
        out["hixl_switch_5ms"] = {"Bps": size * iters / wall2}
    finally:
        sys.setswitchinterval(old)
        pair.close()

    raw = RawVerbs(size, depth)
    try:
        raw.stream(size, min(8, iters), depth)
        r0 = _rusage()
        wall3 = raw.stream(size, iters, depth)
        r1 = _rusage()
        out["pyverbs_loop"] = {
            "Bps": size * iters / wall3,
            "user_s": r1[0] - r0[0],
            "sys_s": r1[1] - r0[1],
        }
    finally:
        raw.close()

    profiler = ThreadProfiles()
    try:
        pair = EnginePair(size)
        try:
            hixl_stream(pair, "write", size, min(8, iters), depth)
            profiler.arm()
            pwall, pin_call = hixl_stream(pair, "write", size, iters, depth)
            profiler.stop()
        finally:
            pair.close()
    finally:
        profiler.stop()
    prof: dict[str, Any] = {"wall_s": pwall, "in_call_s": pin_call, "threads": {}}
    text = []
    for name, p in profiler.profiles.items():
        if name != "main" and not name.startswith("hixl-progress-127.0.0.1:0"):
            continue  # the client's progress thread does the sending side's work
        label = "caller thread" if name == "main" else "client progress thread"
        report, rows, busy = _top(p, 25)
        prof["threads"][label] = {"busy_s": busy, "top": rows}
        text.append(f"=== {label} ({name}): {busy:.3f} s busy (not waiting)\n{report}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"profile-put-{size}.txt"
        path.write_text("\n".join(text))
        prof["file"] = path.name
    out["profile"] = prof
    base = out["perftest_Bps"]
    for key in ("hixl", "hixl_switch_5ms", "pyverbs_loop"):  # see _SWITCH_KEYS
        out[key]["vs_ib_write_bw"] = ratio(out[key]["Bps"], base)
    return out


#: The diagnosis's second hixl stream: Python's 5 ms switch interval; runs before
#: 2026-12-04 04:30 UTC repeated the engine's 0.5 ms there (``hixl_switch_0.5ms``).
_SWITCH_KEYS = {"hixl_switch_5ms": "same, GIL switch 5 ms", "hixl_switch_0.5ms": "same again"}


def diagnosis_markdown(diag: list[dict[str, Any]]) -> str:
    """The diagnosis table: ratios against ib_write_bw measured back to back."""
    alt = next((k for k in _SWITCH_KEYS if all(k in d for d in diag)), "hixl_switch_5ms")
    rows = []
    for d in diag:
        h, n = d["hixl"], d["iters"]
        rows.append(
            [
                fmt_size(d["size"]),
                fmt_ratio(h["vs_ib_write_bw"]),
                fmt_ratio(d[alt]["vs_ib_write_bw"]),
                fmt_ratio(d["pyverbs_loop"]["vs_ib_write_bw"]),
                f"{h['in_call_s'] / n * 1e6:.0f}",
                f"{h['caller_user_s'] / n * 1e6:.0f} / {h['caller_sys_s'] / n * 1e6:.0f}",
                f"{h['other_threads_cpu_s'] / n * 1e6:.0f}",
                f"{d['pyverbs_loop']['user_s'] / n * 1e6:.0f} / "
                f"{d['pyverbs_loop']['sys_s'] / n * 1e6:.0f}",
            ]
        )
    headers = [
        "size",
        "hixl put / ib_write_bw",
        _SWITCH_KEYS[alt],
        "pyverbs loop / ib_write_bw",
        "µs/msg in put_async",
        "caller CPU µs/msg user / sys",
        "other threads CPU µs/msg",
        "pyverbs loop CPU µs/msg user / sys",
    ]
    return markdown_table(headers, rows, "l" + "r" * (len(headers) - 1))


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
