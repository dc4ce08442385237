"""Huawei CANN hixl's Python call style, on top of hixl's own engine.

Code written against Huawei's ``hixl`` Python package (``hixl.Hixl``,
``register_mem``, ``transfer_sync``, status codes ...) runs on soft-RoCE by
changing one import::

    from hixl import compat as hixl      # instead of: import hixl

Everything else keeps its names, argument order and return shapes: calls
return a status code (an :class:`int`, here a :class:`Status` member), and
calls that produce a value return ``(status, value)``.  No call raises for an
expected failure; the reason goes to the ``hixl.compat`` logger (warning
level) and to :attr:`Hixl.last_error`.  ``docs/compat.md`` lists what is
covered, which options are honoured and how errors map to codes.

Theory of operation
-------------------
One :class:`Hixl` owns one :class:`hixl.Engine`, built with the alignment
policy off (hixl callers pass arbitrary addresses).  ``register_mem``
registers ``(addr, len)`` with remote read and write access, as hixl exposes
every registered region to its peers.  A ``transfer_sync`` list of
:class:`TransferOpDesc` with absolute addresses is checked in full first,
then every desc is placed in the local region and the peer region that hold
it, and the descs of each (local, remote) pair become one
:class:`hixl.BlockListDesc` per side, in list order, so the byte stream of
the local list lands on the remote list desc by desc.  All pairs go to the
engine as one batch, so a list either is posted whole or not at all.

The pure parts (status mapping, option parsing, engine id rules and desc
grouping) import nothing that touches a device and are unit-tested alone.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from hixl.core.descriptors import BlockListDesc
from hixl.engine import (
    Access,
    Connection,
    ConnState,
    Engine,
    Region,
    TransferHandle,
    TransferRequest,
)
from hixl.engine import TransferStatus as _EngineStatus
from hixl.errors import (
    ArgumentError,
    DescriptorError,
    HixlError,
    RegistrationError,
    StateError,
    TransferTimeout,
    VerbsError,
)

log = logging.getLogger("hixl.compat")

__all__ = [
    "ALREADY_CONNECTED",
    "FAILED",
    "FEATURE_NOT_SUPPORTED",
    "FEATURE_SUPPORTED",
    "NOTIFY_FAILED",
    "NOT_CONNECTED",
    "OPTION_ALIGNMENT",
    "OPTION_ASYNC_TRANSFER_TIMEOUT",
    "OPTION_AUTO_CONNECT",
    "OPTION_BUFFER_POOL",
    "OPTION_DEVICE",
    "OPTION_DEVICE_MEM_AS_HOST",
    "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_TOKEN",
    "PARAM_INVALID",
    "RESOURCE_EXHAUSTED",
    "SUCCESS",
    "TIMEOUT",
    "UNSUPPORTED",
    "CompatOptions",
    "DescGroup",
    "FeatureType",
    "GetTransferStatusArgs",
    "Hixl",
    "MemDesc",
    "MemType",
    "NotifyDesc",
    "Status",
    "TransferArgs",
    "TransferOp",
    "TransferOpDesc",
    "TransferResult",
    "TransferStatus",
    "check_notify",
    "checked_desc",
    "engine_id_for",
    "get_capability",
    "group_op_descs",
    "parse_options",
    "status_of",
]


# ------------------------------------------------------------------ codes and enums


class Status(enum.IntEnum):
    """Status codes, with hixl's numeric values (plain ints compare equal)."""

    SUCCESS = 0
    PARAM_INVALID = 103900
    TIMEOUT = 103901
    NOT_CONNECTED = 103902
    ALREADY_CONNECTED = 103903
    NOTIFY_FAILED = 103904
    UNSUPPORTED = 103905
    FAILED = 503900
    RESOURCE_EXHAUSTED = 203900


SUCCESS = Status.SUCCESS
PARAM_INVALID = Status.PARAM_INVALID
TIMEOUT = Status.TIMEOUT
NOT_CONNECTED = Status.NOT_CONNECTED
ALREADY_CONNECTED = Status.ALREADY_CONNECTED
NOTIFY_FAILED = Status.NOTIFY_FAILED
UNSUPPORTED = Status.UNSUPPORTED
FAILED = Status.FAILED
RESOURCE_EXHAUSTED = Status.RESOURCE_EXHAUSTED


class MemType(enum.IntEnum):
    """Where registered memory lives.  Only host memory exists on rxe (see ``register_mem``)."""

    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(enum.IntEnum):
    """``READ``: remote to local (RDMA READ).  ``WRITE``: local to remote (RDMA WRITE)."""

    READ = 0
    WRITE = 1


class TransferStatus(enum.IntEnum):
    """State of an asynchronous transfer.  ``TIMEOUT`` is never reported (as in hixl)."""

    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2
    FAILED = 3


class FeatureType(enum.IntEnum):
    """Capabilities :func:`get_capability` answers for."""

    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1


