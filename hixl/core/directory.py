"""Engine announcements, their keys and values in a registry, and a watcher's view of them.

This module is pure: no sockets, no clock, no threads. :mod:`hixl.registry` moves the
values it defines to and from etcd (or the in-process store) and keeps its threads.

Keys and values
---------------
Each engine that registers is one key, ``/hixl/v1/engines/<name>``, whose value is a
UTF-8 JSON object with exactly these keys:

===========  ===================================================================
``v``        format version, ``1``
``name``     the engine's registry name, 1..64 of ``A-Z a-z 0-9 . _ -``
``role``     free label such as ``prefill`` or ``decode``, 1..32 of the same set
``engine``   the engine id ``host:port`` that :meth:`hixl.Engine.connect` takes
``gid``      the device GID, IPv6 text form (stored fully expanded, lowercase)
``mtu``      the device's active MTU, one of 256, 512, 1024, 2048, 4096
``capacity`` a non-negative integer the owner chooses (free KV blocks for decode)
``instance`` 16 lowercase hex digits, new for each process that announces the name
===========  ===================================================================

Nothing else is stored: no rkeys, no addresses, no region lists. Those stay in the
authenticated handshake. Everything read from the registry is untrusted: :func:`decode`
checks every field and raises :class:`ValueError` naming the key and the broken part,
and :class:`Directory` skips such values (reporting them) instead of failing.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hixl.core.checks import shown
from hixl.core.wire import parse_engine_id

__all__ = [
    "PREFIX",
    "MAX_VALUE",
    "MAX_CAPACITY",
    "MTUS",
    "Announcement",
    "EventKind",
    "DirectoryEvent",
    "Directory",
    "Rejected",
    "apply_events",
    "key_for",
    "name_from_key",
    "encode",
    "decode",
    "validate_name",
]

PREFIX = "/hixl/v1/engines/"
"""Every hixl key lives under this prefix; one key per announced name."""

MAX_VALUE = 1024
"""Longest value, in bytes, that :func:`decode` accepts."""

MAX_CAPACITY = 1 << 48
"""Largest capacity an announcement may carry (exclusive)."""

MTUS = (256, 512, 1024, 2048, 4096)

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ROLE_RE = re.compile(r"[A-Za-z0-9._-]{1,32}")
_INSTANCE_RE = re.compile(r"[0-9a-f]{16}")
_KEYS = frozenset({"v", "name", "role", "engine", "gid", "mtu", "capacity", "instance"})


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid registry name, else raise :class:`ValueError`.

    A name is 1..64 characters of ``A-Z a-z 0-9 . _ -``.
    """
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise ValueError(f"registry name {shown(name)} must be 1..64 characters of A-Za-z0-9._-")
    return name


def _int(what: str, value: object, low: int, high: int) -> int:
    if type(value) is not int:
        raise ValueError(f"{what} must be an integer, got {shown(value)}")
    if not low <= value < high:
        raise ValueError(f"{what}={value} out of range [{low}, {high})")
    return value


def _gid(value: object) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError(f"gid {shown(value)} must be an IPv6 address in text form")
    try:
        addr = ipaddress.IPv6Address(value)
    except ValueError as exc:
        raise ValueError(f"gid {shown(value)} is not an IPv6 address: {exc}") from None
    return addr.exploded


