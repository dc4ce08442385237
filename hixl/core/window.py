"""A queue pair's send window: what waits to be posted, what is out, and what completes.

Pure bookkeeping, no verbs: a :class:`SendWindow` holds *chunks* (ranges of a chain of
work requests, one per request or notification) in two queues, the *backlog* (not all
posted) and *sent* (some posted, not all completed), and counts the send-queue slots in
use.  The engine keeps one per connection and uses it under its lock.

Theory of operation
-------------------
* **Ids.** A chunk's WRs form signal groups of ``every``; every WR of group ``g``
  carries ``wr_id = first_id + g`` and the last WR of each group is signaled.  Chunks
  are queued with increasing ids, so the backlog, the send queue and *sent* are all in
  id order.
* **Batches.** :meth:`SendWindow.take_batch` reserves as many WRs as the queue has room
  for, across chunks, as one post.  Every chunk of the batch except the last goes out to
  its end and has its last WR made unsignaled (``chain.unsignal``), so a batch of many small
  transfers costs one completion.  A batch always ends on a signaled WR (a group's or
  a chunk's last): whenever WRs are out, a signaled one is at their end, so completions
  keep coming and free every slot.  This needs a group to fit the queue
  (``every <= depth``; the engine uses at most an eighth of it).
* **Completions.** An RC queue completes in order.  A completion with ``wr_id`` ends
  every chunk sent before the one that owns the id, and that one up to its group
  (:meth:`SendWindow.completed`).  A WR that fails completes under its own id whether it
  was signaled or not, so the chunk that owns the failure is the last one returned.
* **One poster.** A reserved batch is posted outside the engine lock; until
  :meth:`SendWindow.end_batch`, no other batch is taken, so WRs reach the queue in order.
  A blocking single request on an idle window is reserved whole as a batch of its own
  (:meth:`SendWindow.take_solo`) and posted by its caller.
* **Holds.** A chunk marked ``held`` stops every batch before it, with what is queued
  behind it, until its owner clears the mark.  The engine holds a notification while
  work queued before it on its connection's other queue pairs (lanes) is unfinished
  (:attr:`SendWindow.oldest_id`), since lanes complete in any order among themselves.
* **Open chunks.** A chunk with ``regions`` set (the engine's run of single messages in
  a ring of slots) may grow while it is the last chunk queued (:attr:`SendWindow.last`)
  and none of it is taken: its owner appends WRs (``stop``/``groups``, one WR per
  group, only the last signaled when it goes out) and their regions.  The window
  checks those regions instead of the chain's, and signals the last WR of every batch
  that ends in such a chunk (:meth:`Chain.signal`).

``tests/unit/test_window.py`` checks these rules with Hypothesis against real chains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from hixl.errors import ArgumentError, HixlError, RegistrationError

__all__ = ["MAX_BATCHES", "Batch", "Chain", "Chunk", "SendWindow"]

#: Batches one send queue may have out (posted, last WR not completed).  Each ends on a
#: signaled WR, so with the group ends of what is out this bounds the completions a
#: queue can owe its CQ: at most ``depth // every + MAX_BATCHES`` (the engine sizes its
#: send CQ by it).  What is queued meanwhile waits and goes out in the next, larger batch.
MAX_BATCHES = 8


class Chain(Protocol):
    """What the window needs of a chain of WRs (:class:`hixl.verbs.chain.SendChain`)."""

    def check_regions(self) -> None: ...

    def unsignal(self, index: int) -> None: ...

    def signal(self, index: int) -> None: ...


@dataclass(slots=True, eq=False)
class Chunk:
    """WRs ``start .. stop-1`` of ``chain``, in signal groups of ``every``.

    Group ``g`` completes under ``wr_id = first_id + g``.  ``posted``/``done`` count the
    chunk's WRs posted and completed so far.  A ``held`` chunk, and what is queued after
    it, is not posted until its owner clears the flag (the engine holds a notification
    until work queued before it on other queue pairs has completed).  ``handle``,
    ``notify_slot`` and ``built`` belong to the engine (the transfer, a notification
    buffer, the pooled chain).  ``regions``: the memory regions the chunk's WRs use, when
    they are not the chain's (an open chunk, see the module's theory of operation);
    ``ring``: its owner's record of the slots.
    """

    chain: Any
    start: int
    stop: int
    handle: Any
    every: int = 1
    first_id: int = 0
    groups: int = 0
    posted: int = 0
    done: int = 0
    notify_slot: int | None = None
    built: Any = None
    held: bool = False
    regions: list[Any] | None = None
    ring: Any = None

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(slots=True, eq=False)
class Batch:
    """Ranges ``(chain, start, stop)`` posted together, and the chunks all posted with them."""

    pieces: list[tuple[Any, int, int]]
    finished: list[Chunk]


class SendWindow:
    """The backlog, the sent chunks and the slots in use of one send queue."""

    __slots__ = ("_backlog", "_ends", "_sent", "in_flight", "last", "poster")

    def __init__(self) -> None:
        self._backlog: deque[Chunk] = deque()  # not all posted; the head may be partly
        self._sent: deque[Chunk] = deque()  # some WRs posted, not all completed; in order
        self._ends: deque[int] = deque()  # the id of each batch out's last WR, in order
        self.in_flight = 0  # WRs posted (or being posted) and not completed
        self.poster = False  # a batch is out, being posted
        self.last: Chunk | None = None  # the chunk queued last (an open chunk must be it)

    def queue(self, chunks: list[Chunk]) -> None:
        """Add chunks (ids assigned, increasing) at the end of the backlog."""
        self._backlog.extend(chunks)
        if chunks:
            self.last = chunks[-1]

    def queue1(self, chunk: Chunk) -> None:
        """Add one chunk (id assigned, the highest yet) at the end of the backlog."""
        self._backlog.append(chunk)
        self.last = chunk

    @property
    def head(self) -> Chunk | None:
        """The chunk the next batch starts with."""
        return self._backlog[0] if self._backlog else None

    def waiting(self) -> Iterator[Chunk]:
        """The backlog's chunks, oldest first."""
        return iter(self._backlog)

    @property
    def oldest_id(self) -> int | None:
        """The first id of the oldest chunk not yet completed; None when there is none."""
        if self._sent:
            return self._sent[0].first_id
        if self._backlog:
            return self._backlog[0].first_id
        return None

    @property
    def backlog(self) -> bool:
        """True when some chunk still has WRs to post."""
        return bool(self._backlog)

    @property
    def pending(self) -> int:
        """Chunks queued or sent."""
        return len(self._sent) + sum(1 for c in self._backlog if not c.posted)

    def take_batch(self, depth: int) -> Batch | None:
        """Reserve what a send queue of ``depth`` slots has room for; None if nothing fits.

        Sets :attr:`poster` until :meth:`end_batch`; must not be called while it is set.
        The WRs count as posted from here on (a completion may be reaped before the post
        returns).  The batch ends on a signaled WR (the end of a signal group or of a
        chunk), so what is out always raises a completion: where room runs out inside a
        group, the batch stops at the group's start, and when that leaves nothing, None
        is returned until completions free room.  A chunk whose chain's
        ``check_regions`` raises ends the batch before it; when it is the head, the
        error propagates with nothing reserved: that chunk is the culprit.
        """
        if self.poster:
            raise AssertionError("take_batch while a batch is out")
        room = depth - self.in_flight
        if room <= 0 or not self._backlog or len(self._ends) >= MAX_BATCHES:
            return None
        if len(self._backlog) == 1:  # one chunk that fits whole: the common case
            chunk = self._backlog[0]
            if chunk.posted == 0 and chunk.size <= room and not chunk.held:
                _check_regions(chunk)
                if chunk.regions is not None:
                    chunk.chain.signal(chunk.stop - 1)
                self._sent.append(chunk)
                chunk.posted = chunk.size
                self.in_flight += chunk.size
                self._backlog.clear()
                self.poster = True
                self._ends.append(chunk.first_id + chunk.groups - 1)
                return Batch([(chunk.chain, chunk.start, chunk.stop)], [chunk])
        # One pass over the backlog.  A chunk followed by another in the batch went out
        # to its end (room was left), so it is the one made unsignaled when the next is
        # added; the batch's last chunk keeps its signal.
        pieces: list[tuple[Any, int, int]] = []
        finished: list[Chunk] = []
        backlog, sent = self._backlog, self._sent
        prev: Chunk | None = None
        last = backlog[0]  # the chunk of the batch's last piece
        while backlog and room > 0:
            chunk = backlog[0]
            if chunk.held:
                break
            posted = chunk.posted
            if not posted:
                try:
                    _check_regions(chunk)
                except HixlError:
                    if not pieces:
                        raise
                    break
            lo = chunk.start + posted
            hi = chunk.stop
            if hi - lo > room:  # room runs out inside it: stop at its last group's start
                hi = chunk.start + (lo + room - chunk.start) // chunk.every * chunk.every
                if hi <= lo:
                    break
            if prev is not None:
                prev.chain.unsignal(prev.stop - 1)
            pieces.append((chunk.chain, lo, hi))
            last = chunk
            if not posted:
                sent.append(chunk)
            k = hi - lo
            chunk.posted = posted + k
            self.in_flight += k
            room -= k
            if hi != chunk.stop:
                break
            backlog.popleft()
            finished.append(chunk)
            prev = chunk
        if not pieces:
            if self.in_flight == 0 and not backlog[0].held:
                raise ArgumentError(
                    f"a signal group of {backlog[0].every} WRs does not fit a send queue of {depth}"
                )
            return None  # completions of what is out will make room
        self.poster = True
        if last.regions is not None:  # an open chunk's WRs go unsignaled until here
            last.chain.signal(pieces[-1][2] - 1)
        # The last WR ends a group or the chunk: signaled, under its group's id.
        self._ends.append(last.first_id + (pieces[-1][2] - 1 - last.start) // last.every)
        return Batch(pieces, finished)

    def take_solo(self, chunk: Chunk) -> bool:
        """Reserve ``chunk`` (ids assigned, one signal group) as a batch of its own, for
        the caller to post at once; only when the window is idle: nothing queued, nothing
        out and no batch being posted.  False otherwise, with nothing changed (queue it).

        Sets :attr:`poster` until :meth:`end_batch`, as :meth:`take_batch` does; the
        chunk completes through :meth:`completed` like any other.
        """
        if self.poster or self.in_flight or self._backlog:
            return False
        if chunk.groups != 1 or chunk.posted:
            raise ArgumentError(f"take_solo: a chunk of one unposted signal group, not {chunk}")
        chunk.posted = size = chunk.stop - chunk.start
        self._sent.append(chunk)
        self.in_flight = size
        self.poster = True
        self._ends.append(chunk.first_id)
        return True

    def end_batch(self) -> None:
        """The batch's post returned."""
        self.poster = False

    def completed(self, wr_id: int) -> list[tuple[Chunk, bool]]:
        """The chunks a completion under ``wr_id`` ends or advances, oldest first.

        Every chunk sent before the one ``wr_id`` belongs to is complete; the owner is
        complete up to its group (``True`` when that is all of it).  Empty for an id of
        a chunk already forgotten (flushed after a failure, or never sent).
        """
        ends = self._ends
        while ends and ends[0] <= wr_id:
            ends.popleft()
        out: list[tuple[Chunk, bool]] = []
        sent = self._sent
        while sent:
            chunk = sent[0]
            g = wr_id - chunk.first_id
            if g < 0:
                break
            size = chunk.stop - chunk.start  # not the property: this runs per completion
            if g >= chunk.groups:
                if chunk.posted < size:
                    break  # not all posted: the id is not of a later chunk
                self.in_flight -= size - chunk.done
                chunk.done = size
                sent.popleft()
                out.append((chunk, True))
                continue
            upto = min(size, (g + 1) * chunk.every)
            self.in_flight -= upto - chunk.done
            chunk.done = upto
            if upto == size:
                sent.popleft()
                out.append((chunk, True))
            else:
                out.append((chunk, False))
            break
        return out

    def drain(self) -> list[Chunk]:
        """Forget every queued and sent chunk (the queue pair is in ERR or gone)."""
        chunks = list(self._sent) + [c for c in self._backlog if not c.posted]
        self._sent.clear()
        self._backlog.clear()
        self._ends.clear()
        self.in_flight = 0
        self.last = None
        return chunks


def _check_regions(chunk: Chunk) -> None:
    """Refuse a chunk whose memory regions were closed (the chain's, or its own)."""
    if chunk.regions is None:
        chunk.chain.check_regions()
        return
    for region in chunk.regions:
        if region.closed:
            raise RegistrationError(
                f"a queued request refers to a closed memory region {region!r}; it cannot be posted"
            )
