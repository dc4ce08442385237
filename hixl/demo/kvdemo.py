"""``hixl demo``: a prefill worker pushes a real model's KV cache to a decode worker.

Theory of operation
-------------------
Two processes share one soft-RoCE device (on the host, or in the hixl VM):

* **decode** builds the model, registers a vLLM-style *paged* KV cache (per layer, K and V
  are ``[blocks][16 tokens][heads][head_dim]`` fp16) with ``REMOTE_WRITE``, listens, and
  tells prefill which blocks (scattered, from a shuffled pool) its request owns.
* **prefill** runs a small decoder-only transformer (numpy, float32 math, fp16 KV) over
  the prompt. Its K/V live in the layout its attention wants: head-major, each head's
  token rows padded to a power of two (head_dim 96 is 192 bytes, stride 256). As soon as
  layer ``i`` is computed it posts **one strided put** that moves that layer's K and V
  into decode's blocks, with notification ``layer{i}`` whose message is the sha256 of
  the layer's K/V as prefill computed them. The put converts layouts on the way (head
  major to token major, padding dropped): each work request gathers up to ``max_sge``
  head rows into one contiguous run of a block.
* decode waits for ``layer0``, ``layer1``, ... (RC delivers a notification after the
  data before it, so the bytes are in place), hashes what landed and compares. After
  ``done`` (carrying prefill's first generated token) it recomputes the prefill itself,
  greedily generates from the received cache and from its own cache, and compares.

The orchestrator (:func:`run_demo`) starts both as subprocesses, forwards their output,
kills the other side as soon as one fails, and prints the summary; every wait has a
deadline. Both processes read ``time.monotonic()``, one clock for the whole machine, so
their timestamps can be compared.

The model math, the KV views and the descriptor choices (:mod:`hixl.demo.kvmodel`) and the
summary arithmetic (:mod:`hixl.demo.kvsummary`) are pure (no engine, no clock) and tested
in ``tests/unit/test_demo_model.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from hixl.core.kv import ContiguousKVLayout, PagedKVLayout
from hixl.demo.kvmodel import (
    DEFAULT_PROMPT,
    F16,
    DemoConfig,
    PagedKV,
    TinyLM,
    allocate_blocks,
    decode_blocks,
    encode_blocks,
    kv_digest,
    layer_descriptors,
    paged_layout,
    source_layout,
    source_view,
)
from hixl.demo.kvsummary import format_summary, summarize
from hixl.errors import ArgumentError, HixlError
from hixl.testbed.net import free_tcp_port

__all__ = [
    "DEFAULT_PROMPT",
    "DemoConfig",
    "PagedKV",
    "TinyLM",
    "format_summary",
    "run_demo",
    "summarize",
]

Emit = Callable[[str], None]


# =====================================================================================
# The two roles (engine)
# =====================================================================================


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self, what: str) -> float:
        from hixl.errors import TransferTimeout

        left = self.at - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what}: the demo's deadline of {self.seconds:.0f} s passed")
        return left


def _wait_note(engine: Any, name: str, peer: str, deadline: _Deadline) -> Any:
    """Wait for notification ``name`` from ``peer``; fail early if the connection fails."""
    from hixl.engine import ConnState
    from hixl.errors import ConnectionFailed, TransferTimeout

    while True:
        left = deadline.left(f"waiting for notification {name!r} from {peer}")
        try:
            return engine.wait_notification(name, timeout=min(1.0, left), peer=peer)
        except TransferTimeout:
            conn = engine.connection(peer)
            if conn.state is not ConnState.READY:
                raise ConnectionFailed(
                    f"connection to {peer} is {conn.state.name} while waiting for {name!r}: "
                    f"{conn.failure}"
                ) from None


TOKEN_ENV = "HIXL_DEMO_TOKEN"
"""The variable that gives both roles their engines' shared token (none when unset: then
decode must listen on loopback)."""


def demo_token() -> str | None:
    """The roles' shared engine token, from ``$HIXL_DEMO_TOKEN`` (None when unset)."""
    return os.environ.get(TOKEN_ENV) or None


