"""The control-channel wire format: the versioned handshake and the messages after it.

This module is pure: no sockets, no clock, no pyverbs. It turns message values into bytes
(:func:`encode`) and bytes from the network into message values (:class:`Decoder`, sans-I/O
in the style of h11). Everything a peer sends is untrusted: a frame is checked field by field,
and anything malformed raises :class:`~hixl.errors.HandshakeError` (never ``KeyError``,
``TypeError``, ``UnicodeError``, ``RecursionError``...), with the field and value named.
The message values and the checks on their fields are in :mod:`hixl.core.messages`;
every public name there can be imported from this module too.

Frames
------
Every message is one frame: a 12-byte header ``struct "!4sHHI"`` = (``MAGIC`` ``b"HIXL"``,
protocol version, :class:`MsgType`, payload length in bytes), then the payload, a UTF-8 JSON
object of exactly the keys listed below (no key missing, none extra, no key twice). Integers
are JSON integers (``true``/``false`` and floats are refused), bytes are lowercase hex
strings. The length is checked against the decoder's ``max_payload`` (default
:data:`MAX_PAYLOAD`, 1 MiB) from the header, before any of the payload is buffered.

==========  ==========================================================================
type        payload keys
==========  ==========================================================================
HELLO       ``engine_id``, ``nonce`` (16 bytes)
CHALLENGE   ``engine_id``, ``nonce`` (16 bytes)
INFO        ``proof``, ``qpn``, ``psn``, ``gid``, ``mtu``, ``max_sge``, ``recv_slots``,
            ``recv_slot_size``, ``regions`` (list of region objects), ``lanes``
            (hex; 6 bytes per extra queue pair: QP number and PSN, 3 bytes each),
            ``direct`` (1: the last extra queue pair is the sender's direct lane)
ACCEPT      same keys as INFO
READY       none (``{}``)
REGIONS     ``add``, ``remove`` (lists of region objects)
ERROR       ``code`` (one of :class:`ErrorCode`), ``message``
BYE         ``reason``
PING        ``nonce`` (16 bytes)
PONG        ``nonce`` (16 bytes)
CREDIT      ``notes`` (1..2**31: notifications the receiver lets the sender add)
SEALED      binary, not JSON: ``seq`` (u64, big-endian), ``mac`` (32 bytes), then one
            whole frame of another type (see :mod:`hixl.core.seal`)
==========  ==========================================================================

A region object has the keys ``addr``, ``length``, ``rkey``, ``access``, ``name``
(see :class:`RemoteRegion`). Type 9 (NOTIFY, a TCP notification of version 1) is retired:
notifications travel only as RDMA SENDs, and a frame of type 9 is refused as unknown.

Protocol
--------
The handshake (HELLO, CHALLENGE, INFO, ACCEPT, READY) and its proofs are described and
driven by :mod:`hixl.core.handshake`: the client proves first, and with a token the
proofs cover every field of every handshake message. Version 2 changed the handshake
(no proof in CHALLENGE, a real one in ACCEPT), REGIONS (deltas) and added PING/PONG.

Afterwards every message is carried inside a SEALED frame: a sequence number and a MAC
under a key of this connection's (see :mod:`hixl.core.seal`); a frame that is not sealed,
or whose MAC or number is wrong, fails the connection. Inside, the connection carries,
in either direction, REGIONS (regions the
sender has started or stopped exposing since its last message: ``remove`` applies first,
then ``add``), PING (answered by a PONG with the same nonce: a liveness probe), CREDIT (the
sender may send that many more notifications: see :mod:`hixl.engine.inbox`), ERROR and
BYE. Either side may answer a message it cannot accept with ERROR and close:
``VERSION`` (another protocol version), ``MALFORMED`` (a bad frame), ``AUTH`` (a proof
that does not match), ``ALREADY_CONNECTED`` (a live connection holds the claimed id),
``BUSY`` (too many handshakes at once: try again), ``LIMIT`` (a configured limit such as
``max_peers``), ``TIMEOUT`` (a handshake step came too late), ``OVERFLOW`` (the sender
filled a bounded queue, such as unread notifications), ``INTEGRITY`` (a control message
failed its MAC or sequence check) or ``INTERNAL``.
:attr:`Decoder.error_code` says which code fits a decoding failure.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from hixl.core.checks import shown
from hixl.core.messages import (
    _CLASSES,
    _U32_MAX,
    ERROR_CODES,
    HEADER,
    HEADER_SIZE,
    LANE_BYTES,
    MAX_LANES,
    MAX_REGIONS,
    NONCE_SIZE,
    PROOF_SIZE,
    REMOTE_READ,
    REMOTE_WRITE,
    Accept,
    Bye,
    Challenge,
    Credit,
    Error,
    ErrorCode,
    Hello,
    Info,
    Message,
    MsgType,
    Ping,
    Pong,
    QpInfo,
    Ready,
    Regions,
    RemoteRegion,
    Sealed,
    _new_object,
    _plain_region,
    _set_field,
    pack_lanes,
    parse_engine_id,
)
from hixl.errors import HandshakeError

__all__ = [
    "ERROR_CODES",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "CONTROL_MAX_PAYLOAD",
    "MAX_PAYLOAD",
    "MAX_REGIONS",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "LANE_BYTES",
    "MAX_LANES",
    "PROTOCOL_VERSION",
    "REMOTE_READ",
    "REMOTE_WRITE",
    "Accept",
    "Bye",
    "Challenge",
    "Credit",
    "Decoder",
    "Error",
    "ErrorCode",
    "Hello",
    "Info",
    "Message",
    "MsgType",
    "Ping",
    "Pong",
    "QpInfo",
    "Ready",
    "Regions",
    "RemoteRegion",
    "SEAL_OVERHEAD",
    "Sealed",
    "decode",
    "encode",
    "expect",
    "make_nonce",
    "pack_lanes",
    "parse_engine_id",
    "RegionChanges",
    "region_size",
    "regions_frames",
]

#: Version of the wire format this module speaks; a frame with another version is refused.
#: 3: the handshake proofs are keyed with SHA-256 of the token (see hixl.core.handshake).
#: 4: INFO and ACCEPT carry ``lanes``, the sender's extra queue pairs (see :class:`QpInfo`).
#: 5: INFO and ACCEPT carry ``direct``: whether the last extra queue pair is a direct lane.
#: 6: every message after the handshake is SEALED (sequence number and MAC); CREDIT.
#: 7: a message after the handshake carries at most CONTROL_MAX_PAYLOAD bytes (REGIONS
#:    changes are split to fit).
PROTOCOL_VERSION = 7
#: First four bytes of every frame.
MAGIC = b"HIXL"
#: Default largest payload a :class:`Decoder` accepts and :func:`encode` produces, in bytes.
MAX_PAYLOAD = 1 << 20
#: Largest payload of a message after the handshake (the frame a SEALED one carries), in
#: bytes.  Decoding one is a step the receiver cannot interrupt: keeping it small bounds
#: how long one peer's message can hold up the others'.  :func:`regions_frames` splits a
#: REGIONS change to fit.
CONTROL_MAX_PAYLOAD = 4 << 10
# The longest integer literal a payload may hold: u64 values have at most 20 digits. The cap
# is applied while parsing, so a megabyte of digits never reaches int() (quadratic).
_MAX_INT_DIGITS = 24

#: Bytes a SEALED frame adds around the frame it carries: its own header, ``seq``, ``mac``.
SEAL_OVERHEAD = HEADER_SIZE + 8 + PROOF_SIZE
_SEALED_HEAD = struct.Struct("!Q32s")
_TYPES = {int(t): t for t in MsgType}  # a header's type field to its member, fast


def region_size(region: RemoteRegion) -> int:
    """Bytes ``region`` takes in an encoded INFO, ACCEPT or REGIONS payload (with a comma).

    An engine keeps the sum of its exposed regions' sizes under :data:`MAX_PAYLOAD` less
    room for the other fields, so its handshake messages always fit a peer's decoder.
    """
    obj = _region_json(region)
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")) + 1


#: Bytes of the payload of a REGIONS message with no regions: ``{"add":[],"remove":[]}``.
_EMPTY_REGIONS = len(json.dumps({"add": [], "remove": []}, separators=(",", ":")))


def regions_frames(
    add: tuple[RemoteRegion, ...] = (),
    remove: tuple[RemoteRegion, ...] = (),
    *,
    max_payload: int = CONTROL_MAX_PAYLOAD,
) -> list[bytes]:
    """Encoded REGIONS messages for one change, each payload at most ``max_payload``
    bytes: one message when it fits, else the removals, then the additions, each list
    packed in order into as few messages as it needs.  Applied in order they leave the
    receiver where one message would (removals first, then additions).  Each region is
    encoded once to size it, then once in its message: linear in the regions.

    Raises :class:`HandshakeError` if one region alone does not fit.
    """
    add, remove = tuple(add), tuple(remove)
    add_sizes = [region_size(r) for r in add]
    remove_sizes = [region_size(r) for r in remove]
    # Each list's sizes count one comma per region; a list of k regions has k - 1.
    whole = _EMPTY_REGIONS + sum(add_sizes) - bool(add) + sum(remove_sizes) - bool(remove)
    if whole <= max_payload:
        return [encode(Regions(add=add, remove=remove), max_payload=max_payload)]
    out: list[bytes] = []
    for regions, sizes, adding in ((remove, remove_sizes, False), (add, add_sizes, True)):
        first, used = 0, _EMPTY_REGIONS - 1
        for i, size in enumerate(sizes):
            if i > first and used + size > max_payload:
                part = regions[first:i]
                out.append(_regions_frame(part, adding, max_payload))
                first, used = i, _EMPTY_REGIONS - 1
            used += size
        if first < len(regions):
            out.append(_regions_frame(regions[first:], adding, max_payload))
    return out


def _regions_frame(regions: tuple[RemoteRegion, ...], adding: bool, max_payload: int) -> bytes:
    msg = Regions(add=regions) if adding else Regions(remove=regions)
    return encode(msg, max_payload=max_payload)


class RegionChanges:
    """Changes of exposed regions not sent yet, merged: for each region, by ``(rkey,
    addr)``, the last change made to it.  Sent as one change (:meth:`take`: removals,
    then additions), they leave the receiver where sending each in turn would, since a
    receiver keys regions the same way (an addition replaces, a removal of an absent one
    does nothing).  Holds one entry per region changed."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], tuple[RemoteRegion, bool]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def __repr__(self) -> str:
        return f"<RegionChanges regions={len(self._last)}>"

    def note(
        self, add: tuple[RemoteRegion, ...] = (), remove: tuple[RemoteRegion, ...] = ()
    ) -> None:
        """One more change: ``remove`` first, then ``add``."""
        last = self._last
        for r in remove:
            last[(r.rkey, r.addr)] = (r, False)
        for r in add:
            last[(r.rkey, r.addr)] = (r, True)

    def take(self) -> tuple[tuple[RemoteRegion, ...], tuple[RemoteRegion, ...]]:
        """The merged change, ``(add, remove)``, and nothing held from then on."""
        changes = self._last.values()
        add = tuple(r for r, added in changes if added)
        remove = tuple(r for r, added in changes if not added)
        self._last = {}
        return add, remove


