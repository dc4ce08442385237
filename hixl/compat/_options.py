"""The ``options`` of ``Hixl.initialize``, checked and interpreted (pure).

hixl's own rules are followed where they are public (hicann/hixl
``docs/zh/api/cpp/HIXL-interface.md`` and the option parsers in
``src/llm_datadist/adxl/adxl_inner_engine.cc`` and
``src/hixl/engine/connect_pool_executor.cc``): ``BufferPool`` is
``"NUM:SIZE"`` with SIZE in MiB, default ``"4:8"``, ``"0:0"`` turns the pool
off; ``GlobalResourceConfig`` is a JSON object whose ``channel_pool.*`` keys
configure the link pool and ``connect_pool.*`` keys the asynchronous connect
workers.  Keys with no meaning on a verbs NIC are kept in ``CompatOptions.notes``
so that ``initialize`` can warn about them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hixl.compat._types import (
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    Status,
)
from hixl.errors import ArgumentError, HixlError

__all__ = [
    "DEFAULT_BUFFER_POOL",
    "OPTION_ALIGNMENT",
    "OPTION_ASYNC_TRANSFER_TIMEOUT",
    "OPTION_DEVICE",
    "OPTION_GIL_SWITCH_INTERVAL",
    "OPTION_TOKEN",
    "ChannelPool",
    "CompatOptions",
    "Refusal",
    "engine_id_for",
    "parse_options",
    "status_of",
]

# Keys only this compat layer knows (hixl would warn about and ignore them).
ENV_TOKEN = "HIXL_TOKEN"  # the token when the options give none
OPTION_TOKEN = "hixl.Token"
OPTION_ALIGNMENT = "hixl.Alignment"
OPTION_DEVICE = "hixl.Device"
OPTION_ASYNC_TRANSFER_TIMEOUT = "hixl.AsyncTransferTimeout"
OPTION_GIL_SWITCH_INTERVAL = "hixl.GilSwitchInterval"

DEFAULT_BUFFER_POOL = (4, 8)  # hixl's default: 4 buffers of 8 MiB
DEFAULT_ASYNC_TIMEOUT_MS = 60_000
MAX_CHANNEL = 512  # hixl's upper bound (and default) for channel_pool.max_channel
_MAX_POOL_BYTES = 1 << 40


class Refusal(HixlError):
    """A call refused with a definite status code (raised inside hixl.compat only)."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(exc: BaseException) -> Status:
    """The status code a hixl call reports for ``exc``.

    Bad arguments, descriptors, bounds, alignment and unregistered memory give
    PARAM_INVALID; deadlines give TIMEOUT; completion errors, broken or
    refused connections, device and state problems give FAILED.
    """
    if isinstance(exc, Refusal):
        return exc.code
    if isinstance(exc, TimeoutError):  # TransferTimeout is one
        return Status.TIMEOUT
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return Status.PARAM_INVALID
    return Status.FAILED


@dataclass(frozen=True, slots=True)
class ChannelPool:
    """hixl's link pool: at most ``max_channel`` links; before a new link is made,
    when there are ``high_mark`` or more, idle ones are closed down to ``low_mark``."""

    max_channel: int
    high_mark: int
    low_mark: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatOptions:
    """What :func:`parse_options` made of an ``initialize`` options dict.

    ``buffer_pool`` is ``(num, size_mib)`` or None when turned off.
    ``channel_pool`` is set when ``GlobalResourceConfig`` configures both
    waterlines (hixl's rule).  ``gil_switch_interval`` (seconds) is the
    application's request to lower the process's GIL switch interval (None:
    leave it alone).  ``connect_threads``/``connect_queue`` size the
    ``connect_async`` workers.  ``notes`` are messages about accepted keys that
    have no effect here; ``unknown`` names keys nobody knows.
    """

    auto_connect: bool = False
    token: str | None = None
    alignment: int | None = None
    device: str | None = None
    async_timeout_ms: int = DEFAULT_ASYNC_TIMEOUT_MS
    gil_switch_interval: float | None = None
    buffer_pool: tuple[int, int] | None = DEFAULT_BUFFER_POOL
    traffic_class: int | None = None
    service_level: int | None = None
    channel_pool: ChannelPool | None = None
    connect_threads: int = 2
    connect_queue: int = 128
    notes: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    ignored: tuple[str, ...] = field(default=())  # hixl keys accepted without effect