def run_decode(cfg: DemoConfig, listen: str, seconds: float, emit: Emit) -> dict[str, Any]:
    """The decode role: receive, verify, recompute, generate, compare. Returns results."""
    from hixl.engine import Access, ConnState, Engine

    deadline = _Deadline(seconds)
    t = time.monotonic()
    model = TinyLM(cfg)
    build_s = time.monotonic() - t
    pool, ids = allocate_blocks(cfg)
    dst = paged_layout(cfg, pool, cfg.block_size)
    cache = np.zeros(dst.nbytes, dtype=np.uint8)
    view = PagedKV(cache, dst, ids)
    layers: list[dict[str, Any]] = []
    with Engine(listen, token=demo_token()) as engine:
        engine.register(cache, access=Access.REMOTE_WRITE, name="kv")
        emit(
            f"listening on {listen}; paged KV cache {dst.nbytes / (1 << 20):.2f} MiB "
            f"({cfg.layers} layers x K|V x {pool} blocks of {cfg.block_size} tokens); "
            f"this request owns blocks {ids.tolist()}"
        )
        peer = None
        while peer is None:
            deadline.left("waiting for prefill to connect")
            for p in engine.peers:
                with contextlib.suppress(HixlError):
                    if engine.connection(p).state is ConnState.READY:
                        peer = p
            time.sleep(0.02)
        emit(f"prefill {peer} connected; sending the block table")
        engine.notify(
            peer,
            "blocks",
            encode_blocks(pool, cfg.block_size, ids),
            timeout=deadline.left("sending the block table"),
        )
        for i in range(cfg.layers):
            note = _wait_note(engine, f"layer{i}", peer, deadline)
            arrived = time.monotonic()
            k, v = view.read(i, cfg.tokens)
            got = kv_digest(k, v)
            want = note.message.decode("ascii", "replace")
            exact = got == want
            layers.append(
                {
                    "layer": i,
                    "arrived": arrived,
                    "bit_exact": exact,
                    "sha256": got,
                    "prefill_sha256": want,
                }
            )
            emit(
                f"layer {i}: landed; sha256 {got[:16]}... "
                f"{'== prefill (bit-exact)' if exact else '!= prefill ' + want[:16]}"
            )
        done = _wait_note(engine, "done", peer, deadline)
        info = json.loads(done.message)
        _expect_goodbye()
        engine.notify(peer, "ack", b"", timeout=deadline.left("acknowledging"))
        _await_hangup(engine, peer, deadline)
    first = int(info["first_token"])
    received_prompt = cache.copy()

    emit("recomputing the prefill locally for comparison ...")
    t = time.monotonic()
    local = np.zeros_like(cache)
    local_view = PagedKV(local, dst, ids)
    run = model.prefill(cfg.prompt_tokens())
    for i in range(cfg.layers):
        k, v = run.step()
        local_view.write_prompt(i, k, v)
        deadline.left("recomputing the prefill")
    local_first = run.next_token()
    recompute_s = time.monotonic() - t
    same = bool(np.array_equal(received_prompt, local))

    t = time.monotonic()
    got_tokens = [first, *model.generate(view, first, cfg.tokens, cfg.gen_tokens)]
    deadline.left("generating from the received cache")
    local_tokens = [
        local_first,
        *model.generate(local_view, local_first, cfg.tokens, cfg.gen_tokens),
    ]
    generate_s = time.monotonic() - t
    emit(f"generated {len(got_tokens)} tokens from the received cache: {got_tokens}")
    emit(
        f"generated {len(local_tokens)} tokens from the local cache:    {local_tokens} "
        f"({'equal' if got_tokens == local_tokens else 'DIFFERENT'})"
    )
    return {
        "role": "decode",
        "pool_blocks": pool,
        "block_size": cfg.block_size,
        "block_ids": ids.tolist(),
        "layers": layers,
        "first_token": local_first,
        "prefill_first_token": first,
        "received_equals_recompute": same,
        "tokens_received": got_tokens,
        "tokens_local": local_tokens,
        "build_s": build_s,
        "recompute_s": recompute_s,
        "generate_s": generate_s,
    }


