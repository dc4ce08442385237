"""The posting hand-over: when a caller's queued lane reaches the progress thread."""

from __future__ import annotations

import threading
import time
from typing import Any

from hixl.engine.posting import Poster


class Waker:
    """The progress thread as a poster sees it: asleep, counting wake-ups."""

    sleeping = True

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1


class SendCQ:
    def poll_rows(self, n: int) -> list[tuple[int, int, int, int]]:
        return []


class Window:
    poster = False
    backlog = False  # nothing to reserve: start_post returns None


class FakeLane:
    def __init__(self, qpn: int) -> None:
        self.qpn = qpn
        self.window = Window()
        self.ring = None


def Lane(qpn: int) -> Any:  # noqa: N802 - stands in for the engine's Lane
    return FakeLane(qpn)


def poster() -> tuple[Poster, Waker]:
    p = Poster(threading.RLock(), 64, planner=None, host=None)  # type: ignore[arg-type]
    waker = Waker()
    p.attach(waker, SendCQ(), lambda rows: 0)
    return p, waker


def hand_over(p: Poster, lane: Any) -> None:
    with p._lock:
        p.want_post(lane)
    p.wake_if_due()


def test_a_hand_over_after_a_waiter_took_the_last_lane_wakes_the_progress_thread() -> None:
    """A waiter that posts the lane handed to the sleeping progress thread leaves the
    next hand-over a wake-up of its own (it used to be swallowed: the progress thread
    then slept until its next timeout while the lane waited)."""
    p, waker = poster()
    lane = Lane(7)
    hand_over(p, lane)
    assert waker.wakes == 1
    assert p.reap_inline(time.monotonic())  # the waiter takes lane 7 off the list
    assert not p.to_post
    hand_over(p, lane)
    assert waker.wakes == 2
    assert p.to_post == {7: lane}


def test_one_wake_up_covers_lanes_handed_over_before_the_thread_runs() -> None:
    p, waker = poster()
    hand_over(p, Lane(7))
    hand_over(p, Lane(8))
    assert waker.wakes == 1
    assert sorted(p.to_post) == [7, 8]


def test_the_wake_up_goes_out_before_the_callers_own_post() -> None:
    """After queueing a transfer over two lanes, the caller wakes the progress thread for
    the second before it posts the first (a post on rxe does the sending, and the two
    posts then run at once)."""
    p, waker = poster()
    order: list[str] = []
    waker.wake = lambda: order.append("wake")  # type: ignore[method-assign]
    p.post = lambda lane, batch: order.append("post")  # type: ignore[method-assign]
    with p._lock:
        p.want_post(Lane(8))
    p.post_or_wake(Lane(7), object())  # type: ignore[arg-type]
    assert order == ["wake", "post"]
