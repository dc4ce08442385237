"""The control messages hixl engines exchange, as checked values.

Each message of the protocol described in :mod:`hixl.core.wire` is a frozen dataclass here
(:class:`Hello`, :class:`Challenge`, :class:`Info`, :class:`Accept`, :class:`Ready`,
:class:`Regions`, :class:`Error`, :class:`Bye`, :class:`Ping`, :class:`Pong`,
:class:`Credit`, :class:`Sealed`), with :class:`RemoteRegion` for the memory a peer exposes
and :func:`parse_engine_id` for engine ids. Building a value checks every field (type,
range, size) and raises :class:`~hixl.errors.HandshakeError` naming the first that is
wrong, so a message that exists is well formed, whether made locally or decoded from a peer.
Turning messages into bytes and back is :mod:`hixl.core.wire`'s job; it re-exports every
public name of this module.

This module is pure: no sockets, no clock, no pyverbs.
"""

from __future__ import annotations

import enum
import ipaddress
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from hixl.core.checks import plain_int, shown
from hixl.errors import HandshakeError

__all__ = [
    "ERROR_CODES",
    "HEADER",
    "HEADER_SIZE",
    "LANE_BYTES",
    "MAX_LANES",
    "MAX_REGIONS",
    "NONCE_SIZE",
    "PROOF_SIZE",
    "REMOTE_READ",
    "REMOTE_WRITE",
    "Accept",
    "Bye",
    "Challenge",
    "Credit",
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
    "Sealed",
    "pack_lanes",
    "parse_engine_id",
]

#: Most queue pairs (lanes) one connection may have, the first included.
MAX_LANES = 8
#: Bytes one extra lane takes in ``QpInfo.lanes``: its QP number and its starting PSN,
#: 3 bytes each, big-endian.
LANE_BYTES = 6
#: Frame header: magic, version (u16), message type (u16), payload length in bytes (u32).
HEADER = struct.Struct("!4sHHI")
HEADER_SIZE = HEADER.size
#: Bytes in a handshake nonce.
NONCE_SIZE = 16
#: Bytes in a non-empty proof (HMAC-SHA256).
PROOF_SIZE = 32
#: Most regions one INFO, ACCEPT or REGIONS message may carry.
MAX_REGIONS = 4096
#: Remote access bits of a region, as ``IBV_ACCESS_REMOTE_WRITE`` and ``IBV_ACCESS_REMOTE_READ``.
REMOTE_WRITE = 2
REMOTE_READ = 4

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1
_U24_MAX = (1 << 24) - 1
_GID_SIZE = 16
_MTUS = (256, 512, 1024, 2048, 4096)
_MAX_SGE = 1024
_MAX_RECV_SLOTS = 65536
_MAX_RECV_SLOT_SIZE = 65536
_MAX_REGION_NAME = 128
_REGION_ACCESS = frozenset((REMOTE_WRITE, REMOTE_READ, REMOTE_WRITE | REMOTE_READ))
_MAX_ERROR_MESSAGE = 4096
_MAX_BYE_REASON = 1024
_MAX_HOSTNAME = 253
_MAX_ENGINE_ID = 320


class MsgType(enum.IntEnum):
    """The message type field of a frame header."""

    HELLO = 1
    CHALLENGE = 2
    INFO = 3
    ACCEPT = 4
    READY = 5
    REGIONS = 6
    ERROR = 7
    BYE = 8
    # 9 was NOTIFY (version 1): retired, refused as unknown
    PING = 10
    PONG = 11
    SEALED = 12
    CREDIT = 13


class ErrorCode(enum.StrEnum):
    """The codes an :class:`Error` message may carry."""

    AUTH = "AUTH"
    VERSION = "VERSION"
    MALFORMED = "MALFORMED"
    ALREADY_CONNECTED = "ALREADY_CONNECTED"
    BUSY = "BUSY"
    LIMIT = "LIMIT"
    TIMEOUT = "TIMEOUT"
    OVERFLOW = "OVERFLOW"
    INTEGRITY = "INTEGRITY"
    INTERNAL = "INTERNAL"


ERROR_CODES = frozenset(code.value for code in ErrorCode)