def _connect(engine: Any, peer: str, deadline: _Deadline) -> Any:
    from hixl.errors import ConnectionFailed, TransferTimeout

    last: Exception | None = None
    while True:
        left = deadline.left(f"connecting to decode at {peer} (last error: {last})")
        try:
            return engine.connect(peer, timeout=min(5.0, left))
        except (ConnectionFailed, TransferTimeout) as exc:
            last = exc
            time.sleep(0.1)


def _await_hangup(engine: Any, peer: str, deadline: _Deadline, limit: float = 10.0) -> None:
    """Let ``peer`` close first (at most ``limit`` s). Closing right after our last
    notification races with its delivery: the peer's engine may read our goodbye on the
    control socket before it polls that notification's receive completion, and it drops
    receive completions of a connection that is no longer ready."""
    from hixl.engine import ConnState

    end = time.monotonic() + min(limit, max(0.0, deadline.at - time.monotonic()))
    while time.monotonic() < end:
        try:
            if engine.connection(peer).state is not ConnState.READY:
                return
        except HixlError:
            return
        time.sleep(0.02)


def _expect_goodbye() -> None:
    """From here on the peer closing its engine is the plan, not news: keep its INFO line
    (Debian's pyverbs sets up root logging at INFO on import) out of the demo output."""
    logging.getLogger("hixl").setLevel(logging.WARNING)


