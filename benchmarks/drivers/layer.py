"""The hixl design's comparison, measured: four ways to send one KV-cache layer.

A layer is K and V of ``heads`` heads, ``tokens`` tokens each (default head_dim 128, fp16:
256 bytes per token per head). Both sides hold it as ``[K|V][heads][capacity][head_dim]``
(hixl's :class:`ContiguousKVLayout`) with different token capacities (default 256 on the
sending side, 512 on the receiving side), so each head's ``tokens`` vectors are one
contiguous run on each side but the runs are spaced differently. Ways to send it:

1. ``strided``: one ``put`` with the layout's strided descriptors on both sides (one call,
   one plan, 2*heads work requests posted in chunks);
2. ``per-head``: one ``put_async`` per head (K and V of that head), all in flight, then wait;
3. ``pack``: gather the layer into a staging buffer (numpy copy), ``put`` it contiguous to
   the peer's staging buffer, scatter it there (numpy copy) -- pack + put + unpack;
4. ``tcp``: gather into a staging buffer, ``sendall`` it over a TCP socket on loopback,
   ``recv_into`` a staging buffer, scatter it.

Each method's time runs from the first descriptor built (or byte copied) to the last byte in
place at the receiver; both engines (and the TCP receiver thread) are in this process, on
one device. Reported per head count: median time per method and its ratio to ``strided``
(> 1: strided is faster), work requests, Python calls and CPU-copied bytes. Each method's
first run is checked byte for byte against the source. The issue's target: strided beats
per-head and pack from 32 heads on.

    python benchmarks/bench_layer.py                       # defaults
    python benchmarks/bench_layer.py --heads 32,128 --tokens 64 --repeat 9 --json out.json
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl import Access, ContiguousDesc, ContiguousKVLayout, Engine
from hixl.testbed.net import free_tcp_port

from ..common import (
    BenchError,
    Progress,
    command_line,
    fmt_ratio,
    fmt_size,
    gather_setup,
    json_out,
    markdown_table,
    median,
    parse_ints,
    print_header,
    quiet_logs,
    ratio,
    spread,
    write_json,
)

METHODS = ("strided", "per-head", "pack", "tcp")
TARGET_FROM_HEADS = 32


class TcpPath:
    """A loopback TCP connection with a receiver thread that fills and unpacks a buffer."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            self.tx = socket.create_connection(("127.0.0.1", port), timeout=30)
            self.rx, _ = listener.accept()
        for s in (self.tx, self.rx):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rx.settimeout(60)
        self._jobs: queue.Queue[tuple[memoryview, Callable[[], None]] | None] = queue.Queue()
        self._done: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="tcp-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            buf, unpack = job
            try:
                got, n = 0, len(buf)
                while got < n:
                    k = self.rx.recv_into(buf[got:], n - got)
                    if k == 0:
                        raise BenchError("tcp: connection closed mid-layer")
                    got += k
                unpack()
                self._done.put(None)
            except Exception as exc:  # noqa: BLE001 - reported to the sender
                self._done.put(str(exc))

    def send(self, src: memoryview, dst: memoryview, unpack: Callable[[], None]) -> None:
        self._jobs.put((dst, unpack))
        self.tx.sendall(src)
        err = self._done.get(timeout=120)
        if err is not None:
            raise BenchError(err)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self.tx.close()
        self.rx.close()


@dataclass
class Layer:
    """One head count's buffers, registrations and views."""

    heads: int
    tokens: int
    lay_l: ContiguousKVLayout
    lay_r: ContiguousKVLayout
    local: np.ndarray
    remote: np.ndarray
    stage_l: np.ndarray
    stage_r: np.ndarray
    regions: list[Any]

    @property
    def nbytes(self) -> int:
        return self.stage_l.nbytes

    def local_view(self) -> np.ndarray:
        return self.local.reshape(2, self.heads, self.lay_l.num_tokens, -1)[:, :, : self.tokens]

    def remote_view(self) -> np.ndarray:
        return self.remote.reshape(2, self.heads, self.lay_r.num_tokens, -1)[:, :, : self.tokens]

    def stage_view(self, stage: np.ndarray) -> np.ndarray:
        return stage.reshape(2, self.heads, self.tokens, -1)


