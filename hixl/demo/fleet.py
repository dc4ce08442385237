"""``hixl demo --prefill P --decode D``: many workers, found through etcd, surviving a lost one.

Theory of operation
-------------------
The orchestrator (:func:`run_fleet`) starts a private etcd, ``D`` decode workers and ``P``
prefill workers, each its own process with its own engine, on this machine's RDMA device.

* A **decode worker** (``decode-i``) announces itself in etcd with role ``decode`` and a
  capacity: its free request slots (each slot is a set of blocks of a paged KV pool).
  It serves three notifications: ``alloc`` (reserve a slot for a request attempt; the
  answer ``slot`` names it, or -1 when full), ``kv`` (the request's KV has landed in the
  slot: check each layer's sha256, generate tokens from the received cache, recompute the
  prefill itself and generate from that too, and answer ``result``) and it re-announces its
  capacity after each change. A slot whose prefill went away is freed.
* A **prefill worker** owns a share of the request stream (request ``r`` goes to prefill
  ``r mod P``). Per request it asks :func:`hixl.demo.router.choose` for the decode worker
  with the most free announced capacity in its registry watch, connects by name, reserves
  a slot, computes the prompt's KV layer by layer (each request has its own prompt), puts
  every layer into the slot's blocks in one batch with the notification ``kv``, and waits
  for ``result``. Any failure (the connection failed, a deadline passed) gives up that
  attempt in its :class:`~hixl.demo.router.Ledger`, marks that decode process as bad (until
  it is announced by a new process) and runs the request again elsewhere. A late answer
  from a given-up attempt is refused, so a request completes exactly once.
* The orchestrator kills one decode worker (SIGKILL) once a third of the requests are done,
  if there are two or more; then it checks from the prefill workers' results that every
  request completed exactly once with identical tokens on both sides. It runs a 1x1 fleet
  with the same requests first, so the summary can give the P x D throughput as a ratio
  measured in the same run.

Every engine of a fleet proves a token shared by the run: the orchestrator makes one and
hands it to the workers in ``$HIXL_FLEET_TOKEN`` (:func:`fleet_token`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from hixl.demo.kvdemo import (
    DemoConfig,
    PagedKV,
    TinyLM,
    _child_env,
    add_model_options,
    config_from_args,
    kv_digest,
    layer_descriptors,
    paged_layout,
    source_layout,
    source_view,
)
from hixl.demo.router import Ledger, choose
from hixl.errors import ArgumentError, ConnectionFailed, HixlError, TransferTimeout

__all__ = [
    "FLEET_CONFIG",
    "TOKEN_ENV",
    "check_results",
    "cut_timeline",
    "fleet_token",
    "request_prompt",
    "run_fleet",
    "run_fleet_hosts",
]

Emit = Callable[[str], None]

FLEET_CONFIG = DemoConfig(layers=4, heads=4, head_dim=64, d_model=64, tokens=48, gen_tokens=6)
"""A small model: under emulation a request costs a fraction of a second of compute."""


def request_prompt(cfg: DemoConfig, request: int) -> npt.NDArray[np.int64]:
    """Request ``request``'s prompt: the configured text, rotated so every request differs."""
    base = cfg.prompt_tokens()
    return np.roll(base, -(7 * request) % base.size)


TOKEN_ENV = "HIXL_FLEET_TOKEN"
"""The variable that carries the fleet's shared token from the runner to every worker."""


