"""The ceiling of a one-message-per-call stream: the least Python per message, beside
``ib_write_bw`` and the engine, in one run.

A design probe, not a contender. It answers one question: with Python calls per message
and the GIL, how fast can 4 KiB RDMA WRITEs stream on this device? The *ring* stream
below keeps only what a stream needs and drops the engine's bookkeeping:

* two RC queue pairs (two lanes, as a hixl connection has), looped back on one device
  and sharing one completion queue;
* per lane, a ring of pre-built work requests (one :class:`hixl.verbs.chain.SendChain`
  of 256 WRs, all moving the same 4 KiB), so the producer writes nothing per message;
* per lane, a poster thread that posts everything queued since its last post (at most
  two ranges of the ring, one ``post_send``), signals only the last WR and reaps the
  queue;
* completion by sequence number: the producer's "handle" is ``(lane, n)``, done once the
  lane's last completed id reaches ``n``. There is no handle object, no lock per message
  and no per-message completion work.

Every message writes the same source bytes to the same target range (as the engine's
stream here does). The target is cleared before each ring stream and compared with the
source after it, so a stream in which no write landed fails; a completion error stops it.

The producer (the caller's thread) keeps ``depth`` messages in flight, as
:func:`benchmarks.backends.hixl.hixl_stream` does for the engine. There are no checks,
deadlines, notifications or failure handling beyond stopping at the first bad
completion, so this is a bound for the engine's design, not something to ship.

Each round runs ``ib_write_bw -s SIZE -n N -t DEPTH``, the ring stream and the engine's
``put_async`` stream back to back, and reports both ratios against ``ib_write_bw``.

With ``--against DIR`` each round also streams with the engine of another checkout
(``DIR``, a ``git worktree`` of another commit, say), in a child process that imports
``hixl`` and ``benchmarks`` from there; the two engines' streams run back to back in an
order that flips every round, and the report adds each round's ratio of the two and
how many rounds each side won. That is a paired A/B of two versions in one boot: rounds
close in time read alike under emulation, whichever code runs, so a comparison of two
separate runs cannot tell 0.2x apart.

    hixl run -- .venv/bin/python benchmarks/bench_ceiling.py            # 3 rounds, 4 KiB
    hixl run -- .venv/bin/python benchmarks/bench_ceiling.py --rounds 1 --iters 512
    git worktree add /tmp/old HEAD~1 && hixl run -- .venv/bin/python \
        benchmarks/bench_ceiling.py --rounds 10 --against /tmp/old
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from hixl.verbs.chain import SEND_SIGNALED, SendChain

from ..backends.hixl import EnginePair, hixl_stream
from ..backends.loopback import loopback_qp
from ..backends.perftest import Perftest, bw_wall_check, parse_bw
from ..common import (
    BenchError,
    Progress,
    command_line,
    expect_line,
    fmt_ratio,
    gather_setup,
    json_out,
    markdown_table,
    median,
    parse_size,
    print_header,
    send_line,
    write_json,
)

RING = 256  # WRs per lane's ring (the queue pair's depth)
LANES = 2
POLL = 64


class _Lane:
    """One queue pair, its ring and its counters (ids are message counts)."""

    def __init__(self, dev: Any, cq: Any, verbs: Any, size: int, src: Any, dst: Any):
        self.qp, self.peer = loopback_qp(dev, cq, RING + 8, 1)
        self.chain = SendChain(RING, RING)
        self.chain.fill(
            opcode=verbs.WR_RDMA_WRITE,
            remote_addr=np.full(RING, dst.addr, np.uint64),
            rkey=dst.rkey,
            sge_start=np.arange(RING + 1),
            sge_addr=np.full(RING, src.addr, np.uint64),
            sge_length=np.full(RING, size),
            lkey=src.lkey,
        )
        self.queued = 0  # messages the producer has queued on this lane
        self.posted = 0
        self.done = 0  # the last completed id: every message up to it has completed
        self.cv = threading.Condition()


class RingStream:
    """The probe's device, memory and lanes; :meth:`run` streams on them."""

    def __init__(self, size: int) -> None:
        from hixl.verbs import adapter as verbs

        self.v = verbs
        self.size = size
        self.dev = verbs.open_device()
        try:
            self.cq = self.dev.create_cq(4 * RING * LANES + 16)
            self.src = np.ones(size, np.uint8)
            self.dst = np.zeros(size, np.uint8)
            self.msrc = self.dev.register(self.src.ctypes.data, size, 0, self.src)
            access = verbs.ACCESS_LOCAL_WRITE | verbs.ACCESS_REMOTE_WRITE
            self.mdst = self.dev.register(self.dst.ctypes.data, size, access, self.dst)
            self.lanes = [
                _Lane(self.dev, self.cq, verbs, size, self.msrc, self.mdst) for _ in range(LANES)
            ]
        except BaseException:
            self.dev.close()
            raise
        self._by_qpn = {lane.qp.qpn: lane for lane in self.lanes}
        self._reap_lock = threading.Lock()
        self._stop = False
        self._error: str | None = None

    def _reap(self) -> bool:
        with self._reap_lock:
            rows = self.cq.poll_rows(POLL)
        for wr_id, status, _, qpn in rows:
            if status:
                self._error = f"completion error {self.v.WC_STATUS_NAMES.get(status, status)}"
            self._by_qpn[qpn].done = wr_id
        return bool(rows)

    def _poster(self, lane: _Lane) -> None:
        head, post, chain = lane.chain.head, lane.qp.post_pieces, lane.chain
        signaled = SEND_SIGNALED
        try:
            while not self._stop and self._error is None:
                a = lane.posted
                b = min(lane.queued, lane.done + RING)  # the ring's free slots
                if a == b:
                    if self._reap():
                        with lane.cv:
                            lane.cv.notify_all()
                        continue
                    with lane.cv:
                        if lane.posted == lane.queued and not self._stop:
                            lane.cv.wait(0.001)
                    continue
                i, j = a % RING, (b - 1) % RING
                last = head[j]
                last.wr_id = b
                last.send_flags = signaled
                pieces = ((chain, i, j + 1),) if i <= j else ((chain, i, RING), (chain, 0, j + 1))
                post(pieces)
                last.send_flags = 0  # the provider has copied the WRs
                lane.posted = b
                if self._reap():
                    with lane.cv:
                        lane.cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self._error = f"poster: {exc}"
            with lane.cv:
                lane.cv.notify_all()

    def _wait(self, lane: _Lane, n: int, deadline: float) -> None:
        with lane.cv:
            while lane.done < n:
                if self._error is not None:
                    raise BenchError(f"ring stream: {self._error}")
                if time.monotonic() > deadline:
                    raise BenchError("ring stream: completions stopped coming")
                lane.cv.wait(0.001)

    def run(self, iters: int, depth: int) -> float:
        """Stream ``iters`` messages with up to ``depth`` in flight; wall seconds.  The
        target is cleared first and must hold the source's bytes after."""
        self.dst[:] = 0
        wall = self._stream(iters, depth)
        if not np.array_equal(self.dst, self.src):
            raise BenchError("ring stream: the target's bytes differ from the source's")
        return wall

    def _stream(self, iters: int, depth: int) -> float:
        lanes = self.lanes
        for lane in lanes:
            lane.queued = lane.posted = lane.done = 0
        self._stop, self._error = False, None
        threads = [threading.Thread(target=self._poster, args=(lane,)) for lane in lanes]
        for t in threads:
            t.start()
        window: deque[tuple[_Lane, int]] = deque()
        deadline = time.monotonic() + 60 + iters * self.size / 1e5
        try:
            t0 = time.perf_counter()
            for s in range(iters):
                if len(window) >= depth:
                    lane, n = window.popleft()
                    if lane.done < n:
                        self._wait(lane, n, deadline)
                lane = lanes[s % LANES]
                lane.queued += 1
                window.append((lane, lane.queued))
                if lane.posted == lane.queued - 1:  # its poster may be asleep
                    with lane.cv:
                        lane.cv.notify()
            for lane, n in window:
                self._wait(lane, n, deadline)
            return time.perf_counter() - t0
        finally:
            self._stop = True
            for lane in lanes:
                with lane.cv:
                    lane.cv.notify_all()
            for t in threads:
                t.join(30)

    def close(self) -> None:
        self.dev.close()


