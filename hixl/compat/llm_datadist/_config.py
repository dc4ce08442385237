"""``LLMConfig`` and the ``init`` options it generates, checked and interpreted (pure).

``LLMConfig().generate_options()`` makes the same ``{key: str}`` dict CANN's does
(``ge.exec.deviceId``, ``llm.listenIpInfo``, ``llm.SyncKvCacheWaitTime`` ...), so a
dict written by hand for Ascend works too.  :func:`parse_options` reads such a dict
with CANN's rules (hicann/hixl ``v2/llm_datadist.py``): ``llm.LocalCommRes`` turns the
cache manager and remote cache access on unless told otherwise, and
``llm.TransferBackend`` needs both and a listen address.  Keys that mean nothing on a
verbs NIC are accepted and named in :attr:`DataDistOptions.notes`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from hixl.compat._options import env_token
from hixl.compat.llm_datadist._status import check_int, check_type, require
from hixl.compat.llm_datadist._types import U32, LLMRole

__all__ = [
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "OPTION_DEVICE",
    "OPTION_TOKEN",
    "DataDistOptions",
    "LLMConfig",
    "parse_listen",
    "parse_options",
]

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000  # CANN's default for llm.SyncKvCacheWaitTime

# Keys only this layer knows.
OPTION_DEVICE = "hixl.Device"  # the verbs device, e.g. "rxe0"
OPTION_TOKEN = "hixl.Token"  # shared secret for the engines' handshakes

_I32_MAX = 2**31 - 1


class LLMConfig:
    """Builds the options dict of ``LLMDataDist.init``; see :meth:`generate_options`."""

    def __init__(self) -> None:
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._listen_ip_info = ""
        self._deploy_res_path = ""
        self._ge_options: dict[str, str] = {}
        self._enable_switch_role = False
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._buf_pool_cfg = ""
        self._mem_pool_cfg = ""
        self._host_mem_pool_cfg = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._mem_utilization = 0.95

    def generate_options(self) -> dict[str, str]:
        """The options dict, with the keys CANN's ``LLMConfig`` writes."""
        options: dict[str, str] = dict(self._ge_options)
        dev = self._device_id
        if dev is not None:
            if isinstance(dev, int):
                options["ge.exec.deviceId"] = str(dev)
                options["ge.session_device_id"] = str(dev)
            else:
                options["ge.session_device_id"] = str(dev[0])
                options["ge.exec.deviceId"] = ";".join(str(d) for d in dev)
        if self._sync_kv_timeout is not None:
            options["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            options["llm.deployResPath"] = self._deploy_res_path
        if self._buf_pool_cfg:
            options["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            options["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            options["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            options["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            options["llm.EnableRemoteCacheAccessible"] = (
                "1" if self._enable_remote_cache_accessible else "0"
            )
        if self._listen_ip_info:
            options["llm.listenIpInfo"] = self._listen_ip_info
        if self._link_total_time is not None:
            options["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            options["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            options["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            options["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            options["llm.LocalCommRes"] = self._local_comm_res
        if self._transfer_backend is not None:
            options["llm.TransferBackend"] = self._transfer_backend
        if self._global_resource_config is not None:
            options["llm.GlobalResourceConfig"] = self._global_resource_config
        if self._enable_switch_role:
            options["llm.EnableSwitchRole"] = "1"
        options["llm.MemoryUtilization"] = str(self._mem_utilization)
        return options

    gen_options = generate_options

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...]) -> None:
        check_type("device_id", value, int, list, tuple)
        for dev in [value] if isinstance(value, int) else list(value):
            check_int("device_id", dev, -(2**31), _I32_MAX)
            require(dev >= 0, "device_id should be greater than or equal to zero.")
        self._device_id = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_type("sync_kv_timeout", value, int, str)
        if isinstance(value, str):
            require(value.isdigit(), f"sync_kv_timeout must be digit, got {value!r}.")
        require(int(value) > 0, "sync_kv_timeout should be greater than zero.")
        check_int("sync_kv_timeout", int(value), -(2**31), _I32_MAX)
        self._sync_kv_timeout = value

    @property
    def listen_ip_info(self) -> str:
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str) -> None:
        check_type("listen_ip_info", value, str)
        self._listen_ip_info = value

    @property
    def deploy_res_path(self) -> str:
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str) -> None:
        check_type("deploy_res_path", value, str)
        self._deploy_res_path = value

    @property
    def ge_options(self) -> dict[str, str]:
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_type("ge_options", value, dict)
        for k, v in value.items():
            check_type("ge_options key", k, str)
            check_type("ge_options value", v, str)
        self._ge_options = value

    @property
    def enable_switch_role(self) -> bool:
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool) -> None:
        check_type("enable_switch_role", value, bool)
        self._enable_switch_role = value

    @property
    def link_total_time(self) -> int:
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        check_type("link_total_time", value, int)
        require(
            0 <= value <= U32,
            f"link_total_time should be an integer between [0, 2^32-1], given value is {value}",
        )
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_type("link_retry_count", value, int)
        require(
            1 <= value <= 100,
            f"link_retry_count should be an integer between [1, 100], given value is {value}",
        )
        self._link_retry_count = value

    @property
    def buf_pool_cfg(self) -> str:
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str) -> None:
        check_type("buf_pool_cfg", value, str)
        self._buf_pool_cfg = value

    @property
    def mem_pool_cfg(self) -> str:
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str) -> None:
        check_type("mem_pool_cfg", value, str)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str:
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str) -> None:
        check_type("host_mem_pool_cfg", value, str)
        self._host_mem_pool_cfg = value

    @property
    def enable_cache_manager(self) -> bool:
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool) -> None:
        check_type("enable_cache_manager", value, bool)
        self._enable_cache_manager = value

    @property
    def enable_remote_cache_accessible(self) -> bool:
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool) -> None:
        check_type("enable_remote_cache_accessible", value, bool)
        self._enable_remote_cache_accessible = value

    @property
    def rdma_traffic_class(self) -> int | None:
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        self._rdma_traffic_class = check_int("rdma_traffic_class", value, 0, U32)

    @property
    def rdma_service_level(self) -> int | None:
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        self._rdma_service_level = check_int("rdma_service_level", value, 0, U32)

    @property
    def local_comm_res(self) -> str:
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, value: str) -> None:
        check_type("local_comm_res", value, str)
        self._local_comm_res = value

    @property
    def transfer_backend(self) -> str:
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, value: str) -> None:
        check_type("transfer_backend", value, str)
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, value: str) -> None:
        check_type("global_resource_config", value, str)
        self._global_resource_config = value

    @property
    def mem_utilization(self) -> float:
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_type("mem_utilization", value, float)
        require(0.0 <= value <= 1.0, f"mem_utilization must be in range [0,1], current:{value}")
        self._mem_utilization = value


