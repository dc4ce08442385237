"""The engine lock's debug form: it knows its owner, nests, and works under a Condition."""

from __future__ import annotations

import threading

import pytest

from hixl.engine import locks
from hixl.engine.locks import CheckedRLock, assert_unlocked


def test_assert_unlocked_raises_only_while_a_checked_lock_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)
    lock = CheckedRLock()
    assert_unlocked("a send")
    with lock, lock:  # reentrant
        assert lock.held()
        with pytest.raises(AssertionError, match="a send with an engine lock held"):
            assert_unlocked("a send")
    assert not lock.held()
    assert_unlocked("a send")


def test_assert_unlocked_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", False)
    lock = CheckedRLock()
    with lock:
        assert_unlocked("a send")


def test_a_condition_waits_with_the_checked_lock_fully_released() -> None:
    lock = CheckedRLock()
    cv = threading.Condition(lock)  # type: ignore[arg-type]
    seen: list[bool] = []

    def other() -> None:
        with lock:  # only possible while the waiter has let go of both levels
            seen.append(lock.held())
            cv.notify_all()

    with lock, lock:
        t = threading.Thread(target=other)
        t.start()
        assert cv.wait_for(lambda: bool(seen), timeout=10)
        assert lock.held()  # both levels back
    t.join(10)
    assert seen == [True] and not lock.held()


def test_releasing_a_lock_held_by_another_thread_is_refused() -> None:
    lock = CheckedRLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