# Wire form of each field kind, keyed by the annotation string of the dataclass field
# (``from __future__ import annotations`` keeps them as written in hixl.core.messages).
_REGION_KEYS = ("addr", "length", "rkey", "access", "name")
_REGION_KEY_SET = frozenset(_REGION_KEYS)
_REGIONS_ANNOTATION = "tuple[RemoteRegion, ...]"
_FIELDS: dict[MsgType, tuple[tuple[str, str], ...]] = {
    t: tuple((f.name, str(f.type)) for f in dataclasses.fields(cls)) for t, cls in _CLASSES.items()
}
assert all(
    kind in ("int", "str", "bytes", _REGIONS_ANNOTATION)
    for fields in _FIELDS.values()
    for _, kind in fields
)


# --------------------------------------------------------------------------- encoding


def _region_json(region: RemoteRegion) -> dict[str, object]:
    return {key: getattr(region, key) for key in _REGION_KEYS}


def encode(msg: Message, *, max_payload: int = MAX_PAYLOAD) -> bytes:
    """The frame for ``msg``: 12-byte header then the UTF-8 JSON payload.

    Raises :class:`HandshakeError` if the payload would exceed ``max_payload`` bytes (the
    peer's decoder would refuse it), :class:`TypeError` if ``msg`` is not a message.
    """
    cls = type(msg)
    msg_type = getattr(cls, "TYPE", None)
    if not isinstance(msg_type, MsgType) or _CLASSES.get(msg_type) is not cls:
        raise TypeError(f"encode() takes a hixl wire message, got {cls.__name__}")
    if isinstance(msg, Sealed):
        payload = _SEALED_HEAD.pack(msg.seq, msg.mac) + msg.frame
        if len(payload) > max_payload + SEAL_OVERHEAD:
            raise HandshakeError(
                f"SEALED payload of {len(payload)} bytes exceeds max_payload={max_payload} "
                f"plus {SEAL_OVERHEAD}"
            )
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, len(payload)) + payload
    obj: dict[str, object] = {}
    for name, kind in _FIELDS[msg_type]:
        value = getattr(msg, name)
        if kind == "bytes":
            obj[name] = value.hex()
        elif kind == _REGIONS_ANNOTATION:
            obj[name] = [_region_json(r) for r in value]
        else:
            obj[name] = str(value) if kind == "str" else value
    payload = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(payload) > max_payload:
        raise HandshakeError(
            f"{msg_type.name} payload of {len(payload)} bytes exceeds max_payload={max_payload}"
        )
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, len(payload)) + payload