class Bench:
    """Engines, the TCP path, and the four methods for one layer at a time."""

    def __init__(self) -> None:
        self.server = Engine(f"127.0.0.1:{free_tcp_port()}")
        self.client = Engine("127.0.0.1:0")
        self.peer = self.server.id
        self.tcp = TcpPath()
        self.layer: Layer | None = None
        self._connected = False
        self.in_call = 0.0  # seconds the last method spent inside put_async calls

    def load(
        self, heads: int, tokens: int, cap_l: int, cap_r: int, head_dim: int, itemsize: int
    ) -> Layer:
        self.unload()
        lay_l = ContiguousKVLayout(
            num_layers=1, num_heads=heads, num_tokens=cap_l, head_dim=head_dim, itemsize=itemsize
        )
        lay_r = ContiguousKVLayout(
            num_layers=1, num_heads=heads, num_tokens=cap_r, head_dim=head_dim, itemsize=itemsize
        )
        rng = np.random.default_rng(heads)
        local = rng.integers(0, 256, lay_l.nbytes, dtype=np.uint8)
        remote = np.zeros(lay_r.nbytes, np.uint8)
        n = 2 * heads * tokens * lay_l.vector_bytes
        stage_l = np.zeros(n, np.uint8)
        stage_r = np.zeros(n, np.uint8)
        rw = Access.REMOTE_WRITE
        regions = [
            self.client.register(local, access=Access.NONE),
            self.client.register(stage_l, access=Access.NONE),
            self.server.register(remote, access=rw, name="kv"),
            self.server.register(stage_r, access=rw, name="stage"),
        ]
        if not self._connected:
            self.client.connect(self.peer, timeout=30.0)
            self._connected = True
        else:  # the peer announces new regions over the control channel; wait for them
            conn = self.client.connection(self.peer)
            deadline = time.monotonic() + 30
            want = {(r.addr, r.length) for r in regions[2:]}
            while not want <= {(r.addr, r.length) for r in conn.remote_regions}:
                if time.monotonic() > deadline:
                    raise BenchError("the peer's new regions were not announced within 30 s")
                time.sleep(0.005)
        self.layer = Layer(heads, tokens, lay_l, lay_r, local, remote, stage_l, stage_r, regions)
        return self.layer

    def unload(self) -> None:
        if self.layer is None:
            return
        for r in self.layer.regions[:2]:
            self.client.deregister(r)
        for r in self.layer.regions[2:]:
            self.server.deregister(r)
        self.layer = None

    def close(self) -> None:
        self.unload()
        self.tcp.close()
        self.client.close()
        self.server.close()

    # -- the four methods: each returns (work requests, Python transfer calls, bytes copied)

    def strided(self) -> tuple[int, int, int]:
        ly = self.layer
        assert ly is not None
        toks = range(ly.tokens)
        t0 = time.perf_counter()
        h = self.client.put_async(
            self.peer,
            ly.regions[0],
            "kv",
            local_desc=ly.lay_l.descriptor(kv="kv", tokens=toks),
            remote_desc=ly.lay_r.descriptor(kv="kv", tokens=toks),
        )
        self.in_call = time.perf_counter() - t0
        h.wait()
        return h.num_wrs, 1, 0

    def per_head(self) -> tuple[int, int, int]:
        ly = self.layer
        assert ly is not None
        toks = range(ly.tokens)
        handles = []
        t0 = time.perf_counter()
        for head in range(ly.heads):
            hs = range(head, head + 1)
            handles.append(
                self.client.put_async(
                    self.peer,
                    ly.regions[0],
                    "kv",
                    local_desc=ly.lay_l.descriptor(kv="kv", heads=hs, tokens=toks),
                    remote_desc=ly.lay_r.descriptor(kv="kv", heads=hs, tokens=toks),
                )
            )
        self.in_call = time.perf_counter() - t0
        for h in handles:
            h.wait()
        return sum(h.num_wrs for h in handles), len(handles), 0

    def pack(self) -> tuple[int, int, int]:
        ly = self.layer
        assert ly is not None
        np.copyto(ly.stage_view(ly.stage_l), ly.local_view())
        desc = ContiguousDesc(offset=0, nbytes=ly.nbytes)
        t0 = time.perf_counter()
        h = self.client.put_async(
            self.peer, ly.regions[1], "stage", local_desc=desc, remote_desc=desc
        )
        self.in_call = time.perf_counter() - t0
        h.wait()
        np.copyto(ly.remote_view(), ly.stage_view(ly.stage_r))
        return h.num_wrs, 1, 2 * ly.nbytes

    def tcp_send(self) -> tuple[int, int, int]:
        ly = self.layer
        assert ly is not None
        np.copyto(ly.stage_view(ly.stage_l), ly.local_view())

        def unpack() -> None:
            np.copyto(ly.remote_view(), ly.stage_view(ly.stage_r))

        self.in_call = 0.0
        self.tcp.send(ly.stage_l.data, ly.stage_r.data, unpack)
        return 0, 1, 2 * ly.nbytes

    def method(self, name: str) -> Callable[[], tuple[int, int, int]]:
        return {
            "strided": self.strided,
            "per-head": self.per_head,
            "pack": self.pack,
            "tcp": self.tcp_send,
        }[name]

    def verify(self, name: str) -> None:
        """Clear the receiver, run ``name`` once, and check every byte landed."""
        ly = self.layer
        assert ly is not None
        ly.remote[:] = 0
        ly.stage_r[:] = 0
        self.method(name)()
        if not np.array_equal(ly.remote_view(), ly.local_view()):
            raise BenchError(f"{name}: the receiver's layer differs from the sender's")