LlmConfig = LLMConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class DataDistOptions:
    """What :func:`parse_options` made of an ``init`` options dict.

    ``listen`` is ``(ip, port)`` or None (no listener: this instance only links out).
    ``notes`` name keys accepted without effect here; ``unknown`` keys nobody knows.
    """

    role: LLMRole
    device_id: int | None = None
    listen: tuple[str, int] | None = None
    sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS
    cache_manager: bool = False
    remote_cache_accessible: bool = False
    hixl_backend: bool = False
    link_total_time_s: int = 0
    link_retry_count: int = 1
    local_comm_res: str | None = None
    device: str | None = None
    token: str | None = None
    notes: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def parse_listen(text: str) -> tuple[str, int]:
    """``"ip:port"`` as ``(ip, port)``; ``LLM_PARAM_INVALID`` when it is not one."""
    check_type("llm.listenIpInfo", text, str)
    parts = text.split(":")
    require(
        len(parts) == 2 and parts[1].isdigit(),
        f'llm.listenIpInfo "{text}" is invalid, format should be "ip:port"',
    )
    port = int(parts[1])
    require(0 < port <= 65535, f'llm.listenIpInfo "{text}": port must be in [1, 65535]')
    require(bool(parts[0]), f'llm.listenIpInfo "{text}": the ip is empty')
    return parts[0], port


def _flag(options: Mapping[str, str], key: str) -> bool | None:
    value = options.get(key)
    if value is None:
        return None
    require(value in ("0", "1"), f'option {key}="{value}" must be "0" or "1"')
    return value == "1"


def _number(options: Mapping[str, str], key: str, low: int, high: int) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    require(value.isdigit(), f'option {key}="{value}" must be an integer in [{low}, {high}]')
    number = int(value)
    require(low <= number <= high, f'option {key}="{value}" must be in [{low}, {high}]')
    return number