class _LayerSender:
    """Posts each layer's put from a background thread; another stamps completions.

    The main thread only computes: it hands layer ``i`` over once its K/V are in the
    registered region. The sender hashes them, builds the layer's descriptors and posts
    the put (planning and posting are Python work that would otherwise hold up the next
    layer's compute; BLAS releases the GIL, so they interleave). The watcher waits on the
    handles in posting order (an RC queue pair completes in order) and records when each
    layer landed.
    """

    def __init__(
        self,
        engine: Any,
        peer: str,
        region: Any,
        src: ContiguousKVLayout,
        dst: PagedKVLayout,
        ids: npt.NDArray[np.int64],
        deadline: _Deadline,
        emit: Emit,
    ) -> None:
        self._engine, self._peer, self._region = engine, peer, region
        self._src, self._dst, self._ids = src, dst, ids
        self._deadline = deadline
        self._emit = emit
        self.rows: dict[int, dict[str, Any]] = {}
        self.errors: list[BaseException] = []
        self._todo: queue.Queue[tuple[int, F16, F16, float] | None] = queue.Queue()
        self._posted: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="demo-sender", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="demo-watch", daemon=True)
        self._sender.start()
        self._watcher.start()

    def send(self, layer: int, k: F16, v: F16, ready: float) -> None:
        """Queue ``layer`` (its K/V, each ``[heads, tokens, head_dim]``, ready at ``ready``)."""
        if self.errors:
            raise self.errors[0]
        self._todo.put((layer, k, v, ready))

    def _send_loop(self) -> None:
        while (item := self._todo.get()) is not None:
            i, k, v, ready = item
            try:
                digest = kv_digest(k, v)
                local, remote = layer_descriptors(self._src, self._dst, self._ids, i)
                p0 = time.monotonic()
                handle = self._engine.put_async(
                    self._peer,
                    self._region,
                    "kv",
                    local_desc=local,
                    remote_desc=remote,
                    notify=f"layer{i}",
                    notify_message=digest.encode(),
                    timeout=self._deadline.left(f"posting layer {i}"),
                )
                p1 = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.errors.append(exc)
                break
            self.rows[i] = {
                "ready": ready,
                "post_start": p0,
                "post_end": p1,
                "nbytes": handle.nbytes,
                "num_wrs": handle.num_wrs,
                "sha256": digest,
            }
            self._posted.put((i, handle))
        self._posted.put(None)

    def _watch_loop(self) -> None:
        while (item := self._posted.get()) is not None:
            i, handle = item
            try:
                handle.wait(timeout=max(0.0, self._deadline.at - time.monotonic()))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.errors.append(exc)
                return
            done = time.monotonic()
            row = self.rows[i]
            row["done"] = done
            self._emit(
                f"layer {i}: landed {1e3 * (done - row['ready']):.0f} ms after it was "
                f"computed: one put of {row['nbytes']:,} B as {row['num_wrs']} WRs, posted "
                f"in {1e3 * (row['post_end'] - row['post_start']):.0f} ms, then notify "
                f"layer{i}"
            )

    def finish(self) -> None:
        """Wait until every queued layer has landed; raise the first error."""
        self._todo.put(None)
        for th in (self._sender, self._watcher):
            th.join(timeout=max(0.0, self._deadline.at - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        if self._watcher.is_alive():
            self._deadline.left("waiting for the last layers to land")
        missing = [i for i, r in self.rows.items() if "done" not in r]
        if missing:
            raise HixlError(f"layers {missing} were posted but never completed")

    def stop(self) -> None:
        """Let both threads end (they are daemons; an engine close fails any handle)."""
        self._todo.put(None)


def run_prefill(cfg: DemoConfig, peer: str, seconds: float, emit: Emit) -> dict[str, Any]:
    """The prefill role: compute layer by layer, put each layer at once. Returns results."""
    from hixl.engine import Access, Engine

    deadline = _Deadline(seconds)
    t = time.monotonic()
    model = TinyLM(cfg)
    build_s = time.monotonic() - t
    src = source_layout(cfg)
    buf = np.zeros(src.nbytes, dtype=np.uint8)
    kv = source_view(buf, src)
    with Engine("127.0.0.1:0", token=demo_token()) as engine:
        region = engine.register(buf, access=Access.NONE, name="prefill-kv")
        conn = _connect(engine, peer, deadline)
        dev = engine.device
        device = f"{dev.name} port {dev.port} GID index {dev.gid_index}, MTU {conn.mtu}"
        note = _wait_note(engine, "blocks", peer, deadline)
        pool, block_size, ids = decode_blocks(note.message)
        dst = paged_layout(cfg, pool, block_size)
        emit(f"connected to decode {peer} over {device}; decode's blocks {ids.tolist()}")

        sender = _LayerSender(engine, peer, region, src, dst, ids, deadline, emit)
        computes: list[list[float]] = []
        run = model.prefill(cfg.prompt_tokens())
        try:
            for i in range(cfg.layers):
                c0 = time.monotonic()
                k, v = run.step()
                kv[i, 0] = k
                kv[i, 1] = v
                c1 = time.monotonic()
                computes.append([c0, c1])
                emit(f"layer {i}: computed in {1e3 * (c1 - c0):.0f} ms; handed to the sender")
                sender.send(i, k, v, c1)
            first = run.next_token()
            sender.finish()
        finally:
            sender.stop()
        rows = []
        for i in range(cfg.layers):
            r = sender.rows[i]
            rows.append(
                {
                    "layer": i,
                    "compute": computes[i],
                    "transfer": [r["ready"], r["done"]],
                    "post": [r["post_start"], r["post_end"]],
                    "nbytes": r["nbytes"],
                    "num_wrs": r["num_wrs"],
                    "sha256": r["sha256"],
                }
            )
        tail = rows[-1]["transfer"][1] - computes[-1][1]
        emit(
            f"all {cfg.layers} layers landed, the last {1e3 * tail:.0f} ms after the last "
            f"compute ended; first generated token {first}"
        )
        engine.notify(
            peer,
            "done",
            json.dumps({"first_token": first}).encode(),
            timeout=deadline.left("sending done"),
        )
        _wait_note(engine, "ack", peer, deadline)
        limits = engine.limits
    return {
        "role": "prefill",
        "device": device,
        "limits": {
            "max_sge": limits.max_sge,
            "max_sge_rd": limits.max_sge_rd,
            "max_msg_sz": limits.max_msg_sz,
        },
        "layers": rows,
        "first_token": first,
        "build_s": build_s,
    }


# =====================================================================================
# Orchestration and command line
# =====================================================================================


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that make a :class:`DemoConfig`."""
    d = DemoConfig()
    p.add_argument("--layers", type=int, default=d.layers, help=f"layers (default {d.layers})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"KV heads (default {d.heads})")
    p.add_argument(
        "--head-dim",
        type=int,
        default=d.head_dim,
        help=f"head dimension, e.g. 64, 96, 128 (default {d.head_dim})",
    )
    p.add_argument(
        "--d-model", type=int, default=d.d_model, help=f"residual width (default {d.d_model})"
    )
    p.add_argument("--ffn", type=int, default=0, help="MLP width (default 2 x d_model)")
    p.add_argument(
        "--tokens", type=int, default=d.tokens, help=f"prompt tokens (bytes) (default {d.tokens})"
    )
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=d.gen_tokens,
        help=f"tokens to generate after the first (default {d.gen_tokens})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="weights seed (default 0)")
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="decode's paged block size in tokens (default 16, larger if needed)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (repeated to fit)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        d_model=args.d_model,
        ffn=args.ffn,
        tokens=args.tokens,
        gen_tokens=args.gen_tokens,
        seed=args.seed,
        block_size=args.block_size,
        prompt=args.prompt,
    )


def add_demo_options(p: argparse.ArgumentParser) -> None:
    """Options of ``hixl demo``."""
    add_model_options(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="fail (and stop both workers) after S seconds (default 600)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")


def _forward(
    stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock, tail: list[str]
) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        del tail[:-20]
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # One BLAS thread each: the two workers share the CPUs, and the same thread count
    # on both sides keeps decode's recompute bit-identical to prefill's math.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    # (In the hixl VM the guest also picks OpenBLAS's kernel: hixl.testbed.guest.)
    return env


def run_demo(
    cfg: DemoConfig,
    *,
    timeout: float = 300.0,
    json_path: str | None = None,
    out: IO[str] | None = None,
) -> dict[str, Any]:
    """Run decode and prefill as two processes on this machine's RDMA device.

    Streams both workers' progress to ``out`` (default stdout), prints the summary and
    returns it (see :func:`summarize`); also writes it to ``json_path`` if given. Raises
    :class:`HixlError` when a worker fails (the other is killed at once) or the whole
    run exceeds ``timeout`` seconds (both are killed).
    """
    out = out or sys.stdout
    lock = threading.Lock()
    listen = f"127.0.0.1:{free_tcp_port()}"
    budget = f"{max(1.0, timeout - 5.0):.1f}"
    with tempfile.TemporaryDirectory(prefix="hixl-demo-") as tmp:
        base = [sys.executable, "-u", "-m", "hixl.demo.kvdemo"]
        roles = {
            "decode": [*base, "decode", "--listen", listen],
            "prefill": [*base, "prefill", "--peer", listen],
        }
        procs: dict[str, subprocess.Popen[bytes]] = {}
        tails: dict[str, list[str]] = {}
        threads = []
        start = time.monotonic()
        try:
            for role, cmd in roles.items():
                result = str(Path(tmp) / f"{role}.json")
                procs[role] = subprocess.Popen(
                    [*cmd, "--result", result, "--seconds", budget, *cfg.to_argv()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=_child_env(),
                )
                tails[role] = []
                stdout = procs[role].stdout
                assert stdout is not None
                th = threading.Thread(
                    target=_forward,
                    args=(stdout, f"[{role:<7}] ", out, lock, tails[role]),
                    daemon=True,
                )
                th.start()
                threads.append(th)
            _supervise(procs, start + timeout, timeout)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            for th in threads:
                th.join(timeout=5)
        results = {}
        for role in procs:
            path = Path(tmp) / f"{role}.json"
            try:
                results[role] = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise HixlError(f"demo {role} worker left no result ({exc})") from None
    summary = summarize(cfg, results["prefill"], results["decode"])
    summary["elapsed_s"] = time.monotonic() - start
    with lock:
        out.write("\n" + format_summary(summary) + "\n")
        out.flush()
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _supervise(procs: dict[str, subprocess.Popen[bytes]], kill_at: float, timeout: float) -> None:
    """Wait for every worker; on the first failure or the deadline, kill the rest."""
    while True:
        codes = {role: p.poll() for role, p in procs.items()}
        failed = [(role, rc) for role, rc in codes.items() if rc not in (None, 0)]
        if failed:
            role, rc = failed[0]
            others = [r for r, c in codes.items() if c is None]
            for r in others:
                procs[r].kill()
            stopped = f"; stopped {', '.join(others)}" if others else ""
            raise HixlError(
                f"demo {role} worker failed (exit status {rc}){stopped}; its last output is above"
            )
        if all(rc == 0 for rc in codes.values()):
            return
        if time.monotonic() > kill_at:
            running = [r for r, c in codes.items() if c is None]
            for r in running:
                procs[r].kill()
            raise HixlError(
                f"demo exceeded its timeout of {timeout:.0f} s; killed {', '.join(running)}"
            )
        time.sleep(0.05)


def cmd_demo(args: argparse.Namespace) -> int:
    """``hixl demo``: run here if this host has RDMA, else re-run itself in the VM."""
    cfg = config_from_args(args)
    json_path = str(Path(args.json).resolve()) if args.json else None
    if json_path and not Path(json_path).parent.is_dir():
        raise ArgumentError(f"--json: directory {Path(json_path).parent} does not exist")
    from hixl.testbed.vm import VMConfig, host_has_rdma, run_with_rdma

    if os.environ.get("HIXL_IN_VM") != "1" and not host_has_rdma():
        print(
            "hixl demo: this host has no RDMA device; running in the hixl VM "
            "(boot takes 30-60 s under emulation)",
            flush=True,
        )
        cmd = [sys.executable, "-m", "hixl", "demo", *cfg.to_argv(), f"--timeout={args.timeout}"]
        rw: tuple[Path, ...] = ()
        if json_path:
            cmd.append(f"--json={json_path}")
            rw = (Path(json_path).parent,)
        t = time.monotonic()
        rc = run_with_rdma(cmd, VMConfig(rw_dirs=rw, timeout=args.timeout + 300.0))
        print(f"hixl demo: {time.monotonic() - t:.0f} s in all, VM boot included", flush=True)
        return rc
    summary = run_demo(cfg, timeout=args.timeout, json_path=json_path)
    return 0 if summary["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m hixl.demo.kvdemo {decode,prefill} ...`` (used by
    :func:`run_demo`); writes its result as JSON to ``--result``."""
    p = argparse.ArgumentParser(prog="python -m hixl.demo.kvdemo")
    p.add_argument("role", choices=("decode", "prefill"))
    p.add_argument("--listen", help="decode: engine id to listen on")
    p.add_argument("--peer", help="prefill: decode's engine id")
    p.add_argument("--result", required=True, help="where to write the JSON result")
    p.add_argument("--seconds", type=float, default=300.0, help="deadline for everything")
    add_model_options(p)
    args = p.parse_args(argv)

    def emit(line: str) -> None:
        print(line, flush=True)

    try:
        cfg = config_from_args(args)
        if args.role == "decode":
            if not args.listen:
                raise ArgumentError("decode needs --listen")
            result = run_decode(cfg, args.listen, args.seconds, emit)
        else:
            if not args.peer:
                raise ArgumentError("prefill needs --peer")
            result = run_prefill(cfg, args.peer, args.seconds, emit)
    except HixlError as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        return 1
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