FEATURE_SUPPORTED = 1
FEATURE_NOT_SUPPORTED = 0

# Option keys of hixl's initialize().
OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"

# Keys only this compat layer knows (hixl would ignore or refuse them).
OPTION_TOKEN = "hixl.Token"
OPTION_ALIGNMENT = "hixl.Alignment"
OPTION_DEVICE = "hixl.Device"
OPTION_DEVICE_MEM_AS_HOST = "hixl.DeviceMemAsHost"
OPTION_ASYNC_TRANSFER_TIMEOUT = "hixl.AsyncTransferTimeout"

_DEFAULT_ASYNC_TIMEOUT_MS = 60_000
_AUTO_CONNECT_TIMEOUT_S = 10.0
_MAX_NOTIFY_FIELD = 1024  # hixl's limit on NotifyDesc.name and .notify_msg, characters
_ENGINE_NOTIFY_NAME = 256  # the engine's limit on a notification name, characters
_ENGINE_NOTIFY_BYTES = 1024  # the engine's limit on name + NUL + message, bytes
_ADDR_LIMIT = 1 << 64


# ------------------------------------------------------------------ value types
# Mutable, like the objects of hixl's binding (``args.user_data = 7`` must work); they are
# checked when a call uses them, and a bad one makes that call return PARAM_INVALID.


@dataclass(slots=True)
class MemDesc:
    """Memory to register: ``len`` bytes at address ``addr``.

    ``local_only=True`` registers it for this side's use only (peers cannot
    read or write it).  The caller keeps the memory alive until it is
    deregistered.
    """

    addr: int = 0
    len: int = 0
    local_only: bool = False


@dataclass(slots=True)
class TransferOpDesc:
    """One piece of a transfer: ``len`` bytes between two absolute addresses."""

    local_addr: int = 0
    remote_addr: int = 0
    len: int = 0


@dataclass(slots=True)
class NotifyDesc:
    """A notification: a ``name`` and a message text ``notify_msg``."""

    name: str = ""
    notify_msg: str = ""


@dataclass(slots=True)
class TransferArgs:
    """Options of ``transfer_async``: ``user_data`` comes back in :class:`TransferResult`."""

    user_data: int = 0


@dataclass(slots=True)
class GetTransferStatusArgs:
    """Options of ``get_all_transfer_status``."""

    max_query_count: int = 0xFFFFFFFF
    skip_waiting: bool = False


@dataclass(slots=True)
class TransferResult:
    """One asynchronous request's state, from ``get_all_transfer_status``."""

    req: int
    user_data: int
    status: TransferStatus


# ------------------------------------------------------------------ pure core: errors


