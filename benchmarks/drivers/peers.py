"""hixl beside its peers: perftest, hixl and Mooncake's Transfer Engine on one device, in
one run (one VM boot under ``hixl bench --peers``).

Every contender moves the same bytes with RDMA WRITEs from an initiator process into a
target process (two processes each; perftest's client and server), on the device hixl
selects. Cases:

* ``contiguous`` streams of 4 KiB, 64 KiB and 1 MiB messages, ``--bytes`` per stream,
  at most ``--depth`` messages in flight (``ib_write_bw -t``; hixl ``put_async`` handles;
  Mooncake, which has a handle per batch, two batches of depth/2; and "hixl (batches)",
  hixl driven the way Mooncake is: each batch of depth/2 messages one ``put_async`` of a
  block list, two in flight);
* ``segments``: a layer of 8192 segments of 256 B (stride 512 on both sides) in one
  request (one hixl ``put`` with a block list; one Mooncake batch); perftest moves the
  same messages as ``ib_write_bw -s 256 -n 8192``;
* ``paged``: a paged KV gather: K and V blocks of 16 tokens (8 heads x head_dim 128 x
  fp16 = 32 KiB) picked at random from a pool 4x larger, written to consecutive blocks
  at the target, in one request; perftest moves the same messages.

After every stream both sides hash the ranges involved and the digests must match (the
initiator's buffer gets new random bytes before each stream, the target's others, so a
stale byte cannot pass). rxe's packet counters (``hw_counters/sent_pkts``, ``rcvd_pkts``)
are read around every stream and must grow by at least one packet per MTU of payload, so
every contender really crossed the device. Reported: each contender's bandwidth as a ratio
to ``ib_write_bw`` and to hixl (median over repeats of pairs measured back to back, order
rotated), CPU seconds per stream of initiator and target (``getrusage`` of each process),
and, where the peer has a blocking call, the latency of one blocking write against hixl's
blocking ``put``.

The peers live in their own venv (``.venv-peers``), installed on demand by ``--install``
(``hixl bench --peers`` does it on the host before the VM boots). A peer that cannot be
installed or run is reported with its error; the others still run.

    python benchmarks/bench_peers.py --list                 # what would be installed
    python benchmarks/bench_peers.py --install              # install the peers (host)
    hixl run -- .venv/bin/python benchmarks/bench_peers.py --quick --json peers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hixl.verbs.devices import select_device

from ..backends import worker as worker_module
from ..backends.peers import (
    PEERS,
    PEERS_VENV,
    PeerStatus,
    install_all,
    load_statuses,
    probe,
    render_env,
    venv_python,
)
from ..backends.perftest import Perftest, bw_wall_check, parse_bw
from ..common import (
    BenchError,
    Progress,
    command_line,
    fmt_rate,
    fmt_ratio,
    fmt_size,
    fmt_us,
    gather_setup,
    json_out,
    markdown_table,
    median,
    parse_sizes,
    print_header,
    quiet_logs,
    ratio,
    write_json,
)

DEFAULT_SIZES = "4K,64K,1M"
INSTALL_FILE = "peers-install.json"
WORKER = Path(worker_module.__file__).resolve()


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True, slots=True)
class Case:
    """One transfer every contender makes: ``segments`` are ``[src, dst, nbytes]``."""

    name: str
    label: str
    mode: str  # "stream" (one message per segment, depth in flight) or "request"
    segments: list[list[int]]
    msg_size: int  # perftest's -s
    src_ranges: list[list[int]]
    dst_ranges: list[list[int]]

    @property
    def nbytes(self) -> int:
        return sum(s[2] for s in self.segments)

    @property
    def messages(self) -> int:
        return len(self.segments)


def contiguous_case(size: int, total: int, span: int) -> Case:
    """``total // size`` messages (at least 8: perftest wants 5) of ``size`` bytes, each at
    the next offset of ``span`` bytes on both sides (so every message is checked). The
    span holds at least the 8 messages: a batch of them (one block list for "hixl
    (batches)", one Mooncake batch) must not write one range twice."""
    n = max(8, total // size)
    span = max(8 * size, span - span % size)
    segs = [[(i * size) % span, (i * size) % span, size] for i in range(n)]
    covered = min(span, n * size)
    return Case(
        f"stream {fmt_size(size).replace(' ', '')}",
        f"{fmt_size(size)} stream x{n}",
        "stream",
        segs,
        size,
        [[0, covered]],
        [[0, covered]],
    )


def segments_case(count: int, size: int) -> Case:
    segs = [[i * 2 * size, i * 2 * size, size] for i in range(count)]
    ranges = [[s[0], s[2]] for s in segs]
    return Case(
        "segments",
        f"{count} x {fmt_size(size)} segments, 1 request",
        "request",
        segs,
        size,
        ranges,
        ranges,
    )


def paged_case(blocks: int, block_tokens: int, heads: int, head_dim: int, seed: int) -> Case:
    """K and V blocks gathered from a pool 4x the request into consecutive target blocks."""
    block = block_tokens * heads * head_dim * 2
    pool = 4 * blocks
    ids = random.Random(seed).sample(range(pool), blocks)
    segs = []
    for plane in range(2):
        for j, b in enumerate(ids):
            segs.append([(plane * pool + b) * block, (plane * blocks + j) * block, block])
    return Case(
        "paged",
        f"paged KV gather, {2 * blocks} x {fmt_size(block)} (K+V blocks of {block_tokens} "
        "tokens), 1 request",
        "request",
        segs,
        block,
        [[s[0], s[2]] for s in segs],
        [[s[1], s[2]] for s in segs],
    )


def buffer_bytes(cases: list[Case]) -> int:
    ends = [s[0] + s[2] for c in cases for s in c.segments]
    ends += [s[1] + s[2] for c in cases for s in c.segments]
    return max(ends)


# --------------------------------------------------------------------------- rxe counters


def read_counters(device: str, port: int) -> tuple[int, int] | None:
    """rxe's (sent_pkts, rcvd_pkts) of the port, or None when the device has none."""
    base = Path(f"/sys/class/infiniband/{device}/ports/{port}/hw_counters")
    try:
        return (
            int((base / "sent_pkts").read_text()),
            int((base / "rcvd_pkts").read_text()),
        )
    except (OSError, ValueError):
        return None


def min_packets(segments: list[list[int]], mtu: int) -> int:
    """The fewest packets that can carry these messages: one per MTU of each."""
    return sum(-(-s[2] // mtu) for s in segments)


def crossed(
    before: tuple[int, int] | None, after: tuple[int, int] | None, need: int
) -> dict[str, Any]:
    if before is None or after is None:
        return {"checked": False, "ok": None}
    sent, rcvd = after[0] - before[0], after[1] - before[1]
    return {"checked": True, "ok": sent >= need and rcvd >= need, "sent": sent, "rcvd": rcvd}


# --------------------------------------------------------------------------- workers


class Worker:
    """One worker process (see :mod:`benchmarks.backends.worker`) and its JSON channel."""

    def __init__(
        self, backend: str, role: str, python: str, env: dict[str, str], log: IO[str]
    ) -> None:
        self.label = f"{backend} {role}"
        full_env = {**os.environ, **env}
        full_env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, "-u", str(WORKER), backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
            env=full_env,
        )

    def call(self, op: str, timeout: float = 300.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise BenchError(f"{self.label}: cannot send {op!r}: {exc}") from exc
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            state = "timed out" if not ready else f"exited {self.proc.poll()}"
            raise BenchError(f"{self.label}: no answer to {op!r} ({state} after {timeout} s)")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise BenchError(f"{self.label}: {op} failed: {reply.get('error')}")
        return reply

    def pause(self, stop: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the process; see :meth:`Contender.pause`."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def close(self) -> None:
        self.pause(False)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, BenchError):
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Contender:
    """A library under test: its two processes, or why it is not running."""

    name: str
    python: str
    env: dict[str, str]
    backend: str = ""  # the worker backend (default: the name)
    version: str | None = None
    blocking: bool = False
    error: str | None = None
    target: Worker | None = None
    initiator: Worker | None = None
    notes: list[str] = field(default_factory=list)

    def start(self, device: str, nbytes: int, log: IO[str]) -> None:
        try:
            backend = self.backend or self.name
            self.target = Worker(backend, "target", self.python, self.env, log)
            self.initiator = Worker(backend, "initiator", self.python, self.env, log)
            t = self.target.call("init", role="target", nbytes=nbytes, device=device)
            i = self.initiator.call("init", role="initiator", nbytes=nbytes, device=device)
            self.version = str(i.get("version") or t.get("version"))
            self.blocking = bool(i.get("blocking"))
            self.initiator.call("connect", peer=t["info"], timeout=120.0)
        except (BenchError, OSError) as exc:
            self.error = str(exc)
            self.close()

    def pause(self, stop: bool) -> None:
        """Freeze both processes while another contender is measured, and thaw them for
        this one's turn. An idle peer must not take CPU from the one being measured:
        NIXL's progress thread spins a full CPU per agent even when idle."""
        for w in (self.target, self.initiator):
            if w is not None:
                w.pause(stop)

    @property
    def running(self) -> bool:
        return self.error is None and self.target is not None and self.initiator is not None

    def close(self) -> None:
        for w in (self.initiator, self.target):
            if w is not None:
                w.close()


def stream(c: Contender, case: Case, depth: int, seed: int, dev: Any) -> dict[str, Any]:
    """One stream of ``case`` by ``c``, bytes checked and counters read around it."""
    assert c.target is not None and c.initiator is not None
    c.initiator.call("fill", seed=seed)
    c.target.call("fill", seed=seed + 1)
    t_cpu0 = c.target.call("cpu")["cpu_s"]
    before = read_counters(dev["device"], dev["port"])
    timeout = 120.0 + case.nbytes / 1e5  # >= 100 kB/s
    r = c.initiator.call(
        "run", timeout=timeout, segments=case.segments, mode=case.mode, depth=depth
    )
    after = read_counters(dev["device"], dev["port"])
    t_cpu1 = c.target.call("cpu")["cpu_s"]
    src = c.initiator.call("digest", ranges=case.src_ranges)["digest"]
    dst = c.target.call("digest", ranges=case.dst_ranges)["digest"]
    out = {
        "value": case.nbytes / r["wall_s"],
        "wall_s": r["wall_s"],
        "cpu_initiator_s": r["cpu_s"],
        "cpu_target_s": t_cpu1 - t_cpu0,
        "bytes_ok": src == dst,
        "rxe": crossed(before, after, min_packets(case.segments, dev["active_mtu"])),
    }
    if src != dst:
        out["error"] = f"bytes differ after the stream (digest {src} != {dst})"
    return out


def perftest_stream(pt: Perftest, case: Case, depth: int, dev: Any) -> dict[str, Any]:
    n = case.messages
    args = ["-s", str(case.msg_size), "-n", str(n), "-t", str(min(depth, n))]
    before = read_counters(dev["device"], dev["port"])
    run = pt.run("ib_write_bw", args, check=bw_wall_check(case.nbytes // n, n))
    after = read_counters(dev["device"], dev["port"])
    bw = parse_bw(run.output)
    return {
        "value": bw.avg_Bps,
        "wall_s": run.wall_s,
        "cpu_initiator_s": run.client_cpu_s,
        "cpu_target_s": run.server_cpu_s,
        "bytes_ok": None,  # perftest does not check its bytes
        "rxe": crossed(before, after, min_packets(case.segments, dev["active_mtu"])),
        "command": run.command,
    }


# --------------------------------------------------------------------------- summary


def summarize(
    measurements: list[dict[str, Any]], cases: list[Case], names: list[str]
) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        ms = [m for m in measurements if m["case"] == case.name]
        by_rep: dict[int, dict[str, float]] = {}
        for m in ms:
            if m.get("value") is not None and "error" not in m:
                by_rep.setdefault(m["repeat"], {})[m["impl"]] = m["value"]
        row: dict[str, Any] = {
            "case": case.name,
            "label": case.label,
            "nbytes": case.nbytes,
            "messages": case.messages,
            "impls": {},
        }
        for name in names:
            mine = [m for m in ms if m["impl"] == name]
            ok = [m for m in mine if "error" not in m]

            def paired(
                base: str, name: str = name, reps: dict[int, dict[str, float]] = by_rep
            ) -> float | None:
                xs = [ratio(v.get(name), v.get(base)) for v in reps.values()]
                return median([x for x in xs if x is not None])

            row["impls"][name] = {
                "Bps": median([m["value"] for m in ok]),
                "vs_perftest": paired("perftest"),
                "vs_hixl": paired("hixl"),
                "cpu_initiator_s": median(
                    [m["cpu_initiator_s"] for m in ok if m.get("cpu_initiator_s") is not None]
                ),
                "cpu_target_s": median(
                    [m["cpu_target_s"] for m in ok if m.get("cpu_target_s") is not None]
                ),
                "bytes_ok": (
                    None
                    if not ok or any(m["bytes_ok"] is None for m in ok)
                    else all(m["bytes_ok"] for m in ok)
                ),
                "crossed_rxe": (
                    None
                    if not ok or not all(m["rxe"]["checked"] for m in ok)
                    else all(m["rxe"]["ok"] for m in ok)
                ),
                "runs": len(ok),
                "errors": [m["error"] for m in mine if "error" in m],
            }
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- report


def markdown(data: dict[str, Any]) -> str:
    """The peers' tables from one run's JSON."""
    names = [c["name"] for c in data["contenders"] if c.get("ran")]
    blocking = [n for n in names if any(n in r["us"] for r in data.get("latency") or [])]
    lines = []
    headers = [
        "case",
        "contender",
        "/ ib_write_bw",
        "/ hixl",
        "CPU s initiator",
        "CPU s target",
        "bytes",
        "rxe0 crossed",
        "rate (context)",
    ]
    rows = []
    for r in data["summary"]:
        for name in ["perftest", *names]:
            s = r["impls"].get(name)
            if s is None:
                continue
            if s["runs"] == 0:
                err = (s["errors"] or ["did not run"])[0].splitlines()[0][:80]
                rows.append([r["label"], _title(name), "failed", "", "", "", "", "", err])
                continue
            rows.append(
                [
                    r["label"],
                    _title(name),
                    "1 (baseline)" if name == "perftest" else fmt_ratio(s["vs_perftest"]),
                    "1 (baseline)" if name == "hixl" else fmt_ratio(s["vs_hixl"]),
                    _cpu(s["cpu_initiator_s"]),
                    _cpu(s["cpu_target_s"]),
                    {True: "✓ checked", False: "✗ DIFFER", None: "not checked"}[s["bytes_ok"]],
                    {True: "✓", False: "✗ NO", None: "n/a"}[s["crossed_rxe"]],
                    fmt_rate(s["Bps"]),
                ]
            )
    lines.append(markdown_table(headers, rows, "ll" + "r" * 7))
    lat = data.get("latency") or []
    if lat and blocking:
        lines += ["", "Latency of one blocking write (post to completion seen by the caller):", ""]
        lheaders = [
            "size",
            *[f"{_title(n)}" for n in blocking],
            *[f"{_title(n)} / hixl" for n in blocking if n != "hixl"],
        ]
        lrows = []
        for row in lat:
            cells = [fmt_size(row["size"])]
            cells += [fmt_us(row["us"].get(n)) for n in blocking]
            cells += [
                fmt_ratio(ratio(row["us"].get(n), row["us"].get("hixl")))
                for n in blocking
                if n != "hixl"
            ]
            lrows.append(cells)
        lines.append(markdown_table(lheaders, lrows, "l" + "r" * (len(lheaders) - 1)))
    lines += ["", "Contenders:", ""]
    crows = []
    for c in data["contenders"]:
        env = " ".join(f"{k}={v}" for k, v in c.get("env", {}).items()) or "none"
        state = (
            "ran" if c.get("ran") else f"NOT run: {(c.get('error') or '').splitlines()[0][:120]}"
        )
        crows.append([_title(c["name"]), str(c.get("version")), _where(c["name"]), env, state])
    lines.append(
        markdown_table(["contender", "version", "environment", "env needed", "status"], crows)
    )
    p = data["params"]
    lines += [
        "",
        f"- Ratios: median over {p['repeat']} repeats of the pair measured back to back in "
        "this run (order rotated each repeat); higher is better. `/ ib_write_bw` is against "
        f"plain `ib_write_bw -t {p['depth']}` (one queue pair, no post list), `/ hixl` against "
        "hixl's own `put_async` stream or `put` of the same case. Rates are context only "
        "(MB/s = 10^6 bytes/s).",
        f"- In flight: at most {p['depth']} messages (perftest `-t`, hixl `put_async` handles, "
        "Mooncake as installed two batches of depth/2, Mooncake (tuned) one batch per "
        "message, as many batches as hixl has handles, hixl (batches) two batches of depth/2, "
        "each one `put_async` of a block list, NIXL one request per message). `segments` and "
        "`paged` are one request each; perftest moves the same number of same-size messages "
        "there. Each contender's processes are frozen (SIGSTOP) while another is measured.",
        "- CPU: user + system seconds of each process during the stream (`getrusage`); for "
        "perftest, of the client and server processes over their whole run (set-up included).",
        "- bytes: both sides hash the ranges after every stream (perftest does not check). "
        "rxe0 crossed: `sent_pkts` and `rcvd_pkts` grew by at least one packet per MTU of "
        "payload in every stream.",
    ]
    return "\n".join(lines)


def _where(name: str) -> str:
    """Which venv a contender runs in: hixl's own (both ways of driving it), else the
    peers'."""
    return "project venv" if name in ("hixl", "hixl-batches") else PEERS_VENV.name


def _title(name: str) -> str:
    titles = {
        "perftest": "`ib_write_bw`",
        "hixl": "hixl",
        "hixl-batches": "hixl (batches)",
        "mooncake": "Mooncake TE",
        "nixl": "NIXL (as installed)",
        "nixl-tuned": "NIXL (tuned)",
        "mooncake-tuned": "Mooncake (tuned)",
    }
    return titles.get(name, name)


def _cpu(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def plot(data: dict[str, Any], path: Path) -> bool:
    """Grouped bars: each contender's bandwidth / ib_write_bw per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [c["name"] for c in data["contenders"] if c.get("ran")]
    cases = data["summary"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        ys = [r["impls"].get(name, {}).get("vs_perftest") or 0 for r in cases]
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, ys, width, label=f"{name} {_version(data, name)}")
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="ib_write_bw")
    ax.set_xticks(range(len(cases)), [r["case"] for r in cases])
    ax.set_ylabel("bandwidth / ib_write_bw (higher is better)")
    s = data["setup"]
    ax.set_title(
        f"hixl and peers on {s.get('device')} ({s.get('where')}), one run — "
        f"{s['date_utc'][:10]}, commit {s.get('commit')}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _version(data: dict[str, Any], name: str) -> str:
    for c in data["contenders"]:
        if c["name"] == name:
            return str(c.get("version") or "")
    return ""


# --------------------------------------------------------------------------- main


def statuses_for(names: list[str], run_dir: Path | None) -> list[PeerStatus]:
    """The install outcome ``--install`` wrote into the run directory, else a fresh probe."""
    path = run_dir / INSTALL_FILE if run_dir is not None else None
    known: dict[str, PeerStatus] = {}
    if path is not None and path.is_file():
        known = {s.name: s for s in load_statuses(path)}
    out = []
    for name in names:
        if name in known:
            out.append(known[name])
        elif name in PEERS:
            out.append(probe(PEERS[name]))
        else:
            out.append(PeerStatus(name, False, error=f"unknown peer (known: {sorted(PEERS)})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--peers", default="mooncake", help=f"peers to run, of {','.join(PEERS)}")
    ap.add_argument("--list", action="store_true", help="list the peers and their state; exit")
    ap.add_argument(
        "--install", action="store_true", help=f"install the peers into {PEERS_VENV}; exit"
    )
    ap.add_argument("--run-dir", type=Path, default=None, help="read/write peers-install.json here")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="contiguous message sizes")
    ap.add_argument("--bytes", default=None, help="bytes per contiguous stream (default 16M)")
    ap.add_argument("--segments", type=int, default=8192, help="segments in the layer case")
    ap.add_argument("--segment-size", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=None, help="paged blocks (default 64)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=None, help="repeats (default 5)")
    ap.add_argument("--depth", type=int, default=128, help="messages in flight")
    ap.add_argument("--lat-iters", type=int, default=None, help="blocking writes (default 30)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true", help="2 MiB streams, 1 repeat, fewer blocks")
    ap.add_argument("--json", type=json_out, default=None)
    args = ap.parse_args(argv)
    quiet_logs()
    names = [n for n in args.peers.split(",") if n]

    if args.list:
        for name, spec in PEERS.items():
            st = probe(spec)
            state = f"installed, {st.version}" if st.ok else "not installed"
            print(
                f"{name}: {spec.title}; pip install {' '.join(spec.packages)} into "
                f"{PEERS_VENV} ({state}); env {spec.env or 'none'}; {spec.note}"
            )
        return 0
    if args.install:
        out = args.run_dir / INSTALL_FILE if args.run_dir is not None else None
        install_all(names, out)
        return 0  # a failed install is reported in the run, never fatal

    quick = args.quick
    sizes = parse_sizes(args.sizes)
    total = parse_sizes(args.bytes or ("2M" if quick else "16M"))[0]
    repeat = args.repeat or (1 if quick else 5)
    blocks = args.blocks or (16 if quick else 64)
    lat_iters = args.lat_iters or (10 if quick else 30)
    span = total
    cases = [contiguous_case(s, total, span) for s in sizes]
    cases.append(segments_case(args.segments, args.segment_size))
    cases.append(paged_case(blocks, args.block_tokens, args.heads, args.head_dim, seed=11))
    nbytes = buffer_bytes(cases)

    setup = gather_setup(args.device)
    sel = select_device(args.device)
    dev: dict[str, Any] = {
        "device": sel.device.name,
        "port": sel.port.number,
        "active_mtu": sel.port.active_mtu,
    }
    pt = Perftest(setup["device"], setup["gid_index"], port_base=18600)
    statuses = statuses_for(names, args.run_dir)
    print_header(
        "hixl beside its peers: contiguous streams, a segment layer, a paged KV gather",
        setup,
        [
            f"cases: {'; '.join(c.label for c in cases)}",
            f"repeat {repeat}; depth {args.depth}; buffers {fmt_size(nbytes)} per process",
            "peers: "
            + ", ".join(
                f"{s.name} {s.version}" if s.ok else f"{s.name} NOT available" for s in statuses
            ),
            f"command: {command_line()}",
        ],
    )

    log_path = (args.json.parent if args.json else Path(".")) / "peers-workers.log"
    contenders = [
        Contender("hixl", sys.executable, {}),
        Contender("hixl-batches", sys.executable, {}),
    ]
    for st in statuses:
        if st.ok:
            for name, env in PEERS[st.name].contenders().items():
                env = render_env(env, dev["device"], dev["port"])
                contenders.append(Contender(name, st.python or "", env, backend=st.name))
    failed_installs = [s for s in statuses if not s.ok]
    measurements: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    with log_path.open("a") as log:
        for c in contenders:
            print(f"[peers] starting {c.name}'s target and initiator", flush=True)
            c.start(str(dev["device"]), nbytes, log)
            if c.error:
                print(f"[peers] {c.name} did not start: {c.error}", flush=True)
            else:
                c.pause(True)
        try:
            running = [c for c in contenders if c.running]
            for c in running:  # a warm-up for every library: each case once, untimed
                c.pause(False)
                try:
                    for ci, case in enumerate(cases):
                        stream(c, case, args.depth, 7 + ci, dev)
                except BenchError as exc:
                    print(f"[peers] {c.name} warm-up failed: {exc}", flush=True)
                finally:
                    c.pause(True)
            impls = ["perftest", *[c.name for c in running]]
            progress = Progress(repeat * len(cases) * len(impls), "peers")
            for rep in range(repeat):
                for ci, case in enumerate(cases):
                    k = (rep + ci) % len(impls)
                    for impl in impls[k:] + impls[:k]:
                        progress.step(f"{impl}: {case.label} (repeat {rep + 1}/{repeat})")
                        m: dict[str, Any] = {"repeat": rep, "case": case.name, "impl": impl}
                        try:
                            if impl == "perftest":
                                m.update(perftest_stream(pt, case, args.depth, dev))
                            else:
                                c = next(x for x in running if x.name == impl)
                                seed = 1000 * rep + 10 * ci
                                c.pause(False)
                                try:
                                    m.update(stream(c, case, args.depth, seed, dev))
                                finally:
                                    c.pause(True)
                        except BenchError as exc:
                            m["error"] = str(exc)
                            progress.note(f"  FAILED {impl} {case.name}: {exc}")
                        if m.get("rxe", {}).get("ok") is False:
                            progress.note(f"  {impl} {case.name}: rxe counters did not move")
                        measurements.append(m)
                        progress.advance()
            progress.finish()
            for size in sizes:
                row: dict[str, Any] = {"size": size, "us": {}, "samples": {}}
                for c in running:
                    if not c.blocking:
                        continue
                    assert c.initiator is not None
                    c.pause(False)
                    try:
                        r = c.initiator.call("latency", size=size, iters=lat_iters, warmup=3)
                        row["us"][c.name] = median(r["samples_us"])
                        row["samples"][c.name] = r["samples_us"]
                    except BenchError as exc:
                        row.setdefault("errors", {})[c.name] = str(exc)
                    finally:
                        c.pause(True)
                latency.append(row)
        finally:
            for c in contenders:
                c.close()

    names_ran = [c.name for c in contenders if c.error is None]
    summary = summarize(measurements, cases, ["perftest", *names_ran])
    data: dict[str, Any] = {
        "benchmark": "peers",
        "setup": setup,
        "command": command_line(),
        "params": {
            "sizes": sizes,
            "bytes": total,
            "repeat": repeat,
            "depth": args.depth,
            "segments": [args.segments, args.segment_size],
            "paged": {
                "blocks": blocks,
                "block_tokens": args.block_tokens,
                "heads": args.heads,
                "head_dim": args.head_dim,
            },
            "lat_iters": lat_iters,
        },
        "contenders": [
            {
                "name": c.name,
                "version": c.version,
                "ran": c.error is None,
                "error": c.error,
                "env": c.env,
                "where": _where(c.name),
                "python": c.python,
            }
            for c in contenders
        ]
        + [
            {
                "name": s.name,
                "version": s.version,
                "ran": False,
                "error": f"install failed: {s.error}",
                "env": s.env,
                "where": PEERS_VENV.name,
                "python": s.python,
            }
            for s in failed_installs
        ],
        "measurements": measurements,
        "summary": summary,
        "latency": latency,
        "cases": [
            {"name": c.name, "label": c.label, "nbytes": c.nbytes, "messages": c.messages}
            for c in cases
        ],
    }
    print()
    print(markdown(data))
    if args.json is not None:
        write_json(args.json, data)
    print(f"\n[peers] worker logs: {log_path}; peers venv: {shlex.quote(str(venv_python()))}")
    bad = [
        m for m in measurements if m.get("bytes_ok") is False or m.get("rxe", {}).get("ok") is False
    ]
    hixl_ok = any(m["impl"] == "hixl" and "error" not in m for m in measurements)
    return 1 if bad or not hixl_ok else 0
