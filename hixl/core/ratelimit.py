"""A token bucket over up to three quantities (bytes, messages, seconds of work),
sans-I/O: the caller passes the clock. Used to bound what one peer's control messages
may cost per second."""

from __future__ import annotations

import math

__all__ = ["Budget"]


class Budget:
    """``bytes_per_s``, ``msgs_per_s`` and ``work_per_s``, each with a burst of one
    second's worth.

    ``work_per_s`` is a share of one thread: the seconds of processing (CPU time of the
    thread that handles the messages) the sender may cost per second; ``math.inf`` (the
    default) leaves work unbounded.  Unlike bytes and messages it holds on any host: on a
    slower one each message costs more and fewer are taken.

    :meth:`charge` takes what was used (the balance may go negative: what arrived has
    arrived) and returns how long to wait, in seconds, until every balance is back to
    zero or above: 0.0 when the sender is within its rate.
    """

    __slots__ = ("_at", "_bytes", "_msgs", "_work", "bytes_per_s", "msgs_per_s", "work_per_s")

    def __init__(
        self, bytes_per_s: float, msgs_per_s: float, now: float, work_per_s: float = math.inf
    ) -> None:
        if bytes_per_s <= 0 or msgs_per_s <= 0 or work_per_s <= 0:
            raise ValueError(f"rates must be > 0, got {bytes_per_s}, {msgs_per_s}, {work_per_s}")
        self.bytes_per_s = bytes_per_s
        self.msgs_per_s = msgs_per_s
        self.work_per_s = work_per_s
        self._bytes = float(bytes_per_s)
        self._msgs = float(msgs_per_s)
        self._work = float(work_per_s)
        self._at = now

    def __repr__(self) -> str:
        return (
            f"<Budget bytes={self._bytes:.0f}/{self.bytes_per_s} msgs={self._msgs:.0f}"
            f"/{self.msgs_per_s} work={self._work:.4f}/{self.work_per_s} s>"
        )

    def charge(self, nbytes: int, msgs: int, now: float, work: float = 0.0) -> float:
        """Take ``nbytes``, ``msgs`` and ``work`` seconds at ``now``; seconds until every
        balance is back."""
        elapsed = max(0.0, now - self._at)
        self._at = now
        self._bytes = min(self.bytes_per_s, self._bytes + elapsed * self.bytes_per_s) - nbytes
        self._msgs = min(self.msgs_per_s, self._msgs + elapsed * self.msgs_per_s) - msgs
        wait = max(0.0, -self._bytes / self.bytes_per_s, -self._msgs / self.msgs_per_s)
        if self.work_per_s == math.inf:
            return wait
        self._work = min(self.work_per_s, self._work + elapsed * self.work_per_s) - work
        return max(wait, -self._work / self.work_per_s)