class _Refusal(HixlError):
    """A call refused with a definite status code (raised inside this module only)."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> Status:
    """The status code a hixl call reports for ``exc``.

    Bad arguments, descriptors, bounds, alignment and unregistered memory give
    PARAM_INVALID; deadlines give TIMEOUT; completion errors, broken or
    refused connections, device and state problems give FAILED.
    """
    if isinstance(exc, _Refusal):
        return exc.code
    if isinstance(exc, TransferTimeout | TimeoutError):
        return Status.TIMEOUT
    if isinstance(exc, ValueError | TypeError | OverflowError):
        # hixl's ValueError family: ArgumentError, DescriptorError, AlignmentError,
        # BoundsError, RegistrationError.
        return Status.PARAM_INVALID
    return Status.FAILED  # CompletionError, VerbsError, PeerError, StateError, DeviceError...


# ------------------------------------------------------------------ pure core: options


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatOptions:
    """What :func:`parse_options` made of an ``initialize`` options dict.

    Honoured: ``auto_connect``, ``token``, ``alignment``, ``device``,
    ``device_mem_as_host``, ``async_timeout_ms``.  ``ignored`` names the
    hixl keys that were valid but have no effect on rxe; ``unknown`` names
    keys neither hixl nor this layer knows.
    """

    auto_connect: bool = False
    token: str | None = None
    alignment: int | None = None
    device: str | None = None
    device_mem_as_host: bool = False
    async_timeout_ms: int = _DEFAULT_ASYNC_TIMEOUT_MS
    buffer_pool: tuple[int, int] | None = None
    traffic_class: int | None = None
    service_level: int | None = None
    ignored: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def _int_text(key: str, value: str, low: int, high: int) -> int:
    text = value.strip()
    body = text[1:] if text[:1] in "+-" else text
    if not body.isdigit() or not body.isascii():
        raise ArgumentError(f"option {key}={value!r}: expected a decimal integer")
    number = int(text)
    if not low <= number <= high:
        raise ArgumentError(f"option {key}={value!r}: out of range [{low}, {high}]")
    return number


def _flag(key: str, value: str) -> bool:
    text = value.strip()
    if text not in ("0", "1"):
        raise ArgumentError(f"option {key}={value!r}: expected '0' or '1'")
    return text == "1"


def _json_object(key: str, value: str, *, empty_ok: bool) -> None:
    if empty_ok and not value.strip():
        return
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ArgumentError(f"option {key}: not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ArgumentError(f"option {key}: expected a JSON object, got {type(parsed).__name__}")


def parse_options(options: Mapping[str, str] | None) -> CompatOptions:
    """Check and interpret the ``options`` of ``initialize``.

    Keys may carry hixl's older ``"adxl."`` prefix.  Values must be strings.
    Raises :class:`ArgumentError` naming the key for a malformed value, and a
    refusal that maps to UNSUPPORTED for ``EnableUseFabricMem=1`` (an Ascend
    HCCS feature with no rxe equivalent).
    """
    if options is None:
        return CompatOptions()
    if not isinstance(options, Mapping):
        raise ArgumentError(f"options must be a dict of str to str, got {type(options).__name__}")
    values: dict[str, str] = {}
    for raw_key, value in options.items():
        if not isinstance(raw_key, str) or not isinstance(value, str):
            raise ArgumentError(
                f"options must map str to str: {raw_key!r} -> {value!r} ({type(value).__name__})"
            )
        key = raw_key.removeprefix("adxl.")
        if key in values:
            raise ArgumentError(f"option {key} given twice (with and without 'adxl.')")
        values[key] = value

    fields: dict[str, Any] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    if OPTION_BUFFER_POOL in values and OPTION_ENABLE_USE_FABRIC_MEM in values:
        raise ArgumentError(
            f"options {OPTION_BUFFER_POOL} and {OPTION_ENABLE_USE_FABRIC_MEM} "
            "cannot be given together"
        )
    for key, value in values.items():
        if key == OPTION_AUTO_CONNECT:
            fields["auto_connect"] = _flag(key, value)
        elif key == OPTION_BUFFER_POOL:
            num, sep, size = value.strip().partition(":")
            if not sep:
                raise ArgumentError(f"option {key}={value!r}: expected 'BUFFER_NUM:BUFFER_SIZE'")
            fields["buffer_pool"] = (
                _int_text(key, num, 0, 1 << 20),
                _int_text(key, size, 0, 1 << 20),
            )
            ignored.append(key)
        elif key == OPTION_ENABLE_USE_FABRIC_MEM:
            if _flag(key, value):
                raise _Refusal(
                    Status.UNSUPPORTED,
                    f"option {key}=1: Fabric Mem is an Ascend HCCS feature; rxe has none",
                )
            ignored.append(key)
        elif key == OPTION_RDMA_TRAFFIC_CLASS:
            tc = _int_text(key, value, 0, 255)
            if tc % 4:
                raise ArgumentError(f"option {key}={value!r}: must be a multiple of 4")
            fields["traffic_class"] = tc
            ignored.append(key)
        elif key == OPTION_RDMA_SERVICE_LEVEL:
            fields["service_level"] = _int_text(key, value, 0, 7)
            ignored.append(key)
        elif key in (OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_LOCAL_COMM_RES):
            _json_object(key, value, empty_ok=True)
            ignored.append(key)
        elif key == OPTION_TOKEN:
            if not value:
                raise ArgumentError(f"option {key}: the token must not be empty")
            fields["token"] = value
        elif key == OPTION_ALIGNMENT:
            a = _int_text(key, value, 0, 1 << 20)
            if a & (a - 1):
                raise ArgumentError(f"option {key}={value!r}: must be 0 (off) or a power of two")
            fields["alignment"] = a or None
        elif key == OPTION_DEVICE:
            if not value.strip():
                raise ArgumentError(f"option {key}: the device name must not be empty")
            fields["device"] = value.strip()
        elif key == OPTION_DEVICE_MEM_AS_HOST:
            fields["device_mem_as_host"] = _flag(key, value)
        elif key == OPTION_ASYNC_TRANSFER_TIMEOUT:
            fields["async_timeout_ms"] = _int_text(key, value, 1, 24 * 3600 * 1000)
        else:
            unknown.append(key)
    return CompatOptions(**fields, ignored=tuple(ignored), unknown=tuple(unknown))


# ------------------------------------------------------------------ pure core: engine ids


def engine_id_for(local_engine: str) -> str:
    """The hixl engine id for hixl's ``local_engine`` argument.

    ``"ip:port"`` with port > 0 listens there; ``"ip"``, ``"[v6]"`` or a port
    <= 0 make a client that only connects out (engine id ``"ip:0"``; the
    engine adds a random suffix).  IPv6 addresses must be bracketed.  Raises
    :class:`ArgumentError` for anything else.
    """
    if not isinstance(local_engine, str) or not local_engine.strip():
        raise ArgumentError(f"local_engine must be a non-empty str, got {local_engine!r}")
    text = local_engine.strip()
    port_text: str | None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ArgumentError(f"local_engine {text!r}: '[' without ']'")
        host, rest = text[: end + 1], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ArgumentError(f"local_engine {text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
    else:
        if text.count(":") > 1:
            raise ArgumentError(
                f"local_engine {text!r}: IPv6 addresses must be written [addr] or [addr]:port"
            )
        host, sep, port_part = text.partition(":")
        port_text = port_part if sep else None
    if not host or host == "[]":
        raise ArgumentError(f"local_engine {text!r}: no host")
    port = 0 if port_text is None else _int_text("local_engine port", port_text, -(1 << 31), 65535)
    return f"{host}:{max(port, 0)}"


# ------------------------------------------------------------------ pure core: descs


class _Span(Protocol):
    """What grouping needs of a region: its start address and length in bytes."""

    @property
    def addr(self) -> int: ...

    @property
    def length(self) -> int: ...


L = TypeVar("L", bound=_Span)
R = TypeVar("R", bound=_Span)


@dataclass(frozen=True, slots=True)
class DescGroup(Generic[L, R]):
    """The descs of one (local region, remote region) pair, as one descriptor per side.

    ``local_desc``/``remote_desc`` hold offsets relative to ``local.addr`` and
    ``remote.addr``, in the order of ``indices`` (positions in the op_descs list).
    """

    local: L
    remote: R
    local_desc: BlockListDesc
    remote_desc: BlockListDesc
    indices: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: object) -> int | None:
    """``value`` when it is a true int (not a bool), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def checked_desc(index: int, desc: object) -> tuple[int, int, int]:
    """``(local_addr, remote_addr, len)`` of ``op_descs[index]``, checked.

    Raises :class:`ArgumentError` unless all three are ints, the addresses
    are >= 0, ``len`` >= 1 and neither range passes the end of the 64-bit space.
    """
    values = []
    for field in ("local_addr", "remote_addr", "len"):
        value = _as_int(getattr(desc, field, None))
        if value is None:
            raise ArgumentError(
                f"op_descs[{index}].{field} must be an int, got "
                f"{getattr(desc, field, None)!r} (desc {desc!r})"
            )
        values.append(value)
    local_addr, remote_addr, nbytes = values
    if nbytes < 1:
        raise ArgumentError(f"op_descs[{index}]: len={nbytes}, must be >= 1")
    for name, addr in (("local_addr", local_addr), ("remote_addr", remote_addr)):
        if addr < 0 or addr + nbytes > _ADDR_LIMIT:
            raise ArgumentError(
                f"op_descs[{index}]: {name}={addr:#x} len={nbytes} is outside the 64-bit "
                "address space"
            )
    return local_addr, remote_addr, nbytes


