"""The value types of ``llm_datadist``: roles, data types, cache descriptions, keys (pure).

Names, argument orders, defaults and enum numbers are those of CANN's Python package
(hicann/hixl ``src/python/llm_datadist/llm_datadist``); ``DataType`` values are GE's
``ge::DataType`` numbers.  Checks on construction raise ``TypeError`` for a wrong type,
``ValueError`` for an integer out of its C range and :class:`LLMException`
(``LLM_PARAM_INVALID``) for a disallowed value, as there.
"""

from __future__ import annotations

import enum
import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hixl.compat.llm_datadist._status import check_int, check_type, require

__all__ = [
    "INVALID_ID",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "LLMClusterInfo",
    "LLMRole",
    "LayerSynchronizer",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "check_addrs",
    "check_layer_range",
    "ip_text",
]

INVALID_ID = 2**64 - 1
U16 = 2**16 - 1
U32 = 2**32 - 1
U64 = 2**64 - 1
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


class _Named(enum.IntEnum):
    """An int enum printed as ``Class.NAME``, as CANN prints its enums."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class LLMRole(_Named):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(_Named):
    """Where a cache lives.  Here both are host memory (there is no NPU)."""

    HOST = 0
    DEVICE = 1


class Memtype(enum.Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class RegisterMemStatus(enum.Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


# Bytes per element; None: no fixed size (a string tensor cannot be registered).
_ELEMENT_SIZE: dict[int, int | None] = {
    0: 4,  # DT_FLOAT
    1: 2,  # DT_FLOAT16
    2: 1,  # DT_INT8
    3: 4,  # DT_INT32
    4: 1,  # DT_UINT8
    6: 2,  # DT_INT16
    7: 2,  # DT_UINT16
    8: 4,  # DT_UINT32
    9: 8,  # DT_INT64
    10: 8,  # DT_UINT64
    11: 8,  # DT_DOUBLE
    12: 1,  # DT_BOOL
    13: None,  # DT_STRING
    27: 2,  # DT_BF16
}


class DataType(enum.Enum):
    """Element types, numbered as GE numbers them; :attr:`element_size` in bytes."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13

    @property
    def element_size(self) -> int | None:
        """Bytes per element, or None for ``DT_STRING`` (no fixed size)."""
        return _ELEMENT_SIZE[self.value]


class MemInfo:
    """A memory range (``remap_registered_memory``'s argument)."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_type("mem_type", mem_type, Memtype)
        check_type("addr", addr, int)
        check_type("size", size, int)
        self.mem_type = mem_type
        self.addr = addr
        self.size = size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self.mem_type}, addr={self.addr}, size={self.size})"


class CacheDesc:
    """``num_tensors`` tensors of one ``shape`` and ``data_type``.

    Dimension 0 of ``shape`` counts the blocks of a blocks cache, or the batch of a
    plain one; a block (a batch entry) is ``size // shape[0]`` bytes of each tensor,
    contiguous, as CANN lays caches out.  ``placement`` DEVICE is host memory here.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_int("num_tensors", num_tensors, 0, U32)
        check_type("shape", shape, list, tuple)
        for dim in shape:
            check_int("shape element", dim, *I64)
        check_type("data_type", data_type, DataType)
        check_type("placement", placement, Placement)
        check_type("batch_dim_index", batch_dim_index, int)
        check_int("seq_len_dim_index", seq_len_dim_index, *I32)
        check_type("kv_tensor_format", kv_tensor_format, str, allow_none=True)
        require(
            0 <= batch_dim_index < len(shape),
            f"batch_dim_index {batch_dim_index} out of range [0, {len(shape)})",
        )
        require(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index {seq_len_dim_index} is invalid, should be -1 or in "
            f"[0, {len(shape)})",
        )
        self._num_tensors = num_tensors
        self._shape = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement}, "
            f"batch_dim_index={self._batch_dim}, seq_len_dim_index={self._seq_len_dim_index}, "
            f"kv_tensor_format={self._kv_tensor_format})"
        )

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> list[int]:
        return self._shape

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        self._shape[dim_index] = dim_value

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def batch_dim(self) -> int:
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim]

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of one tensor; ``LLM_PARAM_INVALID`` for a shape or type without one."""
        element = self._data_type.element_size
        require(element is not None, f"{self._data_type} has no fixed element size")
        assert element is not None
        require(
            len(self._shape) > 0 and all(d > 0 for d in self._shape),
            f"shape {self._shape} must have at least one dimension, each > 0",
        )
        total = element
        for dim in self._shape:
            total *= dim
        return total

    @property
    def unit_size(self) -> int:
        """Bytes of one block (blocks cache) or batch entry: ``size // shape[0]``."""
        return self.size // self._shape[0]