_NO_EFFECT = {
    "llm.RdmaTrafficClass": "the queue pairs use traffic class 0 (rxe ignores it)",
    "llm.RdmaServiceLevel": "the queue pairs use service level 0 (rxe ignores it)",
    "llm.LocalCommRes": "the verbs device is found as `hixl devices` finds it",
    "llm.GlobalResourceConfig": "hixl's engine options do not apply to this layer's engines",
    "llm.MemPoolConfig": "memory pools are not supported (allocate_cache raises)",
    "llm.HostMemPoolConfig": "memory pools are not supported (allocate_cache raises)",
    "llm.BufPoolCfg": "memory pools are not supported",
    "llm.EnableSwitchRole": "switch_role works without it",
    "llm.MemoryUtilization": "there is no device memory to budget",
    "llm.deployResPath": "there is no deployment resource to read",
    "llm.ClusterInfo": "links are made with link_clusters",
    "llm.OutputMaxSize": "there is no model output here",
    "ge.flowGraphMemMaxSize": "there is no device memory pool",
    "ge.session_device_id": "caches are host memory",
}
_KNOWN = {
    "ge.exec.deviceId",
    "llm.SyncKvCacheWaitTime",
    "llm.EnableCacheManager",
    "llm.EnableRemoteCacheAccessible",
    "llm.listenIpInfo",
    "llm.LinkTotalTime",
    "llm.LinkRetryCount",
    "llm.TransferBackend",
    "llm.Role",
    OPTION_DEVICE,
    OPTION_TOKEN,
}


def parse_options(options: Mapping[str, str], role: LLMRole) -> DataDistOptions:
    """Check ``options`` (values are strings) and say what they ask for.

    Raises ``TypeError`` for a non-dict or non-string entry and :class:`LLMException`
    (``LLM_PARAM_INVALID``) for a malformed value or a combination CANN refuses.
    """
    check_type("options", options, dict)
    for key, value in options.items():
        check_type("options key", key, str)
        check_type(f"option {key}", value, str)
    device_id: int | None = None
    dev_text = options.get("ge.exec.deviceId")
    if dev_text is not None:
        first = dev_text.split(";")[0]
        require(first.isdigit(), f'option ge.exec.deviceId="{dev_text}" must be an integer')
        device_id = int(first)
    flow = options.get("ge.flowGraphMemMaxSize")
    if flow is not None:
        require(flow.isdigit(), f"ge.flowGraphMemMaxSize must be digit, config value={flow}")
    timeout = _number(options, "llm.SyncKvCacheWaitTime", 1, _I32_MAX)
    total = _number(options, "llm.LinkTotalTime", 0, U32)
    retries = _number(options, "llm.LinkRetryCount", 1, 100)
    for key in ("llm.RdmaTrafficClass", "llm.RdmaServiceLevel"):
        _number(options, key, 0, U32)
    grc = options.get("llm.GlobalResourceConfig")
    if grc:
        try:
            parsed = json.loads(grc)
        except ValueError as exc:
            require(False, f"llm.GlobalResourceConfig is not JSON: {exc}")
        else:
            require(isinstance(parsed, dict), "llm.GlobalResourceConfig must be a JSON object")

    local_comm_res = "llm.LocalCommRes" in options
    cache_manager = _flag(options, "llm.EnableCacheManager")
    remote = _flag(options, "llm.EnableRemoteCacheAccessible")
    if local_comm_res:
        cache_manager = True if cache_manager is None else cache_manager
        remote = True if remote is None else remote
        require(
            cache_manager,
            "llm.LocalCommRes is not supported when llm.EnableCacheManager is not configured.",
        )
    backend = options.get("llm.TransferBackend")
    if backend is not None:
        require(
            backend == "hixl",
            f'llm.TransferBackend="{backend}" is not supported; the only backend is "hixl"',
        )
        require(
            bool(cache_manager),
            "llm.TransferBackend is not supported when llm.EnableCacheManager is not configured.",
        )
        remote = True if remote is None else remote
        require(
            remote,
            "llm.TransferBackend is not supported when llm.EnableRemoteCacheAccessible "
            "is not enabled.",
        )
        require(
            "llm.listenIpInfo" in options,
            "llm.TransferBackend is not supported when llm.listenIpInfo is not configured.",
        )
    listen_text = options.get("llm.listenIpInfo")
    listen = parse_listen(listen_text) if listen_text else None
    device = options.get(OPTION_DEVICE) or None
    token = options.get(OPTION_TOKEN) or env_token()
    notes = tuple(
        f"option {key} is accepted without effect: {why}"
        for key, why in _NO_EFFECT.items()
        if key in options
    )
    unknown = tuple(sorted(k for k in options if k not in _KNOWN and k not in _NO_EFFECT))
    return DataDistOptions(
        role=role,
        device_id=device_id,
        listen=listen,
        sync_kv_timeout_ms=DEFAULT_SYNC_KV_TIMEOUT_MS if timeout is None else timeout,
        cache_manager=bool(cache_manager),
        remote_cache_accessible=bool(remote),
        hixl_backend=backend is not None,
        link_total_time_s=0 if total is None else total,
        link_retry_count=1 if retries is None else retries,
        local_comm_res=options.get("llm.LocalCommRes"),
        device=device,
        token=token,
        notes=notes,
        unknown=unknown,
    )
