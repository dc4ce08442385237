"""Notifications on the wire: the one copy of their format and limits.

A notification travels as one RDMA SEND of ``name`` (UTF-8), a NUL byte and the
``message`` bytes, into a receive slot of :data:`SLOT_BYTES` bytes that the target keeps
posted.  Because it is posted on the same RC queue pair right after a transfer's data,
the target sees it only once every byte before it has landed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hixl.errors import ArgumentError

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_MESSAGE_BYTES",
    "SLOT_BYTES",
    "Notification",
    "decode",
    "encode",
]

#: Longest notification name, in characters (Huawei hixl allows 1024).
MAX_NAME_CHARS = 1024
#: One receive slot: the largest name + NUL + message that fits, in bytes.
SLOT_BYTES = 4096
#: Longest message: what is left of a slot after a one-character name and the NUL.
MAX_MESSAGE_BYTES = SLOT_BYTES - 2


@dataclass(frozen=True, slots=True)
class Notification:
    """A notification that arrived from ``peer``: ``name`` and an optional ``message``.

    ``peer`` is the engine id the connection proved in its handshake, never a value the
    notification itself carries.
    """

    peer: str
    name: str
    message: bytes


def encode(name: str, message: bytes = b"") -> bytes:
    """The payload of a notification; :class:`ArgumentError` when it breaks a limit."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or "\0" in name:
        shown = name if not isinstance(name, str) or len(name) <= 80 else name[:80] + "..."
        raise ArgumentError(
            f"notification name must be 1..{MAX_NAME_CHARS} characters without NUL, got {shown!r}"
        )
    if not isinstance(message, bytes | bytearray | memoryview):
        raise ArgumentError(f"notification message must be bytes, not {type(message).__name__}")
    raw = name.encode() + b"\0" + bytes(message)
    if len(raw) > SLOT_BYTES:
        raise ArgumentError(
            f"notification too large: name+NUL+message={len(raw)} bytes, at most {SLOT_BYTES}"
        )
    return raw


def decode(peer: str, raw: bytes) -> Notification | None:
    """The notification in a received slot, or None when it is malformed."""
    name, sep, message = raw.partition(b"\0")
    if not sep or not name:
        return None
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return None
    if len(text) > MAX_NAME_CHARS:
        return None
    return Notification(peer, text, message)