# --------------------------------------------------------------------------- decoding

_HEX_RE = re.compile(r"(?:[0-9a-f]{2})*", re.ASCII)


class _Reject(ValueError):
    """Raised from inside json.loads hooks; caught and reported as HandshakeError."""


def _parse_int(literal: str) -> int:
    if len(literal) > _MAX_INT_DIGITS:
        raise _Reject(f"integer literal of {len(literal)} characters (at most {_MAX_INT_DIGITS})")
    return int(literal)


def _parse_constant(name: str) -> float:
    raise _Reject(f"the non-standard constant {name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    result = {}
    for key, value in pairs:
        if key in result:
            raise _Reject(f"key {shown(key)} appears twice in one object")
        result[key] = value
    return result


def _parse_json(where: str, payload: bytes) -> dict[str, Any]:
    try:
        text = payload.decode("utf-8")
        obj = json.loads(
            text,
            parse_int=_parse_int,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_keys,
        )
    except UnicodeDecodeError as exc:
        raise HandshakeError(f"{where} payload is not UTF-8: {exc}") from None
    except RecursionError:
        raise HandshakeError(f"{where} payload nests JSON too deeply") from None
    except ValueError as exc:  # JSONDecodeError, _Reject
        raise HandshakeError(f"{where} payload is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise HandshakeError(
            f"{where} payload must be a JSON object, got {type(obj).__name__} {shown(obj)}"
        )
    return obj


def _check_keys(where: str, obj: dict[str, Any], expected: tuple[str, ...]) -> None:
    missing = [k for k in expected if k not in obj]
    extra = [k for k in obj if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if extra:
            parts.append(f"unexpected keys {shown(sorted(extra))}")
        raise HandshakeError(f"{where}: {' and '.join(parts)}; expected exactly {list(expected)}")


def _wire_int(where: str, value: object) -> int:
    # JSON gives exact ints; bool is a subclass of int and must not pass.
    if type(value) is not int:
        raise HandshakeError(
            f"{where} must be a JSON integer, got {type(value).__name__} {shown(value)}"
        )
    return value


def _wire_str(where: str, value: object) -> str:
    if type(value) is not str:
        raise HandshakeError(
            f"{where} must be a JSON string, got {type(value).__name__} {shown(value)}"
        )
    return value


def _wire_bytes(where: str, value: object) -> bytes:
    text = _wire_str(where, value)
    if _HEX_RE.fullmatch(text) is None:
        raise HandshakeError(
            f"{where} must be an even number of lowercase hex digits, got {shown(text)}"
        )
    return bytes.fromhex(text)


def _wire_regions(where: str, value: object) -> tuple[RemoteRegion, ...]:
    if type(value) is not list:
        raise HandshakeError(
            f"{where} must be a JSON array, got {type(value).__name__} {shown(value)}"
        )
    if len(value) > MAX_REGIONS:
        raise HandshakeError(f"{where} has {len(value)} regions, at most {MAX_REGIONS}")
    regions = []
    for i, item in enumerate(value):
        if type(item) is dict and item.keys() == _REGION_KEY_SET:
            addr, length, rkey = item["addr"], item["length"], item["rkey"]
            access, name = item["access"], item["name"]
            if (
                type(addr) is int
                and type(length) is int
                and type(rkey) is int
                and type(access) is int
                and type(name) is str
            ):  # the usual case, without a message prepared per field
                try:
                    regions.append(
                        RemoteRegion(addr=addr, length=length, rkey=rkey, access=access, name=name)
                    )
                except HandshakeError as exc:
                    raise HandshakeError(f"{where}[{i}]: {exc}") from None
                continue
        at = f"{where}[{i}]"
        if type(item) is not dict:
            raise HandshakeError(
                f"{at} must be a JSON object, got {type(item).__name__} {shown(item)}"
            )
        _check_keys(at, item, _REGION_KEYS)
        try:
            regions.append(
                RemoteRegion(
                    addr=_wire_int(f"{at}.addr", item["addr"]),
                    length=_wire_int(f"{at}.length", item["length"]),
                    rkey=_wire_int(f"{at}.rkey", item["rkey"]),
                    access=_wire_int(f"{at}.access", item["access"]),
                    name=_wire_str(f"{at}.name", item["name"]),
                )
            )
        except HandshakeError as exc:
            raise HandshakeError(f"{at}: {exc}") from None
    return tuple(regions)


_WIRE_KINDS: dict[str, Callable[[str, object], Any]] = {
    "int": _wire_int,
    "str": _wire_str,
    "bytes": _wire_bytes,
    _REGIONS_ANNOTATION: _wire_regions,
}


# A REGIONS payload as encode() writes it (keys in their order, no spaces, integers in
# plain digits, names without escapes or control characters) is read with two regular
# expressions and no JSON hooks: about a quarter of the general path's cost per region.
# Anything else (or a value out of range) takes the general path, which takes any valid
# JSON and names what is wrong; both give the same message for what the fast one takes.
_NUM = rb"(0|[1-9][0-9]{0,19})"
_REGION_PATTERN = (
    rb'\{"addr":%s,"length":%s,"rkey":%s,"access":%s,"name":"([^"\\\x00-\x1f]*)"\}' % ((_NUM,) * 4)
)
_REGION_RE = re.compile(_REGION_PATTERN)
_ONE = _REGION_PATTERN.replace(b"(", b"(?:")
_LIST = rb"\[((?:%s(?:,%s)*)?)\]" % (_ONE, _ONE)
_REGIONS_RE = re.compile(rb'\{"add":%s,"remove":%s\}' % (_LIST, _LIST))


def _fast_regions(payload: bytes) -> Regions | None:
    """The REGIONS message in ``payload`` if it is in encode()'s exact form and every value
    is in range with no region repeated; else None (the general path decides)."""
    whole = _REGIONS_RE.fullmatch(payload)
    if whole is None:
        return None
    lists: list[tuple[RemoteRegion, ...]] = []
    for text in whole.groups():
        found = _REGION_RE.findall(text)
        if len(found) > MAX_REGIONS:
            return None
        regions = []
        for addr, length, rkey, access, name in found:
            try:
                region = _plain_region(
                    int(addr), int(length), int(rkey), int(access), name.decode("utf-8")
                )
            except UnicodeDecodeError:
                return None
            if region is None:
                return None
            regions.append(region)
        if len({(r.rkey, r.addr) for r in regions}) != len(regions):
            return None
        lists.append(tuple(regions))
    msg = _new_object(Regions)
    _set_field(msg, "add", lists[0])
    _set_field(msg, "remove", lists[1])
    return msg


def _decode_payload(msg_type: MsgType, payload: bytes) -> Message:
    where = msg_type.name
    if msg_type is MsgType.REGIONS:
        fast = _fast_regions(payload)
        if fast is not None:
            return fast
    if msg_type is MsgType.SEALED:
        if len(payload) < _SEALED_HEAD.size + HEADER_SIZE:
            raise HandshakeError(
                f"SEALED payload has {len(payload)} bytes, less than "
                f"{_SEALED_HEAD.size + HEADER_SIZE}"
            )
        seq, mac = _SEALED_HEAD.unpack_from(payload)
        return Sealed(seq=seq, mac=mac, frame=payload[_SEALED_HEAD.size :])
    obj = _parse_json(where, payload)
    fields = _FIELDS[msg_type]
    _check_keys(where, obj, tuple(name for name, _ in fields))
    kwargs = {name: _WIRE_KINDS[kind](f"{where}.{name}", obj[name]) for name, kind in fields}
    try:
        return _CLASSES[msg_type](**kwargs)
    except HandshakeError as exc:
        raise HandshakeError(f"invalid {where} message: {exc}") from None


class Decoder:
    """Sans-I/O frame decoder: feed it bytes as they arrive, get complete messages back.

    ``max_payload`` (bytes, default :data:`MAX_PAYLOAD`) bounds a frame's payload; a header
    announcing more is refused before any payload is buffered, so the decoder never holds
    more than ``HEADER_SIZE + max_payload`` bytes. The first malformed frame raises
    :class:`HandshakeError` and poisons the decoder: every later :meth:`feed` raises too, and
    :attr:`error_code` says which :class:`ErrorCode` to send the peer before closing.
    """

    __slots__ = ("_body_len", "_buf", "_error", "_error_code", "_max_payload", "_msg_type")

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        if isinstance(max_payload, bool) or not isinstance(max_payload, int):
            raise TypeError(f"max_payload must be an int, got {type(max_payload).__name__}")
        if not 2 <= max_payload <= _U32_MAX:
            raise ValueError(f"max_payload={max_payload} out of range [2, {_U32_MAX}]")
        self._max_payload = max_payload
        self._buf = bytearray()
        self._msg_type: MsgType | None = None  # set while the payload of a frame is awaited
        self._body_len = 0
        self._error: HandshakeError | None = None
        self._error_code: ErrorCode | None = None

    @property
    def max_payload(self) -> int:
        """Largest payload accepted, in bytes."""
        return self._max_payload

    @property
    def buffered(self) -> int:
        """Bytes held from an incomplete frame (header or payload)."""
        return len(self._buf)

    @property
    def error_code(self) -> ErrorCode | None:
        """``None`` while healthy; after a failure ``VERSION`` or ``MALFORMED``."""
        return self._error_code

    def __repr__(self) -> str:
        state = "poisoned" if self._error else f"buffered={len(self._buf)}"
        return f"<Decoder max_payload={self._max_payload} {state}>"

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Take the next bytes received; return every message they complete, in order.

        Partial frames are kept for the next call. Raises :class:`HandshakeError` on the
        first malformed frame (messages completed earlier in the same call are dropped with
        it: the connection is to be closed).
        """
        if self._error is not None:
            raise HandshakeError(
                f"decoder is unusable after an earlier error: {self._error}"
            ) from self._error
        view = memoryview(data).cast("B")
        try:
            return self._feed(view)
        except HandshakeError as exc:
            self._error = exc
            self._error_code = self._error_code or ErrorCode.MALFORMED
            self._buf = bytearray()
            self._msg_type = None
            raise

    def eof(self) -> None:
        """Declare the stream ended; raises :class:`HandshakeError` inside a frame.

        A stream cut inside a frame poisons the decoder like a malformed one.
        """
        if self._error is not None:
            raise HandshakeError(
                f"decoder is unusable after an earlier error: {self._error}"
            ) from self._error
        if self._msg_type is not None:
            problem = (
                f"connection closed inside a {self._msg_type.name} frame: got "
                f"{len(self._buf)} of {self._body_len} payload bytes"
            )
        elif self._buf:
            problem = (
                f"connection closed inside a frame header: got {len(self._buf)} of "
                f"{HEADER_SIZE} bytes"
            )
        else:
            return
        self._error = HandshakeError(problem)
        self._error_code = ErrorCode.MALFORMED
        self._buf = bytearray()
        self._msg_type = None
        raise self._error

    def limit(self, max_payload: int) -> None:
        """Accept at most ``max_payload`` bytes per payload from now on (a handshake's
        decoder becomes a control channel's).  A frame being received that announced more
        fails now, like a malformed one, and poisons the decoder."""
        if not 2 <= max_payload <= self._max_payload:
            raise ValueError(f"max_payload={max_payload} out of range [2, {self._max_payload}]")
        self._max_payload = max_payload
        if self._error is None and self._msg_type is not None:
            allowed = max_payload + (SEAL_OVERHEAD if self._msg_type == MsgType.SEALED else 0)
            if self._body_len > allowed:
                self._error = HandshakeError(
                    f"frame announces a {self._body_len}-byte payload, more than "
                    f"max_payload={max_payload}"
                )
                self._error_code = ErrorCode.MALFORMED
                self._buf = bytearray()
                self._msg_type = None
                raise self._error

    def _feed(self, view: memoryview) -> list[Message]:
        out: list[Message] = []
        pos, end = 0, len(view)
        while True:
            if self._msg_type is None and not self._buf and end - pos >= HEADER_SIZE:
                # A whole header in ``view`` (and, most often, its whole frame): decoded
                # without passing through the buffer.
                head = bytes(view[pos : pos + HEADER_SIZE])
                self._check_header(head)
                _, _, raw_type, length = HEADER.unpack(head)
                pos += HEADER_SIZE
                if end - pos >= length:
                    payload = bytes(view[pos : pos + length])
                    pos += length
                    out.append(_decode_payload(_TYPES[raw_type], payload))
                    continue
                self._msg_type = _TYPES[raw_type]
                self._body_len = length
            elif self._msg_type is None:
                take = min(HEADER_SIZE - len(self._buf), end - pos)
                self._buf += view[pos : pos + take]
                pos += take
                self._check_header(self._buf)
                if len(self._buf) < HEADER_SIZE:
                    return out
                _, _, raw_type, length = HEADER.unpack(self._buf)
                self._msg_type = _TYPES[raw_type]
                self._body_len = length
                self._buf = bytearray()
            take = min(self._body_len - len(self._buf), end - pos)
            self._buf += view[pos : pos + take]
            pos += take
            if len(self._buf) < self._body_len:
                return out
            msg_type = self._msg_type
            payload = bytes(self._buf)
            self._msg_type = None
            self._buf = bytearray()
            out.append(_decode_payload(msg_type, payload))

    def _check_header(self, head: bytes | bytearray) -> None:
        """Check as much of a (possibly partial) header as has arrived."""
        n = len(head)
        if head[: min(n, 4)] != MAGIC[: min(n, 4)]:
            shown = bytes(head[: min(n, 4)])
            raise HandshakeError(f"bad frame magic {shown!r}, expected {MAGIC!r}")
        if n >= 6:
            (version,) = struct.unpack_from("!H", head, 4)
            if version != PROTOCOL_VERSION:
                self._error_code = ErrorCode.VERSION
                raise HandshakeError(
                    f"unsupported protocol version {version}: this side speaks version "
                    f"{PROTOCOL_VERSION}"
                )
        if n >= 8:
            (raw_type,) = struct.unpack_from("!H", head, 6)
            if raw_type not in _CLASSES:
                retired = " (NOTIFY of protocol version 1, retired)" if raw_type == 9 else ""
                known = ", ".join(str(int(t)) for t in sorted(_CLASSES))
                raise HandshakeError(f"unknown message type {raw_type}{retired} (known: {known})")
        if n >= HEADER_SIZE:
            (length,) = struct.unpack_from("!I", head, 8)
            (raw_type,) = struct.unpack_from("!H", head, 6)
            # A SEALED frame carries a whole frame of up to max_payload, and its own fields.
            allowed = self._max_payload + (SEAL_OVERHEAD if raw_type == MsgType.SEALED else 0)
            if length > allowed:
                raise HandshakeError(
                    f"frame announces a {length}-byte payload, more than "
                    f"max_payload={self._max_payload}"
                )


def decode(frame: bytes | bytearray | memoryview, *, max_payload: int = MAX_PAYLOAD) -> Message:
    """The one message in ``frame``, which must be exactly one complete frame.

    Raises :class:`HandshakeError` if it is malformed, incomplete or followed by more bytes.
    """
    decoder = Decoder(max_payload=max_payload)
    messages = decoder.feed(frame)
    decoder.eof()
    if len(messages) != 1:
        raise HandshakeError(f"expected exactly one frame, got {len(messages)}")
    return messages[0]


_M = TypeVar("_M", Hello, Challenge, Info, Accept, Ready, Regions, Error, Bye, Ping, Pong, Sealed)


def expect(msg: Message, kind: type[_M]) -> _M:
    """``msg`` if it is a ``kind`` message, else :class:`HandshakeError` naming both.

    An :class:`Error` from the peer (when not expected) is reported with its code and text.
    """
    if isinstance(msg, kind):
        return msg
    if isinstance(msg, Error):
        raise HandshakeError(
            f"peer sent ERROR {msg.code}: {msg.message!r} while {kind.TYPE.name} was expected"
        )
    raise HandshakeError(f"expected a {kind.TYPE.name} message, got {msg.TYPE.name}")


# --------------------------------------------------------------------------- nonces


def make_nonce() -> bytes:
    """A fresh random 16-byte nonce from :mod:`secrets`."""
    return secrets.token_bytes(NONCE_SIZE)
