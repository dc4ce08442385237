"""KV cache layouts: the descriptors that select layers, K/V, heads and tokens.

Two layouts, both in one registered region whose start is offset ``base_offset``:

* :class:`ContiguousKVLayout`: ``[layers][K|V][heads][tokens][head_dim]``, with an
  optional padded token stride (head_dim 96 in fp16 is 192 bytes; padded to 256 it is a
  power of two). Its descriptors are :class:`~hixl.core.descriptors.NdStridedDesc`.
* :class:`PagedKVLayout`: vLLM-style paged blocks; per layer, K and V are each
  ``[num_blocks, block_size, heads, head_dim]``, and a request owns a list of block ids.
  Its descriptors are :class:`~hixl.core.descriptors.BlockListDesc`.

Both take a token range, so that only new tokens are sent, and a head range (tensor
parallel slices). A transfer pairs two streams byte for byte, so both sides must list the
bytes in the same logical order: ``order="head"`` streams (layer, K|V, head, token) and
``order="token"`` streams (layer, K|V, token, head). Paged layouts are token-major; pair
them with ``order="token"``. Only data bytes are streamed, never padding.

Pure: no I/O. All sizes and offsets are in bytes unless named ``num_*`` or ``*_dim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from hixl.core.descriptors import (
    DEFAULT_ALIGNMENT,
    INT64_MAX,
    BlockListDesc,
    NdStridedDesc,
)
from hixl.core.segments import _int
from hixl.errors import DescriptorError

__all__ = [
    "ContiguousKVLayout",
    "KVPart",
    "PagedKVLayout",
    "TokenOrder",
    "padded_stride",
]

#: Which planes to move: K only, V only, or both (K then V).
KVPart = Literal["k", "v", "kv"]
#: Stream order of a contiguous layout's descriptor.
TokenOrder = Literal["head", "token"]


def padded_stride(
    head_dim: int, itemsize: int, align: int = DEFAULT_ALIGNMENT, *, pow2: bool = False
) -> int:
    """Bytes per token of one head, rounded up for alignment.

    ``head_dim * itemsize`` rounded up to a multiple of ``align`` (bytes, >= 1), or with
    ``pow2=True`` to the next power of two that is at least ``align``. Examples (fp16):
    head_dim 128 is 256 bytes and stays 256; head_dim 80 is 160 bytes and becomes 192 with
    ``align=64``; head_dim 96 is 192 bytes, already a multiple of 64, and becomes 256 with
    ``pow2=True`` or ``align=128``. Raises :class:`DescriptorError` for values below 1.
    """
    raw = _int("head_dim", head_dim, minimum=1) * _int("itemsize", itemsize, minimum=1)
    a = _int("align", align, minimum=1)
    if pow2:
        return max(1 << (raw - 1).bit_length(), a)
    return -(-raw // a) * a


def _span(name: str, value: range | None, limit: int) -> range:
    """A non-empty ``range`` with step >= 1 inside ``[0, limit)``; None means all."""
    if value is None:
        return range(limit)
    if not isinstance(value, range):
        raise DescriptorError(f"{name} must be a range, got {type(value).__name__} {value!r}")
    if value.step < 1:
        raise DescriptorError(f"{name} must have a positive step, got {value!r}")
    if len(value) == 0:
        raise DescriptorError(f"{name} is empty ({value!r}): nothing to transfer")
    if value.start < 0 or value[-1] >= limit:
        raise DescriptorError(
            f"{name} {value!r} reaches outside [0, {limit}): first={value.start} last={value[-1]}"
        )
    return value


def _planes(kv: str) -> tuple[int, int]:
    """(first plane, number of planes) for ``kv``."""
    planes = {"k": (0, 1), "v": (1, 1), "kv": (0, 2)}
    if kv not in planes:
        raise DescriptorError(f"kv must be 'k', 'v' or 'kv', got {kv!r}")
    return planes[kv]


@dataclass(frozen=True, slots=True, kw_only=True)
class ContiguousKVLayout:
    """``[layers][K|V][heads][tokens][head_dim]`` in one region, starting at ``base_offset``.

    ``num_tokens`` is the token capacity per head; ``itemsize`` the bytes per value (2 for
    fp16/bf16). ``token_stride`` is the bytes from one token's ``head_dim`` vector to the
    next (default ``head_dim * itemsize``: no padding; see :func:`padded_stride`).
    Raises :class:`DescriptorError` for counts below 1, a ``token_stride`` shorter than
    the vector, or a layout that overflows int64.
    """

    num_layers: int
    num_heads: int
    num_tokens: int
    head_dim: int
    itemsize: int = 2
    token_stride: int | None = None
    base_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_tokens", "head_dim", "itemsize"):
            object.__setattr__(self, name, _int(name, getattr(self, name), minimum=1))
        object.__setattr__(self, "base_offset", _int("base_offset", self.base_offset, 0))
        vector = self.head_dim * self.itemsize
        stride = vector if self.token_stride is None else self.token_stride
        stride = _int("token_stride", stride, minimum=1)
        if stride < vector:
            raise DescriptorError(
                f"token_stride={stride} is shorter than head_dim*itemsize="
                f"{self.head_dim}*{self.itemsize}={vector} bytes"
            )
        object.__setattr__(self, "token_stride", stride)
        if self.base_offset + self.nbytes > INT64_MAX:
            raise DescriptorError(
                f"layout overflows int64: base_offset={self.base_offset} nbytes={self.nbytes}"
            )

    @property
    def vector_bytes(self) -> int:
        """Data bytes of one token of one head, ``head_dim * itemsize``."""
        return self.head_dim * self.itemsize

    @property
    def stride_token(self) -> int:
        """Bytes between consecutive tokens of one head (``token_stride``, resolved)."""
        assert self.token_stride is not None  # resolved in __post_init__
        return self.token_stride

    @property
    def head_stride(self) -> int:
        """Bytes between consecutive heads, ``num_tokens * token_stride``."""
        return self.num_tokens * self.stride_token

    @property
    def kv_stride(self) -> int:
        """Bytes from a layer's K plane to its V plane, ``num_heads * head_stride``."""
        return self.num_heads * self.head_stride

    @property
    def layer_stride(self) -> int:
        """Bytes between consecutive layers, ``2 * kv_stride``."""
        return 2 * self.kv_stride

    @property
    def nbytes(self) -> int:
        """Bytes the layout spans, padding included (the region must be at least this)."""
        return self.num_layers * self.layer_stride

    def offset_of(self, layer: int, plane: int, head: int, token: int) -> int:
        """Offset of one token vector: ``base + layer, plane (0=K, 1=V), head, token``."""
        return (
            self.base_offset
            + layer * self.layer_stride
            + plane * self.kv_stride
            + head * self.head_stride
            + token * self.stride_token
        )

    def descriptor(
        self,
        *,
        layers: range | None = None,
        kv: KVPart = "kv",
        heads: range | None = None,
        tokens: range | None = None,
        order: TokenOrder = "head",
        alignment: int | None = DEFAULT_ALIGNMENT,
    ) -> NdStridedDesc:
        """The bytes of the selected layers, planes, heads and tokens (padding excluded).

        ``layers``/``heads``/``tokens`` are ranges (None = all; steps allowed), e.g.
        ``tokens=range(old_len, new_len)`` for the new tokens only. ``order="head"``
        streams (layer, K|V, head, token), ``"token"`` streams (layer, K|V, token, head).
        The result is simplified (contiguous runs fused) and the ``alignment`` policy
        applies to its element starts and strides. Raises :class:`DescriptorError` for
        empty or out-of-range selections, :class:`AlignmentError` under the policy.
        """
        ls = _span("layers", layers, self.num_layers)
        hs = _span("heads", heads, self.num_heads)
        ts = _span("tokens", tokens, self.num_tokens)
        first, planes = _planes(kv)
        if order not in ("head", "token"):
            raise DescriptorError(f"order must be 'head' or 'token', got {order!r}")
        offset = self.offset_of(ls.start, first, hs.start, ts.start)
        head = (len(hs), hs.step * self.head_stride)
        token = (len(ts), ts.step * self.stride_token)
        inner = (head, token) if order == "head" else (token, head)
        dims = ((len(ls), ls.step * self.layer_stride), (planes, self.kv_stride), *inner)
        return (
            NdStridedDesc(
                offset=offset,
                shape=tuple(n for n, _ in dims),
                strides=tuple(s for _, s in dims),
                size=self.vector_bytes,
                alignment=None,
            )
            .simplified()
            .with_alignment(alignment)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedKVLayout:
    """vLLM-style paged KV cache in one region starting at ``base_offset``.

    Per layer, K and V are each ``[num_blocks, block_size, heads, head_dim]``. By default
    the planes are packed: ``kv_stride = num_blocks * block_bytes`` and
    ``layer_stride = 2 * kv_stride``; pass larger strides when each plane is its own
    allocation inside a bigger region. Raises :class:`DescriptorError` for counts below 1
    or strides that would make planes overlap.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    itemsize: int = 2
    kv_stride: int | None = None
    layer_stride: int | None = None
    base_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_dim"):
            object.__setattr__(self, name, _int(name, getattr(self, name), minimum=1))
        object.__setattr__(self, "itemsize", _int("itemsize", self.itemsize, minimum=1))
        object.__setattr__(self, "base_offset", _int("base_offset", self.base_offset, 0))
        plane = self.num_blocks * self.block_bytes
        kv = _int("kv_stride", plane if self.kv_stride is None else self.kv_stride, 1)
        if kv < plane:
            raise DescriptorError(
                f"kv_stride={kv} is shorter than one plane ({self.num_blocks} blocks x "
                f"{self.block_bytes} bytes = {plane})"
            )
        object.__setattr__(self, "kv_stride", kv)
        layer = _int("layer_stride", 2 * kv if self.layer_stride is None else self.layer_stride, 1)
        if layer < kv + plane:
            raise DescriptorError(
                f"layer_stride={layer} is shorter than kv_stride + plane = {kv} + {plane}"
            )
        object.__setattr__(self, "layer_stride", layer)
        if self.base_offset + self.nbytes > INT64_MAX:
            raise DescriptorError(
                f"layout overflows int64: base_offset={self.base_offset} nbytes={self.nbytes}"
            )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token over all heads, ``num_heads * head_dim * itemsize``."""
        return self.num_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane, ``block_size * token_bytes``."""
        return self.block_size * self.token_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the layout spans (the region must be at least this long)."""
        assert self.layer_stride is not None and self.kv_stride is not None
        return (
            (self.num_layers - 1) * self.layer_stride
            + self.kv_stride
            + (self.num_blocks * self.block_bytes)
        )

    def descriptor(
        self,
        block_ids: npt.ArrayLike,
        *,
        layers: range | None = None,
        kv: KVPart = "kv",
        heads: range | None = None,
        tokens: range | None = None,
        alignment: int | None = DEFAULT_ALIGNMENT,
    ) -> BlockListDesc:
        """The bytes of a request's tokens, streamed (layer, K|V, token, head).

        ``block_ids[i]`` is the block holding the request's tokens ``i*block_size ..
        (i+1)*block_size - 1``. ``tokens`` (default: all of those) selects positions in the
        request, e.g. ``range(old_len, new_len)`` for new tokens only; ``heads`` a range of
        heads with step 1 (default all); ``layers`` any range. With all heads each block's
        selected tokens are one element; otherwise one element per token. The
        ``alignment`` policy applies to every element start. Raises
        :class:`DescriptorError` for block ids outside ``[0, num_blocks)``, empty or
        out-of-range selections; :class:`AlignmentError` under the policy.
        """
        assert self.layer_stride is not None and self.kv_stride is not None
        try:
            ids = np.asarray(block_ids)
        except (TypeError, ValueError) as exc:
            raise DescriptorError(f"block_ids must be integers: {exc}") from None
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise DescriptorError(
                f"block_ids must be a non-empty 1-D integer array, got shape {ids.shape} "
                f"dtype {ids.dtype}"
            )
        bad = np.flatnonzero((ids < 0) | (ids >= self.num_blocks))
        if bad.size:
            i = int(bad[0])
            raise DescriptorError(
                f"block_ids[{i}]={int(ids[i])} is outside [0, num_blocks={self.num_blocks})"
            )
        ids = ids.astype(np.int64)
        ls = _span("layers", layers, self.num_layers)
        ts = _span("tokens", tokens, ids.size * self.block_size)
        if ts.step != 1:
            raise DescriptorError(f"tokens must have step 1 in a paged layout, got {tokens!r}")
        hs = _span("heads", heads, self.num_heads)
        if hs.step != 1:
            raise DescriptorError(f"heads must have step 1, got {heads!r}")
        first, planes = _planes(kv)
        head_bytes = self.head_dim * self.itemsize
        bs = self.block_size

        if len(hs) == self.num_heads:
            # One element per (block, selected token run) : tokens are contiguous in a block.
            b = np.arange(ts.start // bs, (ts.stop - 1) // bs + 1, dtype=np.int64)
            t0 = np.maximum(ts.start, b * bs)
            t1 = np.minimum(ts.stop, (b + 1) * bs)
            inner = ids[b] * self.block_bytes + (t0 - b * bs) * self.token_bytes
            length = (t1 - t0) * self.token_bytes
        else:
            t = np.arange(ts.start, ts.stop, dtype=np.int64)
            inner = ids[t // bs] * self.block_bytes + (t % bs) * self.token_bytes
            inner += hs.start * head_bytes
            length = np.full(t.size, len(hs) * head_bytes, dtype=np.int64)
        layer = np.arange(ls.start, ls.stop, ls.step, dtype=np.int64) * self.layer_stride
        plane = np.arange(first, first + planes, dtype=np.int64) * self.kv_stride
        offsets = (
            self.base_offset + layer[:, None, None] + plane[None, :, None] + inner[None, None, :]
        ).ravel()
        lengths = np.broadcast_to(length, (len(ls), planes, length.size)).ravel()
        return BlockListDesc(offsets=offsets, lengths=lengths, alignment=alignment)
