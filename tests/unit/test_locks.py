"""The engine lock's debug switch: assert_unlocked knows which thread holds which lock."""

from __future__ import annotations

import gc
import threading

import pytest

from hixl.engine import locks
from hixl.engine.locks import assert_unlocked, engine_lock


def test_assert_unlocked_raises_only_while_this_thread_holds_a_checked_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)
    first, second = engine_lock(), engine_lock()  # two engines' locks
    assert_unlocked("a send")
    for lock in (first, second):
        with lock, lock, pytest.raises(AssertionError, match="a send with an engine lock held"):
            assert_unlocked("a send")  # held twice (reentrant)
        assert_unlocked("a send")  # both levels let go


def test_a_lock_another_thread_holds_is_not_this_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)
    lock = engine_lock()
    taken, done = threading.Event(), threading.Event()
    seen: list[BaseException | None] = []

    def other() -> None:
        with lock:
            taken.set()
            done.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert taken.wait(10)
        assert_unlocked("a send")  # held, but not by this thread
        with lock.__class__():  # an unrelated RLock is not an engine lock
            assert_unlocked("a send")

        def check_in_owner() -> None:
            try:
                with lock:
                    assert_unlocked("a send")
                seen.append(None)
            except AssertionError as exc:
                seen.append(exc)

        done.set()
        t.join(10)
        owner = threading.Thread(target=check_in_owner)
        owner.start()
        owner.join(10)
        assert len(seen) == 1 and isinstance(seen[0], AssertionError)
    finally:
        done.set()
        t.join(10)


def test_assert_unlocked_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", False)
    lock = engine_lock()
    with lock:
        assert_unlocked("a send")
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)
    with lock:  # made while the switch was off: not checked
        assert_unlocked("a send")


def test_a_dropped_lock_leaves_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "DEBUG_LOCKS", True)
    made = [engine_lock() for _ in range(100)]
    ids = {id(lock) for lock in made}
    assert len({id(r()) for r in locks._checked} & ids) == 100
    del made
    gc.collect()
    assert not [r for r in locks._checked if r() is None or id(r()) in ids]
