"""``bench_transfer --diagnose``: where a stream's time goes, by thread (cProfile per
thread, the process's CPU time) beside raw verbs with no engine; and its markdown."""

from __future__ import annotations

import cProfile
import io
import pstats
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.hixl import EnginePair, hixl_stream
from ..backends.loopback import loopback_qp
from ..backends.perftest import Perftest, bw_wall_check, parse_bw
from ..common import (
    BenchError,
    fmt_ratio,
    fmt_size,
    markdown_table,
    ratio,
)


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