def group_op_descs(
    op_descs: Iterable[object],
    find_local: Callable[[int, int], L],
    find_remote: Callable[[int, int], R],
    *,
    alignment: int | None = None,
) -> list[DescGroup[L, R]]:
    """Check every desc, place it in its regions, and group them per region pair.

    ``find_local(addr, nbytes)``/``find_remote(addr, nbytes)`` return the
    region holding that range or raise :class:`RegistrationError`.  Groups come
    in order of first appearance; inside a group descs keep their list order.
    ``alignment`` is the policy the descriptors are built under (None = off).

    Raises :class:`ArgumentError` for an empty list or a malformed desc,
    :class:`RegistrationError` (prefixed with the desc's index) for memory that no
    region holds, and :class:`DescriptorError`/:class:`AlignmentError` from the
    descriptors themselves.  Nothing is returned unless every desc is valid.
    """
    if isinstance(op_descs, str | bytes) or not isinstance(op_descs, Iterable):
        raise ArgumentError(f"op_descs must be a list of TransferOpDesc, got {op_descs!r}")
    checked = [checked_desc(i, d) for i, d in enumerate(op_descs)]
    if not checked:
        raise ArgumentError("op_descs is empty: nothing to transfer")
    groups: dict[tuple[int, int], tuple[L, R, list[int]]] = {}
    for i, (local_addr, remote_addr, nbytes) in enumerate(checked):
        try:
            local = find_local(local_addr, nbytes)
            remote = find_remote(remote_addr, nbytes)
        except RegistrationError as exc:
            raise RegistrationError(f"op_descs[{i}]: {exc}") from exc
        key = (id(local), id(remote))
        if key not in groups:
            groups[key] = (local, remote, [])
        groups[key][2].append(i)
    out: list[DescGroup[L, R]] = []
    for local, remote, indices in groups.values():
        try:
            ldesc = BlockListDesc.from_pairs(
                ((checked[i][0] - local.addr, checked[i][2]) for i in indices),
                alignment=alignment,
            )
            rdesc = BlockListDesc.from_pairs(
                ((checked[i][1] - remote.addr, checked[i][2]) for i in indices),
                alignment=alignment,
            )
        except DescriptorError as exc:
            shown = f"{indices[:8]}{'...' if len(indices) > 8 else ''}"
            raise type(exc)(f"op_descs {shown}: {exc}") from exc
        out.append(DescGroup(local, remote, ldesc, rdesc, tuple(indices)))
    return out