# --------------------------------------------------------------------------- field checks


def _int(where: str, value: object, lo: int, hi: int) -> int:
    """``value`` as a plain int in ``[lo, hi]``; bool is refused, ``__index__`` accepted."""
    result = plain_int(where, value, HandshakeError)
    if not lo <= result <= hi:
        raise HandshakeError(f"{where}={result} out of range [{lo}, {hi}]")
    return result


def _bytes(where: str, value: object, sizes: tuple[int, ...] | None, max_size: int = 0) -> bytes:
    """``value`` as bytes of one of ``sizes`` (or at most ``max_size`` when sizes is None)."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise HandshakeError(f"{where} must be bytes, got {type(value).__name__} {shown(value)}")
    result = bytes(value)
    if sizes is not None and len(result) not in sizes:
        allowed = " or ".join(str(s) for s in sizes)
        raise HandshakeError(f"{where} must be {allowed} bytes long, got {len(result)} bytes")
    if sizes is None and len(result) > max_size:
        raise HandshakeError(f"{where} has {len(result)} bytes, at most {max_size} allowed")
    return result


def _text(where: str, value: object, lo: int, hi: int, *, multiline: bool = False) -> str:
    """``value`` as a str of ``lo..hi`` printable characters (``\\t``/``\\n`` if multiline).

    Printable excludes lone surrogates, so every accepted string encodes as UTF-8.
    """
    if not isinstance(value, str):
        raise HandshakeError(f"{where} must be a str, got {type(value).__name__} {shown(value)}")
    if not lo <= len(value) <= hi:
        raise HandshakeError(f"{where} has {len(value)} characters, allowed {lo}..{hi}")
    for i, ch in enumerate(value):
        if not (ch.isprintable() or (multiline and ch in "\t\n")):
            raise HandshakeError(f"{where} has the unprintable character {ch!r} at index {i}")
    return str(value)


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


# --------------------------------------------------------------------------- engine ids

_PORT_RE = re.compile(r"(0|[1-9][0-9]{0,4})(?:~([0-9a-fA-F]{1,16}))?", re.ASCII)
_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)
_DOTTED_RE = re.compile(r"[0-9.]+", re.ASCII)
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}", re.ASCII)


def parse_engine_id(text: str) -> tuple[str, int]:
    """Split an engine id ``"host:port"`` or ``"host:port~suffix"`` into ``(host, port)``.

    ``host`` is an IPv4 dotted quad, a bracketed IPv6 address ``[v6]`` (returned without the
    brackets; a ``%scope`` of letters, digits, ``_.-`` is allowed) or a hostname (letters,
    digits, dashes, dot-separated labels of 1..63 characters, at most 253 characters, not all
    digits). ``port`` is decimal ``0..65535`` without leading zeros. The optional suffix is
    ``~`` and 1..16 hex digits; it keeps ids of engines that do not listen (port 0) unique
    and is not returned.

    Raises :class:`ValueError` naming the id and the broken part. The message decoders turn
    it into :class:`~hixl.errors.HandshakeError`.
    """
    if not isinstance(text, str):
        raise ValueError(f"engine id must be a str, got {type(text).__name__} {shown(text)}")
    if len(text) > _MAX_ENGINE_ID:
        raise ValueError(f"engine id has {len(text)} characters, at most {_MAX_ENGINE_ID}")
    host, sep, rest = text.rpartition(":")
    if not sep:
        raise ValueError(f"engine id {text!r} has no ':port'")
    if "]" in rest:
        raise ValueError(f"engine id {text!r}: the part after the last ':' is not a port")
    match = _PORT_RE.fullmatch(rest)
    if match is None:
        raise ValueError(
            f"engine id {text!r}: port {rest!r} must be decimal 0..65535 without leading "
            "zeros, optionally followed by '~' and 1..16 hex digits"
        )
    port = int(match.group(1))
    if port > 0xFFFF:
        raise ValueError(f"engine id {text!r}: port {port} out of range [0, 65535]")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"engine id {text!r}: '[' without a closing ']' before the port")
        host = host[1:-1]
        address, pct, scope = host.partition("%")
        if pct and _SCOPE_RE.fullmatch(scope) is None:
            raise ValueError(f"engine id {text!r}: bad IPv6 scope {scope!r}")
        if not address.isascii():
            raise ValueError(f"engine id {text!r}: {address!r} is not an IPv6 address")
        try:
            ipaddress.IPv6Address(address)
        except ValueError as exc:
            raise ValueError(
                f"engine id {text!r}: {address!r} is not an IPv6 address: {exc}"
            ) from None
        return host, port
    if not host:
        raise ValueError(f"engine id {text!r} has an empty host")
    if ":" in host:
        raise ValueError(f"engine id {text!r}: an IPv6 host must be written in brackets, [v6]")
    if _DOTTED_RE.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError as exc:
            raise ValueError(
                f"engine id {text!r}: {host!r} is not an IPv4 address: {exc}"
            ) from None
        return host, port
    if len(host) > _MAX_HOSTNAME:
        raise ValueError(
            f"engine id {text!r}: hostname has {len(host)} characters, at most {_MAX_HOSTNAME}"
        )
    for label in host.split("."):
        if _LABEL_RE.fullmatch(label) is None:
            raise ValueError(
                f"engine id {text!r}: hostname label {label!r} must be 1..63 letters, digits "
                "or dashes, not starting or ending with a dash"
            )
    return host, port


def _engine_id(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise HandshakeError(f"{where} must be a str, got {type(value).__name__} {shown(value)}")
    try:
        parse_engine_id(value)
    except ValueError as exc:
        raise HandshakeError(f"{where}: {exc}") from None
    return str(value)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteRegion:
    """A memory region a peer exposes: ``[addr, addr + length)`` under ``rkey``.

    ``addr`` is the peer's virtual address (u64) and ``length`` the size in bytes
    (``1..2**64-1``, ending at or before ``2**64``); ``rkey`` is a u32; ``access`` is a
    non-zero combination of :data:`REMOTE_WRITE` and :data:`REMOTE_READ` only; ``name`` is
    up to 128 printable characters. Invalid values raise :class:`HandshakeError`.
    """

    addr: int
    length: int
    rkey: int
    access: int
    name: str = ""

    def __post_init__(self) -> None:
        addr, length, rkey, access, name = self.addr, self.length, self.rkey, self.access, self.name
        if (
            type(addr) is int
            and type(length) is int
            and type(rkey) is int
            and type(access) is int
            and type(name) is str
            and _plain_in_range(addr, length, rkey, access, name)
        ):
            return  # plain values in range (what the wire gives): nothing to convert
        addr = _int("RemoteRegion.addr", self.addr, 0, _U64_MAX)
        length = _int("RemoteRegion.length", self.length, 1, _U64_MAX)
        if addr + length > 1 << 64:
            raise HandshakeError(
                f"RemoteRegion ends past 2**64: addr={addr:#x} length={length} "
                f"end={addr + length:#x}"
            )
        access = _int("RemoteRegion.access", self.access, 0, _U32_MAX)
        if access == 0 or access & ~(REMOTE_WRITE | REMOTE_READ):
            raise HandshakeError(
                f"RemoteRegion.access={access:#x} must be a non-zero combination of "
                f"REMOTE_WRITE={REMOTE_WRITE:#x} and REMOTE_READ={REMOTE_READ:#x}"
            )
        _set(self, "addr", addr)
        _set(self, "length", length)
        _set(self, "rkey", _int("RemoteRegion.rkey", self.rkey, 0, _U32_MAX))
        _set(self, "access", access)
        _set(self, "name", _text("RemoteRegion.name", self.name, 0, _MAX_REGION_NAME))

    @property
    def end(self) -> int:
        """One past the last address of the region."""
        return self.addr + self.length


def _plain_in_range(addr: int, length: int, rkey: int, access: int, name: str) -> bool:
    """True when a region's ints and str are all in range (no conversion needed)."""
    return (
        addr >= 0
        and length >= 1
        and addr + length <= 1 << 64
        and 0 <= rkey <= _U32_MAX
        and access in _REGION_ACCESS
        and len(name) <= _MAX_REGION_NAME
        and name.isprintable()
    )


