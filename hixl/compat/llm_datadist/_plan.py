"""How caches are named to peers and how a call becomes byte ranges (pure).

Theory of operation
-------------------
Every tensor of a remotely accessible cache is registered with the listening engine as
one region whose *name* says what it is: ``"lldd c<cache_id> t<i>/<n> B<model_id>
d<dtype> u<unit> k<units>"`` (``C-`` instead of ``B<model_id>`` for a plain cache, or
for a blocks cache registered without a key).  A peer learns the names in the
handshake, so :func:`index_remote` can find the cache behind a ``BlocksCacheKey``
(by model id) or a ``CacheKeyByIdAndIndex`` (by cache id) without asking.

A block (or batch entry) is ``unit`` contiguous bytes of a tensor; block ``b`` starts
at ``b * unit``.  A transfer moves, for each pair of tensors :func:`tensor_pairs`
gives, the block pairs of :func:`block_runs`: runs where both sides' ids go up by one
are merged into one range, as CANN merges them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from hixl.compat.llm_datadist._status import require

__all__ = [
    "PREFIX",
    "RemoteCache",
    "RemoteTable",
    "TensorName",
    "block_runs",
    "check_blocks",
    "index_remote",
    "parse_region_name",
    "region_name",
    "tensor_pairs",
]

PREFIX = "lldd"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TensorName:
    """What a region name says: tensor ``tensor`` of ``num_tensors`` of cache ``cache_id``."""

    cache_id: int
    tensor: int
    num_tensors: int
    model_id: int | None  # the BlocksCacheKey's model id, None without a key
    is_blocks: bool
    data_type: int
    unit: int  # bytes per block / batch entry
    units: int  # blocks / batch entries (shape[0])

    def __post_init__(self) -> None:
        if not 0 <= self.tensor < self.num_tensors:
            raise ValueError(f"tensor {self.tensor} not in [0, {self.num_tensors})")
        if self.unit <= 0 or self.units <= 0:
            raise ValueError(f"unit={self.unit} and units={self.units} must be > 0")


def region_name(name: TensorName) -> str:
    """The region name that announces ``name`` (at most 128 printable characters)."""
    key = "C-"
    if name.is_blocks:
        key = "B-" if name.model_id is None else f"B{name.model_id}"
    return (
        f"{PREFIX} c{name.cache_id} t{name.tensor}/{name.num_tensors} {key} "
        f"d{name.data_type} u{name.unit} k{name.units}"
    )


def _num(text: str, tag: str) -> int:
    if not text.startswith(tag) or not text[len(tag) :].lstrip("-").isdigit():
        raise ValueError(f"{text!r} is not {tag}<int>")
    return int(text[len(tag) :])


def parse_region_name(text: str) -> TensorName | None:
    """The :class:`TensorName` in a region name, or None for a region of someone else."""
    parts = text.split(" ")
    if len(parts) != 7 or parts[0] != PREFIX:
        return None
    try:
        cache_id = _num(parts[1], "c")
        index, _, count = parts[2][1:].partition("/")
        if not parts[2].startswith("t") or not index.isdigit() or not count.isdigit():
            return None
        key = parts[3]
        if key in ("B-", "C-"):
            model_id = None
        elif key.startswith("B"):
            model_id = _num(key, "B")
        else:
            return None
        return TensorName(
            cache_id=cache_id,
            tensor=int(index),
            num_tensors=int(count),
            model_id=model_id,
            is_blocks=key.startswith("B"),
            data_type=_num(parts[4], "d"),
            unit=_num(parts[5], "u"),
            units=_num(parts[6], "k"),
        )
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class RemoteCache(Generic[T]):
    """A peer's cache: its description and one region handle per tensor, in order."""

    cache_id: int
    model_id: int | None
    is_blocks: bool
    data_type: int
    unit: int
    units: int
    tensors: tuple[T, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)


@dataclass(frozen=True, slots=True)
class RemoteTable(Generic[T]):
    """A peer's caches, by cache id and by the model id of their ``BlocksCacheKey``."""

    by_id: dict[int, RemoteCache[T]]
    by_model: dict[int, RemoteCache[T]]


