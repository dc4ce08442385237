"""Routing requests to decode workers found in the registry, and exactly-once bookkeeping.

Pure: no engine, no clock, no threads. A prefill worker keeps a :class:`Ledger` of its
requests and asks :func:`choose` for a decode worker per request, given the registry's live
view (:meth:`hixl.registry.Watch.members`).

* :func:`choose` picks the live worker of the wanted role with the most free capacity,
  counting the requests this router already has in flight there (the announced capacity
  lags), skipping workers it saw fail; ties go to the lowest name, so the choice is
  deterministic.
* :class:`Ledger` gives each request attempts: ``assign`` starts one on a worker,
  ``complete`` accepts the result of the *current* attempt only (a late answer from an
  attempt that was already given up is refused, so nothing completes twice), and
  ``fail`` / ``worker_lost`` put a request back in the queue to run again elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hixl.core.directory import Announcement

__all__ = ["choose", "Ledger", "Attempt"]


def choose(
    members: Mapping[str, Announcement],
    *,
    role: str = "decode",
    inflight: Mapping[str, int] | None = None,
    exclude: Iterable[str] = (),
) -> str | None:
    """The name of the least loaded live worker of ``role``, or None if there is none.

    Load is judged by free capacity: the announced ``capacity`` minus ``inflight[name]``.
    Workers in ``exclude`` and workers with no free capacity left are not chosen.
    """
    skip = set(exclude)
    busy = inflight or {}
    best: tuple[int, str] | None = None
    for name, ann in members.items():
        if ann.role != role or name in skip:
            continue
        free = ann.capacity - busy.get(name, 0)
        if free <= 0:
            continue
        key = (-free, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a request on a worker."""

    request: int
    number: int
    worker: str


class Ledger:
    """The state of every request of a stream: pending, running (one attempt), or done.

    Invariants (tested with Hypothesis): a request is in exactly one state; it completes at
    most once, and only through its current attempt; ``inflight()`` counts running
    attempts per worker.
    """

    def __init__(self, requests: Iterable[int]) -> None:
        self._pending: OrderedDict[int, None] = OrderedDict((r, None) for r in requests)
        self._running: dict[int, Attempt] = {}
        self._done: dict[int, Attempt] = {}
        self._attempts: dict[int, int] = {}
        self.retries = 0

    def __repr__(self) -> str:
        return (
            f"<Ledger pending={len(self._pending)} running={len(self._running)} "
            f"done={len(self._done)} retries={self.retries}>"
        )

    @property
    def finished(self) -> bool:
        return not self._pending and not self._running

    def next_pending(self) -> int | None:
        """The oldest request waiting for a worker."""
        return next(iter(self._pending), None)

    def assign(self, request: int, worker: str) -> Attempt:
        """Start the next attempt of a pending ``request`` on ``worker``."""
        if request not in self._pending:
            raise ValueError(f"request {request} is not pending")
        del self._pending[request]
        number = self._attempts.get(request, 0) + 1
        self._attempts[request] = number
        attempt = Attempt(request, number, worker)
        self._running[request] = attempt
        return attempt

    def complete(self, attempt: Attempt) -> bool:
        """Record ``attempt`` as the request's result; False (and no change) if it is not
        the request's current attempt (given up already, or the request is done)."""
        if self._running.get(attempt.request) != attempt:
            return False
        del self._running[attempt.request]
        self._done[attempt.request] = attempt
        return True

    def fail(self, attempt: Attempt, *, count: bool = True) -> bool:
        """Give up ``attempt``; the request waits for another worker. False if stale.

        ``count=False`` for an attempt that never reached a worker (no slot free, registry
        unreachable): it is not counted in :attr:`retries`."""
        if self._running.get(attempt.request) != attempt:
            return False
        del self._running[attempt.request]
        self._pending[attempt.request] = None
        self._pending.move_to_end(attempt.request, last=False)  # re-run it first
        if count:
            self.retries += 1
        return True

    def worker_lost(self, worker: str) -> list[int]:
        """Give up every running attempt on ``worker``; returns the requests put back."""
        lost = [a for a in self._running.values() if a.worker == worker]
        for a in lost:
            self.fail(a)
        return [a.request for a in lost]

    def inflight(self) -> dict[str, int]:
        """Running attempts per worker."""
        out: dict[str, int] = {}
        for a in self._running.values():
            out[a.worker] = out.get(a.worker, 0) + 1
        return out

    def done(self) -> dict[int, Attempt]:
        """Completed requests and the attempt that completed each."""
        return dict(self._done)

    def running(self) -> list[Attempt]:
        return list(self._running.values())
