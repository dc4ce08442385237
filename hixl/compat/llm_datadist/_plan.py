"""How caches are named to peers and how a call becomes block moves (pure).

Theory of operation
-------------------
Every cache is registered as a KV cache of the engine (``Engine.register_kv``): one
``uint8`` array of shape ``(units, unit)`` per tensor, block axis 0 (a block, or a batch
entry, is ``unit`` contiguous bytes) and "heads" axis 1, so that a head range is a byte
range inside a block.  The KV cache's *name* says what the cache is:
``"lldd c<cache_id> n<num_tensors> B<model_id> d<dtype> u<unit> k<units>"`` (``C-``
instead of ``B<model_id>`` for a plain cache, ``B-`` for a blocks cache registered
without a key).  A peer learns the names from the announced geometry regions, so
:func:`index_remote` finds the cache behind a ``BlocksCacheKey`` (by model id) or a
``CacheKeyByIdAndIndex`` (by cache id) without asking.  A cache that is not remotely
accessible gets a name :func:`parse_cache_name` does not accept (:func:`local_name`),
so peers never list it.

A transfer is a list of :class:`BlockMove` (block ids on each side, optionally narrowed
to byte ranges) applied to every tensor pair :func:`tensor_pairs` gives.  Blocks to
blocks and a batch entry to a batch entry are one move; a batch entry cut into the other
side's blocks is one move per piece (:func:`entry_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hixl.compat.llm_datadist._status import require

__all__ = [
    "PREFIX",
    "BlockMove",
    "CacheName",
    "RemoteCache",
    "RemoteTable",
    "block_runs",
    "cache_name",
    "check_blocks",
    "entry_pieces",
    "index_remote",
    "local_name",
    "parse_cache_name",
    "prefix_move",
    "tensor_pairs",
]

PREFIX = "lldd"
#: Longest KV cache name the engine takes.
MAX_NAME = 96
I64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class CacheName:
    """What a cache's name says: cache ``cache_id`` of ``num_tensors`` tensors."""

    cache_id: int
    num_tensors: int
    model_id: int | None  # the BlocksCacheKey's model id, None without a key
    is_blocks: bool
    data_type: int
    unit: int  # bytes per block / batch entry
    units: int  # blocks / batch entries (shape[0])

    def __post_init__(self) -> None:
        if self.num_tensors <= 0:
            raise ValueError(f"num_tensors={self.num_tensors} must be > 0")
        if self.unit <= 0 or self.units <= 0:
            raise ValueError(f"unit={self.unit} and units={self.units} must be > 0")


def cache_name(name: CacheName) -> str:
    """The KV cache name that announces ``name`` (printable, no ``/``).  Raises
    :class:`LLMException` (``LLM_PARAM_INVALID``) past the engine's 96 characters."""
    key = "C-"
    if name.is_blocks:
        key = "B-" if name.model_id is None else f"B{name.model_id}"
    text = (
        f"{PREFIX} c{name.cache_id} n{name.num_tensors} {key} d{name.data_type} "
        f"u{name.unit} k{name.units}"
    )
    require(len(text) <= MAX_NAME, f"cache name {text!r} is longer than {MAX_NAME} characters")
    return text


def local_name(cache_id: int) -> str:
    """The KV cache name of a cache peers must not find (not remotely accessible)."""
    return f"{PREFIX}-local c{cache_id}"


def _num(text: str, tag: str) -> int:
    if not text.startswith(tag) or not text[len(tag) :].lstrip("-").isdigit():
        raise ValueError(f"{text!r} is not {tag}<int>")
    return int(text[len(tag) :])


def parse_cache_name(text: str) -> CacheName | None:
    """The :class:`CacheName` in a KV cache name, or None for a name of someone else."""
    parts = text.split(" ")
    if len(parts) != 7 or parts[0] != PREFIX:
        return None
    try:
        key = parts[3]
        if key in ("B-", "C-"):
            model_id = None
        elif key.startswith("B"):
            model_id = _num(key, "B")
        else:
            return None
        return CacheName(
            cache_id=_num(parts[1], "c"),
            num_tensors=_num(parts[2], "n"),
            model_id=model_id,
            is_blocks=key.startswith("B"),
            data_type=_num(parts[4], "d"),
            unit=_num(parts[5], "u"),
            units=_num(parts[6], "k"),
        )
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class RemoteCache:
    """A peer's cache: ``kv`` is the name to pass to ``put_blocks``/``get_blocks``."""

    kv: str
    cache_id: int
    model_id: int | None
    is_blocks: bool
    data_type: int
    unit: int
    units: int
    num_tensors: int


@dataclass(frozen=True, slots=True)
class RemoteTable:
    """A peer's caches, by cache id and by the model id of their ``BlocksCacheKey``."""

    by_id: dict[int, RemoteCache]
    by_model: dict[int, RemoteCache]


def index_remote(names: Iterable[str]) -> RemoteTable:
    """The caches among a peer's KV cache names (others are skipped).

    When two blocks caches carry the same model id, the one registered last (the
    higher cache id) is found by that key.
    """
    found: dict[int, RemoteCache] = {}
    for text in names:
        name = parse_cache_name(text)
        if name is not None:
            found[name.cache_id] = RemoteCache(
                kv=text,
                cache_id=name.cache_id,
                model_id=name.model_id,
                is_blocks=name.is_blocks,
                data_type=name.data_type,
                unit=name.unit,
                units=name.units,
                num_tensors=name.num_tensors,
            )
    by_id = {k: found[k] for k in sorted(found)}
    by_model = {c.model_id: c for c in by_id.values() if c.is_blocks and c.model_id is not None}
    return RemoteTable(by_id=by_id, by_model=by_model)


@dataclass(frozen=True, slots=True)
class BlockMove:
    """Blocks ``local[i]`` <-> ``remote[i]`` of every tensor pair, narrowed to the byte
    ranges ``heads`` (in each local block) and ``remote_heads`` (in each remote block);
    None: the whole block."""

    local: I64Array
    remote: I64Array
    heads: tuple[int, int] | None = None
    remote_heads: tuple[int, int] | None = None


def _one(i: int) -> I64Array:
    return np.array([i], np.int64)


def entry_pieces(
    entry: int, entry_bytes: int, piece: int, blocks: I64Array, *, entry_is_local: bool
) -> list[BlockMove]:
    """Batch entry ``entry`` (``entry_bytes`` bytes) cut into ``piece``-byte pieces, piece
    ``j`` to or from block ``blocks[j]`` of the other side (the last piece may be shorter;
    pieces past the listed blocks stay).  ``LLM_PARAM_INVALID`` for more blocks than
    pieces."""
    pieces = -(-entry_bytes // piece)
    require(
        blocks.size <= pieces,
        f"{entry_bytes} bytes cut into pieces of {piece} make {pieces} blocks, fewer than the "
        f"{blocks.size} blocks listed",
    )
    moves = []
    for j, block in enumerate(blocks.tolist()):
        start = j * piece
        n = min(piece, entry_bytes - start)
        in_entry, in_block = (start, start + n), (0, n)
        if entry_is_local:
            moves.append(BlockMove(_one(entry), _one(block), in_entry, in_block))
        else:
            moves.append(BlockMove(_one(block), _one(entry), in_block, in_entry))
    return moves


def prefix_move(local: int, remote: int, nbytes: int) -> BlockMove:
    """The first ``nbytes`` of batch entry ``local`` <-> those of entry ``remote``."""
    return BlockMove(_one(local), _one(remote), (0, nbytes), (0, nbytes))


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


def check_blocks(name: str, blocks: Sequence[int], units: int, what: str) -> I64Array:
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