def check_notify(notify: object) -> tuple[str, bytes]:
    """``(name, message bytes)`` of a :class:`NotifyDesc`, checked against both limits.

    hixl allows 1024 characters for each field; the engine carries a name of
    1..256 characters without NUL and at most 1024 bytes of name, NUL and
    UTF-8 message together.  Raises :class:`ArgumentError` past either.
    """
    name = getattr(notify, "name", None)
    msg = getattr(notify, "notify_msg", None)
    if not isinstance(name, str) or not isinstance(msg, str):
        raise ArgumentError(f"notify must be a NotifyDesc with str name and notify_msg: {notify!r}")
    if len(name) > _MAX_NOTIFY_FIELD or len(msg) > _MAX_NOTIFY_FIELD:
        raise ArgumentError(
            f"notify name/notify_msg are {len(name)}/{len(msg)} characters, "
            f"at most {_MAX_NOTIFY_FIELD} each"
        )
    if not name or len(name) > _ENGINE_NOTIFY_NAME or "\0" in name:
        raise ArgumentError(
            f"notify name must be 1..{_ENGINE_NOTIFY_NAME} characters without NUL here "
            f"(got {len(name)})"
        )
    raw = msg.encode("utf-8")
    total = len(name.encode("utf-8")) + 1 + len(raw)
    if total > _ENGINE_NOTIFY_BYTES:
        raise ArgumentError(
            f"notify too large: name+message take {total} bytes in UTF-8, "
            f"at most {_ENGINE_NOTIFY_BYTES} here"
        )
    return name, raw


def _timeout_s(call: str, timeout_in_millis: object) -> float:
    if (
        not isinstance(timeout_in_millis, int | float)
        or isinstance(timeout_in_millis, bool)
        or not math.isfinite(timeout_in_millis)
        or timeout_in_millis <= 0
    ):
        raise ArgumentError(f"{call}: timeout_in_millis must be > 0, got {timeout_in_millis!r}")
    return float(timeout_in_millis) / 1000.0


def _op_kind(op: object) -> str:
    try:
        kind = TransferOp(op)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise ArgumentError(f"op must be TransferOp.READ or TransferOp.WRITE, got {op!r}") from None
    return "read" if kind is TransferOp.READ else "write"


def get_capability(feature_type: object) -> tuple[Status, int]:
    """``(status, FEATURE_SUPPORTED | FEATURE_NOT_SUPPORTED)`` for ``feature_type``.

    Auto connect and client/server communication are supported; other
    non-negative values are not; a negative or non-int value is PARAM_INVALID.
    """
    value = _as_int(feature_type)
    if value is None or value < 0:
        return Status.PARAM_INVALID, FEATURE_NOT_SUPPORTED
    supported = value in {int(f) for f in FeatureType}
    return Status.SUCCESS, FEATURE_SUPPORTED if supported else FEATURE_NOT_SUPPORTED


# ------------------------------------------------------------------ the Hixl object


@dataclass(slots=True)
class _Pending:
    handle: TransferHandle
    user_data: int
    peer: str


