"""The block moves of one ``CacheManager`` call: block and range lists checked against both
caches, cut into the requests the engine posts, and posted and settled together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hixl.compat.llm_datadist._node import CacheEntry, Route
from hixl.compat.llm_datadist._plan import (
    BlockMove,
    RemoteCache,
    block_runs,
    prefix_move,
)
from hixl.compat.llm_datadist._status import (
    check_int,
    check_type,
    require,
)
from hixl.compat.llm_datadist._types import (
    U32,
    CacheDesc,
    check_layer_range,
)
from hixl.core.descriptors import BlockListDesc
from hixl.core.wire import RemoteRegion
from hixl.engine import Region, TransferHandle, TransferRequest
from hixl.engine.kv import KVCache
from hixl.errors import HixlError

log = logging.getLogger("hixl.compat.llm_datadist")

TENSORS_PER_LAYER = 2  # CANN's default tensor_num_per_layer: K and V
I64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Moves:
    """One call's block moves between a local and a remote KV cache, for every tensor
    pair (``local_tensors[i]`` with ``remote_tensors[i]``)."""

    write: bool
    kv: KVCache
    remote: str  # the peer's KV cache name
    local_tensors: tuple[int, ...]
    remote_tensors: tuple[int, ...]
    moves: tuple[BlockMove, ...]

    @classmethod
    def of(
        cls,
        write: bool,
        entry: CacheEntry,
        route: Route,
        remote: RemoteCache,
        pairs: Sequence[tuple[int, int]],
        moves: Sequence[BlockMove],
    ) -> Moves:
        """``pairs`` are ``(src tensor, dst tensor)``; the local side is src for a write."""
        src = tuple(s for s, _ in pairs)
        dst = tuple(d for _, d in pairs)
        local, theirs = (src, dst) if write else (dst, src)
        return cls(write, entry.local(route.side), remote.kv, local, theirs, tuple(moves))

    def _start(self, route: Route, m: BlockMove, timeout: float, *, wait: bool) -> Any:
        engine = route.engine
        call: Callable[..., Any]
        if wait:
            call = engine.put_blocks if self.write else engine.get_blocks
        else:
            call = engine.put_blocks_async if self.write else engine.get_blocks_async
        return call(
            route.peer,
            self.kv,
            self.remote,
            m.local,
            m.remote,
            tensors=self.local_tensors,
            remote_tensors=self.remote_tensors,
            heads=m.heads,
            remote_heads=m.remote_heads,
            timeout=timeout,
        )

    def post(self, route: Route, timeout: float) -> list[TransferHandle]:
        """Start every move; on an error before posting, wait for those started, raise."""
        handles: list[TransferHandle] = []
        try:
            for m in self.moves:
                handles.append(self._start(route, m, timeout, wait=False))
        except BaseException:
            settle(handles)
            raise
        return handles

    def run(self, route: Route, timeout: float) -> None:
        """Move everything and wait; raises the first failure once all are done."""
        if len(self.moves) == 1:  # posted and waited for on this thread
            self._start(route, self.moves[0], timeout, wait=True)
            return
        error = settle(self.post(route, timeout))
        if error is not None:
            raise error


def settle(handles: Sequence[TransferHandle]) -> HixlError | None:
    """Wait for every handle; the first failure (the others are logged)."""
    first: HixlError | None = None
    for h in handles:
        try:
            h.wait()
        except HixlError as exc:
            if first is None:
                first = exc
            else:
                log.debug("another transfer of the same call failed: %s", exc)
    return first


@dataclass(frozen=True, slots=True)
class Ranges:
    """The same byte ranges in every tensor pair: offsets on each side and lengths."""

    local: I64Array
    remote: I64Array
    lengths: I64Array


def blocks_list(name: str, value: object) -> list[int]:
    check_type(name, value, list, tuple)
    assert isinstance(value, list | tuple)
    for item in value:
        check_type(f"{name} element", item, int)
    return list(value)


def layer_args(call: str, kwargs: dict[str, Any]) -> tuple[range | None, range | None, int]:
    """``src_layer_range``, ``dst_layer_range`` and ``tensor_num_per_layer`` from a
    pull's keyword arguments, checked; anything else is refused."""
    src = kwargs.pop("src_layer_range", None)
    dst = kwargs.pop("dst_layer_range", None)
    per_layer = kwargs.pop("tensor_num_per_layer", TENSORS_PER_LAYER)
    require(not kwargs, f"{call}: unsupported arguments {sorted(kwargs)}")
    check_layers(src, dst, per_layer)
    return src, dst, per_layer


