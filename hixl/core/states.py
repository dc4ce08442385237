"""The life of a connection, as one transition table.

A connection starts CONNECTING (handshake under way), becomes READY when the handshake
completes, and ends FAILED (a completion error, a lost peer, a deadline: its queue pair is
flushed and its transfers fail) or CLOSED (disconnected and forgotten).  Nothing goes back.
Every legal move is a row of :data:`TRANSITIONS`; anything else is a :class:`StateError`
naming the state and the event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from hixl.errors import StateError

__all__ = ["ConnEvent", "ConnState", "TRANSITIONS", "next_state"]


class ConnState(enum.Enum):
    """Life of a connection; the moves between states are in :data:`TRANSITIONS`."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class ConnEvent(enum.Enum):
    """What can happen to a connection."""

    ESTABLISHED = "established"  # the handshake completed and the queue pair is at RTS
    FAIL = "fail"  # a completion error, a lost peer, a deadline, a goodbye
    CLOSE = "close"  # disconnect() or Engine.close(): forget the connection


_S, _E = ConnState, ConnEvent

#: (state, event) -> next state.  Failing twice or closing twice is allowed (idempotent);
#: a closed connection stays closed whatever happens to it afterwards.
TRANSITIONS: Mapping[tuple[ConnState, ConnEvent], ConnState] = MappingProxyType(
    {
        (_S.CONNECTING, _E.ESTABLISHED): _S.READY,
        (_S.CONNECTING, _E.FAIL): _S.FAILED,
        (_S.CONNECTING, _E.CLOSE): _S.CLOSED,
        (_S.READY, _E.FAIL): _S.FAILED,
        (_S.READY, _E.CLOSE): _S.CLOSED,
        (_S.FAILED, _E.FAIL): _S.FAILED,
        (_S.FAILED, _E.CLOSE): _S.CLOSED,
        (_S.CLOSED, _E.FAIL): _S.CLOSED,
        (_S.CLOSED, _E.CLOSE): _S.CLOSED,
    }
)


def next_state(state: ConnState, event: ConnEvent, what: str = "connection") -> ConnState:
    """The state after ``event`` in ``state``; :class:`StateError` if the move is illegal."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise StateError(
            f"{what}: illegal transition {event.value!r} in state {state.name}"
        ) from None
