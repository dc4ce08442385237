"""TransferHandle: waiting, finishing, and the Event that only sleeping waiters make.

``finish`` is the engine's side (called under the engine lock, so one finisher at a time);
these tests call it from one thread, as the engine does, and wait from others.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from hixl.engine.handles import TransferHandle, TransferStatus
from hixl.errors import CompletionError, TransferTimeout


def _handle(deadline_s: float = 30.0) -> TransferHandle:
    return TransferHandle("peer", 4096, 1, time.monotonic() + deadline_s)


def test_a_finished_handle_returns_or_raises_at_once() -> None:
    ok = _handle()
    ok.finish(None)
    ok.wait()
    assert ok.done() and ok.status is TransferStatus.DONE and ok.error is None

    bad = _handle()
    err = CompletionError("RDMA transfer to peer", 10, "IBV_WC_REM_ACCESS_ERR", 7, 0)
    bad.finish(err)
    bad.finish(None)  # the first call wins
    with pytest.raises(CompletionError):
        bad.wait()
    assert bad.status is TransferStatus.FAILED and bad.error is err


def test_a_wait_timeout_leaves_the_transfer_pending() -> None:
    h = _handle()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        h.wait(timeout=0.05)
    assert 0.04 <= time.monotonic() - t0 < 2.0
    assert h.status is TransferStatus.PENDING
    h.finish(None)
    h.wait(timeout=0.05)


def test_waiters_racing_the_finisher_all_wake() -> None:
    """Two threads wait on each of many handles while a third finishes them, with the
    finish landing before, during and after the waiters make their Event.  A lost wake-up
    would show as a wait that runs into its 5 s timeout."""
    n = 3000
    handles = [_handle() for _ in range(n)]
    rng = random.Random(11)
    delays = [rng.choice((0.0, 0.0, 0.0, 1e-5, 1e-4)) for _ in range(n)]
    slow: list[float] = []
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def waiter() -> None:
        start.wait()
        for h in handles:
            t0 = time.monotonic()
            try:
                h.wait(timeout=5.0)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)
            dt = time.monotonic() - t0
            if dt > 1.0:
                slow.append(dt)

    def finisher() -> None:
        start.wait()
        for h, d in zip(handles, delays, strict=True):
            if d:
                time.sleep(d)
            h.finish(None)

    threads = [threading.Thread(target=f) for f in (waiter, waiter, finisher)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and slow == []
    assert all(h.status is TransferStatus.DONE for h in handles)
