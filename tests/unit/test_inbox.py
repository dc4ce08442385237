"""Unread notifications and their credits (hixl.engine.inbox): bookkeeping only."""

from __future__ import annotations

from hixl.core.notify import Notification
from hixl.engine.inbox import Inbox


def note(peer: str, i: int = 0) -> Notification:
    return Notification(peer=peer, name=f"n{i}", message=b"")


def test_grant_keeps_every_live_connection_under_the_total() -> None:
    assert Inbox(1024, 16384, 64).grant == 256
    assert Inbox(50, 80, 2).grant == 40
    assert Inbox(10, 5, 64).grant == 1


def test_a_sender_past_its_credits_is_named() -> None:
    inbox = Inbox(3, 100, 1)
    for i in range(3):
        assert inbox.arrive(1, note("a", i)) is None
    problem = inbox.arrive(1, note("a", 3))
    assert problem is not None and "3 of its notifications" in problem and "granted 3" in problem
    assert len(inbox) == 3


def test_credits_go_back_in_quarters_or_when_nothing_is_left() -> None:
    inbox = Inbox(8, 100, 1)  # grant 8: a CREDIT for every 2 taken
    notes = [note("a", i) for i in range(5)]
    for n in notes:
        inbox.arrive(7, n)
    owed = [inbox.take(n) for n in notes[:4]]
    assert owed == [None, (7, 2), None, (7, 2)]
    assert inbox.take(notes[4]) == (7, 1)  # the last one: nothing left unread
    sent: list[tuple[int, int]] = []
    for i in range(3):
        inbox.arrive(7, note("a", i))
    assert len(inbox.take_all(lambda k, c: sent.append((k, c)))) == 3
    assert sent == [(7, 2), (7, 1)]


def test_the_total_charges_the_largest_holder_a_gone_one_first() -> None:
    inbox = Inbox(4, 8, 2)  # grant 4
    for i in range(4):
        inbox.arrive(1, note("a", i))
        inbox.arrive(2, note("b", i))
    inbox.closed(1)
    assert inbox.arrive(3, note("c")) is None
    assert inbox.dropped == 1
    assert [n.peer for n in inbox.notes].count("a") == 3
    of_a = next(n for n in inbox.notes if n.peer == "a")
    assert inbox.take(of_a) is None  # a gone connection is owed nothing


def test_equal_notes_of_two_connections_are_told_apart() -> None:
    inbox = Inbox(4, 8, 2)
    first, second = note("a"), note("a")
    inbox.arrive(1, first)
    inbox.arrive(2, second)
    assert inbox.take(second) == (2, 1)
    assert inbox.held(1) == 1 and inbox.held(2) == 0
