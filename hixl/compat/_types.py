"""The names, numbers and value types of Huawei hixl's Python binding.

The binding (hicann/hixl ``src/python/hixl_py/hixl_py.cc``) defines:

* status codes and option keys as plain module-level ``int``/``str`` values;
* ``MemType``, ``TransferOp`` and ``FeatureType`` as unscoped C++ enums with
  ``export_values()``: they compare equal to ints and their members are also
  module-level names (``hixl.MEM_DEVICE``, ``hixl.READ`` ...);
* ``TransferStatus`` and ``AsyncConnectStatus`` as ``enum class``: ``int()``
  works, but a member never compares equal to a plain int (pybind11's strict
  comparison for scoped enums).  ``AsyncConnectStatus`` exports its values,
  ``TransferStatus`` does not (``hixl.TIMEOUT``/``hixl.FAILED`` are status codes);
* small value classes whose fields are C integers: assigning a negative or
  too large number, or a non-int, raises ``TypeError`` as pybind11 does.

Pure: imports nothing that touches a device.
"""

from __future__ import annotations

import enum
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "ALREADY_CONNECTED",
    "AUTO_CONNECT",
    "CLIENT_SERVER_COMM",
    "CONNECTED",
    "CONNECTING",
    "CONNECT_FAILED",
    "CONNECT_PENDING",
    "DISCONNECTING",
    "DISCONNECT_PENDING",
    "FAILED",
    "FEATURE_NOT_SUPPORTED",
    "FEATURE_SUPPORTED",
    "MEM_DEVICE",
    "MEM_HOST",
    "NOTIFY_FAILED",
    "NOT_CONNECT",
    "NOT_CONNECTED",
    "OPTION_AUTO_CONNECT",
    "OPTION_BUFFER_POOL",
    "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "PARAM_INVALID",
    "READ",
    "RESOURCE_EXHAUSTED",
    "SUCCESS",
    "TIMEOUT",
    "UNSUPPORTED",
    "WRITE",
    "AsyncConnectStatus",
    "FeatureType",
    "GetTransferStatusArgs",
    "MemDesc",
    "MemType",
    "NotifyDesc",
    "Status",
    "TransferArgs",
    "TransferOp",
    "TransferOpDesc",
    "TransferResult",
    "TransferStatus",
]


class Status(enum.IntEnum):
    """Status codes with hixl's numbers.  The binding exports them as plain ints;
    members of this ``IntEnum`` are ints too and compare equal to them (the class
    itself is a hixl.compat extra)."""

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

FEATURE_SUPPORTED = 1
FEATURE_NOT_SUPPORTED = 0

OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"


class MemType(enum.IntEnum):
    """Where registered memory lives (unscoped in C++: compares equal to ints)."""

    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(enum.IntEnum):
    """``READ``: remote to local (RDMA READ).  ``WRITE``: local to remote (RDMA WRITE)."""

    READ = 0
    WRITE = 1


class FeatureType(enum.IntEnum):
    """Capabilities :func:`get_capability` answers for."""

    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1


class _ScopedEnum(enum.Enum):
    """A C++ ``enum class`` as pybind11 shows it: ``int(x)`` works, ``x == 0`` is False."""

    def __int__(self) -> int:
        return int(self.value)

    def __index__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"


class TransferStatus(_ScopedEnum):
    """State of an asynchronous transfer.  ``TIMEOUT`` is never reported (as in hixl)."""

    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2
    FAILED = 3


class AsyncConnectStatus(_ScopedEnum):
    """State of a ``connect_async``/``disconnect_async`` request for one remote engine."""

    NOT_CONNECT = 0
    CONNECT_PENDING = 1
    CONNECTING = 2
    CONNECTED = 3
    CONNECT_FAILED = 4
    DISCONNECT_PENDING = 5
    DISCONNECTING = 6


# export_values(): the members of the unscoped enums and of AsyncConnectStatus are
# module-level names as well.
MEM_DEVICE = MemType.MEM_DEVICE
MEM_HOST = MemType.MEM_HOST
READ = TransferOp.READ
WRITE = TransferOp.WRITE
AUTO_CONNECT = FeatureType.AUTO_CONNECT
CLIENT_SERVER_COMM = FeatureType.CLIENT_SERVER_COMM
NOT_CONNECT = AsyncConnectStatus.NOT_CONNECT
CONNECT_PENDING = AsyncConnectStatus.CONNECT_PENDING
CONNECTING = AsyncConnectStatus.CONNECTING
CONNECTED = AsyncConnectStatus.CONNECTED
CONNECT_FAILED = AsyncConnectStatus.CONNECT_FAILED
DISCONNECT_PENDING = AsyncConnectStatus.DISCONNECT_PENDING
DISCONNECTING = AsyncConnectStatus.DISCONNECTING