def fleet_token(environ: Mapping[str, str] | None = None) -> str:
    """The fleet's shared engine token, from ``$HIXL_FLEET_TOKEN``.

    Every runner (:func:`run_fleet`, :func:`run_fleet_hosts`, ``make test-fleet``) makes
    one with :func:`secrets.token_hex` and hands it to its workers in the environment, so
    no fleet engine runs unauthenticated. Raises :class:`ArgumentError` when it is unset."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV, "")
    if not token:
        raise ArgumentError(
            f"${TOKEN_ENV} is unset: fleet workers share a token (the runners set it; "
            "'hixl token' makes one)"
        )
    return token


def _wait_file(path: str, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not Path(path).exists():
        if time.monotonic() > end:
            raise TransferTimeout(f"{what}: {path} did not appear within {seconds:.0f} s")
        time.sleep(0.2)


def _msg(note: Any) -> dict[str, Any]:
    try:
        doc = json.loads(note.message)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise HixlError(f"malformed {note.name!r} message from {note.peer}")
    return doc


# -- decode ---------------------------------------------------------------------------------


def run_fleet_decode(
    cfg: DemoConfig,
    name: str,
    listen: str,
    url: str,
    slots: int,
    seconds: float,
    emit: Emit,
    *,
    stop_file: str | None = None,
    vanish_file: str | None = None,
    restart_after: int | None = None,
    restart_file: str | None = None,
    role: str = "decode",
    scratch: int = 0,
    token: str | None = None,
) -> dict[str, Any]:
    """A decode worker; serves until SIGTERM, ``stop_file`` exists, or ``seconds``.

    With ``vanish_file`` (multi-host runs only) its host is cut off as soon as that file
    exists (looked at every 20 ms by a thread of its own, and again before each answer,
    so a request whose KV arrives after the order is never answered; the process is
    frozen at once): a host lost mid-stream. With
    ``restart_after`` the worker restarts once after serving that many requests (with
    ``restart_file``, once that file exists): its engine closes and a new one comes up
    under the same name and address (a new process, as far as peers can tell). While the
    registry is unreachable, capacity updates are kept and made when it is back.
    ``scratch`` bytes more are registered as region ``"scratch"`` (remote write), for
    tests that stream into a worker. Returns what it served."""
    from hixl.engine import Access, ConnState, Engine
    from hixl.errors import RegistryUnavailable

    model = TinyLM(cfg)
    bn = cfg.blocks_needed
    dst = paged_layout(cfg, slots * bn, cfg.block_size)
    cache = np.zeros(dst.nbytes, dtype=np.uint8)
    local_layout = paged_layout(cfg, bn, cfg.block_size)
    spare = np.zeros(scratch, dtype=np.uint8) if scratch else None
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    served: list[dict[str, Any]] = []
    end = time.monotonic() + seconds

    def start_engine() -> Engine:
        while True:
            try:
                eng = Engine(
                    listen, name=name, role=role, capacity=slots, registry=url, token=token
                )
            except (RegistryUnavailable, OSError) as exc:
                if time.monotonic() > end:
                    raise
                emit(f"cannot start yet ({exc}); retrying")
                time.sleep(0.5)
                continue
            eng.register(cache, access=Access.REMOTE_WRITE, name="kv")
            if spare is not None:
                eng.register(spare, access=Access.REMOTE_WRITE, name="scratch")
            emit(f"ready: {name} at {eng.id}, {slots} slots of {bn} blocks")
            return eng

    def set_capacity(eng: Engine, free: int) -> None:
        try:
            eng.set_capacity(free)
        except RegistryUnavailable as exc:
            emit(f"capacity {free} kept for later: {exc}")

    eng = start_engine()
    restarted = False
    free = list(range(slots))
    owner: dict[int, tuple[str, int, int]] = {}
    next_check = 0.0
    vanishing = threading.Lock()

    def vanish_if_ordered() -> None:
        """Cut this host off if ordered to: the process is frozen at once (see vanish)."""
        if vanish_file is None or not Path(vanish_file).exists():
            return
        from hixl.testbed.hosts import vanish

        with vanishing:  # one thread vanishes; another one that gets here waits, frozen
            held = sorted(r for _, r, _ in list(owner.values()))
            emit(f"ordered off the wire with requests {held} in hand; this host now vanishes")
            vanish(f"{name} cut off mid-stream holding requests {held}")

    def watch_for_vanish() -> None:
        # Its own thread, so that the order is obeyed within 20 ms even while the main
        # thread checks and regenerates a request (seconds under emulation): the lease
        # must stop being refreshed when the order is given, not when that work ends.
        while not stop.is_set():
            vanish_if_ordered()
            time.sleep(0.02)

    if vanish_file is not None:
        threading.Thread(target=watch_for_vanish, name="vanish-watch", daemon=True).start()
    try:
        while not stop.is_set() and time.monotonic() < end:
            want_restart = restart_after is not None and len(served) >= restart_after
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 0.5
                if stop_file is not None and Path(stop_file).exists():
                    break
                if restart_file is not None and Path(restart_file).exists():
                    want_restart = True
            if want_restart and not restarted:
                emit(f"restarting: a new engine under the same name {name}")
                eng.close()
                eng = start_engine()
                restarted = True
                free = list(range(slots))
                owner.clear()
            for slot, (peer, _, _) in list(owner.items()):  # free slots of vanished prefills
                try:
                    alive = eng.connection(peer).state is ConnState.READY
                except HixlError:
                    alive = False
                if not alive:
                    del owner[slot]
                    free.append(slot)
                    set_capacity(eng, len(free))
            notes = eng.notifications()
            if not notes:
                time.sleep(0.005)
                continue
            for note in notes:
                try:
                    msg = _msg(note)
                    req, attempt = int(msg["req"]), int(msg["attempt"])
                    if note.name == "alloc":
                        slot = free.pop() if free else -1
                        if slot >= 0:
                            owner[slot] = (note.peer, req, attempt)
                            set_capacity(eng, len(free))
                        answer = {"req": req, "attempt": attempt, "slot": slot}
                        answer |= {"pool": slots * bn, "block_size": cfg.block_size}
                        eng.notify(note.peer, "slot", json.dumps(answer).encode())
                    elif note.name == "kv":
                        slot = int(msg["slot"])
                        if owner.get(slot) != (note.peer, req, attempt):
                            continue  # not the attempt that holds this slot
                        result = _serve(model, cfg, cache, dst, local_layout, slot, msg, req)
                        vanish_if_ordered()  # no answer once ordered off the wire
                        result |= {"req": req, "attempt": attempt, "decode": name}
                        del owner[slot]
                        free.append(slot)
                        set_capacity(eng, len(free))
                        eng.notify(note.peer, "result", json.dumps(result).encode())
                        served.append(result)
                        emit(f"request {req} (attempt {attempt}): served, ok={result['ok']}")
                except (HixlError, KeyError, ValueError, TypeError) as exc:
                    emit(f"ignoring {note.name!r} from {note.peer}: {exc}")
    finally:
        stop.set()  # ends the vanish watch too
        eng.close()
    return {"role": "decode", "name": name, "served": served, "restarted": restarted}


def _serve(
    model: TinyLM,
    cfg: DemoConfig,
    cache: npt.NDArray[np.uint8],
    dst: Any,
    local_layout: Any,
    slot: int,
    msg: dict[str, Any],
    req: int,
) -> dict[str, Any]:
    bn = cfg.blocks_needed
    view = PagedKV(cache, dst, np.arange(slot * bn, (slot + 1) * bn, dtype=np.int64))
    digests = [kv_digest(*view.read(i, cfg.tokens)) for i in range(cfg.layers)]
    exact = digests == list(msg["digests"])
    first = int(msg["first_token"])
    got = [first, *model.generate(view, first, cfg.tokens, cfg.gen_tokens)]
    local_buf = np.zeros(local_layout.nbytes, dtype=np.uint8)
    local = PagedKV(local_buf, local_layout, np.arange(bn, dtype=np.int64))
    run = model.prefill(request_prompt(cfg, req))
    for i in range(cfg.layers):
        local.write_prompt(i, *run.step())
    lf = run.next_token()
    mine = [lf, *model.generate(local, lf, cfg.tokens, cfg.gen_tokens)]
    return {"ok": exact and got == mine, "bit_exact": exact, "tokens": got, "local": mine}


def wait_for_registry(url: str, seconds: float) -> None:
    """Return once the registry at ``url`` answers; RegistryUnavailable after ``seconds``."""
    from hixl.errors import RegistryUnavailable
    from hixl.registry import open_registry

    end = time.monotonic() + seconds
    while True:
        try:
            open_registry(url, timeout=1.0).close()
            return
        except RegistryUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


# -- prefill --------------------------------------------------------------------------------


def run_fleet_prefill(
    cfg: DemoConfig,
    host: str,
    url: str,
    requests: list[int],
    seconds: float,
    emit: Emit,
    on_done: Callable[[int], None] | None = None,
    *,
    on_slot: Callable[[str, int], None] | None = None,
    role: str = "decode",
    expect: int = 1,
    token: str | None = None,
) -> dict[str, Any]:
    """A prefill worker: every request in ``requests`` completed exactly once, or an error.

    It starts once ``expect`` workers of ``role`` are announced (within 120 s) and routes
    to workers of that role. ``on_done(n)`` is called after the ``n``-th completion,
    ``on_slot(worker, request)`` when a worker has reserved a slot for a request (its KV
    goes out next). An attempt that fails because the registry is unreachable is retried
    without blaming the decode worker. The result has a timeline on this host's monotonic
    clock: every choice of a worker, every failed attempt (with when it ended) and every
    worker seen leaving the registry."""
    from hixl.core.directory import EventKind
    from hixl.engine import Access, Engine
    from hixl.errors import RegistryUnavailable

    model = TinyLM(cfg)
    src = source_layout(cfg)
    buf = np.zeros(src.nbytes, dtype=np.uint8)
    kv = source_view(buf, src)
    ledger = Ledger(requests)
    bad: dict[str, str] = {}  # decode name -> the instance that failed us
    results: dict[int, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    choices: list[dict[str, Any]] = []
    leaves: list[dict[str, Any]] = []  # bounded below: the registry is ours, but still

    def on_event(ev: Any) -> None:  # the registry's watch thread
        if ev.kind is EventKind.LEAVE and len(leaves) < 1000:
            leaves.append({"t": time.monotonic(), "name": ev.name})

    end = time.monotonic() + seconds
    with Engine(f"{host}:0", registry=url, token=token) as eng:
        region = eng.register(buf, access=Access.NONE)
        assert eng.registry is not None
        watch = eng.registry.watch(callback=on_event)  # the view, and leaves timed
        eng.registry.wait_synced(watch, 10.0)
        ready_by = time.monotonic() + 120.0
        while len(watch.members(role)) < expect:
            if time.monotonic() > ready_by:
                raise TransferTimeout(
                    f"prefill: {len(watch.members(role))} of {expect} {role} workers "
                    f"announced in {url} after 120 s"
                )
            time.sleep(0.1)
        began = time.monotonic()
        emit(f"routing {len(requests)} requests among {len(watch.members(role))} {role} workers")
        while not ledger.finished:
            if time.monotonic() > end:
                raise TransferTimeout(f"prefill: {ledger} after {seconds} s")
            req = ledger.next_pending()
            assert req is not None  # one request at a time: nothing else is running
            members = {n: a for n, a in watch.members(role).items() if bad.get(n) != a.instance}
            target = choose(members, role=role, inflight=ledger.inflight())
            if target is None:
                time.sleep(0.1)
                continue
            attempt = ledger.assign(req, target)
            t0 = time.monotonic()
            choices.append({"t": t0, "req": req, "attempt": attempt.number, "decode": target})
            slot_hook = None if on_slot is None else (lambda w=target, r=req: on_slot(w, r))
            try:
                out = _one_request(
                    eng, region, model, cfg, src, kv, target, attempt.number, req, slot_hook
                )
            except _Busy:
                ledger.fail(attempt, count=False)
                time.sleep(0.05)
                continue
            except RegistryUnavailable as exc:
                emit(f"request {req}: registry unreachable ({exc}); trying again shortly")
                ledger.fail(attempt, count=False)
                time.sleep(0.5)
                continue
            except HixlError as exc:
                waited = time.monotonic() - t0
                emit(
                    f"request {req}: attempt {attempt.number} on {target} failed after "
                    f"{waited:.1f} s: {exc}; running it again elsewhere"
                )
                failures.append(
                    {
                        "req": req,
                        "decode": target,
                        "seconds": waited,
                        "t_end": time.monotonic(),
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                    }
                )
                ledger.fail(attempt)
                bad[target] = members[target].instance
                continue
            if not ledger.complete(attempt):
                continue
            out |= {"seconds": time.monotonic() - t0, "finished": time.monotonic()}
            results[req] = out
            if on_done is not None:
                on_done(len(results))
            emit(
                f"request {req}: done on {target} (attempt {attempt.number}), "
                f"{'bit-exact, same tokens' if out['ok'] else 'MISMATCH'} {out['tokens']}"
            )
        wall = time.monotonic() - began
    return {
        "role": "prefill",
        "results": {str(k): v for k, v in results.items()},
        "retries": ledger.retries,
        "failures": failures,
        "wall_s": wall,
        "began": began,
        "choices": choices,
        "leaves": list(leaves),
    }


class _Busy(HixlError):
    pass


def _wait_for(eng: Any, conn: Any, name: str, req: int, attempt: int, end: float) -> dict[str, Any]:
    """The ``name`` notification for (req, attempt) from ``conn``'s peer; fails as soon as
    the connection does, or at ``end``."""
    from hixl.engine import ConnState

    while True:
        if conn.state is not ConnState.READY:
            raise ConnectionFailed(f"connection to {conn.peer} failed: {conn.failure}")
        left = end - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"no {name!r} for request {req} from {conn.peer}")
        try:  # short waits: a failed connection is noticed within 50 ms
            note = eng.wait_notification(name, timeout=min(0.05, left), peer=conn.peer)
        except TransferTimeout:
            continue
        msg = _msg(note)
        if msg.get("req") == req and msg.get("attempt") == attempt:
            return msg


def _one_request(
    eng: Any,
    region: Any,
    model: TinyLM,
    cfg: DemoConfig,
    src: Any,
    kv: Any,
    target: str,
    attempt: int,
    req: int,
    on_slot: Callable[[], None] | None = None,
) -> dict[str, Any]:
    from hixl.engine import TransferRequest

    end = time.monotonic() + 60.0
    conn = eng.connect(target, timeout=10.0)
    tag = {"req": req, "attempt": attempt}
    eng.notify(target, "alloc", json.dumps(tag).encode())
    answer = _wait_for(eng, conn, "slot", req, attempt, end)
    slot = int(answer["slot"])
    if slot < 0:
        raise _Busy(f"{target} has no free slot")
    if on_slot is not None:
        on_slot()
    bn = cfg.blocks_needed
    dst = paged_layout(cfg, int(answer["pool"]), int(answer["block_size"]))
    ids = np.arange(slot * bn, (slot + 1) * bn, dtype=np.int64)
    run = model.prefill(request_prompt(cfg, req))
    digests, batch = [], []
    for i in range(cfg.layers):
        k, v = run.step()
        kv[i, 0] = k
        kv[i, 1] = v
        digests.append(kv_digest(k, v))
        local, remote = layer_descriptors(src, dst, ids, i)
        batch.append(
            TransferRequest(
                op="write", local=region, remote="kv", local_desc=local, remote_desc=remote
            )
        )
    first = run.next_token()
    message = {**tag, "slot": slot, "digests": digests, "first_token": first}
    eng.transfer(target, batch, notify="kv", notify_message=json.dumps(message).encode())
    result = _wait_for(eng, conn, "result", req, attempt, end)
    ok = bool(result.get("ok")) and result.get("tokens") == result.get("local")
    return {"decode": target, "attempt": attempt, "ok": ok, "tokens": result.get("tokens")}


# -- orchestration --------------------------------------------------------------------------


def check_results(requests: int, prefills: list[dict[str, Any]]) -> dict[str, Any]:
    """Exactly-once and correctness over the prefill workers' results (pure)."""
    seen: dict[int, int] = {}
    ok = 0
    per_decode: dict[str, int] = {}
    for p in prefills:
        for key, r in p["results"].items():
            seen[int(key)] = seen.get(int(key), 0) + 1
            ok += bool(r["ok"])
            per_decode[r["decode"]] = per_decode.get(r["decode"], 0) + 1
    missing = sorted(set(range(requests)) - set(seen))
    duplicated = sorted(r for r, n in seen.items() if n > 1)
    return {
        "requests": requests,
        "completed": len(seen),
        "missing": missing,
        "duplicated": duplicated,
        "all_ok": ok == requests and not missing and not duplicated,
        "retries": sum(int(p["retries"]) for p in prefills),
        "per_decode": per_decode,
    }