class Cache:
    """A registered cache; made by ``CacheManager.register_*cache`` (or ``create_cpu_cache``)."""

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        is_blocks_cache: bool,
    ) -> None:
        check_int("cache_id", cache_id, *I64)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._is_blocks_cache = is_blocks_cache
        self.valid = True

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """A host cache of ``addrs`` (not registered), for ``swap_blocks``."""
        check_type("cache_desc", cache_desc, CacheDesc)
        check_addrs(addrs)
        require(cache_desc.placement == Placement.HOST, "cache_desc placement must be HOST")
        require(
            cache_desc.num_tensors == len(addrs),
            f"cache_desc num_tensors:{cache_desc.num_tensors} not equal addrs num:{len(addrs)}",
        )
        return cls(-1, cache_desc, addrs, True)

    def __repr__(self) -> str:
        return (
            f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = "
            f"{len(self._tensor_addrs)}, is_blocks_cache = {self._is_blocks_cache})"
        )


def _keyword_args(
    what: str, args: tuple[Any, ...], kwargs: dict[str, Any], order: Sequence[str]
) -> dict[str, Any]:
    require(len(args) + len(kwargs) <= len(order), f"{what}: param num is over limit")
    merged = dict(kwargs)
    for name, value in zip(order, args, strict=False):
        require(name not in merged, f"{what}: param {name} given twice")
        merged[name] = value
    if "prompt_cluster_id" in merged:
        require("cluster_id" not in merged, f"{what}: give cluster_id or prompt_cluster_id")
        merged["cluster_id"] = merged.pop("prompt_cluster_id")
    for name in merged:
        require(name in order or name == "prompt_cluster_id", f"{what}: unsupported param {name}")
    require("cluster_id" in merged, f"{what}: param prompt_cluster_id or cluster_id is required")
    return merged


class _ClusterKey:
    """A key of a peer's cache: ``cluster_id`` (alias ``prompt_cluster_id``) and
    ``model_id``, taken by position or keyword in the order ``fields``."""

    _cluster_id: int
    _model_id: int

    def _take(self, what: str, args: Any, kwargs: Any, fields: Sequence[str]) -> dict[str, Any]:
        values = _keyword_args(what, args, kwargs, fields)
        self._cluster_id = check_int("cluster_id", values["cluster_id"], 0, U64)
        self._model_id = check_int("model_id", values.get("model_id", 0), 0, U64)
        return values

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id


class BlocksCacheKey(_ClusterKey):
    """The blocks cache a peer registered with ``BlocksCacheKey(its cluster_id, model_id)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._take("BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"))

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


class CacheKey(_ClusterKey):
    """A cache a peer registered under ``req_id`` (or ``prefix_id``) and ``model_id``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = self._take(
            "CacheKey", args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id")
        )
        require("req_id" in values, "CacheKey: param req_id is required")
        self._req_id = check_int("req_id", values["req_id"], 0, U64)
        self._prefix_id = check_int("prefix_id", values.get("prefix_id", INVALID_ID), 0, U64)

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"prefix_id={self._prefix_id}, model_id={self._model_id})"
        )


class CacheKeyByIdAndIndex:
    """Batch entry ``batch_index`` of the peer's cache ``cache_id``."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_int("cluster_id", cluster_id, 0, U64)
        self._cache_id = check_int("cache_id", cache_id, *I64)
        self._batch_index = check_int("batch_index", batch_index, 0, U32)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class LayerSynchronizer(ABC):
    """Implemented by the caller: block until layer ``layer_index`` is computed."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """True when the layer's cache may be sent, False to give the transfer up."""