_new_object = object.__new__
_set_field = object.__setattr__  # how a frozen dataclass's own __init__ sets its fields


def _plain_region(addr: int, length: int, rkey: int, access: int, name: str) -> RemoteRegion | None:
    """``RemoteRegion(...)`` of ints and a str in range, without the keyword call and
    ``__post_init__``; None when one is out of range (``RemoteRegion`` then names it)."""
    if not _plain_in_range(addr, length, rkey, access, name):
        return None
    region = _new_object(RemoteRegion)
    _set_field(region, "addr", addr)
    _set_field(region, "length", length)
    _set_field(region, "rkey", rkey)
    _set_field(region, "access", access)
    _set_field(region, "name", name)
    return region


def _regions(where: str, value: object) -> tuple[RemoteRegion, ...]:
    if not isinstance(value, tuple | list):
        raise HandshakeError(f"{where} must be a tuple of RemoteRegion, got {type(value).__name__}")
    if len(value) > MAX_REGIONS:
        raise HandshakeError(f"{where} has {len(value)} regions, at most {MAX_REGIONS}")
    seen: dict[tuple[int, int], int] = {}
    for i, region in enumerate(value):
        if not isinstance(region, RemoteRegion):
            raise HandshakeError(
                f"{where}[{i}] must be a RemoteRegion, got {type(region).__name__}"
            )
        key = (region.rkey, region.addr)
        if key in seen:
            raise HandshakeError(
                f"{where}[{i}] repeats {where}[{seen[key]}]: rkey={region.rkey:#x} "
                f"addr={region.addr:#x}"
            )
        seen[key] = i
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Client -> server, first message: who the client is and a fresh 16-byte nonce."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    engine_id: str
    nonce: bytes

    def __post_init__(self) -> None:
        _set(self, "engine_id", _engine_id("Hello.engine_id", self.engine_id))
        _set(self, "nonce", _bytes("Hello.nonce", self.nonce, (NONCE_SIZE,)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Challenge:
    """Server -> client: the server's id and a fresh 16-byte nonce; no proof (the client
    proves first, see :mod:`hixl.core.handshake`)."""

    TYPE: ClassVar[MsgType] = MsgType.CHALLENGE
    engine_id: str
    nonce: bytes

    def __post_init__(self) -> None:
        _set(self, "engine_id", _engine_id("Challenge.engine_id", self.engine_id))
        _set(self, "nonce", _bytes("Challenge.nonce", self.nonce, (NONCE_SIZE,)))


@dataclass(frozen=True, slots=True, kw_only=True)
class QpInfo:
    """What one end tells the other to connect an RC queue pair and reach its memory.

    Not a message itself: :class:`Info` (client -> server) and :class:`Accept` (server ->
    client) are, each with its sender's proof (``b""`` without a token, else 32 bytes).
    ``qpn`` is the 24-bit non-zero QP number, ``psn`` the 24-bit starting packet sequence
    number, ``gid`` 16 bytes, ``mtu`` the path MTU in bytes (256..4096, a power of two),
    ``max_sge`` 1..1024, ``recv_slots`` and ``recv_slot_size`` (bytes) describe the posted
    receive buffers (0..65536 each) and ``regions`` the exposed memory (at most 4096, no
    two with the same rkey and addr).  ``lanes`` lists the sender's extra queue pairs (at
    most ``MAX_LANES - 1``), :data:`LANE_BYTES` each: QP number (non-zero) and starting
    PSN, 3 bytes each, big-endian (see :meth:`extra_lanes` and :func:`pack_lanes`).
    ``direct`` is 1 when the last of them is the sender's *direct lane* (a queue pair for
    a channel, see :mod:`hixl.engine.channel`), else 0.  Both ends connect as many
    ordinary lanes as the shorter list allows, lane ``i`` to lane ``i``, and their direct
    lanes to each other when both have one; the receive buffers, and so the
    notifications, are on the first QP (``qpn``).
    """

    proof: bytes
    qpn: int
    psn: int
    gid: bytes
    mtu: int
    max_sge: int
    recv_slots: int
    recv_slot_size: int
    regions: tuple[RemoteRegion, ...] = ()
    lanes: bytes = b""
    direct: int = 0

    def __post_init__(self) -> None:
        kind = type(self).__name__
        _set(self, "proof", _bytes(f"{kind}.proof", self.proof, (0, PROOF_SIZE)))
        _set(self, "qpn", _int(f"{kind}.qpn", self.qpn, 1, _U24_MAX))
        _set(self, "psn", _int(f"{kind}.psn", self.psn, 0, _U24_MAX))
        _set(self, "gid", _bytes(f"{kind}.gid", self.gid, (_GID_SIZE,)))
        mtu = _int(f"{kind}.mtu", self.mtu, _MTUS[0], _MTUS[-1])
        if mtu not in _MTUS:
            raise HandshakeError(f"{kind}.mtu={mtu} must be one of {', '.join(map(str, _MTUS))}")
        _set(self, "mtu", mtu)
        _set(self, "max_sge", _int(f"{kind}.max_sge", self.max_sge, 1, _MAX_SGE))
        _set(self, "recv_slots", _int(f"{kind}.recv_slots", self.recv_slots, 0, _MAX_RECV_SLOTS))
        _set(
            self,
            "recv_slot_size",
            _int(f"{kind}.recv_slot_size", self.recv_slot_size, 0, _MAX_RECV_SLOT_SIZE),
        )
        _set(self, "regions", _regions(f"{kind}.regions", self.regions))
        lanes = _bytes(f"{kind}.lanes", self.lanes, None, (MAX_LANES - 1) * LANE_BYTES)
        if len(lanes) % LANE_BYTES:
            raise HandshakeError(
                f"{kind}.lanes has {len(lanes)} bytes, not a multiple of {LANE_BYTES}"
            )
        for i in range(0, len(lanes), LANE_BYTES):
            if not int.from_bytes(lanes[i : i + 3], "big"):
                raise HandshakeError(f"{kind}.lanes[{i // LANE_BYTES}] has QP number 0")
        _set(self, "lanes", lanes)
        direct = _int(f"{kind}.direct", self.direct, 0, 1)
        if direct and not lanes:
            raise HandshakeError(f"{kind}.direct=1 needs an extra queue pair in lanes")
        _set(self, "direct", direct)

    def ordinary_lanes(self) -> tuple[tuple[int, int], ...]:
        """The sender's ordinary queue pairs as ``(qpn, psn)`` pairs, the first included."""
        lanes = ((self.qpn, self.psn), *self.extra_lanes())
        return lanes[:-1] if self.direct else lanes

    def direct_lane(self) -> tuple[int, int] | None:
        """The sender's direct lane as ``(qpn, psn)``, or None."""
        return self.extra_lanes()[-1] if self.direct else None

    def extra_lanes(self) -> tuple[tuple[int, int], ...]:
        """The sender's extra queue pairs as ``(qpn, psn)`` pairs, in lane order."""
        b = self.lanes
        return tuple(
            (int.from_bytes(b[i : i + 3], "big"), int.from_bytes(b[i + 3 : i + 6], "big"))
            for i in range(0, len(b), LANE_BYTES)
        )


def pack_lanes(lanes: Iterable[tuple[int, int]]) -> bytes:
    """``(qpn, psn)`` pairs in the form of :attr:`QpInfo.lanes`."""
    return b"".join(q.to_bytes(3, "big") + p.to_bytes(3, "big") for q, p in lanes)


@dataclass(frozen=True, slots=True, kw_only=True)
class Info(QpInfo):
    """Client -> server: the client's QP and regions, and its proof over the transcript."""

    TYPE: ClassVar[MsgType] = MsgType.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class Accept(QpInfo):
    """Server -> client, sent only to a proven client: the server's QP, regions and proof."""

    TYPE: ClassVar[MsgType] = MsgType.ACCEPT


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """Client -> server: the client's QP is in RTS; the connection is usable."""

    TYPE: ClassVar[MsgType] = MsgType.READY


@dataclass(frozen=True, slots=True, kw_only=True)
class Regions:
    """Either direction, after READY: what the sender stopped (``remove``) and started
    (``add``) exposing since its last message; the receiver removes first, then adds.

    Each list holds at most 4096 regions, no two with the same rkey and addr.
    """

    TYPE: ClassVar[MsgType] = MsgType.REGIONS
    add: tuple[RemoteRegion, ...] = ()
    remove: tuple[RemoteRegion, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "add", _regions("Regions.add", self.add))
        _set(self, "remove", _regions("Regions.remove", self.remove))


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """Either direction: the sender refuses or gives up; it closes the connection after.

    ``code`` is one of :class:`ErrorCode` (stored as the enum member), ``message`` up to
    4096 printable characters (tabs and newlines allowed).
    """

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: str
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.code, str) or self.code not in ERROR_CODES:
            raise HandshakeError(
                f"Error.code={shown(self.code)} must be one of {', '.join(sorted(ERROR_CODES))}"
            )
        _set(self, "code", ErrorCode(self.code))
        _set(
            self,
            "message",
            _text("Error.message", self.message, 0, _MAX_ERROR_MESSAGE, multiline=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """Either direction: an orderly close, with up to 1024 printable characters of reason."""

    TYPE: ClassVar[MsgType] = MsgType.BYE
    reason: str

    def __post_init__(self) -> None:
        _set(self, "reason", _text("Bye.reason", self.reason, 0, _MAX_BYE_REASON, multiline=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """Either direction, after READY: is the other end alive? Answered by :class:`Pong`.

    ``nonce`` is 16 bytes, echoed in the answer.
    """

    TYPE: ClassVar[MsgType] = MsgType.PING
    nonce: bytes

    def __post_init__(self) -> None:
        _set(self, "nonce", _bytes("Ping.nonce", self.nonce, (NONCE_SIZE,)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    """The answer to a :class:`Ping`, carrying its ``nonce``."""

    TYPE: ClassVar[MsgType] = MsgType.PONG
    nonce: bytes

    def __post_init__(self) -> None:
        _set(self, "nonce", _bytes("Pong.nonce", self.nonce, (NONCE_SIZE,)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    """Either direction, after READY: the sender of this message lets its peer send
    ``notes`` (1..2**31) more notifications (flow control, see :mod:`hixl.engine.inbox`)."""

    TYPE: ClassVar[MsgType] = MsgType.CREDIT
    notes: int

    def __post_init__(self) -> None:
        _set(self, "notes", _int("Credit.notes", self.notes, 1, 1 << 31))


@dataclass(frozen=True, slots=True, kw_only=True)
class Sealed:
    """Either direction, after READY: one whole frame (``frame``, its header included) with
    the sender's sequence number ``seq`` (u64) and ``mac`` (32 bytes) over both.

    The payload is binary (``seq`` big-endian, ``mac``, ``frame``), not JSON. Decoding a
    SEALED frame does not look inside ``frame``: :class:`hixl.core.seal.Opener` checks the
    MAC and the number first, then decodes it.
    """

    TYPE: ClassVar[MsgType] = MsgType.SEALED
    seq: int
    mac: bytes
    frame: bytes

    def __post_init__(self) -> None:
        _set(self, "seq", _int("Sealed.seq", self.seq, 0, _U64_MAX))
        _set(self, "mac", _bytes("Sealed.mac", self.mac, (PROOF_SIZE,)))
        frame = _bytes("Sealed.frame", self.frame, None, _U32_MAX)
        if len(frame) < HEADER_SIZE:
            raise HandshakeError(
                f"Sealed.frame has {len(frame)} bytes, less than a {HEADER_SIZE}-byte header"
            )
        _set(self, "frame", frame)


Message = (
    Hello
    | Challenge
    | Info
    | Accept
    | Ready
    | Regions
    | Error
    | Bye
    | Ping
    | Pong
    | Sealed
    | Credit
)

_CLASSES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Challenge,
        Info,
        Accept,
        Ready,
        Regions,
        Error,
        Bye,
        Ping,
        Pong,
        Sealed,
        Credit,
    )
}
assert set(_CLASSES) == set(MsgType)