@dataclass(frozen=True, slots=True, kw_only=True)
class Announcement:
    """What one engine tells the registry about itself; validated when built.

    ``engine`` is the id :meth:`hixl.Engine.connect` takes (``host:port`` with a port that
    listens, never 0). ``gid`` may be given in any IPv6 text form and is stored expanded.
    Raises :class:`ValueError` naming the field and value.
    """

    name: str
    role: str
    engine: str
    gid: str
    mtu: int
    capacity: int
    instance: str = field(default="0" * 16)

    def __post_init__(self) -> None:
        validate_name(self.name)
        if not isinstance(self.role, str) or _ROLE_RE.fullmatch(self.role) is None:
            raise ValueError(f"role {shown(self.role)} must be 1..32 characters of A-Za-z0-9._-")
        if not isinstance(self.engine, str):
            raise ValueError(f"engine id must be a str, got {shown(self.engine)}")
        _, port = parse_engine_id(self.engine)
        if port == 0 or "~" in self.engine:
            raise ValueError(
                f"engine id {self.engine!r} does not listen (port 0): only a listening "
                "engine can be announced"
            )
        object.__setattr__(self, "gid", _gid(self.gid))
        mtu = _int("mtu", self.mtu, 0, 1 << 16)
        if mtu not in MTUS:
            raise ValueError(f"mtu={mtu} must be one of {', '.join(map(str, MTUS))}")
        _int("capacity", self.capacity, 0, MAX_CAPACITY)
        if not isinstance(self.instance, str) or _INSTANCE_RE.fullmatch(self.instance) is None:
            raise ValueError(f"instance {shown(self.instance)} must be 16 lowercase hex digits")


def key_for(name: str) -> str:
    """The registry key of ``name`` (validated)."""
    return PREFIX + validate_name(name)


def name_from_key(key: str) -> str:
    """The name a key under :data:`PREFIX` stands for; :class:`ValueError` for any other key."""
    if not key.startswith(PREFIX):
        raise ValueError(f"key {shown(key)} is not under {PREFIX}")
    return validate_name(key[len(PREFIX) :])


