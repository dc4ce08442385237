"""Transfer requests and the handles that track them."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hixl.core.descriptors import Descriptor
from hixl.core.wire import RemoteRegion
from hixl.errors import ArgumentError, HixlError, TransferTimeout

if TYPE_CHECKING:
    from hixl.engine.regions import Region

__all__ = ["GroupHandle", "MemberHandle", "TransferHandle", "TransferRequest", "TransferStatus"]

#: Longest a waiter reaps completions itself before it sleeps until the progress thread
#: finishes its transfer (it stops sooner when the engine says spinning does not pay).
SPIN_S = 0.002
#: A spinning waiter reads the clock once in this many rounds.
SPIN_CLOCK_EVERY = 4

# Two waiters of one handle make one Event between them.  Innermost lock, never held
# while taking another.  Handles are finished under the engine lock.
_handle_lock = threading.Lock()


class TransferStatus(enum.Enum):
    """Life of a transfer: PENDING, then DONE or FAILED, never back."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


# The members as plain globals for the per-message checks: reading an Enum member off its
# class costs about three times a global's lookup.
_PENDING = TransferStatus.PENDING
_DONE = TransferStatus.DONE


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRequest:
    """One piece of a batch: move ``local_desc`` of ``local`` to/from ``remote_desc`` of ``remote``.

    ``op`` is ``"write"`` (put: local -> remote) or ``"read"`` (get: remote ->
    local).  ``remote`` is a :class:`RemoteRegion` from the connection or the
    name the peer registered it under.  A missing descriptor means the whole
    region, or as many bytes as the other side describes.
    """

    op: str
    local: Region
    remote: RemoteRegion | str
    local_desc: Descriptor | None = None
    remote_desc: Descriptor | None = None