# ------------------------------------------------------------------ checked C fields

_V = TypeVar("_V")


class _CField(Generic[_V]):
    """A slot holding a C value, checked on every assignment like a pybind11 field."""

    def __init__(self, kind: str, *, readonly: bool = False) -> None:
        self.kind = kind
        self.readonly = readonly
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type) -> _CField[_V]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _V: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        if obj is None:
            return self
        return getattr(obj, self.slot)

    def __set__(self, obj: object, value: Any) -> None:
        if self.readonly:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")
        object.__setattr__(
            obj, self.slot, _convert(type(obj).__name__, self.name, self.kind, value)
        )


_LIMITS = {"u64": 1 << 64, "u32": 1 << 32}


def _convert(owner: str, field: str, kind: str, value: Any) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise TypeError(f"{owner}.{field} must be a str, got {type(value).__name__}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{field} must be a bool, got {type(value).__name__}")
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}.{field} must be an int, got {type(value).__name__} {value!r}")
    limit = _LIMITS[kind]
    if not 0 <= value < limit:
        raise TypeError(f"{owner}.{field}={value} is outside [0, {limit - 1}]")
    return int(value)


class _Value:
    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._fields)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the binding's objects


class MemDesc(_Value):
    """Memory to register: ``len`` bytes at address ``addr`` (both required).

    ``local_only`` (keyword, default False) is a hixl.compat extra: True
    registers the memory for this side's use only, so peers cannot see it.
    The caller keeps the memory alive until it is deregistered.
    """

    __slots__ = ("_addr", "_len", "local_only")
    _fields = ("addr", "len")
    addr: _CField[int] = _CField("u64")
    len: _CField[int] = _CField("u64")

    def __init__(self, addr: int, len: int, *, local_only: bool = False) -> None:  # noqa: A002
        self.addr = addr
        self.len = len
        self.local_only = bool(local_only)


class TransferOpDesc(_Value):
    """One piece of a transfer: ``len`` bytes between two absolute addresses."""

    __slots__ = ("_local_addr", "_remote_addr", "_len")
    _fields = ("local_addr", "remote_addr", "len")
    local_addr: _CField[int] = _CField("u64")
    remote_addr: _CField[int] = _CField("u64")
    len: _CField[int] = _CField("u64")

    def __init__(self, local_addr: int, remote_addr: int, len: int) -> None:  # noqa: A002
        self.local_addr = local_addr
        self.remote_addr = remote_addr
        self.len = len


class NotifyDesc(_Value):
    """A notification: a ``name`` and a message text ``notify_msg``."""

    __slots__ = ("_name", "_notify_msg")
    _fields = ("name", "notify_msg")
    name: _CField[str] = _CField("str")
    notify_msg: _CField[str] = _CField("str")

    def __init__(self, name: str, notify_msg: str) -> None:
        self.name = name
        self.notify_msg = notify_msg


class TransferArgs(_Value):
    """Options of ``transfer_async``: ``user_data`` (default 0) comes back in
    :class:`TransferResult`.  Built without arguments, as in the binding."""

    __slots__ = ("_user_data",)
    _fields = ("user_data",)
    user_data: _CField[int] = _CField("u64")

    def __init__(self) -> None:
        self.user_data = 0


class GetTransferStatusArgs(_Value):
    """Options of ``get_all_transfer_status``."""

    __slots__ = ("_max_query_count", "_skip_waiting")
    _fields = ("max_query_count", "skip_waiting")
    max_query_count: _CField[int] = _CField("u32")
    skip_waiting: _CField[bool] = _CField("bool")

    def __init__(self, max_query_count: int = 0xFFFFFFFF, skip_waiting: bool = False) -> None:
        self.max_query_count = max_query_count
        self.skip_waiting = skip_waiting


class TransferResult(_Value):
    """One asynchronous request's state.  ``TransferResult()`` is req 0,
    user_data 0, status WAITING; ``status`` is read-only, as in the binding."""

    __slots__ = ("_req", "_user_data", "_status")
    _fields = ("req", "user_data", "status")
    req: _CField[int] = _CField("u64")
    user_data: _CField[int] = _CField("u64")
    status: _CField[TransferStatus] = _CField("status", readonly=True)

    def __init__(self) -> None:
        self.req = 0
        self.user_data = 0
        object.__setattr__(self, "_status", TransferStatus.WAITING)

    @classmethod
    def _make(cls, req: int, user_data: int, status: TransferStatus) -> TransferResult:
        result = cls()
        result.req = req
        result.user_data = user_data
        object.__setattr__(result, "_status", status)
        return result
