"""Notifications with hixl's limits over the engine's smaller ones (pure).

hixl allows a ``NotifyDesc`` name and message of up to 1024 bytes each, and
an empty name (hicann/hixl ``src/hixl/engine/hixl_impl.cc``, ``kMaxNotifyLength``).
One engine notification carries a name of 1..256 characters and at most
1024 bytes of name, NUL and message.  A notify that fits goes as one engine
notification under its own name; any other is cut into fragments sent under
the reserved name :data:`FRAGMENT_NAME`, which the receiving compat layer
joins again.  Fragments of one notify travel on one reliable connection, in
order, so they arrive after all data posted before the notify.

Everything received is untrusted: a fragment with a bad header, a count or
size over the limits, or a payload that does not decode is dropped (with a
warning by the caller), and partial notifies are kept in a bounded table.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from hixl.errors import ArgumentError

__all__ = [
    "FRAGMENT_NAME",
    "MAX_NOTIFY_BYTES",
    "Reassembler",
    "check_notify",
    "encode_notify",
]

MAX_NOTIFY_BYTES = 1024  # hixl: name and notify_msg, each, in bytes
FRAGMENT_NAME = "hixl.compat.fragment"
_ENGINE_NAME_CHARS = 256
_ENGINE_SLOT = 1024  # engine: name + NUL + message, bytes
_HEADER = struct.Struct("!IHH")  # notify id, fragment index, fragment count
_LENGTHS = struct.Struct("!HH")  # name bytes, message bytes (start of the joined payload)
_PER_FRAGMENT = _ENGINE_SLOT - len(FRAGMENT_NAME.encode()) - 1 - _HEADER.size
_MAX_FRAGMENTS = -(-(_LENGTHS.size + 2 * MAX_NOTIFY_BYTES) // _PER_FRAGMENT)


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


def encode_notify(notify_id: int, name: bytes, message: bytes) -> list[tuple[str, bytes]]:
    """The engine notifications ``(name, message)`` that carry one hixl notify, in order."""
    text = name.decode("utf-8", "surrogateescape")
    if (
        0 < len(text) <= _ENGINE_NAME_CHARS
        and b"\0" not in name
        and text != FRAGMENT_NAME
        and len(name) + 1 + len(message) <= _ENGINE_SLOT
        and text.isprintable()
    ):
        return [(text, message)]
    payload = _LENGTHS.pack(len(name), len(message)) + name + message
    parts = [payload[i : i + _PER_FRAGMENT] for i in range(0, len(payload), _PER_FRAGMENT)]
    ident = notify_id & 0xFFFFFFFF
    return [
        (FRAGMENT_NAME, _HEADER.pack(ident, i, len(parts)) + part) for i, part in enumerate(parts)
    ]


@dataclass(slots=True)
class _Partial:
    count: int
    parts: dict[int, bytes]


class Reassembler:
    """Joins fragments back into ``(name, message)`` notifies; holds at most ``max_partial``."""

    def __init__(self, max_partial: int = 256) -> None:
        self._partial: OrderedDict[tuple[str, int], _Partial] = OrderedDict()
        self._max = max_partial
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._partial)

    def feed(self, peer: str, message: bytes) -> tuple[str, str] | None:
        """Take one fragment from ``peer``; return the notify it completes, else None.

        Raises :class:`ValueError` (with the reason) for a malformed fragment.
        """
        if len(message) < _HEADER.size:
            raise ValueError(f"fragment of {len(message)} bytes is shorter than its header")
        ident, index, count = _HEADER.unpack_from(message)
        if not 0 < count <= _MAX_FRAGMENTS or index >= count:
            raise ValueError(f"fragment {index} of {count}: at most {_MAX_FRAGMENTS} allowed")
        body = message[_HEADER.size :]
        if len(body) > _PER_FRAGMENT:
            raise ValueError(f"fragment body of {len(body)} bytes, at most {_PER_FRAGMENT}")
        key = (peer, ident)
        partial = self._partial.get(key)
        if partial is None or partial.count != count:
            partial = _Partial(count, {})
            self._partial[key] = partial
            while len(self._partial) > self._max:
                self._partial.popitem(last=False)
                self.dropped += 1
        partial.parts[index] = body
        if len(partial.parts) < count:
            return None
        del self._partial[key]
        payload = b"".join(partial.parts[i] for i in range(count))
        if len(payload) < _LENGTHS.size:
            raise ValueError("joined notify shorter than its length header")
        name_len, msg_len = _LENGTHS.unpack_from(payload)
        if name_len > MAX_NOTIFY_BYTES or msg_len > MAX_NOTIFY_BYTES:
            raise ValueError(f"joined notify claims {name_len}/{msg_len} bytes, limit 1024")
        if _LENGTHS.size + name_len + msg_len != len(payload):
            raise ValueError(
                f"joined notify is {len(payload)} bytes, header says "
                f"{_LENGTHS.size}+{name_len}+{msg_len}"
            )
        start = _LENGTHS.size
        name = payload[start : start + name_len].decode("utf-8", "replace")
        msg = payload[start + name_len :].decode("utf-8", "replace")
        return name, msg