def check_addrs(addrs: object, name: str = "addrs", *kinds: type) -> None:
    """``addrs`` is a list (or one of ``kinds``) of addresses, each an int in
    ``[0, 2**64)``."""
    check_type(name, addrs, *(kinds or (list,)))
    assert isinstance(addrs, list | tuple)
    for addr in addrs:
        check_int(f"{name} element", addr, 0, U64)


def check_layer_range(name: str, layer_range: object, allow_none: bool = True) -> None:
    """A layer range is a ``range`` with step 1 and ``0 <= start < stop``."""
    if layer_range is None and allow_none:
        return
    check_type(name, layer_range, range)
    assert isinstance(layer_range, range)
    require(layer_range.step == 1, f"check {name}.step == 1 failed: {layer_range}")
    require(
        0 <= layer_range.start < layer_range.stop,
        f"check 0 <= range.start < range.stop failed, {name} = {layer_range}",
    )


class TransferConfig:
    """Where ``transfer_cache_async`` sends layers: the peer's raw tensor addresses."""

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_int("dst_cluster_id", dst_cluster_id, 0, U64)
        check_addrs(dst_addrs, "dst_addrs", list, tuple)
        check_layer_range("src_layer_range", src_layer_range)
        check_int("src_batch_index", src_batch_index, 0, U32)
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = list(dst_addrs)
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self.dst_cluster_id}, dst_addrs={self.dst_addrs}, "
            f"src_layer_range={self.src_layer_range}, src_batch_index={self.src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """Where ``transfer_cache_async`` sends layers: a cache the peer registered, by key."""

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_type("cache_key", cache_key, BlocksCacheKey, CacheKeyByIdAndIndex)
        check_layer_range("src_layer_range", src_layer_range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range, allow_none=False)
        assert src_layer_range is not None and dst_layer_range is not None
        require(
            len(src_layer_range) == len(dst_layer_range),
            f"src_layer_range size should be equal to dst_layer_range size: "
            f"{src_layer_range} vs {dst_layer_range}",
        )
        check_int("src_batch_index", src_batch_index, 0, U32)
        require(
            not (isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0),
            "src_batch_index should be 0 when cache_key is BlocksCacheKey.",
        )
        self.cache_key = cache_key
        self.src_layer_range: range | None = src_layer_range
        self.dst_layer_range: range | None = dst_layer_range
        self.src_batch_index = src_batch_index
        self.dst_cluster_id = cache_key.cluster_id

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self.cache_key}, "
            f"src_layer_range={self.src_layer_range}, dst_layer_range={self.dst_layer_range}, "
            f"src_batch_index={self.src_batch_index})"
        )


def _ip_int(ip: object) -> int:
    """An IPv4 address as CANN keeps it: the 4 bytes of ``inet_aton`` read little-endian."""
    check_type("ip", ip, str, int)
    if isinstance(ip, int):
        return check_int("ip", ip, 0, U32)
    assert isinstance(ip, str)
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError as exc:
        raise ValueError(f"cannot parse ip {ip!r}") from exc


def ip_text(ip: int) -> str:
    """The dotted form of an address kept by :class:`LLMClusterInfo`."""
    return socket.inet_ntoa(ip.to_bytes(4, "little"))


class LLMClusterInfo:
    """A peer to link: its cluster id and where it listens."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_int("remote_cluster_id", value, 0, U64)

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        check_type("remote_role_type", value, LLMRole, int)
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        address = _ip_int(ip)
        self._local_ip_info_list.append((address, check_int("port", port, 0, U16)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        address = _ip_int(ip)
        self._remote_ip_info_list.append((address, check_int("port", port, 0, U16)))

    def __repr__(self) -> str:
        remote = [f"{ip_text(ip)}:{port}" for ip, port in self._remote_ip_info_list]
        return f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, remote={remote})"