def encode(ann: Announcement) -> bytes:
    """The value stored for ``ann``: compact JSON with sorted keys."""
    doc = {
        "v": 1,
        "name": ann.name,
        "role": ann.role,
        "engine": ann.engine,
        "gid": ann.gid,
        "mtu": ann.mtu,
        "capacity": ann.capacity,
        "instance": ann.instance,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def decode(key: str, value: bytes) -> Announcement:
    """Parse the untrusted ``value`` stored under ``key``.

    Raises :class:`ValueError` naming the key and what is wrong: not under the prefix, too
    long, not UTF-8 JSON, not an object, a key missing or extra, a field out of range, or a
    ``name`` that differs from the key's.
    """
    name = name_from_key(key)
    if not isinstance(value, bytes | bytearray):
        raise ValueError(f"{key}: value must be bytes, got {type(value).__name__}")
    if len(value) > MAX_VALUE:
        raise ValueError(f"{key}: value has {len(value)} bytes, at most {MAX_VALUE}")
    try:
        doc = json.loads(bytes(value).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{key}: value is not UTF-8 JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{key}: value must be a JSON object, got {type(doc).__name__}")
    if doc.get("v") != 1 or type(doc.get("v")) is not int:
        raise ValueError(f"{key}: format version v={shown(doc.get('v'))}, this hixl reads 1")
    missing = sorted(_KEYS - doc.keys())
    extra = sorted(doc.keys() - _KEYS)
    if missing or extra:
        raise ValueError(f"{key}: value keys missing {missing}, unexpected {extra}")
    if doc["name"] != name:
        raise ValueError(f"{key}: value names {shown(doc['name'])}, the key names {name!r}")
    try:
        return Announcement(
            name=name,
            role=doc["role"],
            engine=doc["engine"],
            gid=doc["gid"],
            mtu=doc["mtu"],
            capacity=doc["capacity"],
            instance=doc["instance"],
        )
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


class EventKind(enum.Enum):
    """What changed for one name."""

    JOIN = "join"
    """A name appeared."""
    UPDATE = "update"
    """A name's announcement changed: capacity, or a restart (a new ``instance``)."""
    LEAVE = "leave"
    """A name disappeared: withdrawn, or its lease expired."""


@dataclass(frozen=True, slots=True)
class DirectoryEvent:
    """One change seen by a watcher.

    ``current`` is the new announcement (``None`` for LEAVE), ``previous`` the one it
    replaces (``None`` for JOIN).
    """

    kind: EventKind
    name: str
    current: Announcement | None
    previous: Announcement | None

    @property
    def restarted(self) -> bool:
        """True for an UPDATE whose announcer is a new process (another ``instance``)."""
        return (
            self.kind is EventKind.UPDATE
            and self.current is not None
            and self.previous is not None
            and self.current.instance != self.previous.instance
        )


@dataclass(frozen=True, slots=True)
class Rejected:
    """A value :class:`Directory` skipped: its key and why."""

    key: str
    reason: str


class Directory:
    """The set of live announcements a watcher knows, and the events that change it.

    Fed with raw keys and values from the registry; a malformed or foreign value is never
    stored and never raises: it is returned in the ``rejected`` list so the caller can warn.
    A value that fails under a name that was valid before counts as that name leaving.
    Not thread-safe: the owner serialises calls.
    """

    def __init__(self, max_members: int = 4096) -> None:
        self.max_members = max_members
        self._members: dict[str, Announcement] = {}

    def members(self) -> dict[str, Announcement]:
        """A copy of the current view: name -> announcement."""
        return dict(self._members)

    def _set(self, name: str, ann: Announcement | None) -> DirectoryEvent | None:
        old = self._members.get(name)
        if ann is None:
            if old is None:
                return None
            del self._members[name]
            return DirectoryEvent(EventKind.LEAVE, name, None, old)
        if old == ann:
            return None
        self._members[name] = ann
        kind = EventKind.JOIN if old is None else EventKind.UPDATE
        return DirectoryEvent(kind, name, ann, old)

    def put(self, key: str, value: bytes) -> tuple[DirectoryEvent | None, Rejected | None]:
        """Apply a put of ``value`` at ``key``: (the event or None, the rejection or None)."""
        try:
            ann = decode(key, value)
        except ValueError as exc:
            event = None
            if key.startswith(PREFIX) and key[len(PREFIX) :] in self._members:
                event = self._set(key[len(PREFIX) :], None)
            return event, Rejected(key, str(exc))
        if ann.name not in self._members and len(self._members) >= self.max_members:
            return None, Rejected(key, f"{key}: directory full ({self.max_members} names)")
        return self._set(ann.name, ann), None

    def delete(self, key: str) -> DirectoryEvent | None:
        """Apply a delete of ``key``; keys that name nothing known are ignored."""
        if not key.startswith(PREFIX):
            return None
        return self._set(key[len(PREFIX) :], None)

    def replace(
        self, items: Iterable[tuple[str, bytes]]
    ) -> tuple[list[DirectoryEvent], list[Rejected]]:
        """Make the view equal to a full listing; return the events that get there.

        Used after (re)connecting: names missing from ``items`` leave, new ones join,
        changed ones update. Events come in name order.
        """
        fresh: dict[str, Announcement] = {}
        rejected: list[Rejected] = []
        for key, value in items:
            try:
                ann = decode(key, value)
            except ValueError as exc:
                rejected.append(Rejected(key, str(exc)))
                continue
            if len(fresh) >= self.max_members:
                rejected.append(Rejected(key, f"{key}: directory full ({self.max_members} names)"))
                continue
            fresh[ann.name] = ann
        events: list[DirectoryEvent] = []
        for name in sorted(self._members.keys() | fresh.keys()):
            event = self._set(name, fresh.get(name))
            if event is not None:
                events.append(event)
        return events, rejected


def apply_events(
    start: Mapping[str, Announcement], events: Iterable[DirectoryEvent]
) -> dict[str, Announcement]:
    """Replay ``events`` on ``start``; what a consumer of the event stream reconstructs."""
    out = dict(start)
    for ev in events:
        if ev.kind is EventKind.LEAVE:
            out.pop(ev.name, None)
        else:
            assert ev.current is not None
            out[ev.name] = ev.current
    return out