def summarize(measurements: list[dict[str, Any]], heads_list: list[int]) -> list[dict[str, Any]]:
    rows = []
    for heads in heads_list:
        ms = [m for m in measurements if m["heads"] == heads and "time_s" in m]
        if not ms:
            continue
        row: dict[str, Any] = {"heads": heads, "nbytes": ms[0]["nbytes"], "methods": {}}
        for name in METHODS:
            mine = [m for m in ms if m["method"] == name]
            if not mine:
                continue
            row["methods"][name] = {
                "time_s": spread([m["time_s"] for m in mine]),
                "cpu_s": median([m["cpu_s"] for m in mine]),
                "wrs": mine[0]["wrs"],
                "calls": mine[0]["calls"],
                "copied_bytes": mine[0]["copied"],
                "in_call_s": median([m["in_call_s"] for m in mine]),
            }
        base = row["methods"].get("strided", {}).get("time_s", {}).get("median")
        for v in row["methods"].values():
            v["vs_strided"] = ratio(v["time_s"]["median"], base)
        rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Strided must beat per-head and pack (ratio > 1) from 32 heads on."""
    misses = []
    checked = 0
    for r in rows:
        if r["heads"] < TARGET_FROM_HEADS:
            continue
        for other in ("per-head", "pack"):
            x = r["methods"].get(other, {}).get("vs_strided")
            if x is None:
                continue
            checked += 1
            if x <= 1.0:
                misses.append({"heads": r["heads"], "method": other, "vs_strided": x})
    return {
        "strided_beats_per_head_and_pack": {
            "from_heads": TARGET_FROM_HEADS,
            "checked": checked,
            "met": checked > 0 and not misses,
            "misses": misses,
        }
    }


def markdown(data: dict[str, Any]) -> str:
    p = data["params"]
    headers = [
        "heads",
        "layer",
        *[f"{m} / strided" for m in METHODS[1:]],
        "WRs: strided · per-head · pack · tcp",
        "calls: per-head",
        "in put_async: strided · per-head · pack",
        "strided time",
    ]
    rows = []
    for r in data["summary"]:
        ms = r["methods"]

        def rat(name: str, r: dict[str, Any] = r, ms: dict[str, Any] = ms) -> str:
            x = ms.get(name, {}).get("vs_strided")
            s = fmt_ratio(x)
            if name != "tcp" and x is not None and r["heads"] >= TARGET_FROM_HEADS:
                s += " ✓" if x > 1.0 else " ✗"
            return s

        wrs = " · ".join(str(ms.get(m, {}).get("wrs", "n/a")) for m in METHODS)
        t = ms.get("strided", {}).get("time_s", {}).get("median")
        rows.append(
            [
                str(r["heads"]),
                fmt_size(r["nbytes"]),
                *[rat(m) for m in METHODS[1:]],
                wrs,
                str(ms.get("per-head", {}).get("calls", "n/a")),
                " · ".join(_share(ms.get(m, {})) for m in METHODS[:3]),
                "n/a" if t is None else f"{t * 1e3:.1f} ms",
            ]
        )
    table = markdown_table(headers, rows, "rl" + "r" * (len(headers) - 2))
    notes = [
        f"Layer = K and V of each head, {p['tokens']} tokens x head_dim {p['head_dim']} x "
        f"{p['itemsize']} B; sender capacity {p['cap_local']} tokens, receiver "
        f"{p['cap_remote']}. Medians of {p['repeat']} repeats after {p['warmup']} warm-up.",
        "Ratios are method time / strided time in the same run (> 1: strided is faster; "
        f'target from {TARGET_FROM_HEADS} heads on: ✓/✗). "strided time" is context.',
        "pack and tcp include the gather on the sender and the scatter on the receiver "
        "(numpy copies, 2x the layer's bytes); tcp is a plain socket on loopback.",
        '"in put_async": share of each method\'s time spent inside its `put_async` calls '
        "(descriptors, validation, planning, building, posting, and rxe's work inside "
        "`ibv_post_send`); the rest is waiting for completions (and copying, for pack).",
    ]
    return table + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _share(m: dict[str, Any]) -> str:
    t = m.get("time_s", {}).get("median")
    c = m.get("in_call_s")
    if not t or c is None:
        return "n/a"
    return f"{100 * c / t:.0f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", default=None, help="head counts (default 8,32,64,128)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens sent per head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--itemsize", type=int, default=2, help="bytes per value (2 = fp16)")
    ap.add_argument(
        "--cap-local", type=int, default=None, help="sender's token capacity (default 2*tokens)"
    )
    ap.add_argument(
        "--cap-remote", type=int, default=None, help="receiver's token capacity (default 4*tokens)"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per point (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    ap.add_argument("--quick", action="store_true", help="heads 8,32,64 and 2 repeats")
    ap.add_argument("--json", type=json_out, default=None, help="write results here")
    args = ap.parse_args(argv)
    quiet_logs()

    heads_list = parse_ints(args.heads or ("8,32,64" if args.quick else "8,32,64,128"))
    args.repeat = args.repeat or (2 if args.quick else 3)
    args.cap_local = args.cap_local or 2 * args.tokens
    args.cap_remote = args.cap_remote or 4 * args.tokens
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS) or "strided" not in methods:
        ap.error(f"--methods: choose from {METHODS}, including strided (the baseline)")
    if min(args.cap_local, args.cap_remote) < args.tokens:
        ap.error("capacities must be >= --tokens")

    setup = gather_setup()
    print_header(
        "hixl layer benchmark: strided put vs per-head puts vs pack+put vs TCP",
        setup,
        [
            f"heads {heads_list}; tokens {args.tokens}; head_dim {args.head_dim}; itemsize "
            f"{args.itemsize}; capacities {args.cap_local}/{args.cap_remote}; repeat "
            f"{args.repeat}; warm-up {args.warmup}",
            f"command: {command_line()}",
        ],
    )
    progress = Progress(len(heads_list) * args.repeat * len(methods), "layer")
    measurements: list[dict[str, Any]] = []
    bench = Bench()
    try:
        for heads in heads_list:
            ly = bench.load(
                heads, args.tokens, args.cap_local, args.cap_remote, args.head_dim, args.itemsize
            )
            for name in methods:
                bench.verify(name)
                for _ in range(max(0, args.warmup - 1)):
                    bench.method(name)()
            for rep in range(args.repeat):
                order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
                for name in order:
                    progress.step(
                        f"{name} {heads} heads ({fmt_size(ly.nbytes)}) "
                        f"repeat {rep + 1}/{args.repeat}"
                    )
                    fn = bench.method(name)
                    c0, t0 = time.process_time(), time.perf_counter()
                    wrs, calls, copied = fn()
                    t1, c1 = time.perf_counter(), time.process_time()
                    measurements.append(
                        {
                            "heads": heads,
                            "method": name,
                            "repeat": rep,
                            "nbytes": ly.nbytes,
                            "time_s": t1 - t0,
                            "cpu_s": c1 - c0,
                            "wrs": wrs,
                            "calls": calls,
                            "copied": copied,
                            "in_call_s": bench.in_call,
                        }
                    )
                    progress.advance()
    finally:
        bench.close()
    progress.finish()

    summary = summarize(measurements, heads_list)
    data: dict[str, Any] = {
        "benchmark": "layer",
        "setup": setup,
        "command": command_line(),
        "params": {
            "heads": heads_list,
            "tokens": args.tokens,
            "head_dim": args.head_dim,
            "itemsize": args.itemsize,
            "cap_local": args.cap_local,
            "cap_remote": args.cap_remote,
            "methods": methods,
            "repeat": args.repeat,
            "warmup": args.warmup,
        },
        "measurements": measurements,
        "summary": summary,
        "targets": check_targets(summary),
    }
    print()
    print(markdown(data))
    t = data["targets"]["strided_beats_per_head_and_pack"]
    print(
        f"\ntarget strided beats per-head and pack from {TARGET_FROM_HEADS} heads: "
        f"{'met' if t['met'] else 'NOT met: ' + str(t['misses'])}"
    )
    if args.json is not None:
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
