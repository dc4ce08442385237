"""Notifications with hixl's limits, carried by engine notifications (pure).

hixl allows a ``NotifyDesc`` name and message of up to 1024 bytes each, and
an empty name (hicann/hixl ``src/hixl/engine/hixl_impl.cc``, ``kMaxNotifyLength``).
An engine notification carries a non-empty, printable name without NUL and
up to :data:`hixl.core.notify.SLOT_BYTES` bytes in all.  A notify whose name
the engine can carry goes as one engine notification under that name.  Any
other (an empty name, a name that is not printable UTF-8, or the reserved
name itself) goes in an *envelope*: one engine notification named
:data:`ENVELOPE_NAME` whose message holds both lengths, the name and the
message.  The receiving compat layer opens it again.  Either way a notify is
one engine notification, so it arrives after all data posted before it.

Everything received is untrusted: an envelope with a bad header, lengths over
the limits or a size that does not add up is refused with :class:`ValueError`.
"""

from __future__ import annotations

import struct

from hixl.core.notify import MAX_NAME_CHARS, SLOT_BYTES
from hixl.errors import ArgumentError

__all__ = ["ENVELOPE_NAME", "MAX_NOTIFY_BYTES", "check_notify", "encode_notify", "open_envelope"]

MAX_NOTIFY_BYTES = 1024  # hixl: name and notify_msg, each, in bytes
ENVELOPE_NAME = "hixl.compat.notify"
_LENGTHS = struct.Struct("!HH")  # name bytes, message bytes

# The largest envelope must fit one engine notification.
assert len(ENVELOPE_NAME) + 1 + _LENGTHS.size + 2 * MAX_NOTIFY_BYTES <= SLOT_BYTES


def check_notify(notify: object) -> tuple[bytes, bytes]:
    """``(name, message)`` of a ``NotifyDesc`` as UTF-8, checked against hixl's limits.

    Raises :class:`ArgumentError` naming the sizes when either is over 1024
    bytes or the object is not a NotifyDesc-like value with str fields.
    """
    name = getattr(notify, "name", None)
    msg = getattr(notify, "notify_msg", None)
    if not isinstance(name, str) or not isinstance(msg, str):
        raise ArgumentError(f"notify must be a NotifyDesc with str name and notify_msg: {notify!r}")
    raw_name = name.encode("utf-8", "surrogateescape")
    raw_msg = msg.encode("utf-8", "surrogateescape")
    if len(raw_name) > MAX_NOTIFY_BYTES or len(raw_msg) > MAX_NOTIFY_BYTES:
        raise ArgumentError(
            f"notify name/notify_msg are {len(raw_name)}/{len(raw_msg)} bytes, "
            f"at most {MAX_NOTIFY_BYTES} each"
        )
    return raw_name, raw_msg


def encode_notify(name: bytes, message: bytes) -> tuple[str, bytes]:
    """The engine notification ``(name, message)`` that carries one hixl notify."""
    text = name.decode("utf-8", "surrogateescape")
    if (
        0 < len(text) <= MAX_NAME_CHARS
        and text != ENVELOPE_NAME
        and text.isprintable()
        and len(name) + 1 + len(message) <= SLOT_BYTES
    ):
        return text, message
    return ENVELOPE_NAME, _LENGTHS.pack(len(name), len(message)) + name + message


def open_envelope(message: bytes) -> tuple[str, str]:
    """``(name, notify_msg)`` from an envelope's message; :class:`ValueError` if malformed."""
    if len(message) < _LENGTHS.size:
        raise ValueError(f"envelope of {len(message)} bytes is shorter than its header")
    name_len, msg_len = _LENGTHS.unpack_from(message)
    if name_len > MAX_NOTIFY_BYTES or msg_len > MAX_NOTIFY_BYTES:
        raise ValueError(f"envelope claims {name_len}/{msg_len} bytes, limit 1024 each")
    if _LENGTHS.size + name_len + msg_len != len(message):
        raise ValueError(
            f"envelope is {len(message)} bytes, header says {_LENGTHS.size}+{name_len}+{msg_len}"
        )
    start = _LENGTHS.size
    name = message[start : start + name_len].decode("utf-8", "replace")
    msg = message[start + name_len :].decode("utf-8", "replace")
    return name, msg