def check_layers(src: object, dst: object, per_layer: object) -> None:
    check_layer_range("src_layer_range", src)
    check_layer_range("dst_layer_range", dst)
    check_int("tensor_num_per_layer", per_layer, 0, U32)


def run_ranges(src: I64Array, dst: I64Array, unit: int, remote_unit: int) -> Ranges:
    """Blocks ``src[i]`` (local, ``unit`` bytes) to blocks ``dst[i]`` (remote, blocks of
    ``remote_unit`` bytes), runs merged."""
    s, d, n = block_runs(src, dst)
    return Ranges(local=s * unit, remote=d * remote_unit, lengths=n * unit)


def split_ranges(start: int, total: int, block: int, dst_blocks: I64Array) -> Ranges:
    """A contiguous local ``total`` bytes at ``start`` cut into ``block``-byte pieces,
    piece ``j`` to remote block ``dst_blocks[j]`` (the last piece may be shorter)."""
    pieces = -(-total // block)
    require(
        dst_blocks.size <= pieces,
        f"{total} bytes cut into pieces of {block} make {pieces} blocks, fewer than the "
        f"{dst_blocks.size} blocks listed",
    )
    j = np.arange(dst_blocks.size, dtype=np.int64)
    return Ranges(
        local=start + j * block,
        remote=dst_blocks * block,
        lengths=np.minimum(block, total - j * block).astype(np.int64),
    )


def block_requests(
    local: Sequence[tuple[Region, int]],
    remote: Sequence[tuple[RemoteRegion, int]],
    ranges: Ranges,
) -> list[TransferRequest]:
    """RDMA WRITE requests, one per ``(local tensor, remote tensor)`` pair, each a
    ``(region, offset of the tensor in it)``, over the same ranges."""
    if ranges.lengths.size == 0:
        return []
    return [
        TransferRequest(
            op="write",
            local=lr,
            remote=rr,
            local_desc=BlockListDesc(
                offsets=ranges.local + lbase, lengths=ranges.lengths, alignment=None
            ),
            remote_desc=BlockListDesc(
                offsets=ranges.remote + rbase, lengths=ranges.lengths, alignment=None
            ),
        )
        for (lr, lbase), (rr, rbase) in zip(local, remote, strict=True)
    ]


def entry_move(
    call: str,
    desc: CacheDesc,
    local_index: int,
    remote: RemoteCache,
    remote_index: int,
    size: int,
) -> BlockMove:
    """Batch entry ``local_index`` <-> entry ``remote_index``: ``size`` bytes of each
    (-1: whole entries, which must then be of one size)."""
    require(
        local_index < desc.shape[0],
        f"{call}: local batch index {local_index} is out of range [0, {desc.shape[0]})",
    )
    require(
        remote_index < remote.units,
        f"{call}: remote batch index {remote_index} is out of range [0, {remote.units}) of "
        f"remote cache {remote.cache_id}",
    )
    if size == -1:
        same_unit(call, desc, remote)
        size = desc.unit_size
    require(
        size <= desc.unit_size and size <= remote.unit,
        f"{call}: size {size} is larger than a batch entry ({desc.unit_size} bytes here, "
        f"{remote.unit} in remote cache {remote.cache_id})",
    )
    return prefix_move(local_index, remote_index, size)


def same_length(src: list[int], dst: list[int]) -> None:
    require(
        len(src) == len(dst),
        f"src_blocks ({len(src)}) and dst_blocks ({len(dst)}) differ in length",
    )


def same_unit(call: str, local: CacheDesc, remote: RemoteCache) -> None:
    require(
        local.unit_size == remote.unit,
        f"{call}: the caches do not match: a block of the local cache is {local.unit_size} "
        f"bytes (shape {local.shape}, {local.data_type.name}), of the remote cache "
        f"{remote.cache_id} {remote.unit} bytes ({remote.units} blocks, data type "
        f"{remote.data_type})",
    )