class TransferHandle:
    """An asynchronous transfer: poll :meth:`done` / :attr:`status`, or :meth:`wait`."""

    __slots__ = (
        "_error",
        "_event",
        "_reap",
        "_status",
        "chunks_left",
        "deadline",
        "nbytes",
        "num_wrs",
        "peer",
    )

    def __init__(
        self,
        peer: str,
        nbytes: int,
        num_wrs: int,
        deadline: float,
        reap: Callable[[float], bool] | None = None,
    ) -> None:
        self.peer = peer
        self._reap = reap  # the engine's own completion reaping, for waiters to drive
        self.nbytes = nbytes
        self.num_wrs = num_wrs
        self.deadline = deadline
        self._status = TransferStatus.PENDING
        self._error: HixlError | None = None
        self._event: threading.Event | None = None  # made by the first wait() that sleeps
        self.chunks_left = 0  # engine bookkeeping, under the engine lock

    @property
    def status(self) -> TransferStatus:
        return self._status

    @property
    def error(self) -> HixlError | None:
        """The error that failed the transfer, or None."""
        return self._error

    def done(self) -> bool:
        """True once the transfer finished, successfully or not.

        While the transfer is pending, each call also drives the engine on the calling
        thread, as :meth:`wait` does before it sleeps: it posts what waits for the
        progress thread and reaps send completions, skipping both when the engine is
        busy on another thread.  So a thread that polls ``done()`` while it runs Python
        sees its transfer finish without waiting for the progress thread to get the GIL.
        """
        if self._status is not _PENDING:
            return True
        reap = self._reap
        if reap is not None:
            reap(time.monotonic())
        return self._status is not TransferStatus.PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer finishes; raise its error if it failed.

        ``timeout`` (seconds) bounds this wait only; when it passes first this
        raises :class:`TransferTimeout` and the transfer goes on.  The transfer
        has its own deadline, after which it fails on its own.
        """
        if self._status is not TransferStatus.PENDING:  # final: _error was set before it
            if self._error is not None:
                raise self._error
            return
        reap = self._reap
        if reap is not None:
            # Reap completions on this thread for a moment before sleeping: a short
            # transfer then ends without waking the progress thread and this one in turn.
            # One clock reading per SPIN_CLOCK_EVERY rounds, handed to the engine too (in
            # a VM without a usable TSC each reading is a system call).
            now = time.monotonic()
            spin_until = now + (SPIN_S if timeout is None else min(SPIN_S, timeout))
            rounds = 0
            while self._status is TransferStatus.PENDING and now < spin_until:
                if not reap(now):
                    break  # the engine says spinning does not pay now
                rounds += 1
                if not rounds % SPIN_CLOCK_EVERY:  # a round that finds the lock taken is short
                    now = time.monotonic()
            if self._status is TransferStatus.PENDING:
                reap(0.0)  # about to sleep: the progress thread takes over
        event = None
        if self._status is TransferStatus.PENDING:  # most are done by now: no Event for them
            with _handle_lock:  # two waiters make one Event
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            # finish() sets the status, then reads _event: either it saw this Event and
            # sets it, or the status already reads final here (the GIL orders the two).
            if self._status is not TransferStatus.PENDING:
                event = None
        if event is not None:
            # One second of grace past the deadline, for the progress thread to fail it.
            own_limit = self.deadline - time.monotonic() + 1.0
            limit = own_limit if timeout is None else min(own_limit, timeout)
            if not event.wait(max(0.0, limit)):
                waited = "past its deadline" if limit == own_limit else f"after {timeout} s"
                raise TransferTimeout(
                    f"transfer to {self.peer} still pending {waited} "
                    f"({self.nbytes} bytes, {self.num_wrs} work requests)"
                )
        if self._error is not None:
            raise self._error

    def finish(self, error: HixlError | None) -> None:
        """Engine side, under the engine lock: end the transfer (first call wins) and
        wake its waiter."""
        if self._status is not TransferStatus.PENDING:
            return
        self._error = error  # before the status: a reader that sees it final sees this
        self._status = TransferStatus.DONE if error is None else TransferStatus.FAILED
        event = self._event
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        return (
            f"<TransferHandle peer={self.peer} nbytes={self.nbytes} "
            f"wrs={self.num_wrs} status={self._status.value}>"
        )


class GroupHandle(TransferHandle):
    """Engine side: the single messages queued on one queue pair as one open chunk.

    The engine tracks the group as one transfer (one deadline, the earliest of its
    members', one completion); each message's caller holds a :class:`MemberHandle`
    that reads the group.  When one of the group's WRs completes in error, ``fail_at``
    is its index in the group: the members before it completed (a queue pair completes
    in order), that member gets the completion's error and the later ones ``rest``
    (set before the group finishes, so a woken waiter sees it).
    """

    __slots__ = ("fail_at", "rest", "timeout")

    def __init__(
        self,
        peer: str,
        deadline: float,
        reap: Callable[[float], bool] | None,
        timeout: float = float("inf"),
    ) -> None:
        super().__init__(peer, 0, 0, deadline, reap)
        self.fail_at: int | None = None
        self.rest: HixlError | None = None
        self.timeout = timeout  # the shortest timeout of a member (engine, under its lock)


class MemberHandle(TransferHandle):
    """The handle of one single message that went into a :class:`GroupHandle`.

    A :class:`TransferHandle` to its caller: it is done when its group is, and its
    outcome is the group's, except after a completion error in the group (see there).
    """

    __slots__ = ("_group", "_index")

    def __init__(self, group: GroupHandle, index: int, nbytes: int) -> None:
        # The base's own state is never used: every reader goes to the group.
        self._group = group
        self._index = index
        self.nbytes = nbytes

    @property
    def peer(self) -> str:  # type: ignore[override]
        return self._group.peer

    @property
    def num_wrs(self) -> int:  # type: ignore[override]
        return 1

    @property
    def deadline(self) -> float:  # type: ignore[override]
        return self._group.deadline

    @property
    def status(self) -> TransferStatus:
        g = self._group
        status = g._status
        if status is TransferStatus.FAILED and g.fail_at is not None and self._index < g.fail_at:
            return TransferStatus.DONE
        return status

    @property
    def error(self) -> HixlError | None:
        g = self._group
        if g.fail_at is not None:
            if self._index < g.fail_at:
                return None
            if self._index > g.fail_at and g.rest is not None:
                return g.rest
        return g._error

    def done(self) -> bool:
        """As :meth:`TransferHandle.done`."""
        return self._group.done()

    def wait(self, timeout: float | None = None) -> None:
        """As :meth:`TransferHandle.wait`."""
        g = self._group
        if g._status is _DONE:
            return
        try:
            g.wait(timeout)
        except HixlError:
            if g._status is TransferStatus.PENDING:
                raise  # this wait's own timeout
        err = self.error
        if err is not None:
            raise err

    def finish(self, error: HixlError | None) -> None:
        raise ArgumentError("a member's outcome is its group's")  # engine bug if reached

    def __repr__(self) -> str:
        return (
            f"<TransferHandle peer={self.peer} nbytes={self.nbytes} "
            f"wrs=1 status={self.status.value}>"
        )