def index_remote(regions: Iterable[tuple[str, T]]) -> RemoteTable[T]:
    """Group named regions into caches; caches with a tensor missing are left out.

    When two blocks caches carry the same model id, the one registered last (the
    higher cache id) is found by that key.
    """
    parts: dict[int, dict[int, tuple[TensorName, T]]] = {}
    for text, handle in regions:
        name = parse_region_name(text)
        if name is not None:
            parts.setdefault(name.cache_id, {})[name.tensor] = (name, handle)
    by_id: dict[int, RemoteCache[T]] = {}
    by_model: dict[int, RemoteCache[T]] = {}
    for cache_id in sorted(parts):
        tensors = parts[cache_id]
        first = next(iter(tensors.values()))[0]
        if sorted(tensors) != list(range(first.num_tensors)):
            continue
        cache = RemoteCache(
            cache_id=cache_id,
            model_id=first.model_id,
            is_blocks=first.is_blocks,
            data_type=first.data_type,
            unit=first.unit,
            units=first.units,
            tensors=tuple(tensors[i][1] for i in range(first.num_tensors)),
        )
        by_id[cache_id] = cache
        if cache.is_blocks and cache.model_id is not None:
            by_model[cache.model_id] = cache
    return RemoteTable(by_id=by_id, by_model=by_model)


def tensor_pairs(
    src_tensors: int,
    dst_tensors: int,
    src_layer_range: range | None,
    dst_layer_range: range | None,
    tensor_num_per_layer: int,
) -> list[tuple[int, int]]:
    """``(src tensor, dst tensor)`` pairs a layer-ranged call moves.

    Layer ``l`` is tensors ``[l * n, (l + 1) * n)`` with ``n = tensor_num_per_layer``.
    A missing range is the other side's range, or every layer when both are missing.
    Raises :class:`LLMException` (``LLM_PARAM_INVALID``) for a range past a cache, a
    tensor count that ``n`` does not divide, or ranges of different lengths.
    """
    n = tensor_num_per_layer
    require(n > 0, f"tensor_num_per_layer ({n}) is invalid, should be >= 1")
    if src_layer_range is None and dst_layer_range is None:
        require(
            src_tensors == dst_tensors,
            f"the caches hold different numbers of tensors: {src_tensors} (src) vs "
            f"{dst_tensors} (dst); give layer ranges to move part of them",
        )
        return [(i, i) for i in range(src_tensors)]
    src_range = src_layer_range if src_layer_range is not None else dst_layer_range
    dst_range = dst_layer_range if dst_layer_range is not None else src_layer_range
    assert src_range is not None and dst_range is not None
    for side, rng, count in (("src", src_range, src_tensors), ("dst", dst_range, dst_tensors)):
        require(rng.step == 1, f"{side}_layer_range step must be 1, got {rng}")
        require(
            n <= count and count % n == 0,
            f"tensor_num_per_layer ({n}) must divide the {side} cache's {count} tensors",
        )
        layers = count // n
        require(
            0 <= rng.start < rng.stop <= layers,
            f"{side}_layer_range {rng} is out of range: the {side} cache has {layers} layers "
            f"of {n} tensors",
        )
    require(
        len(src_range) == len(dst_range),
        f"src_layer_range {src_range} and dst_layer_range {dst_range} differ in length",
    )
    return [
        (s * n + k, d * n + k) for s, d in zip(src_range, dst_range, strict=True) for k in range(n)
    ]


def check_blocks(name: str, blocks: Sequence[int], units: int, what: str) -> npt.NDArray[np.int64]:
    """``blocks`` as an int64 array, each in ``[0, units)``; ``LLM_PARAM_INVALID`` otherwise."""
    arr = np.asarray(blocks, dtype=np.int64) if len(blocks) else np.zeros(0, np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= units))
    require(
        bad.size == 0,
        f"{name}[{int(bad[0]) if bad.size else 0}]="
        f"{int(arr[bad[0]]) if bad.size else 0} is out of range [0, {units}) of the {what}",
    )
    return arr


def block_runs(
    src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Merge block pairs into runs: ``(src starts, dst starts, lengths)`` in blocks.

    Pair ``i`` joins pair ``i - 1``'s run when both ids are one higher.
    """
    require(
        src.size == dst.size,
        f"src_blocks ({src.size}) and dst_blocks ({dst.size}) differ in length",
    )
    if src.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    ends = np.concatenate((breaks, [src.size])).astype(np.int64)
    return src[starts], dst[starts], ends - starts
