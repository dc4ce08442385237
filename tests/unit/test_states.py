"""The connection state table: every allowed move, every refused one."""

from __future__ import annotations

import itertools

import pytest

from hixl.core.states import TRANSITIONS, ConnEvent, ConnState, next_state
from hixl.errors import StateError

S, E = ConnState, ConnEvent

ALLOWED = {
    (S.CONNECTING, E.ESTABLISHED): S.READY,
    (S.CONNECTING, E.FAIL): S.FAILED,
    (S.CONNECTING, E.CLOSE): S.CLOSED,
    (S.READY, E.FAIL): S.FAILED,
    (S.READY, E.CLOSE): S.CLOSED,
    (S.FAILED, E.FAIL): S.FAILED,
    (S.FAILED, E.CLOSE): S.CLOSED,
    (S.CLOSED, E.FAIL): S.CLOSED,
    (S.CLOSED, E.CLOSE): S.CLOSED,
}
REFUSED = [k for k in itertools.product(S, E) if k not in ALLOWED]


def test_table_is_exactly_the_specified_moves() -> None:
    assert dict(TRANSITIONS) == ALLOWED


@pytest.mark.parametrize(("state", "event"), list(ALLOWED))
def test_allowed(state: ConnState, event: ConnEvent) -> None:
    assert next_state(state, event) is ALLOWED[(state, event)]


@pytest.mark.parametrize(("state", "event"), REFUSED)
def test_refused_names_state_and_event(state: ConnState, event: ConnEvent) -> None:
    with pytest.raises(StateError, match=f"{event.value!r} in state {state.name}"):
        next_state(state, event, "connection to 10.0.0.1:5000")


def test_refused_moves_are_the_ones_that_go_back() -> None:
    # Nothing returns to CONNECTING or leaves CLOSED, and only a handshake makes READY.
    assert sorted((s.name, e.name) for s, e in REFUSED) == [
        ("CLOSED", "ESTABLISHED"),
        ("FAILED", "ESTABLISHED"),
        ("READY", "ESTABLISHED"),
    ]


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        TRANSITIONS[(S.CLOSED, E.ESTABLISHED)] = S.READY  # type: ignore[index]


def test_no_path_leaves_closed() -> None:
    for event in E:
        if (S.CLOSED, event) in TRANSITIONS:
            assert TRANSITIONS[(S.CLOSED, event)] is S.CLOSED