class Hixl:
    """One hixl instance: call :meth:`initialize` first and :meth:`finalize` last.

    Every method returns a status code (or ``(status, value)``) and never
    raises for a failure; :attr:`last_error` holds the reason of the latest
    one.  Methods may be called from several threads.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._engine: Engine | None = None
        self._options = CompatOptions()
        self._handles: dict[int, Region] = {}
        self._next_handle = 1
        self._outbound: set[str] = set()  # peers this side connected to
        self._pending: dict[int, _Pending] = {}
        self._next_req = 1
        self.last_error = ""

    # -- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> Hixl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finalize()

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is not None:
            warnings.warn(
                "hixl.compat.Hixl collected without finalize(); finalizing now",
                ResourceWarning,
                stacklevel=2,
            )
            with contextlib.suppress(Exception):
                self.finalize()

    def __repr__(self) -> str:
        state = "uninitialized" if self._engine is None else f"engine={self._engine.id}"
        return f"<hixl.compat.Hixl {state} mems={len(self._handles)} pending={len(self._pending)}>"

    @property
    def engine_id(self) -> str | None:
        """The id peers know this instance by (a client's has a ``~suffix``), or None."""
        engine = self._engine
        return None if engine is None else str(engine.id)

    @property
    def engine(self) -> Engine | None:
        """The underlying :class:`hixl.Engine` (None before ``initialize``), for native calls."""
        return self._engine

    @property
    def options(self) -> CompatOptions:
        """The options as ``initialize`` understood them."""
        return self._options

    def _fail(self, call: str, exc: BaseException) -> Status:
        code = status_of(exc)
        self.last_error = f"{call}: {exc}"
        if isinstance(exc, HixlError | ValueError | TypeError | OSError):
            log.warning("%s -> %s: %s", call, code.name, exc)
        else:  # not an expected failure: keep the traceback for the bug report
            log.error("%s -> %s: unexpected %r", call, code.name, exc, exc_info=exc)
        return code

    def _require(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise _Refusal(Status.FAILED, "not initialized: call initialize() first")
        return engine

    def initialize(self, local_engine: str, options: Mapping[str, str] | None = None) -> Status:
        """Create the engine named by ``local_engine`` (``"ip:port"`` listens, ``"ip"`` connects).

        Returns SUCCESS (also when already initialized: the call is then
        ignored), PARAM_INVALID for a bad id or option, UNSUPPORTED for an
        option that asks for an Ascend-only feature, FAILED when no verbs
        device is usable or the address cannot be bound.
        """
        try:
            with self._lock:
                if self._engine is not None:
                    return Status.SUCCESS
                opts = parse_options(options)
                engine_id = engine_id_for(local_engine)
                for key in opts.ignored:
                    log.info("initialize: option %s accepted but has no effect on rxe", key)
                for key in opts.unknown:
                    log.warning("initialize: unknown option %r ignored", key)
                engine = Engine(
                    engine_id,
                    device=opts.device,
                    token=opts.token,
                    alignment=opts.alignment,
                )
                self._engine, self._options = engine, opts
                log.debug("initialized %s as engine %s", local_engine, engine.id)
                return Status.SUCCESS
        except Exception as exc:
            return self._fail("initialize", exc)

    def finalize(self) -> None:
        """Close every link, release registrations and the engine.  Safe to call twice.

        Pending asynchronous transfers fail; their ids are forgotten.
        ``initialize`` may be called again afterwards.
        """
        with self._lock:
            engine, self._engine = self._engine, None
            self._handles.clear()
            self._outbound.clear()
            self._pending.clear()
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # noqa: BLE001 - finalize reports nothing, never raises
                self._fail("finalize", exc)

    # -- memory --------------------------------------------------------------------------
    def register_mem(self, mem_desc: MemDesc, mem_type: MemType) -> tuple[Status, int]:
        """Register ``mem_desc.len`` bytes at ``mem_desc.addr``; return ``(status, handle)``.

        The memory is exposed to peers for remote read and write unless
        ``mem_desc.local_only``.  Registering the same range again returns
        the same handle.  MEM_DEVICE (NPU memory) does not exist on rxe and
        gives PARAM_INVALID, unless the option ``hixl.DeviceMemAsHost=1``
        says such addresses are host memory.  The handle is 0 on failure.
        """
        try:
            engine = self._require()
            addr = _as_int(getattr(mem_desc, "addr", None))
            length = _as_int(getattr(mem_desc, "len", None))
            if addr is None or length is None or addr <= 0 or length <= 0:
                raise ArgumentError(
                    "mem_desc needs int addr > 0 and len > 0, got "
                    f"addr={getattr(mem_desc, 'addr', None)!r} "
                    f"len={getattr(mem_desc, 'len', None)!r}"
                )
            try:
                kind = MemType(mem_type)
            except (ValueError, TypeError):
                raise ArgumentError(f"mem_type must be a MemType, got {mem_type!r}") from None
            if kind is MemType.MEM_DEVICE and not self._options.device_mem_as_host:
                raise ArgumentError(
                    "MEM_DEVICE memory (NPU memory) does not exist on rxe; register host memory "
                    f"as MEM_HOST, or pass option {OPTION_DEVICE_MEM_AS_HOST}='1' to treat "
                    "device addresses as host memory"
                )
            access = (
                Access.LOCAL_WRITE
                if getattr(mem_desc, "local_only", False)
                else Access.REMOTE_READ | Access.REMOTE_WRITE
            )
            with self._lock:
                try:
                    region = engine.register((addr, length), access=access)
                except VerbsError as exc:
                    if exc.errno in (errno.EFAULT, errno.EINVAL):
                        raise ArgumentError(
                            f"addr={addr:#x} len={length} cannot be registered: {exc}"
                        ) from exc
                    raise
                for handle, known in self._handles.items():
                    if known is region:
                        return Status.SUCCESS, handle
                handle = self._next_handle
                self._next_handle += 1
                self._handles[handle] = region
                return Status.SUCCESS, handle
        except Exception as exc:
            return self._fail("register_mem", exc), 0

    def deregister_mem(self, mem_handle: int) -> Status:
        """Release the registration ``mem_handle`` from ``register_mem``.

        Returns PARAM_INVALID for 0 or a non-int, SUCCESS for an unknown
        non-zero handle (nothing to do, as in hixl) and for a repeated call.
        Peers are told the memory is gone; transfers to it then give PARAM_INVALID.
        """
        try:
            engine = self._require()
            if not _is_int(mem_handle) or mem_handle == 0:
                raise ArgumentError(f"mem_handle must be a non-zero int, got {mem_handle!r}")
            with self._lock:
                region = self._handles.pop(mem_handle, None)
                if region is not None:
                    engine.deregister(region)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("deregister_mem", exc)

    # -- links ---------------------------------------------------------------------------
    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Link to the instance listening at ``remote_engine`` (``"ip:port"``).

        Returns SUCCESS, ALREADY_CONNECTED when this side already has a
        working link to it, PARAM_INVALID for a bad id or timeout, TIMEOUT
        when the handshake does not finish in time, FAILED when the peer
        cannot be reached or refuses.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("connect", timeout_in_millis)
            peer = _peer(remote_engine)
            with self._lock:
                if (
                    peer in self._outbound
                    and peer in engine.peers
                    and engine.connection(peer).state is ConnState.READY
                ):
                    raise _Refusal(Status.ALREADY_CONNECTED, f"already connected to {peer}")
            engine.connect(peer, timeout=timeout)
            with self._lock:
                self._outbound.add(peer)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("connect", exc)

    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> Status:
        """Close the link to ``remote_engine`` (made by either side).

        Returns SUCCESS, NOT_CONNECTED when there is no link, PARAM_INVALID
        for a bad timeout.  Pending transfers on that link fail.
        """
        try:
            engine = self._require()
            _timeout_s("disconnect", timeout_in_millis)
            peer = _peer(remote_engine)
            with self._lock:
                self._outbound.discard(peer)
                if peer not in engine.peers:
                    raise _Refusal(Status.NOT_CONNECTED, f"not connected to {peer}")
                engine.disconnect(peer)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("disconnect", exc)

    def _link(self, engine: Engine, peer: str) -> Connection:
        """The working connection to ``peer``, made now under the AutoConnect option."""
        if peer in engine.peers:
            conn = engine.connection(peer)
            if conn.state is ConnState.READY:
                return conn
            if not self._options.auto_connect:
                raise _Refusal(
                    Status.FAILED,
                    f"the link to {peer} is {conn.state.name}: {conn.failure}; "
                    "disconnect() and connect() again",
                )
        elif not self._options.auto_connect:
            raise _Refusal(
                Status.NOT_CONNECTED,
                f"not connected to {peer} (links: {sorted(engine.peers)}); call connect() first",
            )
        conn = engine.connect(peer, timeout=_AUTO_CONNECT_TIMEOUT_S)
        with self._lock:
            self._outbound.add(peer)
        return conn

    def _requests(
        self, engine: Engine, peer: str, op: object, op_descs: object
    ) -> list[TransferRequest]:
        kind = _op_kind(op)
        if not isinstance(op_descs, Sequence) or isinstance(op_descs, str | bytes):
            raise ArgumentError(f"op_descs must be a list of TransferOpDesc, got {op_descs!r}")
        for i, desc in enumerate(op_descs):
            checked_desc(i, desc)  # bad descs before link problems, as hixl reports them
        conn = self._link(engine, peer)
        groups = group_op_descs(
            op_descs, engine.find_region, conn.find_remote, alignment=engine.alignment
        )
        return [
            TransferRequest(
                op=kind,
                local=g.local,
                remote=g.remote,
                local_desc=g.local_desc,
                remote_desc=g.remote_desc,
            )
            for g in groups
        ]

    # -- transfers -----------------------------------------------------------------------
    def transfer_sync(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        timeout_in_millis: int = 1000,
    ) -> Status:
        """Move every desc of ``op_descs`` (READ: remote to local, WRITE: local to remote).

        All descs go as one batch; the call returns when every byte has
        landed.  Returns SUCCESS; PARAM_INVALID for a bad op, timeout or
        desc, or memory that no registered region (local, or the peer's)
        wholly holds; NOT_CONNECTED without a link; TIMEOUT when the batch
        misses its deadline (the link is then unusable: disconnect and
        connect again); FAILED for a completion error or a broken link.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("transfer_sync", timeout_in_millis)
            peer = _peer(remote_engine)
            requests = self._requests(engine, peer, op, op_descs)
            engine.transfer(peer, requests, timeout=timeout)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("transfer_sync", exc)

    def transfer_async(
        self,
        remote_engine: str,
        op: TransferOp,
        op_descs: Sequence[TransferOpDesc],
        args: TransferArgs | None = None,
    ) -> tuple[Status, int]:
        """Start a transfer as ``transfer_sync`` does; return ``(status, req_id)``.

        Poll ``get_transfer_status(req_id)``.  Errors found before posting are
        returned here (req_id 0) with the codes of ``transfer_sync``.  The
        transfer has a deadline (60 s, option ``hixl.AsyncTransferTimeout``
        in ms), after which it reports FAILED.
        """
        try:
            engine = self._require()
            peer = _peer(remote_engine)
            user_data = 0 if args is None else getattr(args, "user_data", 0)
            if not _is_int(user_data):
                raise ArgumentError(f"args.user_data must be an int, got {user_data!r}")
            requests = self._requests(engine, peer, op, op_descs)
            handle = engine.transfer_async(
                peer, requests, timeout=self._options.async_timeout_ms / 1000.0
            )
            with self._lock:
                req = self._next_req
                self._next_req += 1
                self._pending[req] = _Pending(handle, int(user_data), peer)
            return Status.SUCCESS, req
        except Exception as exc:
            return self._fail("transfer_async", exc), 0

    def _report(self, req: int, pending: _Pending) -> tuple[Status, TransferStatus]:
        """State of one request; a finished one is forgotten (caller holds the lock)."""
        state = pending.handle.status
        if state is _EngineStatus.PENDING:
            return Status.SUCCESS, TransferStatus.WAITING
        del self._pending[req]
        if state is _EngineStatus.DONE:
            return Status.SUCCESS, TransferStatus.COMPLETED
        error = pending.handle.error or StateError("transfer failed without an error")
        return self._fail(f"transfer {req} to {pending.peer}", error), TransferStatus.FAILED

    def get_transfer_status(self, req_id: int) -> tuple[Status, TransferStatus]:
        """``(status, TransferStatus)`` of the request ``req_id`` from ``transfer_async``.

        WAITING while it runs; COMPLETED (with SUCCESS) once every byte
        landed; FAILED with the failure's code (FAILED, TIMEOUT, ...).  After
        COMPLETED or FAILED the id is released, and asking again (or for an
        unknown id) gives ``(PARAM_INVALID, FAILED)``.
        """
        try:
            self._require()
            with self._lock:
                pending = self._pending.get(req_id) if _is_int(req_id) else None
                if pending is None:
                    raise ArgumentError(f"unknown transfer request id {req_id!r}")
                return self._report(req_id, pending)
        except Exception as exc:
            return self._fail("get_transfer_status", exc), TransferStatus.FAILED

    def get_all_transfer_status(
        self, args: GetTransferStatusArgs | None = None
    ) -> tuple[Status, list[TransferResult]]:
        """Every asynchronous request's state, oldest first: ``(status, [TransferResult])``.

        At most ``args.max_query_count`` results; WAITING ones are left out
        with ``args.skip_waiting``.  Finished requests reported here are
        released, as by ``get_transfer_status``.
        """
        try:
            self._require()
            args = args or GetTransferStatusArgs()
            limit, skip = args.max_query_count, args.skip_waiting
            if not _is_int(limit) or limit < 0:
                raise ArgumentError(f"max_query_count must be an int >= 0, got {limit!r}")
            out: list[TransferResult] = []
            with self._lock:
                for req, pending in list(self._pending.items()):
                    if len(out) >= limit:
                        break
                    _, state = self._report(req, pending)
                    if skip and state is TransferStatus.WAITING:
                        continue
                    out.append(TransferResult(req, pending.user_data, state))
            return Status.SUCCESS, out
        except Exception as exc:
            return self._fail("get_all_transfer_status", exc), []

    # -- notifications -------------------------------------------------------------------
    def send_notify(
        self, remote_engine: str, notify: NotifyDesc, timeout_in_millis: int = 1000
    ) -> Status:
        """Send ``notify`` to ``remote_engine``; it arrives after all data sent before it.

        Returns SUCCESS; PARAM_INVALID for a bad timeout or a name/message
        over the limits (see ``docs/compat.md``); NOT_CONNECTED without a
        link; TIMEOUT or FAILED when it cannot be delivered.
        """
        try:
            engine = self._require()
            timeout = _timeout_s("send_notify", timeout_in_millis)
            peer = _peer(remote_engine)
            name, message = check_notify(notify)
            self._link(engine, peer)
            engine.notify(peer, name, message, timeout=timeout)
            return Status.SUCCESS
        except Exception as exc:
            return self._fail("send_notify", exc)

    def get_notifies(self) -> tuple[Status, list[NotifyDesc]]:
        """Take every notification received so far, oldest first: ``(status, [NotifyDesc])``.

        Messages are decoded as UTF-8 (bad bytes replaced).
        """
        try:
            engine = self._require()
            notes = engine.notifications()
            return Status.SUCCESS, [
                NotifyDesc(n.name, n.message.decode("utf-8", "replace")) for n in notes
            ]
        except Exception as exc:
            return self._fail("get_notifies", exc), []


def _peer(remote_engine: object) -> str:
    if not isinstance(remote_engine, str) or not remote_engine:
        raise ArgumentError(f"remote_engine must be a non-empty str, got {remote_engine!r}")
    return remote_engine
