"""``CacheManager``: registering caches, moving blocks and batches, local copies.

Every push and pull is a ``put_blocks``/``get_blocks`` of the engine between the two
caches' KV registrations (see ``_plan``): blocks to blocks and a batch entry to a batch
entry are one request for all tensor pairs; a batch entry cut into the other side's
blocks is one request per piece, all posted before the first is waited for.  Only
``transfer_cache_async`` with ``TransferConfig`` (the peer's raw tensor addresses, no
cache named) is a batch of byte ranges over the regions those addresses fall in.  Every
block id and range is checked against both caches before anything is posted; a call
either moves everything it names or raises.  Transfers wait at most
``sync_kv_timeout``; after a timeout the link is broken (posted RDMA cannot be
recalled) and must be made again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hixl.compat.llm_datadist._moves import (
    TENSORS_PER_LAYER,
    Moves,
    Ranges,
    block_requests,
    blocks_list,
    check_layers,
    entry_move,
    layer_args,
    run_ranges,
    same_length,
    same_unit,
    split_ranges,
)
from hixl.compat.llm_datadist._node import CacheEntry, Node, Route
from hixl.compat.llm_datadist._plan import (
    BlockMove,
    RemoteCache,
    check_blocks,
    entry_pieces,
    prefix_move,
    tensor_pairs,
)
from hixl.compat.llm_datadist._status import (
    LLMException,
    LLMStatusCode,
    check_int,
    check_type,
    code_of,
    refuse,
    require,
)
from hixl.compat.llm_datadist._types import (
    U32,
    U64,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_addrs,
)
from hixl.core.wire import RemoteRegion
from hixl.engine import TransferHandle, TransferRequest
from hixl.errors import HixlError

__all__ = ["CacheManager", "CacheTask"]

log = logging.getLogger("hixl.compat.llm_datadist")

I64Array = npt.NDArray[np.int64]


class CacheManager:
    """Caches and transfers of one ``LLMDataDist`` (``LLMDataDist.cache_manager``)."""

    def __init__(self, node: Node) -> None:
        self._node = node

    @property
    def node(self) -> Node:
        return self._node

    # -- registration --------------------------------------------------------------------
    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register ``addrs`` (one tensor each) as a plain cache; peers find it by cache id.

        ``cache_keys`` are accepted, but peers cannot pull by them here (see
        ``pull_cache``).  ``remote_accessible`` defaults to True for ``Placement.DEVICE``
        and False for ``Placement.HOST``, as in CANN.
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        check_addrs(addrs)
        check_type("cache_keys", cache_keys, list, tuple)
        for key in cache_keys:
            check_type("cache_keys element", key, CacheKey)
        check_type("remote_accessible", remote_accessible, bool, allow_none=True)
        cache = self._node.register(
            cache_desc, addrs, blocks=False, model_id=None, remote_accessible=remote_accessible
        )
        log.info("[register_cache] success, cache_id = %d", cache.cache_id)
        return cache

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: list[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Register ``addrs`` as a blocks cache (``shape[0]`` blocks per tensor).

        Peers find it by ``BlocksCacheKey(this cluster_id, blocks_cache_key.model_id)``
        or by its cache id.
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        check_addrs(addrs)
        check_type("blocks_cache_key", blocks_cache_key, BlocksCacheKey, allow_none=True)
        check_type("remote_accessible", remote_accessible, bool, allow_none=True)
        model_id = None if blocks_cache_key is None else blocks_cache_key.model_id
        cache = self._node.register(
            cache_desc, addrs, blocks=True, model_id=model_id, remote_accessible=remote_accessible
        )
        log.info("[register_blocks_cache] success, cache_id = %d", cache.cache_id)
        return cache

    def unregister_cache(self, cache_id: int) -> None:
        """Release a cache; unlink first, as CANN requires (peers' later transfers fail)."""
        check_int("cache_id", cache_id, -(2**63), 2**63 - 1)
        self._node.unregister(cache_id)
        log.info("[unregister_cache] success, cache_id = %d", cache_id)

    # -- lookups -------------------------------------------------------------------------
    def _remote(
        self, call: str, key: BlocksCacheKey | CacheKeyByIdAndIndex
    ) -> tuple[Route, RemoteCache]:
        route = self._node.route(key.cluster_id)
        table = self._node.remote(route)
        if isinstance(key, BlocksCacheKey):
            found = table.by_model.get(key.model_id)
            where = f"blocks cache with model_id {key.model_id}"
            known = sorted(table.by_model)
        else:
            found = table.by_id.get(key.cache_id)
            where = f"cache id {key.cache_id}"
            known = sorted(table.by_id)
        if found is None:
            refuse(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{call}: cluster {key.cluster_id} exposes no {where} (it exposes {known}; "
                "only a cache registered remote-accessible is exposed)",
            )
        return route, found

    def _local(self, call: str, cache: Cache, *, blocks: bool | None) -> CacheEntry:
        check_type("cache", cache, Cache)
        entry = self._node.entry(cache)
        if blocks is True:
            require(
                cache.is_blocks_cache, f"{call}: param check failed, cache should be blocks cache."
            )
        elif blocks is False:
            require(
                not cache.is_blocks_cache,
                f"{call}: param check failed, cache can not be blocks cache.",
            )
        return entry

    @property
    def _timeout(self) -> float:
        return self._node.opts.sync_kv_timeout_ms / 1000

    def _move(
        self,
        call: str,
        write: bool,
        entry: CacheEntry,
        key: tuple[Route, RemoteCache],
        layers: tuple[range | None, range | None, int],
        moves: Sequence[BlockMove],
    ) -> None:
        """Carry out ``moves`` for the tensor pairs of ``layers`` (src range, dst range,
        tensors per layer) between ``entry`` and the peer's cache; the local cache is the
        source of a write.  Engine errors become :class:`LLMException`."""
        route, remote = key
        here, there = entry.cache.cache_desc.num_tensors, remote.num_tensors
        src, dst = (here, there) if write else (there, here)
        pairs = tensor_pairs(src, dst, *layers)
        log.debug("[%s] %d moves with %s", call, len(moves), route.peer)
        try:
            Moves.of(write, entry, route, remote, pairs, moves).run(route, self._timeout)
        except HixlError as exc:
            refuse(code_of(exc), f"{call} failed: {exc}")

    # -- blocks --------------------------------------------------------------------------
    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        **kwargs: Any,
    ) -> None:
        """Read blocks ``src_blocks`` of the peer's cache into ``dst_blocks`` of ``dst_cache``.

        Keyword arguments: ``src_layer_range``, ``dst_layer_range`` (ranges of layers,
        step 1) and ``tensor_num_per_layer`` (default 2).  With a
        ``CacheKeyByIdAndIndex`` (a plain remote cache) ``src_blocks`` must be empty:
        the batch entry is cut into blocks of ``dst_cache`` in order.
        """
        layers = layer_args("pull_blocks", kwargs)
        check_type("src_cache_key", src_cache_key, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
        src = blocks_list("src_blocks", src_blocks)
        dst = blocks_list("dst_blocks", dst_blocks)
        entry = self._local("pull_blocks", dst_cache, blocks=True)
        require(len(dst) > 0, "dst_blocks can not be empty.")
        if isinstance(src_cache_key, CacheKey):
            refuse(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "pull_blocks by CacheKey (req_id) is not supported here: peers find caches by "
                "BlocksCacheKey or CacheKeyByIdAndIndex (no request-key table is exchanged)",
            )
        desc = dst_cache.cache_desc
        key = self._remote("pull_blocks", src_cache_key)
        remote = key[1]
        dst_arr = check_blocks("dst_blocks", dst, desc.shape[0], "local cache")
        if isinstance(src_cache_key, BlocksCacheKey):
            require(len(src) > 0, "src_blocks can not be empty.")
            same_length(src, dst)
            same_unit("pull_blocks", desc, remote)
            src_arr = check_blocks(
                "src_blocks", src, remote.units, f"remote cache {remote.cache_id}"
            )
            moves = [BlockMove(dst_arr, src_arr)]
        else:
            require(
                len(src) == 0,
                "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.",
            )
            batch = src_cache_key.batch_index
            require(
                batch < remote.units,
                f"batch_index {batch} is out of range [0, {remote.units}) of remote cache "
                f"{remote.cache_id}",
            )
            moves = entry_pieces(batch, remote.unit, desc.unit_size, dst_arr, entry_is_local=False)
        self._move("pull_blocks", False, entry, key, layers, moves)

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """Write ``src_blocks`` of ``src_cache`` into ``dst_blocks`` of the peer's blocks cache.

        Needs ``enable_remote_cache_accessible`` (on with ``local_comm_res`` or the hixl
        backend), as in CANN.  Layer ranges as for :meth:`pull_blocks`.
        """
        self._require_push("push_blocks")
        check_type("dst_cache_key", dst_cache_key, BlocksCacheKey)
        src = blocks_list("src_blocks", src_blocks)
        dst = blocks_list("dst_blocks", dst_blocks)
        check_layers(src_layer_range, dst_layer_range, tensor_num_per_layer)
        entry = self._local("push_blocks", src_cache, blocks=True)
        require(len(dst) > 0, "dst_blocks can not be empty.")
        same_length(src, dst)
        desc = src_cache.cache_desc
        key = self._remote("push_blocks", dst_cache_key)
        remote = key[1]
        same_unit("push_blocks", desc, remote)
        src_arr = check_blocks("src_blocks", src, desc.shape[0], "local cache")
        dst_arr = check_blocks("dst_blocks", dst, remote.units, f"remote cache {remote.cache_id}")
        layers = (src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._move("push_blocks", True, entry, key, layers, [BlockMove(src_arr, dst_arr)])

    def _require_push(self, call: str) -> None:
        require(
            self._node.opts.remote_cache_accessible,
            f"{call} is only supported while enable_remote_cache_accessible is True",
        )

    # -- plain caches --------------------------------------------------------------------
    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """Read batch entry ``cache_key.batch_index`` of the peer's cache ``cache_key.cache_id``
        into entry ``batch_index`` of ``cache``: ``size`` bytes per tensor (-1: a whole entry).

        Keyword arguments as for :meth:`pull_blocks`.  ``CacheKey`` (by request id) gives
        ``LLM_FEATURE_NOT_ENABLED``: no request-key table is exchanged here.
        """
        layers = layer_args("pull_cache", kwargs)
        if self._node.opts.remote_cache_accessible:
            check_type("cache_key", cache_key, CacheKeyByIdAndIndex)
        else:
            check_type("cache_key", cache_key, CacheKey, CacheKeyByIdAndIndex)
        check_int("batch_index", batch_index, 0, U32)
        check_int("size", size, -(2**63), 2**63 - 1)
        entry = self._local("pull_cache", cache, blocks=False)
        require(
            size == -1 or size > 0, f"[pull_cache] size ({size}) is invalid, should be -1 or > 0"
        )
        if isinstance(cache_key, CacheKey):
            refuse(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                "pull_cache by CacheKey (req_id) is not supported here: use "
                "CacheKeyByIdAndIndex (no request-key table is exchanged)",
            )
        key = self._remote("pull_cache", cache_key)
        move = entry_move(
            "pull_cache", cache.cache_desc, batch_index, key[1], cache_key.batch_index, size
        )
        self._move("pull_cache", False, entry, key, layers, [move])

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """Write batch entry ``src_batch_index`` of ``src_cache`` into entry
        ``dst_cache_key.batch_index`` of the peer's cache ``dst_cache_key.cache_id``."""
        self._require_push("push_cache")
        check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        check_int("src_batch_index", src_batch_index, 0, U32)
        check_int("size", size, -(2**63), 2**63 - 1)
        check_layers(src_layer_range, dst_layer_range, tensor_num_per_layer)
        entry = self._local("push_cache", src_cache, blocks=False)
        require(size == -1, f"[push_cache] size ({size}) is invalid, should be = -1.")
        key = self._remote("push_cache", dst_cache_key)
        move = entry_move(
            "push_cache",
            src_cache.cache_desc,
            src_batch_index,
            key[1],
            dst_cache_key.batch_index,
            size,
        )
        layers = (src_layer_range, dst_layer_range, tensor_num_per_layer)
        self._move("push_cache", True, entry, key, layers, [move])

    # -- layer by layer ------------------------------------------------------------------
    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Send ``src_cache`` layer by layer: layer ``i`` (tensors ``2i`` and ``2i + 1``)
        goes to every config whose ``src_layer_range`` holds it, once
        ``layer_synchronizer.synchronize_layer(i, None)`` returned True.

        Blocks to blocks with both index lists, a batch entry to blocks with
        ``dst_block_indices`` only (cut into ``dst_block_memory_size`` pieces), a batch
        entry to a batch entry with neither.  Everything is checked before the task
        starts; the returned :class:`CacheTask` reports each config's status.
        """
        check_type("src_cache", src_cache, Cache)
        require(
            src_cache.cache_desc.placement != Placement.HOST,
            "src cache not support placement HOST",
        )
        entry = self._node.entry(src_cache)
        src_idx = (
            None
            if src_block_indices is None
            else blocks_list("src_block_indices", src_block_indices)
        )
        dst_idx = (
            None
            if dst_block_indices is None
            else blocks_list("dst_block_indices", dst_block_indices)
        )
        for name, idx in (("src_block_indices", src_idx), ("dst_block_indices", dst_idx)):
            for value in idx or ():
                check_int(f"{name} element", value, 0, U64)
        if dst_block_memory_size is not None:
            check_int("dst_block_memory_size", dst_block_memory_size, 0, U64)
        if src_idx:
            require(bool(dst_idx), "transfer from blocks to cache is not supported")
            assert dst_idx is not None
            require(
                len(src_idx) == len(dst_idx),
                f"num_block_indices mismatches, src_num = {len(src_idx)}, dst_num = {len(dst_idx)}",
            )
        elif dst_idx:
            require(
                dst_block_memory_size is not None and dst_block_memory_size > 0,
                "dst_block_memory_size must be set when transfer from cache to blocks",
            )
        else:
            require(
                dst_block_memory_size in (None, 0),
                f"dst_block_memory_size ({dst_block_memory_size}) is neither None nor 0 while "
                "dst is not blocks",
            )
        check_type("layer_synchronizer", layer_synchronizer, LayerSynchronizer)
        check_type("transfer_configs", transfer_configs, list, tuple)
        kind: type = (
            TransferWithCacheKeyConfig
            if self._node.opts.remote_cache_accessible
            else TransferConfig
        )
        for config in transfer_configs:
            check_type("transfer_configs element", config, kind)
        desc = src_cache.cache_desc
        require(
            desc.num_tensors % 2 == 0, f"cache_desc.num_tensors ({desc.num_tensors}) is not even"
        )
        layers = desc.num_tensors // 2
        shape = _Shape(src_idx or None, dst_idx or None, dst_block_memory_size or None)
        plans = [
            self._plan_keyed(entry, config, layers, shape)
            if isinstance(config, TransferWithCacheKeyConfig)
            else self._plan_addrs(entry, config, layers, shape)
            for config in transfer_configs
        ]
        task = CacheTask(self._node, layer_synchronizer, layers, plans)
        task.start()
        return task

    @staticmethod
    def _config_layers(
        desc: CacheDesc,
        config: TransferConfig | TransferWithCacheKeyConfig,
        layers: int,
        shape: _Shape,
    ) -> range:
        """The config's source layers, with its batch index checked."""
        src_range = config.src_layer_range or range(layers)
        require(
            0 <= src_range.start < src_range.stop <= layers,
            f"src_layer_range: {src_range} out of range, src_layer_num = {layers}",
        )
        batch = config.src_batch_index
        if shape.src is not None:
            require(
                batch == 0,
                f"Invalid TransferConfig, src_batch_index ({batch}) != 0 while src is blocks",
            )
        require(
            batch < desc.shape[0],
            f"src_batch_index {batch} is out of range [0, {desc.shape[0]})",
        )
        return src_range

    def _plan_keyed(
        self, entry: CacheEntry, config: TransferWithCacheKeyConfig, layers: int, shape: _Shape
    ) -> _ConfigPlan:
        """A config naming the peer's cache: per layer, block moves into its layer."""
        desc = entry.cache.cache_desc
        src_range = self._config_layers(desc, config, layers, shape)
        route = self._node.route(config.dst_cluster_id)
        key_route, remote = self._remote("transfer_cache_async", config.cache_key)
        require(
            key_route.side == route.side,
            "transfer_cache_async: the config's cache key and dst_cluster_id disagree",
        )
        dst_range = config.dst_layer_range or src_range
        require(
            remote.num_tensors % 2 == 0 and dst_range.stop <= remote.num_tensors // 2,
            f"dst_layer_range {dst_range} is out of range of remote cache {remote.cache_id} "
            f"({remote.num_tensors} tensors)",
        )
        dst_batch = (
            config.cache_key.batch_index
            if isinstance(config.cache_key, CacheKeyByIdAndIndex)
            else 0
        )
        require(
            dst_batch < remote.units,
            f"batch index {dst_batch} is out of range [0, {remote.units}) of remote cache",
        )
        batch = config.src_batch_index
        if shape.dst is None:  # an entry to an entry
            same_unit("transfer_cache_async", desc, remote)
            moves = [prefix_move(batch, dst_batch, desc.unit_size)]
        else:
            dst_arr = check_blocks("dst_block_indices", shape.dst, remote.units, "remote cache")
            if shape.src is not None:  # blocks to blocks
                same_unit("transfer_cache_async", desc, remote)
                src_arr = check_blocks("src_block_indices", shape.src, desc.shape[0], "local cache")
                moves = [BlockMove(src_arr, dst_arr)]
            else:  # an entry cut into the peer's blocks
                require(
                    shape.block_size in (None, remote.unit),
                    f"dst_block_memory_size[{shape.block_size}] is not equal to "
                    f"stride[{remote.unit}] of remote cache.",
                )
                moves = entry_pieces(
                    batch, desc.unit_size, remote.unit, dst_arr, entry_is_local=True
                )
        steps = {
            layer: Moves.of(
                True,
                entry,
                route,
                remote,
                [(2 * layer + k, 2 * dst_layer + k) for k in range(2)],
                moves,
            )
            for layer, dst_layer in zip(src_range, dst_range, strict=True)
        }
        return _ConfigPlan(route=route, layers=src_range, steps=steps)

    def _plan_addrs(
        self, entry: CacheEntry, config: TransferConfig, layers: int, shape: _Shape
    ) -> _ConfigPlan:
        """A config with the peer's raw tensor addresses (two per layer): byte ranges
        into the regions they fall in."""
        desc = entry.cache.cache_desc
        src_range = self._config_layers(desc, config, layers, shape)
        route = self._node.route(config.dst_cluster_id)
        require(
            len(config.dst_addrs) == 2 * len(src_range),
            f"expect {2 * len(src_range)} dst_addrs, but len(dst_addrs) = "
            f"{len(config.dst_addrs)}, range = {src_range}",
        )
        conn = route.engine.connection(route.peer)
        remote_unit = shape.block_size or desc.unit_size
        src_off = config.src_batch_index * desc.unit_size
        if shape.src is not None and shape.dst is not None:
            require(
                remote_unit == desc.unit_size,
                f"block sizes differ: {desc.unit_size} bytes here, {remote_unit} remote",
            )
            src_arr = check_blocks("src_block_indices", shape.src, desc.shape[0], "local cache")
            dst_arr = np.asarray(shape.dst, np.int64)
            ranges = run_ranges(src_arr, dst_arr, desc.unit_size, remote_unit)
        elif shape.dst is not None:
            ranges = split_ranges(
                src_off, desc.unit_size, remote_unit, np.asarray(shape.dst, np.int64)
            )
        else:
            one = np.ones(1, np.int64)
            ranges = Ranges(local=one * src_off, remote=one * 0, lengths=one * desc.unit_size)
        steps: dict[int, Moves | list[TransferRequest]] = {}
        for k, layer in enumerate(src_range):
            remote: list[tuple[RemoteRegion, int]] = []
            for addr in config.dst_addrs[2 * k : 2 * k + 2]:
                try:
                    region = conn.find_remote(addr, 1)
                except HixlError as exc:
                    refuse(LLMStatusCode.LLM_PARAM_INVALID, f"transfer_cache_async: {exc}")
                remote.append((region, addr - region.addr))
            local = [entry.tensor(route.side, 2 * layer + t) for t in range(2)]
            steps[layer] = block_requests(local, remote, ranges)
        return _ConfigPlan(route=route, layers=src_range, steps=steps)

    # -- local copies --------------------------------------------------------------------
    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy block ``src`` to each block of ``copy_block_info[src]``, in every tensor."""
        check_type("cache", cache, Cache)
        check_type("copy_block_info", copy_block_info, dict)
        for src, dsts in copy_block_info.items():
            check_type("copy_block_info key", src, int)
            check_type("copy_block_info value", dsts, list)
            for dst in dsts:
                check_type("copy_block_info value element", dst, int)
        require(cache.is_blocks_cache, "param check failed, cache should be blocks cache.")
        self._node.entry(cache)
        desc = cache.cache_desc
        pairs = [(s, d) for s, dsts in copy_block_info.items() for d in dsts]
        for s, d in pairs:
            require(
                0 <= s < desc.shape[0] and 0 <= d < desc.shape[0],
                f"copy_blocks: block pair ({s}, {d}) is out of range [0, {desc.shape[0]})",
            )
        unit = desc.unit_size
        for base in cache.tensor_addrs:
            for s, d in pairs:
                ctypes.memmove(base + d * unit, base + s * unit, unit)

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copy ``size`` bytes (-1: the rest of the entry) at ``offset`` of a batch entry of
        every tensor of ``src`` into ``dst`` (plain caches of equal entry size)."""
        check_type("dst", dst, Cache)
        check_type("src", src, Cache)
        check_int("dst_batch_index", dst_batch_index, 0, U32)
        check_int("src_batch_index", src_batch_index, 0, U32)
        check_int("offset", offset, 0, U64)
        check_int("size", size, -(2**63), 2**63 - 1)
        if req_id is not None:
            check_int("req_id", req_id, 0, U64)
        require(not src.is_blocks_cache, "param check failed, src cache can not be blocks cache.")
        require(not dst.is_blocks_cache, "param check failed, dst cache can not be blocks cache.")
        require(
            size == -1 or size > 0, f"[copy_cache] size ({size}) is invalid, should be = -1 or > 0"
        )
        self._node.entry(src)
        self._node.entry(dst)
        sd, dd = src.cache_desc, dst.cache_desc
        require(
            sd.num_tensors == dd.num_tensors,
            f"copy_cache: num_tensors differ: {sd.num_tensors} (src) vs {dd.num_tensors} (dst)",
        )
        require(src_batch_index < sd.shape[0], f"src_batch_index {src_batch_index} out of range")
        require(dst_batch_index < dd.shape[0], f"dst_batch_index {dst_batch_index} out of range")
        require(offset < sd.unit_size and offset < dd.unit_size, f"offset {offset} out of range")
        count = sd.unit_size - offset if size == -1 else size
        require(
            offset + count <= sd.unit_size and offset + count <= dd.unit_size,
            f"copy_cache: offset {offset} + size {count} passes a batch entry "
            f"({sd.unit_size} bytes in src, {dd.unit_size} in dst)",
        )
        for s_base, d_base in zip(src.tensor_addrs, dst.tensor_addrs, strict=True):
            ctypes.memmove(
                d_base + dst_batch_index * dd.unit_size + offset,
                s_base + src_batch_index * sd.unit_size + offset,
                count,
            )

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks between a HOST and a DEVICE cache (both host memory here)."""
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache", dst_cache, Cache)
        check_type("src_to_dst", src_to_dst, dict)
        for k, v in src_to_dst.items():
            check_type("src_to_dst key", k, int)
            check_type("src_to_dst value", v, int)
        require(src_cache.is_blocks_cache, "param check failed, src cache should be blocks cache.")
        require(dst_cache.is_blocks_cache, "param check failed, dst cache should be blocks cache.")
        sd, dd = src_cache.cache_desc, dst_cache.cache_desc
        require(
            sd.unit_size == dd.unit_size,
            f"src block size:{sd.unit_size} and dst block size:{dd.unit_size} must be equal",
        )
        require(
            sd.num_tensors == dd.num_tensors,
            f"src num_tensors:{sd.num_tensors} and dst num_tensors:{dd.num_tensors} must be equal",
        )
        for s, d in src_to_dst.items():
            require(0 <= s < sd.shape[0], f"src_block_index:{s} must be in [0, {sd.shape[0]})")
            require(0 <= d < dd.shape[0], f"dst_block_index:{d} must be in [0, {dd.shape[0]})")
        swap_in = sd.placement == Placement.HOST and dd.placement == Placement.DEVICE
        swap_out = sd.placement == Placement.DEVICE and dd.placement == Placement.HOST
        require(
            swap_in or swap_out,
            f"swap src placement:{sd.placement} to dst placement:{dd.placement} is not support",
        )
        unit = sd.unit_size
        for s_base, d_base in zip(src_cache.tensor_addrs, dst_cache.tensor_addrs, strict=True):
            for s, d in src_to_dst.items():
                ctypes.memmove(d_base + d * unit, s_base + s * unit, unit)

    # -- not in scope --------------------------------------------------------------------
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Not supported: there is no device memory pool here (register your own memory)."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "allocate_cache needs a device memory pool, which does not exist here; allocate "
            "the tensors yourself and use register_cache",
        )

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        """Not supported: there is no device memory pool here."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "allocate_blocks_cache needs a device memory pool, which does not exist here; "
            "allocate the tensors yourself and use register_blocks_cache",
        )

    def deallocate_cache(self, cache: Cache) -> None:
        """Not supported (nothing is ever allocated here): use unregister_cache."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "deallocate_cache: caches here are registered, never allocated; use unregister_cache",
        )

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Not supported (nothing is ever allocated here): use unregister_cache."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "deallocate_blocks_cache: caches here are registered, never allocated; use "
            "unregister_cache",
        )

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Not supported: caches are found by id or BlocksCacheKey, not request keys."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "remove_cache_key: request keys are not kept here (caches are found by cache id "
            "or BlocksCacheKey)",
        )

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Not supported (reserved in CANN too): there is no device memory to repair."""
        refuse(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "remap_registered_memory repairs device memory after an NPU memory error; there "
            "is no device memory here",
        )


@dataclass(frozen=True, slots=True)
class _Shape:
    """What ``transfer_cache_async`` moves: block ids on either side (None: a batch
    entry) and the size of a destination block."""

    src: list[int] | None
    dst: list[int] | None
    block_size: int | None


@dataclass(frozen=True, slots=True)
class _ConfigPlan:
    """One transfer config, checked: what each source layer posts."""

    route: Route
    layers: range
    steps: Mapping[int, Moves | list[TransferRequest]]

    def post(self, layer: int, timeout: float) -> list[TransferHandle]:
        step = self.steps[layer]
        if isinstance(step, Moves):
            return step.post(self.route, timeout)
        if not step:
            return []
        return [self.route.engine.transfer_async(self.route.peer, step, timeout=timeout)]


class CacheTask:
    """A running ``transfer_cache_async``: :meth:`synchronize` / :meth:`get_results`."""

    def __init__(
        self,
        node: Node,
        synchronizer: LayerSynchronizer,
        layers: int,
        plans: list[_ConfigPlan],
    ) -> None:
        self._node = node
        self._sync = synchronizer
        self._layers = layers
        self._plans = plans
        self._results: list[LLMStatusCode | None] = [None] * len(plans)
        self._thread = threading.Thread(target=self._run, name="hixl-llmdd-transfer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        timeout = self._node.opts.sync_kv_timeout_ms / 1000
        handles: list[list[TransferHandle]] = [[] for _ in self._plans]
        posted = [0] * len(self._plans)  # layers posted, per config
        failed: set[int] = set()
        for layer in range(self._layers):
            wanted = [i for i, p in enumerate(self._plans) if layer in p.layers and i not in failed]
            if not wanted:
                continue
            try:
                ok = bool(self._sync.synchronize_layer(layer, None))
            except Exception as exc:  # noqa: BLE001 - the caller's code: reported, not raised
                log.warning("synchronize_layer(%d) raised %r", layer, exc)
                ok = False
            if not ok:
                log.error("Failed to synchronize layer %d", layer)
                for i in wanted:
                    self._results[i] = LLMStatusCode.LLM_PARAM_INVALID
                break
            for i in wanted:
                plan = self._plans[i]
                try:
                    handles[i] += plan.post(layer, timeout)
                    posted[i] += 1
                except (HixlError, LLMException) as exc:
                    log.error("layer %d to %s: %s", layer, plan.route.peer, exc)
                    self._results[i] = code_of(exc)
                    failed.add(i)
        for i, hs in enumerate(handles):
            code = LLMStatusCode.LLM_SUCCESS
            for h in hs:  # every posted layer is waited for, even of a config that failed
                try:
                    h.wait()
                except HixlError as exc:
                    log.error("transfer to %s failed: %s", self._plans[i].route.peer, exc)
                    code = code_of(exc)
            if self._results[i] is None and (
                posted[i] == len(self._plans[i].layers) or code != LLMStatusCode.LLM_SUCCESS
            ):
                self._results[i] = code

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Each config's status once every layer is done: ``LLM_TIMEOUT`` for all while the
        task still runs after ``timeout_in_millis``; None for a config never started."""
        if timeout_in_millis is not None:
            check_int("timeout_in_millis", timeout_in_millis, 0, U32)
        self._thread.join(None if timeout_in_millis is None else timeout_in_millis / 1000)
        if self._thread.is_alive():
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._plans)
        return list(self._results)

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """The task's status: its first failure, or ``LLM_SUCCESS``."""
        for code in self.get_results(timeout_in_millis):
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_SUCCESS
