"""The fleet demo's two worker roles, each run as its own process.

* The decode worker announces its free request slots in the registry, reserves a slot per
  request attempt, checks and regenerates from the KV cache a prefill worker put into that
  slot, and answers with the tokens; it can restart under its name or have its host cut off
  mid-stream, for the failure cases.
* The prefill worker routes each of its requests to the decode worker with the most free
  announced capacity, puts the request's KV into the reserved slot, waits for the answer
  and runs the request again elsewhere when an attempt fails.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from hixl.demo.kvmodel import (
    DemoConfig,
    PagedKV,
    TinyLM,
    kv_digest,
    layer_descriptors,
    paged_layout,
    source_layout,
    source_view,
)
from hixl.demo.router import Ledger, choose
from hixl.errors import ConnectionFailed, HixlError, TransferTimeout

Emit = Callable[[str], None]


def request_prompt(cfg: DemoConfig, request: int) -> npt.NDArray[np.int64]:
    """Request ``request``'s prompt: the configured text, rotated so every request differs."""
    base = cfg.prompt_tokens()
    return np.roll(base, -(7 * request) % base.size)


def note_doc(note: Any) -> dict[str, Any]:
    """A notification's message as a JSON object; HixlError when it is not one."""
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
                    msg = note_doc(note)
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
        msg = note_doc(note)
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
