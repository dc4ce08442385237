"""Notifications received and not taken yet, and the credits that bound them.

Flow control
------------
A receiver grants each connection ``grant`` credits (``Inbox.grant``:
``min(max_notifications_per_peer, max_notifications // max_peers)``, at least 1): the
sender may have that many notifications sent and not yet taken by the receiving
application. The first grant is a CREDIT control message right after the handshake;
every notification the application takes gives a credit back, returned in CREDIT
messages of at least a quarter of the grant (or at once when that connection has nothing
left unread). A sender out of credits waits for one, within its transfer's deadline, and
then fails that call alone with :class:`~hixl.errors.TransferTimeout` naming the backlog;
its connection stays up. So a slow reader slows its senders down and fails nobody.

A sender that sends beyond its credits breaks the protocol: :meth:`Inbox.arrive` says so
and the engine fails that connection (``ERROR(OVERFLOW)``). Grants add up to at most
``max_notifications`` over ``max_peers`` live connections, but notifications of peers that
left stay readable (a peer may notify and close at once), so the total can still reach
``max_notifications``: then the departed peer holding the most unread notifications loses
its oldest one, counted in :attr:`Inbox.dropped`. Live connections' notes are charged only
when no departed one's are left (which needs more live connections than
``max_notifications``, each granted 1): a live peer sending within its credits keeps
what it sent whatever departed peers left behind.

Everything here runs under the engine lock; nothing here does I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hixl.core.notify import Notification

__all__ = ["Inbox"]


class Inbox:
    """The unread notifications of one engine, by connection (``key``: an int per
    connection, see ``Connection.note_key``)."""

    __slots__ = ("_gone", "_held", "_origin", "_owed", "dropped", "grant", "notes", "total")

    def __init__(self, per_peer: int, total: int, max_peers: int) -> None:
        self.grant = max(1, min(per_peer, total // max_peers))
        self.total = total
        self.notes: deque[Notification] = deque()
        self._origin: dict[int, int] = {}  # id(note) -> key of the connection it came on
        self._held: dict[int, int] = {}  # key -> notes not taken
        self._owed: dict[int, int] = {}  # key -> credits taken back and not yet returned
        self._gone: set[int] = set()  # keys of connections that closed with notes unread
        self.dropped = 0  # notes dropped to keep ``total`` (the holder of the most's)

    def __len__(self) -> int:
        return len(self.notes)

    def held(self, key: int) -> int:
        return self._held.get(key, 0)

    def arrive(self, key: int, note: Notification) -> str | None:
        """Keep ``note``; or, when its connection has no credit left, return why (the
        caller fails that connection) and keep nothing."""
        held = self._held.get(key, 0)
        if held >= self.grant:
            return (
                f"{note.peer} sent a notification beyond its credits: {held} of its "
                f"notifications are not taken yet and it was granted {self.grant}"
            )
        if len(self.notes) >= self.total:
            self._charge()
        self.notes.append(note)
        self._origin[id(note)] = key
        self._held[key] = self._held.get(key, 0) + 1
        return None

    def _charge(self) -> None:
        """Drop the oldest note of the departed connection holding the most; when none
        is left unread, of the live connection holding the most."""
        held = self._held
        hog = max(held, key=lambda k: (k in self._gone, held[k]))
        for i, note in enumerate(self.notes):
            if self._origin.get(id(note)) == hog:
                del self.notes[i]
                self._took(note)
                self.dropped += 1
                return

    def take(self, note: Notification) -> tuple[int, int] | None:
        """Remove ``note`` (one of :attr:`notes`); ``(key, credits)`` when its connection
        is owed a CREDIT message now."""
        for i, queued in enumerate(self.notes):
            if queued is note:  # by identity: equal notes may come from two connections
                del self.notes[i]
                break
        else:
            raise ValueError("not an unread notification of this inbox")
        return self._took(note)

    def take_all(self, send: Callable[[int, int], None]) -> list[Notification]:
        """Remove and return every note, calling ``send(key, credits)`` for each CREDIT
        owed now."""
        out = list(self.notes)
        self.notes.clear()
        for note in out:
            owed = self._took(note)
            if owed is not None:
                send(*owed)
        return out

    def _took(self, note: Notification) -> tuple[int, int] | None:
        key = self._origin.pop(id(note))
        held = self._held[key] - 1
        if held:
            self._held[key] = held
        else:
            del self._held[key]
        if key in self._gone:
            if not held:
                self._gone.discard(key)
            return None
        owed = self._owed.get(key, 0) + 1
        if owed >= max(1, self.grant // 4) or not held:
            self._owed.pop(key, None)
            return key, owed
        self._owed[key] = owed
        return None

    def closed(self, key: int) -> None:
        """The connection ``key`` is gone: no more credits for it; its notes stay
        readable, first in line to be dropped (see the module doc)."""
        self._owed.pop(key, None)
        if key in self._held:
            self._gone.add(key)

    def clear(self) -> None:
        self.notes.clear()
        self._origin.clear()
        self._held.clear()
        self._owed.clear()
        self._gone.clear()
