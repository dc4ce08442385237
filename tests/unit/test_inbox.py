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


def test_departed_peers_are_charged_before_live_ones_whatever_they_hold() -> None:
    """a leaves 4 unread, b holds 4 (the total): c's 4 push out a's 4, not b's, although
    b then holds more than a."""
    inbox = Inbox(4, 8, 2)
    for i in range(4):
        inbox.arrive(1, note("a", i))
    inbox.closed(1)
    for i in range(4):
        inbox.arrive(2, note("b", i))
    for i in range(4):
        assert inbox.arrive(3, note("c", i)) is None
    assert inbox.dropped == 4
    assert sorted(n.peer for n in inbox.notes) == ["b"] * 4 + ["c"] * 4
    assert [n.name for n in inbox.notes if n.peer == "b"] == ["n0", "n1", "n2", "n3"]


def test_among_departed_peers_the_one_holding_the_most_is_charged() -> None:
    inbox = Inbox(4, 8, 2)  # grant 4
    for i in range(4):
        inbox.arrive(1, note("a", i))
    for i in range(2):
        inbox.arrive(2, note("b", i))
    inbox.closed(1)
    inbox.closed(2)
    for i in range(2):
        inbox.arrive(4, note("d", i))
    inbox.arrive(3, note("c"))
    assert [n.name for n in inbox.notes if n.peer == "a"] == ["n1", "n2", "n3"]  # oldest went
    assert len(inbox) == 8 and inbox.held(2) == 2 and inbox.held(4) == 2


def test_live_peers_are_charged_the_largest_first_when_no_departed_one_holds_any() -> None:
    inbox = Inbox(10, 5, 64)  # grant 1: 64 live connections can hold more than 5
    for key in range(5):
        inbox.arrive(key, note(f"p{key}"))
    inbox.take(inbox.notes[0])  # p0 took its one back
    inbox.arrive(0, note("p0"))
    assert inbox.arrive(9, note("p9")) is None
    assert inbox.dropped == 1 and len(inbox) == 5


def test_equal_notes_of_two_connections_are_told_apart() -> None:
    inbox = Inbox(4, 8, 2)
    first, second = note("a"), note("a")
    inbox.arrive(1, first)
    inbox.arrive(2, second)
    assert inbox.take(second) == (2, 1)
    assert inbox.held(1) == 1 and inbox.held(2) == 0