def _fleet_once(
    cfg: DemoConfig,
    *,
    prefill: int,
    decode: int,
    requests: int,
    kill: bool,
    timeout: float,
    out: IO[str],
    tag: str,
) -> dict[str, Any]:
    from hixl.testbed.etcd import EtcdServer
    from hixl.testbed.net import free_tcp_port

    lock = threading.Lock()
    done_count = [0]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ready: dict[str, threading.Event] = {}

    def forward(role: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("ready:"):
                ready[role].set()
            if role.startswith("prefill") and ": done on " in line:
                done_count[0] += 1
            with lock:
                out.write(f"[{tag} {role:<9}] {line}\n")
                out.flush()

    base = [sys.executable, "-u", "-m", "hixl.demo.fleet"]
    env = _child_env() | {TOKEN_ENV: secrets.token_hex(32)}  # this fleet's shared token
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="hixl-fleet-") as tmp:
        start = time.monotonic()
        threads = []
        killed: str | None = None
        try:

            def spawn(role: str, argv: list[str]) -> None:
                ready[role] = threading.Event()
                procs[role] = subprocess.Popen(
                    [*base, *argv, "--registry", etcd.url, "--seconds", f"{timeout:.0f}"]
                    + ["--result", str(Path(tmp) / f"{role}.json"), *cfg.to_argv()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                assert procs[role].stdout is not None
                th = threading.Thread(target=forward, args=(role, procs[role].stdout), daemon=True)
                th.start()
                threads.append(th)

            for i in range(decode):
                listen = f"127.0.0.1:{free_tcp_port()}"
                spawn(f"decode-{i}", ["decode", "--name", f"decode-{i}", "--listen", listen])
            for i in range(decode):
                if not ready[f"decode-{i}"].wait(max(1.0, start + 120 - time.monotonic())):
                    raise HixlError(f"decode-{i} did not become ready")
            for j in range(prefill):
                mine = ",".join(str(r) for r in range(requests) if r % prefill == j)
                spawn(f"prefill-{j}", ["prefill", "--requests", mine])
            t0 = time.monotonic()
            pre = [p for r, p in procs.items() if r.startswith("prefill")]
            while any(p.poll() is None for p in pre):
                if time.monotonic() > start + timeout:
                    raise HixlError(f"fleet {tag} exceeded {timeout:.0f} s")
                if kill and killed is None and decode >= 2 and done_count[0] >= requests // 3:
                    killed = "decode-0"
                    procs[killed].kill()
                    with lock:
                        out.write(f"[{tag} orchestr.] killed {killed} (SIGKILL) mid-stream\n")
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            failed = {
                r: p.returncode
                for r, p in procs.items()
                if r.startswith("prefill") and p.returncode != 0
            }
            if failed:
                raise HixlError(f"fleet {tag}: prefill workers failed: {failed}")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for th in threads:
                th.join(5)
        prefills = [
            json.loads((Path(tmp) / f"prefill-{j}.json").read_text()) for j in range(prefill)
        ]
    summary = check_results(requests, prefills)
    summary |= {
        "prefill": prefill,
        "decode": decode,
        "killed": killed,
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed,
    }
    return summary


def run_fleet(
    cfg: DemoConfig = FLEET_CONFIG,
    *,
    prefill: int = 2,
    decode: int = 2,
    requests: int = 12,
    kill: bool = True,
    baseline: bool = True,
    timeout: float = 600.0,
    json_path: str | None = None,
    out: IO[str] | None = None,
) -> dict[str, Any]:
    """A 1x1 fleet (unless not ``baseline``), then a ``prefill`` x ``decode`` fleet (one
    decode killed mid-stream when ``kill`` and there are two or more), each serving
    ``requests`` requests; returns and prints the summary.  Without the 1x1 fleet the
    summary's ``baseline`` and ``throughput_ratio`` are None.  Raises :class:`HixlError`
    if a worker fails or time runs out."""
    if not (1 <= prefill <= 16 and 1 <= decode <= 16 and 1 <= requests <= 10_000):
        raise ArgumentError(
            f"fleet: prefill={prefill} decode={decode} requests={requests} out of range"
        )
    out = out or sys.stdout
    base = (
        _fleet_once(
            cfg,
            prefill=1,
            decode=1,
            requests=requests,
            kill=False,
            timeout=timeout,
            out=out,
            tag="1x1",
        )
        if baseline
        else None
    )
    main = _fleet_once(
        cfg,
        prefill=prefill,
        decode=decode,
        requests=requests,
        kill=kill,
        timeout=timeout,
        out=out,
        tag=f"{prefill}x{decode}",
    )
    summary = {
        "baseline": base,
        "fleet": main,
        "throughput_ratio": None
        if base is None
        else main["requests_per_s"] / base["requests_per_s"],
        "ok": (base is None or base["all_ok"]) and main["all_ok"],
    }
    out.write("\n" + format_fleet(summary) + "\n")
    out.flush()
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


ETCD_PORT = 2379
DECODE_PORT = 5600
TTL_S = 3
"""The lease TTL of every fleet engine's registry, seconds (the engine's default)."""

LEAVE_LIMIT_S = TTL_S + 3.0
"""How long after the order to cut a host off its name must have left the registry,
seconds.  The lease ends TTL after its last refresh, which comes at most a moment after
the order (the host's process is frozen as soon as it sees the order); etcd looks for
expired leases every 0.5 s, then revokes the lease through its log and sends the event
to the watches, on host0, which shares two emulated CPUs with three other VMs.  Seen
from the order in the four-host VM fleet: 2.9 to 4.9 s (a directly read key vanished with
the watch's event, so the time is etcd's).  The limit still tells a leave from a 10 s
connect timeout."""


def cut_timeline(prefill: dict[str, Any], victim: str, cut: float | None) -> dict[str, Any]:
    """When a router stopped using ``victim`` after its host was cut off (pure).

    ``prefill`` is a prefill worker's result (its timeline is on its own host's clock).
    With ``cut`` (the time of the order to cut the host off, on the same clock), the
    times are seconds after it: ``lease_gone_s`` (the router's watch saw the name leave),
    ``last_choice_s`` (the last time it chose ``victim``; negative if before the cut) and
    ``last_given_up_s`` (the last attempt on ``victim`` given up). Without ``cut`` (a
    router on another host, another clock), they are measured from when this router saw
    the name leave (``lease_gone_s`` is then 0). Missing events give None."""
    leaves = [e["t"] for e in prefill.get("leaves", []) if e["name"] == victim]
    if cut is not None:
        leaves = [t for t in leaves if t >= cut]
    leave = min(leaves, default=None)
    zero = cut if cut is not None else leave
    if zero is None:
        return {"lease_gone_s": None, "last_choice_s": None, "last_given_up_s": None}
    chosen = [c["t"] for c in prefill.get("choices", []) if c["decode"] == victim]
    given_up = [
        f["t_end"]
        for f in prefill.get("failures", [])
        if f["decode"] == victim and f.get("t_end", zero) >= zero
    ]
    return {
        "lease_gone_s": None if leave is None else leave - zero,
        "last_choice_s": None if not chosen else max(chosen) - zero,
        "last_given_up_s": None if not given_up else max(given_up) - zero,
    }


def run_fleet_hosts(
    cfg: DemoConfig = FLEET_CONFIG,
    *,
    prefill: int = 2,
    decode: int = 2,
    requests: int = 8,
    timeout: float = 600.0,
    json_path: str | None = None,
) -> dict[str, Any]:
    """The fleet on ``prefill + decode`` hosts of the virtual wire, one VM each.

    host0 runs etcd and prefill-0, the next hosts the other prefill workers, then the
    decode workers. Every engine has the run's shared token (``$HIXL_FLEET_TOKEN``).

    First a 1 x 1 fleet serves the same requests: prefill-0 on host0 and a decode worker
    on the first decode host (role ``base``; the other workers wait for it to end), so
    the summary gives the ``P x D`` fleet's throughput as a ratio measured in the same
    boot. Then the ``P x D`` fleet, where three things go wrong on purpose, each checked:

    * after prefill-0's first request, the last decode worker restarts under the same
      name: the prefill workers find it again and replace their connections to it;
    * with two or more decode workers, once prefill-0 has completed two requests, the
      next time decode-0 reserves a slot for it host0 orders decode-0's host cut off (no
      FIN, no goodbye) before the KV goes out, so that request is in flight when the host
      dies. On host0's clock the summary gives the time from that order to decode-0's
      lease leaving (within TTL + 3 s), to the last choice of decode-0, and to the last
      attempt on it given up (and re-run elsewhere), each at most 0.5 s after the leave
      (:func:`cut_in_time`);
    * after that, etcd on host0 is stopped for 5 s: work goes on over live connections,
      and announcements are made again when it is back.
    """
    import shutil

    from hixl.testbed.hosts import ONE_BLAS_THREAD, host_address, run_hosts
    from hixl.testbed.vm import VMConfig

    hosts = prefill + decode
    if not (prefill >= 1 and decode >= 1 and 2 <= hosts <= 8):
        raise ArgumentError(f"--hosts fleet: prefill={prefill} decode={decode}, 2..8 hosts")
    share = Path(tempfile.mkdtemp(prefix="hixl-fleet-hosts-"))
    etcd_url = f"etcd://{host_address(0)}:{ETCD_PORT}"
    worker = [sys.executable, "-u", "-m", "hixl.demo.fleet"]
    common = ["--registry", etcd_url, "--seconds", f"{timeout:.0f}", *cfg.to_argv()]
    results = [str(share / f"prefill-{j}.json") for j in range(prefill)]
    stop, restart = str(share / "stop"), str(share / "restart")
    base_done, cut = str(share / "baseline-done"), str(share / "cut-decode-0")
    commands = []
    for j in range(prefill):
        mine = ",".join(str(r) for r in range(requests) if r % prefill == j)
        cmd = [*worker, "prefill", "--host", host_address(j), "--requests", mine]
        cmd += ["--result", results[j], "--expect", str(decode)]
        if j == 0:
            cmd += ["--etcd", f"{host_address(0)}:{ETCD_PORT}", "--stop-file", stop]
            cmd += ["--wait-results", ",".join(results[1:])]
            cmd += ["--baseline-requests", str(requests), "--baseline-done", base_done]
            cmd += ["--restart-file", restart, "--restart-at", "1"]
            cmd += ["--etcd-outage-seconds", "5"]
            if decode >= 2:
                cmd += ["--vanish-file", cut]
        else:
            cmd += ["--after", base_done]
        commands.append(cmd + common)
    for i in range(decode):
        addr = host_address(prefill + i)
        cmd = [*worker, "decode", "--name", f"decode-{i}", "--listen", f"{addr}:{DECODE_PORT}"]
        cmd += ["--stop-file", stop, "--result", str(share / f"decode-{i}.json")]
        if i == 0:
            cmd += ["--baseline-until", base_done]
            if decode >= 2:
                cmd += ["--vanish-file", cut]
        else:
            cmd += ["--after", base_done]
        if i == decode - 1:
            cmd += ["--restart-file", restart]
        commands.append(cmd + common)
    print(
        f"hixl demo --hosts {hosts}: etcd and prefill-0 on host0 ({host_address(0)}), "
        f"{prefill} prefill and {decode} decode workers, one VM each; a 1 x 1 fleet first",
        flush=True,
    )
    vmcfg = VMConfig(cpus=1, memory="1536M", timeout=timeout + 300.0, rw_dirs=(share,))
    env = ONE_BLAS_THREAD | {TOKEN_ENV: secrets.token_hex(32)}  # this run's shared token
    t0 = time.monotonic()
    try:
        rc = run_hosts(commands, vmcfg, env=env)
        took = time.monotonic() - t0
        prefills = []
        for path in results:
            try:
                prefills.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as exc:
                raise HixlError(f"{path} missing ({exc}); run status {rc}") from None
        vanished = decode >= 2 and not (share / "decode-0.json").exists()
        last = share / f"decode-{decode - 1}.json"
        restarted = last.exists() and bool(json.loads(last.read_text()).get("restarted"))
        if rc != 0:
            raise HixlError(f"a fleet host failed (exit status {rc}); its output is above")
    finally:
        shutil.rmtree(share, ignore_errors=True)
    summary = _hosts_summary(requests, prefills, prefill=prefill, decode=decode)
    summary |= {"killed": "decode-0 (host cut off)" if vanished else None, "run_s": took}
    summary["restarted"] = restarted
    summary["ok"] = (
        summary["all_ok"]
        and summary["baseline"]["all_ok"]
        and (decode < 2 or (vanished and summary["cut_ok"]))
        and summary["etcd_outage"] is not None
        and restarted
    )
    print("\n" + format_fleet_hosts(summary), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _hosts_summary(
    requests: int, prefills: list[dict[str, Any]], *, prefill: int, decode: int
) -> dict[str, Any]:
    host0 = prefills[0]
    base = host0["baseline"]
    bsum = check_results(requests, [base])
    bsum["requests_per_s"] = requests / base["wall_s"]
    summary = check_results(requests, prefills)
    wall = max(p["wall_s"] for p in prefills)
    summary |= {
        "prefill": prefill,
        "decode": decode,
        "hosts": prefill + decode,
        "elapsed_s": wall,
        "requests_per_s": requests / wall,
        "baseline": bsum | {"elapsed_s": base["wall_s"]},
        "throughput_ratio": (requests / wall) / bsum["requests_per_s"],
        "failures": [f for p in prefills for f in p["failures"]],
        "etcd_outage": host0.get("etcd_outage"),
    }
    cut = host0.get("cut")
    routers = []
    if cut is not None:
        routers.append({"router": "prefill-0", **cut_timeline(host0, "decode-0", cut["t"])})
        for j, p in enumerate(prefills[1:], start=1):
            routers.append(
                {"router": f"prefill-{j}", "from_leave": True, **cut_timeline(p, "decode-0", None)}
            )
    summary["cut"] = None if cut is None else {**cut, "routers": routers}
    summary["cut_ok"] = cut is not None and cut_in_time(routers)
    summary["etcd_warnings"] = list(host0.get("etcd_warnings", []))
    return summary


LEAVE_GRACE_S = 0.5
"""How long after a router sees the lost worker's name leave it may still give up an
attempt there (or choose it), seconds."""


def cut_in_time(routers: list[dict[str, Any]]) -> bool:
    """Whether the routers stopped using the cut worker in time (pure).

    ``routers``: :func:`cut_timeline` rows, the cutting host's router first (times from
    the order), then the others (times from when each saw the name leave).  The name
    must leave within :data:`LEAVE_LIMIT_S` of the order; every router's last choice of
    the worker and last attempt given up there come at most :data:`LEAVE_GRACE_S` after
    it saw the leave.  (A give-up is caused by the leave, so it trails it by the time
    the router takes to act: a bound on the give-up equal to the bound on the leave
    fails a leave seen near that limit.)"""
    if not routers:
        return False
    gone = routers[0].get("lease_gone_s")
    if gone is None or gone > LEAVE_LIMIT_S:
        return False
    for i, r in enumerate(routers):
        until = (gone if i == 0 else 0.0) + LEAVE_GRACE_S
        for key in ("last_choice_s", "last_given_up_s"):
            if r.get(key) is not None and r[key] > until:
                return False
    return True


ETCD_WARNINGS = 8
"""How many of etcd's own warnings host0's result keeps (the last ones)."""


def etcd_warnings(log_text: str, limit: int = ETCD_WARNINGS) -> list[str]:
    """etcd's last ``limit`` warnings and errors from its zap log (JSON lines), each as
    ``"<time> <message> (took <duration>)"`` and at most 200 characters (pure).  Lines
    that are not JSON objects are skipped.  Kept so that a late lease can be told apart
    from a slow etcd ("apply request took too long", slow fdatasync) after the VM is gone."""
    found: list[str] = []
    for line in log_text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or doc.get("level") not in ("warn", "error"):
            continue
        text = f"{doc.get('ts', '?')} {doc.get('msg', '?')}"
        if doc.get("took") is not None:
            text += f" (took {doc['took']})"
        found.append(text[:200])
    return found[-limit:] if limit > 0 else []


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:+.2f} s"


def format_fleet_hosts(s: dict[str, Any]) -> str:
    """The multi-host fleet's summary as text (pure)."""
    b = s["baseline"]
    lines = [
        f"fleet on {s['hosts']} hosts: {s['prefill']} prefill x {s['decode']} decode, "
        f"{s['requests']} requests"
        + (", decode-0's host cut off mid-stream" if s["killed"] else ""),
        f"  completed exactly once: {s['completed']}/{s['requests']} (missing "
        f"{s['missing']}, duplicated {s['duplicated']}), re-run {s['retries']} times",
        f"  served per decode: {s['per_decode']}",
    ]
    for f in s["failures"]:
        lines.append(
            f"  request {f['req']} on {f['decode']} failed after {f['seconds']:.1f} s: "
            f"{f['error'][:120]}"
        )
    cut = s.get("cut")
    if cut is not None:
        held = "with its request " + str(cut["req"]) if cut["req"] is not None else "idle"
        lines.append(f"  decode-0 cut off {held} in flight; on host0's clock, after the order:")
        for r in cut["routers"]:
            if r.get("from_leave") and r["lease_gone_s"] is None:
                lines.append(f"    {r['router']}: its requests were all done before decode-0 left")
            elif r.get("from_leave"):
                lines.append(
                    f"    {r['router']} (own clock, after it saw the leave): last chose "
                    f"decode-0 {_secs(r['last_choice_s'])}, last attempt there given up "
                    f"{_secs(r['last_given_up_s'])}"
                )
            else:
                lines.append(
                    f"    {r['router']}: lease gone {_secs(r['lease_gone_s'])}, last chose "
                    f"decode-0 {_secs(r['last_choice_s'])}, last attempt there given up "
                    f"{_secs(r['last_given_up_s'])} (limits: the leave within TTL + 3 = "
                    f"{LEAVE_LIMIT_S:.0f} s, the others {LEAVE_GRACE_S} s after it)"
                )
        lines.append(f"  routers stopped using decode-0 in time: {'yes' if s['cut_ok'] else 'NO'}")
        warned = s.get("etcd_warnings") or []
        if not s["cut_ok"] and warned:  # a late leave: was etcd itself slow?
            lines.append(f"  etcd's last {len(warned)} warnings on host0:")
            lines += [f"    {w}" for w in warned]
    outage = s.get("etcd_outage")
    if outage is not None:
        lines.append(
            f"  etcd stopped for {outage['seconds']:.1f} s on host0; prefill-0 completed "
            f"{outage['completed_during']} requests meanwhile"
        )
    else:
        lines.append("  etcd outage: DID NOT HAPPEN")
    lines += [
        f"  decode-{s['decode'] - 1} restarted under the same name: "
        f"{'yes' if s['restarted'] else 'NO'}",
        f"  all bit-exact with identical tokens: {'yes' if s['all_ok'] and b['all_ok'] else 'NO'}",
        f"  throughput {s['requests_per_s']:.2f} req/s over {s['elapsed_s']:.1f} s vs 1x1 "
        f"{b['requests_per_s']:.2f} req/s over {b['elapsed_s']:.1f} s in the same run: "
        f"{s['throughput_ratio']:.2f}x; whole run {s['run_s']:.0f} s",
        f"result: {'OK' if s['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def format_fleet(s: dict[str, Any]) -> str:
    f, b = s["fleet"], s["baseline"]
    lines = [
        f"fleet {f['prefill']} prefill x {f['decode']} decode, {f['requests']} requests"
        + (f", {f['killed']} killed mid-stream" if f["killed"] else ""),
        f"  completed exactly once: {f['completed']}/{f['requests']} "
        f"(missing {f['missing']}, duplicated {f['duplicated']}), re-run {f['retries']} times",
        f"  served per decode: {f['per_decode']}",
        f"  all bit-exact with identical tokens: {'yes' if f['all_ok'] else 'NO'}",
        f"  throughput {f['requests_per_s']:.2f} req/s"
        + (
            ""
            if b is None
            else f" vs 1x1 {b['requests_per_s']:.2f} req/s in the same run: "
            f"{s['throughput_ratio']:.2f}x"
        ),
        f"result: {'OK' if s['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def cmd_fleet(args: argparse.Namespace) -> int:
    """``hixl demo --prefill P --decode D``: run here if this host has RDMA, else in the VM.

    The fleet uses :data:`FLEET_CONFIG` (a small model; ``--seed`` applies)."""
    from dataclasses import replace

    from hixl.testbed.vm import VMConfig, host_has_rdma, run_with_rdma

    json_path = str(Path(args.json).resolve()) if args.json else None
    if args.hosts > 1:
        hsum = run_fleet_hosts(
            replace(FLEET_CONFIG, seed=args.seed),
            prefill=args.prefill,
            decode=args.decode,
            requests=args.requests,
            timeout=args.timeout,
            json_path=json_path,
        )
        return 0 if hsum["ok"] else 1
    if os.environ.get("HIXL_IN_VM") != "1" and not host_has_rdma():
        print("hixl demo: no RDMA device here; running the fleet in the hixl VM", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "hixl",
            "demo",
            f"--prefill={args.prefill}",
            f"--decode={args.decode}",
            f"--requests={args.requests}",
            f"--seed={args.seed}",
            f"--timeout={args.timeout}",
        ]
        rw: tuple[Path, ...] = ()
        if json_path:
            cmd.append(f"--json={json_path}")
            rw = (Path(json_path).parent,)
        return run_with_rdma(cmd, VMConfig(rw_dirs=rw, timeout=2 * args.timeout + 300.0))
    cfg = replace(FLEET_CONFIG, seed=args.seed)
    summary = run_fleet(
        cfg,
        prefill=args.prefill,
        decode=args.decode,
        requests=args.requests,
        timeout=args.timeout,
        json_path=json_path,
    )
    return 0 if summary["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m hixl.demo.fleet {decode,prefill} ...``.

    The engines take the fleet's token from ``$HIXL_FLEET_TOKEN`` (:func:`fleet_token`)."""
    p = argparse.ArgumentParser(prog="python -m hixl.demo.fleet")
    p.add_argument("role", choices=("decode", "prefill"))
    p.add_argument("--name", help="decode: registry name")
    p.add_argument("--listen", help="decode: engine id to listen on")
    p.add_argument("--host", default="127.0.0.1", help="prefill: local address")
    p.add_argument("--slots", type=int, default=2, help="decode: request slots")
    p.add_argument("--requests", default="", help="prefill: comma-separated request ids")
    p.add_argument("--registry", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--after", help="start once this file exists (a phase before ended)")
    p.add_argument("--expect", type=int, default=1, help="prefill: start once N decode are up")
    p.add_argument("--stop-file", help="decode: stop serving once this file exists")
    p.add_argument(
        "--vanish-file",
        help="decode: cut this host off once the file exists; prefill with --etcd: write it",
    )
    p.add_argument("--scratch-mib", type=int, default=0, help="decode: a 'scratch' region")
    p.add_argument("--restart-after", type=int, help="decode: restart once after N requests")
    p.add_argument(
        "--restart-file",
        help="decode: restart once when this file exists; prefill with --etcd: write it",
    )
    p.add_argument("--restart-at", type=int, help="prefill with --etcd: after N requests")
    p.add_argument("--etcd-outage-seconds", type=float, default=0.0)
    p.add_argument("--etcd", help="prefill: run etcd here first, on HOST:PORT")
    p.add_argument(
        "--wait-results", default="", help="prefill with --etcd: result files to wait for"
    )
    p.add_argument(
        "--baseline-until", help="decode: first serve a 1x1 fleet (role base) until this file"
    )
    p.add_argument(
        "--baseline-requests", type=int, default=0, help="prefill with --etcd: a 1x1 fleet first"
    )
    p.add_argument("--baseline-done", help="prefill with --etcd: write this file after it")
    add_model_options(p)
    args = p.parse_args(argv)

    def emit(line: str) -> None:
        print(line, flush=True)

    try:
        cfg = config_from_args(args)
        token = fleet_token()
        if args.role == "decode":
            if not args.name or not args.listen:
                raise ArgumentError("decode needs --name and --listen")
            wait_for_registry(args.registry, 120.0)
            baseline = None
            if args.baseline_until:
                baseline = run_fleet_decode(
                    cfg,
                    f"base-{args.name}",
                    args.listen,
                    args.registry,
                    args.slots,
                    args.seconds,
                    emit,
                    stop_file=args.baseline_until,
                    role="base",
                    token=token,
                )
            if args.after:
                _wait_file(args.after, args.seconds, args.name)
            result = run_fleet_decode(
                cfg,
                args.name,
                args.listen,
                args.registry,
                args.slots,
                args.seconds,
                emit,
                stop_file=args.stop_file,
                vanish_file=args.vanish_file,
                restart_after=args.restart_after,
                restart_file=args.restart_file,
                scratch=args.scratch_mib << 20,
                token=token,
            )
            result["baseline"] = baseline
        elif args.etcd:
            return _prefill_with_etcd(cfg, args, emit, token)
        else:
            wait_for_registry(args.registry, 120.0)
            if args.after:
                _wait_file(args.after, args.seconds, "prefill")
            reqs = [int(x) for x in args.requests.split(",") if x]
            result = run_fleet_prefill(
                cfg,
                args.host,
                args.registry,
                reqs,
                args.seconds,
                emit,
                expect=args.expect,
                token=token,
            )
    except HixlError as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        return 1
    Path(args.result).write_text(json.dumps(result))
    return 0


def _prefill_with_etcd(cfg: DemoConfig, args: argparse.Namespace, emit: Emit, token: str) -> int:
    """host0 of the multi-host fleet: etcd, the 1x1 fleet's prefill, a prefill worker of the
    fleet, the orders that make things go wrong (restart, cut, etcd outage), and the end of
    the run (wait for every prefill's result, then tell the decode workers to stop)."""
    from hixl.testbed.etcd import EtcdServer

    host, _, port = args.etcd.rpartition(":")
    reqs = [int(x) for x in args.requests.split(",") if x]
    end = time.monotonic() + args.seconds
    outage: dict[str, Any] = {}
    cut: dict[str, Any] = {}
    done = [0]
    timers: list[threading.Timer] = []
    with EtcdServer(host, client_port=int(port), peer_port=int(port) + 1) as etcd:
        emit(f"etcd up at {etcd.url}")

        def back() -> None:
            etcd.start()
            outage["back"] = time.monotonic()
            emit(f"etcd started again after {outage['back'] - outage['stopped']:.1f} s")

        def stop_etcd(n: int) -> None:
            etcd.stop()
            outage["stopped"] = time.monotonic()
            emit(f"etcd stopped (for {args.etcd_outage_seconds:.0f} s) after {n} requests")
            timer = threading.Timer(args.etcd_outage_seconds, back)
            timer.start()
            timers.append(timer)

        def order_cut(req: int | None) -> None:
            Path(args.vanish_file).write_text("cut\n")
            cut.update(t=time.monotonic(), req=req)
            held = f"request {req} about to go there" if req is not None else "nothing of ours"
            emit(f"ordered decode-0's host cut off ({held})")

        def on_slot(worker: str, req: int) -> None:
            if args.vanish_file and not cut and worker == "decode-0" and done[0] >= 2:
                order_cut(req)

        def on_done(n: int) -> None:
            done[0] = n
            if args.restart_file and n == args.restart_at:
                Path(args.restart_file).write_text("restart\n")
                emit(f"asked the last decode worker to restart, after {n} requests")
            if args.vanish_file and not cut and n >= len(reqs) - 2:
                order_cut(None)  # decode-0 never reserved a slot for us late enough
            if cut and n == len(reqs):
                # Our last request: keep this router and its watch up until decode-0's lease
                # must have gone, so the summary sees the leave (and etcd is not stopped
                # before it).  A plain wait in this driver thread; no lock is held.
                time.sleep(max(0.0, cut["t"] + LEAVE_LIMIT_S + 0.5 - time.monotonic()))
            late = not args.vanish_file or (cut and time.monotonic() > cut["t"] + LEAVE_LIMIT_S)
            if args.etcd_outage_seconds and not outage and late:
                stop_etcd(n)

        try:
            baseline = None
            if args.baseline_requests:
                emit(f"1 x 1 fleet first: {args.baseline_requests} requests")
                baseline = run_fleet_prefill(
                    cfg,
                    args.host,
                    etcd.url,
                    list(range(args.baseline_requests)),
                    args.seconds,
                    emit,
                    role="base",
                    token=token,
                )
                emit(f"1 x 1 fleet done in {baseline['wall_s']:.1f} s")
                Path(args.baseline_done).write_text("done\n")
            result = run_fleet_prefill(
                cfg,
                args.host,
                etcd.url,
                reqs,
                args.seconds,
                emit,
                on_done=on_done,
                on_slot=on_slot,
                expect=args.expect,
                token=token,
            )
            if args.etcd_outage_seconds and not outage:
                stop_etcd(len(reqs))  # every request finished first: nothing ran during it
            for timer in timers:
                timer.join(args.etcd_outage_seconds + 35.0)
            if outage:
                during = [
                    r
                    for r in result["results"].values()
                    if outage["stopped"] < r["finished"] < outage.get("back", float("inf"))
                ]
                result["etcd_outage"] = {
                    "seconds": outage.get("back", float("nan")) - outage["stopped"],
                    "completed_during": len(during),
                }
            result["baseline"] = baseline
            result["cut"] = cut or None
            result["etcd_warnings"] = etcd_warnings(etcd.log_tail())
            Path(args.result).write_text(json.dumps(result))
            for path in [p for p in args.wait_results.split(",") if p]:
                while not Path(path).exists():
                    if time.monotonic() > end:
                        raise TransferTimeout(f"no result {path} within {args.seconds} s")
                    time.sleep(0.5)
        finally:
            if args.stop_file:
                Path(args.stop_file).write_text("stop\n")
            time.sleep(2.0)  # let the decode workers see it while etcd still runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