def _int_text(key: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ArgumentError(f"option {key}={value!r}: expected an integer")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        body = text[1:] if text[:1] in "+-" else text
        if not body.isdigit() or not body.isascii():
            raise ArgumentError(f"option {key}={value!r}: expected a decimal integer")
        number = int(text)
    if not low <= number <= high:
        raise ArgumentError(f"option {key}={value!r}: out of range [{low}, {high}]")
    return number


def _ratio(key: str, value: object) -> float:
    try:
        number = float(str(value).strip()) if not isinstance(value, bool) else math.nan
    except ValueError:
        number = math.nan
    if not 0.0 < number < 1.0:
        raise ArgumentError(f"option {key}={value!r}: must be a number in (0, 1)")
    return number


def _seconds(key: str, value: str) -> float:
    """A GIL switch interval in seconds, in (0, 1] as ``Engine`` accepts."""
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not 0.0 < number <= 1.0:
        raise ArgumentError(f"option {key}={value!r}: must be a number of seconds in (0, 1]")
    return number


def _flag(key: str, value: str) -> bool:
    text = value.strip()
    if text not in ("0", "1"):
        raise ArgumentError(f"option {key}={value!r}: expected '0' or '1'")
    return text == "1"


def _json_object(key: str, value: str) -> dict[str, Any]:
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ArgumentError(f"option {key}: not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ArgumentError(f"option {key}: expected a JSON object, got {type(parsed).__name__}")
    return parsed


def parse_buffer_pool(value: str) -> tuple[int, int] | None:
    """hixl's ``BufferPool`` value ``"NUM:SIZE"`` (SIZE in MiB); ``"0:0"`` gives None."""
    key = OPTION_BUFFER_POOL
    text = value.strip()
    if text == "0:0":
        return None
    parts = text.split(":")
    if len(parts) != 2:
        raise ArgumentError(f"option {key}={value!r}: expected 'BUFFER_NUM:BUFFER_SIZE'")
    num = _int_text(key, parts[0], 1, 1 << 20)
    size = _int_text(key, parts[1], 1, 1 << 20)
    if num * size * (1 << 20) > _MAX_POOL_BYTES:
        raise ArgumentError(f"option {key}={value!r}: {num} x {size} MiB is more than 1 TiB")
    return num, size


_PROTOCOLS = {"roce", "hccs", "uboe", "ub_rtp", "ub_ctp", "ub"}


def parse_resource_config(value: str, fields: dict[str, Any], notes: list[str]) -> None:
    """Read ``GlobalResourceConfig``: honoured values go to ``fields``, warnings to ``notes``."""
    key = OPTION_GLOBAL_RESOURCE_CONFIG
    config = _json_object(key, value)
    max_channel: int | None = None
    high: float | None = None
    low: float | None = None
    for name, item in config.items():
        where = f"{key}[{name!r}]"
        if name == "channel_pool.max_channel":
            max_channel = _int_text(where, item, 1, MAX_CHANNEL)
        elif name == "channel_pool.high_waterline":
            high = _ratio(where, item)
        elif name == "channel_pool.low_waterline":
            low = _ratio(where, item)
        elif name == "connect_pool.thread_num":
            fields["connect_threads"] = _int_text(where, item, 1, 64)
        elif name == "connect_pool.task_queue_capacity":
            fields["connect_queue"] = _int_text(where, item, 1, 65535)
        elif name == "comm_resource_config.protocol_desc":
            if not isinstance(item, list) or not all(isinstance(p, str) for p in item):
                raise ArgumentError(f"option {where}: expected a list of 'protocol:placement'")
            for desc in item:
                proto, sep, place = desc.partition(":")
                if not sep or proto not in _PROTOCOLS or place not in ("device", "host"):
                    raise ArgumentError(
                        f"option {where}: {desc!r} is not 'protocol:placement' "
                        f"(protocol one of {sorted(_PROTOCOLS)}, placement device or host)"
                    )
                if proto != "roce":
                    notes.append(f"{where}: {desc} has no meaning on a verbs NIC; RoCE is used")
        elif name == "comm_resource_config.listen_port":
            _int_text(where, item, 1, 65535)
            notes.append(f"{where}: the engine listens only on local_engine's port")
        elif name == "comm_resource_config.max_active_channels":
            _int_text(where, item, 1, 1 << 31)
            notes.append(f"{where}: device-side channels do not exist here")
        elif name.startswith("fabric_memory.") or name == "local_comm_res_path":
            notes.append(f"{where}: an Ascend feature with no meaning here, ignored")
        else:
            notes.append(f"{where}: unknown key, ignored")
    if high is not None and low is not None:
        cap = max_channel if max_channel is not None else MAX_CHANNEL
        high_mark = max(1, int(cap * high))
        low_mark = max(1, int(cap * low))
        if high_mark - low_mark < 1:
            raise ArgumentError(
                f"option {key}: high_waterline={high} low_waterline={low} give marks "
                f"{high_mark} and {low_mark} with max_channel={cap}; high must exceed low by >= 1"
            )
        fields["channel_pool"] = ChannelPool(cap, high_mark, low_mark)
    elif max_channel is not None:
        raise ArgumentError(
            f"option {key}: channel_pool.max_channel needs both channel_pool.high_waterline "
            "and channel_pool.low_waterline"
        )


def parse_options(options: Mapping[str, str] | None) -> CompatOptions:
    """Check and interpret the ``options`` of ``initialize``.

    Keys may carry hixl's older ``"adxl."`` prefix.  Values must be strings.
    Raises :class:`ArgumentError` naming the key for a malformed value, and a
    :class:`Refusal` with UNSUPPORTED for ``EnableUseFabricMem=1`` (an Ascend
    HCCS feature with no verbs equivalent).
    """
    if options is None:
        return CompatOptions(token=env_token())
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
    notes: list[str] = []
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
            fields["buffer_pool"] = parse_buffer_pool(value)
        elif key == OPTION_ENABLE_USE_FABRIC_MEM:
            if _flag(key, value):
                raise Refusal(
                    Status.UNSUPPORTED,
                    f"option {key}=1: Fabric Mem is an Ascend HCCS feature; a verbs NIC has none",
                )
            ignored.append(key)
        elif key == OPTION_RDMA_TRAFFIC_CLASS:
            tc = _int_text(key, value, 0, 255)
            if tc % 4:
                raise ArgumentError(f"option {key}={value!r}: must be a multiple of 4")
            fields["traffic_class"] = tc
            ignored.append(key)
            notes.append(f"{key}={tc}: the engine's queue pairs use traffic class 0")
        elif key == OPTION_RDMA_SERVICE_LEVEL:
            fields["service_level"] = _int_text(key, value, 0, 7)
            ignored.append(key)
            notes.append(f"{key}={value.strip()}: the engine's queue pairs use service level 0")
        elif key == OPTION_GLOBAL_RESOURCE_CONFIG:
            parse_resource_config(value, fields, notes)
        elif key == OPTION_LOCAL_COMM_RES:
            if _json_object(key, value):
                notes.append(f"{key}: ignored; the verbs device is found as `hixl devices` does")
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
        elif key == OPTION_ASYNC_TRANSFER_TIMEOUT:
            fields["async_timeout_ms"] = _int_text(key, value, 1, 24 * 3600 * 1000)
        elif key == OPTION_GIL_SWITCH_INTERVAL:
            fields["gil_switch_interval"] = _seconds(key, value)
        else:
            unknown.append(key)
    fields.setdefault("token", env_token())
    return CompatOptions(
        **fields, notes=tuple(notes), ignored=tuple(ignored), unknown=tuple(unknown)
    )


def env_token() -> str | None:
    """``$HIXL_TOKEN``, the token of an application that passes no ``hixl.Token`` option
    (an unchanged script on hosts beyond loopback, where an engine needs one), or None."""
    return os.environ.get(ENV_TOKEN) or None


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