# The child of --against: only the API every checkout since the ring's has
# (benchmarks.backends.hixl), so an older commit's tree runs it unchanged.
_CHILD = """
import sys
import hixl
from benchmarks.backends.hixl import EnginePair, hixl_stream
size = int(sys.argv[1])
pair = EnginePair(size)
try:
    print("READY", hixl.__file__, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        wall, _ = hixl_stream(pair, "write", size, int(cmd[1]), int(cmd[2]))
        print("WALL", repr(wall), flush=True)
finally:
    pair.close()
"""


class OtherEngine:
    """The engine stream of another checkout, in a child process (see ``--against``)."""

    def __init__(self, tree: Path, size: int) -> None:
        self.tree = tree
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(size)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        try:
            fields = self._expect("READY", 120)
            where = Path(fields[1]).resolve()
            if not where.is_relative_to(tree.resolve()):
                raise BenchError(f"--against {tree}: the child imported hixl from {where}")
        except BaseException:
            self.close()
            raise

    def _expect(self, word: str, timeout: float) -> list[str]:
        return expect_line(self.proc, word, timeout, "--against child", fields=2)

    def stream(self, iters: int, depth: int, timeout: float) -> float:
        """Wall seconds of one stream of ``iters`` messages, ``depth`` in flight."""
        send_line(self.proc, f"RUN {iters} {depth}")
        return float(self._expect("WALL", timeout)[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                send_line(self.proc, "QUIT")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench_ceiling.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--size", default="4K", help="bytes per message (default 4K)")
    ap.add_argument("--iters", type=int, default=4096, help="messages per stream (default 4096)")
    ap.add_argument("--depth", type=int, default=128, help="messages in flight (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three (default 3)")
    ap.add_argument("--device", default=None, help="RDMA device (default: the one hixl picks)")
    ap.add_argument("--server-addr", default="127.0.0.1", help="perftest's out-of-band address")
    ap.add_argument("--json", type=json_out, default=None, help="write the results here")
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="DIR",
        help="also stream with the engine of the checkout in DIR, paired per round",
    )
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    if not 0 < size <= 1 << 20:
        ap.error("--size must be in 1..1M")
    if args.iters < 1 or not 1 <= args.depth <= RING or args.rounds < 1:
        ap.error(f"--iters and --rounds must be >= 1, --depth in 1..{RING}")
    if args.against is not None and not (args.against / "hixl" / "__init__.py").is_file():
        ap.error(f"--against {args.against}: not a hixl checkout (no hixl/__init__.py)")

    setup = gather_setup(args.device)
    perftest = Perftest(setup["device"], setup["gid_index"], args.server_addr)
    print_header(
        "hixl ceiling probe: the least Python per message, beside ib_write_bw and the engine",
        setup,
        [f"size {size} B; {args.iters} messages per stream, {args.depth} in flight"],
    )
    other_tree = args.against
    progress = Progress(args.rounds * (3 if other_tree is None else 4), "ceiling")
    ring = RingStream(size)
    pair: EnginePair | None = None
    other: OtherEngine | None = None
    rounds: list[dict[str, Any]] = []
    timeout = 120 + args.iters * size / 1e5
    try:
        pair = EnginePair(size)
        ring.run(min(256, args.iters), args.depth)  # warm-up, all
        hixl_stream(pair, "write", size, min(256, args.iters), args.depth)
        if other_tree is not None:
            other = OtherEngine(other_tree, size)
            other.stream(min(256, args.iters), args.depth, timeout)
        pt_args = ["-s", str(size), "-n", str(args.iters), "-t", str(min(args.depth, args.iters))]
        for r in range(args.rounds):
            progress.step(f"ib_write_bw x{args.iters} (round {r + 1}/{args.rounds})")
            run = perftest.run("ib_write_bw", pt_args, check=bw_wall_check(size, args.iters))
            perf = size / parse_bw(run.output).avg_Bps
            progress.advance()
            progress.step(f"ring stream x{args.iters} (round {r + 1}/{args.rounds})")
            ring_s = ring.run(args.iters, args.depth) / args.iters
            progress.advance()
            other_s: float | None = None
            for side in ("this", "other") if r % 2 == 0 else ("other", "this"):
                if side == "this":
                    progress.step(
                        f"hixl put_async stream x{args.iters} (round {r + 1}/{args.rounds})"
                    )
                    wall, _ = hixl_stream(pair, "write", size, args.iters, args.depth)
                    hixl_s = wall / args.iters
                    progress.advance()
                elif other is not None:
                    progress.step(f"--against put_async x{args.iters} (round {r + 1})")
                    other_s = other.stream(args.iters, args.depth, timeout) / args.iters
                    progress.advance()
            entry = {
                "round": r,
                "perftest_us_per_msg": perf * 1e6,
                "ring_us_per_msg": ring_s * 1e6,
                "hixl_us_per_msg": hixl_s * 1e6,
                "ring_ratio": perf / ring_s,
                "hixl_ratio": perf / hixl_s,
                "perftest_command": run.command,
            }
            if other_s is not None:
                entry["against_us_per_msg"] = other_s * 1e6
                entry["against_ratio"] = perf / other_s
                entry["this_over_against"] = other_s / hixl_s  # > 1: this checkout faster
            rounds.append(entry)
    finally:
        progress.finish()
        if other is not None:
            other.close()
        if pair is not None:
            pair.close()
        ring.close()
    ring_med = median([x["ring_ratio"] for x in rounds])
    hixl_med = median([x["hixl_ratio"] for x in rounds])
    if ring_med is None or hixl_med is None:
        raise BenchError("no round ran")
    print()
    print(
        markdown_table(
            ["round", "ring / ib_write_bw", "hixl put_async / ib_write_bw"],
            [
                [str(x["round"] + 1), fmt_ratio(x["ring_ratio"]), fmt_ratio(x["hixl_ratio"])]
                for x in rounds
            ]
            + [["median", fmt_ratio(ring_med), fmt_ratio(hixl_med)]],
        )
    )
    print(
        "\n- Bandwidth ratios (higher is better), each against the ib_write_bw run of its "
        "round.\n- ring: pre-built WRs, a poster thread per lane, completion by sequence "
        "number (see --help); hixl: Engine.put_async, one call per message."
    )
    summary: dict[str, Any] = {"ring_ratio": ring_med, "hixl_ratio": hixl_med}
    if other_tree is not None:
        paired = [x["this_over_against"] for x in rounds]
        wins = sum(1 for v in paired if v > 1)
        summary.update(
            against=str(other_tree),
            against_ratio=median([x["against_ratio"] for x in rounds]),
            this_over_against=median(paired),
            this_wins=wins,
        )
        print()
        print(
            markdown_table(
                ["round", "this / ib_write_bw", "--against / ib_write_bw", "this / --against"],
                [
                    [
                        str(x["round"] + 1),
                        fmt_ratio(x["hixl_ratio"]),
                        fmt_ratio(x["against_ratio"]),
                        fmt_ratio(x["this_over_against"]),
                    ]
                    for x in rounds
                ]
                + [
                    [
                        "median",
                        fmt_ratio(hixl_med),
                        fmt_ratio(summary["against_ratio"]),
                        fmt_ratio(summary["this_over_against"]),
                    ]
                ],
            )
        )
        print(
            f"\n- Paired against {other_tree}: this checkout's engine was faster in {wins} "
            f"of {len(paired)} rounds (this / --against > 1); the two streams of a round "
            "ran back to back, in an order flipped every round."
        )
    if args.json is not None:
        write_json(
            args.json,
            {
                "benchmark": "ceiling",
                "setup": setup,
                "command": command_line(),
                "params": {"size": size, "iters": args.iters, "depth": args.depth},
                "rounds": rounds,
                "summary": summary,
            },
        )
    return 0
