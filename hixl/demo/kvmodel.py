"""The pure half of the KV-cache demo: its configuration, a tiny decoder-only
transformer in numpy (float32 math, fp16 KV), the prefill and decode steps over it, the
source and paged KV layouts with their views and descriptors, and the work-request
counts of the two ways to move a layer.  No engine and no clock: tested in
``tests/unit/test_demo_model.py``."""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hixl.core.descriptors import BlockListDesc, NdStridedDesc
from hixl.core.kv import ContiguousKVLayout, PagedKVLayout, padded_stride
from hixl.core.plan import DeviceLimits, Op, plan_transfer
from hixl.errors import ArgumentError

F32 = npt.NDArray[np.float32]
F16 = npt.NDArray[np.float16]
U8 = npt.NDArray[np.uint8]

DEFAULT_PROMPT = (
    "In disaggregated inference a prefill worker reads the whole prompt once and hands "
    "its key/value cache to a decode worker, which then writes the answer token by token. "
)

_MAX_BLOCKS = 240  # block ids travel as uint16 in one notification (<= 1 KiB)


# =====================================================================================
# Configuration (pure)
# =====================================================================================


def _check(name: str, value: int, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ArgumentError(f"{name}={value} is outside [{low}, {high}]")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """The model and the request.  Sizes are counts; ``head_dim`` must be even (RoPE).

    ``d_model`` is the residual width; the attention projects it to ``heads * head_dim``
    (as models with wide heads do), so the KV cache can be realistic while the matmuls
    stay small enough for an emulated CPU. ``ffn`` is the MLP width (default
    ``2 * d_model``). ``tokens`` is the prompt length in bytes (the tokenizer is bytes;
    the prompt text is repeated or cut to fit); ``gen_tokens`` how many tokens decode
    generates after prefill's first one. ``block_size`` 0 picks the smallest power of two
    >= 16 that keeps the request within 240 blocks. Raises :class:`ArgumentError`.
    """

    layers: int = 8
    heads: int = 8
    head_dim: int = 96
    d_model: int = 128
    ffn: int = 0
    tokens: int = 128
    gen_tokens: int = 16
    seed: int = 0
    block_size: int = 0
    prompt: str = DEFAULT_PROMPT

    def __post_init__(self) -> None:
        _check("layers", self.layers, 1, 256)
        _check("heads", self.heads, 1, 256)
        _check("head_dim", self.head_dim, 2, 1024)
        if self.head_dim % 2:
            raise ArgumentError(f"head_dim={self.head_dim} must be even (rotary embeddings)")
        _check("d_model", self.d_model, 4, 1 << 16)
        _check("ffn", self.ffn, 0, 1 << 18)
        _check("tokens", self.tokens, 1, 1 << 16)
        _check("gen_tokens", self.gen_tokens, 0, 4096)
        _check("seed", self.seed, 0, 2**63 - 1)
        _check("block_size", self.block_size, 0, 1 << 16)
        if not self.prompt.encode():
            raise ArgumentError("prompt must not be empty")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 2 * self.d_model)
        if self.block_size == 0:
            bs = 16
            while -(-self.capacity // bs) > _MAX_BLOCKS:
                bs *= 2
            object.__setattr__(self, "block_size", bs)
        if self.blocks_needed > _MAX_BLOCKS:
            raise ArgumentError(
                f"the request needs {self.blocks_needed} blocks of {self.block_size} tokens "
                f"for {self.capacity} tokens; at most {_MAX_BLOCKS} (raise block_size)"
            )

    @property
    def capacity(self) -> int:
        """Tokens the decode cache must hold: the prompt and every generated token."""
        return self.tokens + self.gen_tokens + 1

    @property
    def blocks_needed(self) -> int:
        return -(-self.capacity // self.block_size)

    @property
    def kv_bytes_per_layer(self) -> int:
        """Data bytes of one layer's K and V for the prompt (fp16, no padding)."""
        return 2 * self.heads * self.tokens * self.head_dim * 2

    def prompt_tokens(self) -> npt.NDArray[np.int64]:
        """The prompt as ``tokens`` byte values (the text repeated or cut to fit)."""
        raw = self.prompt.encode()
        reps = -(-self.tokens // len(raw))
        return np.frombuffer((raw * reps)[: self.tokens], dtype=np.uint8).astype(np.int64)

    def to_argv(self) -> list[str]:
        """Command-line options that rebuild this config (see :func:`add_model_options`)."""
        return [
            f"--layers={self.layers}",
            f"--heads={self.heads}",
            f"--head-dim={self.head_dim}",
            f"--d-model={self.d_model}",
            f"--ffn={self.ffn}",
            f"--tokens={self.tokens}",
            f"--gen-tokens={self.gen_tokens}",
            f"--seed={self.seed}",
            f"--block-size={self.block_size}",
            f"--prompt={self.prompt}",
        ]


# =====================================================================================
# The model (pure numpy)
# =====================================================================================


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One pre-norm block: attention (fused QKV, output) and a SiLU MLP."""

    wqkv: F32  # [d_model, 3 * heads * head_dim]
    wo: F32  # [heads * head_dim, d_model]
    w_up: F32  # [d_model, ffn]
    w_down: F32  # [ffn, d_model]


def _uniform(rng: np.random.Generator, shape: tuple[int, int], fan_in: int) -> F32:
    # Uniform with variance 1/fan_in keeps activations near unit scale through the stack.
    a = np.float32(math.sqrt(3.0 / fan_in))
    out: F32 = rng.random(shape, dtype=np.float32)
    out *= np.float32(2) * a
    out -= a
    return out


def _rms_norm(x: F32) -> F32:
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return np.asarray(x / np.sqrt(ms + np.float32(1e-5)), dtype=np.float32)


def _silu(x: F32) -> F32:
    return np.asarray(x / (np.float32(1) + np.exp(-x)), dtype=np.float32)


def _softmax(x: F32) -> F32:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    out: F32 = e / np.sum(e, axis=-1, keepdims=True)
    return out


class TinyLM:
    """A decoder-only transformer with seeded random weights over a 256-byte vocabulary.

    Deterministic: the same config gives bit-identical weights (layer ``i`` is drawn
    from ``default_rng([seed, i])``) and, on one machine and BLAS thread count,
    bit-identical outputs. KV is cached in fp16; attention reads the fp16 values back,
    so prefill and decode see the same cache. Rotary position embeddings (NeoX halves).
    """

    VOCAB = 256

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        d, hd, inner = cfg.d_model, cfg.head_dim, cfg.heads * cfg.head_dim
        head_rng = np.random.default_rng([cfg.seed, 1 << 20])
        self.embed = _uniform(head_rng, (self.VOCAB, d), 3)
        self.unembed = _uniform(head_rng, (d, self.VOCAB), d)
        self.layers = []
        for i in range(cfg.layers):
            rng = np.random.default_rng([cfg.seed, i])
            self.layers.append(
                LayerWeights(
                    wqkv=_uniform(rng, (d, 3 * inner), d),
                    wo=_uniform(rng, (inner, d), inner),
                    w_up=_uniform(rng, (d, cfg.ffn), d),
                    w_down=_uniform(rng, (cfg.ffn, d), cfg.ffn),
                )
            )
        half = hd // 2
        inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) * 2.0 / hd))
        angles = np.arange(cfg.capacity, dtype=np.float64)[:, None] * inv[None, :]
        self._cos = np.cos(angles).astype(np.float32)  # [positions, half]
        self._sin = np.sin(angles).astype(np.float32)
        self._scale = np.float32(1.0 / math.sqrt(hd))

    def _rope(self, x: F32, positions: slice) -> F32:
        """Rotate ``x[..., pos, head_dim]`` (heads first) by its positions."""
        half = self.cfg.head_dim // 2
        cos, sin = self._cos[positions], self._sin[positions]
        a, b = x[..., :half], x[..., half:]
        out: F32 = np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        return out

    def _split_heads(self, qkv: F32) -> tuple[F32, F32, F32]:
        """``[T, 3*H*hd]`` -> q, k, v each ``[H, T, hd]``."""
        t = qkv.shape[0]
        h, hd = self.cfg.heads, self.cfg.head_dim
        parts = qkv.reshape(t, 3, h, hd).transpose(1, 2, 0, 3)
        return parts[0], parts[1], parts[2]

    def _mlp(self, w: LayerWeights, x: F32) -> F32:
        out: F32 = _silu(_rms_norm(x) @ w.w_up) @ w.w_down
        return out

    def _logits(self, x: F32) -> F32:
        out: F32 = _rms_norm(x) @ self.unembed
        return out

    def prefill(self, tokens: npt.NDArray[np.int64]) -> PrefillRun:
        """Start a prefill over ``tokens``; step it layer by layer."""
        return PrefillRun(self, tokens)

    def generate(self, cache: PagedKV, first: int, start: int, count: int) -> list[int]:
        """Greedy decoding: feed ``first`` at position ``start``, then each output; return
        the ``count`` new tokens. ``cache`` must hold positions ``0..start-1``; the K/V of
        every fed token are written into it."""
        session = DecodeSession(self, cache, start)
        out: list[int] = []
        token = first
        for _ in range(count):
            token = session.step(token)
            out.append(token)
        return out


class DecodeSession:
    """Token-by-token decoding over a :class:`PagedKV` cache.

    The cache's fp16 K/V for positions ``0..start-1`` are read once and widened to
    float32 (exactly: every fp16 value is a float32 value); each step writes the new
    token's fp16 K/V into the cache and appends the same values to that working copy.
    So every step attends over exactly the cache's contents, without re-reading the
    paged blocks per step (which an emulated CPU would pay for many times over).
    """

    def __init__(self, model: TinyLM, cache: PagedKV, start: int) -> None:
        cfg = model.cfg
        if not 0 <= start <= min(cfg.capacity, cache.capacity):
            raise ArgumentError(f"start position {start} outside the cache")
        self.model = model
        self.cache = cache
        self.pos = start
        cap = min(cfg.capacity, cache.capacity)
        shape = (cfg.heads, cap, cfg.head_dim)
        self._k = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        self._v = [np.zeros(shape, np.float32) for _ in range(cfg.layers)]
        if start:
            for i in range(cfg.layers):
                k, v = cache.read(i, start)
                self._k[i][:, :start] = k
                self._v[i][:, :start] = v

    def step(self, token: int) -> int:
        """Feed ``token`` at the next position; return the greedy next token."""
        m, pos = self.model, self.pos
        if pos >= self._k[0].shape[1]:
            raise ArgumentError(f"the cache is full ({pos} tokens)")
        h, hd = m.cfg.heads, m.cfg.head_dim
        x = m.embed[token][None, :].copy()
        where = slice(pos, pos + 1)
        n = pos + 1
        for i, w in enumerate(m.layers):
            q, k, v = m._split_heads(_rms_norm(x) @ w.wqkv)  # [H, 1, hd]
            q, k = m._rope(q, where), m._rope(k, where)
            k16, v16 = k[:, 0].astype(np.float16), v[:, 0].astype(np.float16)
            self.cache.write(i, pos, k16, v16)
            self._k[i][:, pos] = k16
            self._v[i][:, pos] = v16
            kc, vc = self._k[i][:, :n], self._v[i][:, :n]
            scores = (kc @ q.transpose(0, 2, 1))[:, :, 0] * m._scale  # [H, n]
            att = (_softmax(scores)[:, None, :] @ vc)[:, 0, :]  # [H, hd]
            x = x + att.reshape(1, h * hd) @ w.wo
            x = x + m._mlp(w, x)
        self.pos += 1
        return int(np.argmax(m._logits(x)[0]))


class PrefillRun:
    """A prefill in progress: :meth:`step` computes the next layer and returns its K/V."""

    def __init__(self, model: TinyLM, tokens: npt.NDArray[np.int64]) -> None:
        if tokens.ndim != 1 or not 1 <= tokens.size <= model.cfg.capacity:
            raise ArgumentError(
                f"prefill needs 1..{model.cfg.capacity} tokens, got shape {tokens.shape}"
            )
        self.model = model
        self.x: F32 = model.embed[tokens]
        self.layer = 0
        t = tokens.size
        self._mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)

    def step(self) -> tuple[F16, F16]:
        """Compute the next layer; return its K and V, each ``[heads, tokens, head_dim]``
        fp16 C-contiguous (K after the rotary embedding)."""
        m = self.model
        if self.layer >= len(m.layers):
            raise ArgumentError(f"all {len(m.layers)} layers are already computed")
        w = m.layers[self.layer]
        x = self.x
        t = x.shape[0]
        q, k, v = m._split_heads(_rms_norm(x) @ w.wqkv)
        q, k = m._rope(q, slice(0, t)), m._rope(k, slice(0, t))
        k16 = np.ascontiguousarray(k, dtype=np.float16)
        v16 = np.ascontiguousarray(v, dtype=np.float16)
        scores = (q @ k16.astype(np.float32).transpose(0, 2, 1)) * m._scale + self._mask
        att = _softmax(scores) @ v16.astype(np.float32)  # [H, T, hd]
        x = x + att.transpose(1, 0, 2).reshape(t, -1) @ w.wo
        self.x = x + m._mlp(w, x)
        self.layer += 1
        return k16, v16

    def next_token(self) -> int:
        """The greedy token after the prompt (all layers must be computed)."""
        if self.layer != len(self.model.layers):
            raise ArgumentError(f"only {self.layer} of {len(self.model.layers)} layers computed")
        return int(np.argmax(self.model._logits(self.x[-1:])[0]))


# =====================================================================================
# KV layouts, views and descriptors (pure)
# =====================================================================================


def source_layout(cfg: DemoConfig) -> ContiguousKVLayout:
    """Prefill's KV: ``[layer][K|V][head][token]`` rows of ``head_dim`` fp16, each row
    padded to a power of two bytes (the layout its attention reads)."""
    return ContiguousKVLayout(
        num_layers=cfg.layers,
        num_heads=cfg.heads,
        num_tokens=cfg.tokens,
        head_dim=cfg.head_dim,
        itemsize=2,
        token_stride=padded_stride(cfg.head_dim, 2, pow2=True),
    )


def paged_layout(cfg: DemoConfig, pool_blocks: int, block_size: int) -> PagedKVLayout:
    """Decode's KV: per layer, K and V each ``[pool_blocks][block_size][heads][head_dim]``."""
    return PagedKVLayout(
        num_layers=cfg.layers,
        num_blocks=pool_blocks,
        block_size=block_size,
        num_heads=cfg.heads,
        head_dim=cfg.head_dim,
        itemsize=2,
    )


def allocate_blocks(cfg: DemoConfig) -> tuple[int, npt.NDArray[np.int64]]:
    """``(pool size, the request's block ids)``: a pool a quarter larger than needed, and
    the request's blocks drawn from it in shuffled order (as an allocator that has served
    other requests hands them out)."""
    need = cfg.blocks_needed
    pool = need + max(2, need // 4)
    ids = np.random.default_rng([cfg.seed, 0xB10C]).permutation(pool)[:need]
    return pool, ids.astype(np.int64)


def encode_blocks(pool: int, block_size: int, ids: npt.NDArray[np.int64]) -> bytes:
    """The block table as a notification message: ``<pool u32><block_size u32><ids u16...>``."""
    if pool > 0xFFFF or ids.size > _MAX_BLOCKS:
        raise ArgumentError(f"block table too large: pool={pool} ids={ids.size}")
    return struct.pack("<II", pool, block_size) + ids.astype("<u2").tobytes()


def decode_blocks(message: bytes) -> tuple[int, int, npt.NDArray[np.int64]]:
    """Inverse of :func:`encode_blocks`; raises :class:`ArgumentError` when malformed."""
    if len(message) < 8 or (len(message) - 8) % 2:
        raise ArgumentError(f"malformed block table: {len(message)} bytes")
    pool, block_size = struct.unpack_from("<II", message)
    ids = np.frombuffer(message, dtype="<u2", offset=8).astype(np.int64)
    if ids.size == 0 or pool < 1 or block_size < 1 or int(ids.max()) >= pool:
        raise ArgumentError(
            f"malformed block table: pool={pool} block_size={block_size} ids={ids.tolist()}"
        )
    return int(pool), int(block_size), ids


def source_view(buf: U8, layout: ContiguousKVLayout) -> F16:
    """``[layer, K|V, head, token, head_dim]`` fp16 view of prefill's padded buffer."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != layout.nbytes:
        raise ArgumentError(
            f"buffer must be {layout.nbytes} uint8 bytes, got {buf.dtype} shape {buf.shape}"
        )
    row = layout.stride_token // layout.itemsize
    full = buf.view(np.float16).reshape(
        layout.num_layers, 2, layout.num_heads, layout.num_tokens, row
    )
    return full[..., : layout.head_dim]


class PagedKV:
    """One request's tokens in a paged cache buffer laid out as ``layout``.

    ``block_ids[i]`` holds the request's tokens ``i*block_size .. (i+1)*block_size - 1``.
    Reads return ``[heads, tokens, head_dim]`` copies; writes go into the buffer.
    """

    def __init__(self, buf: U8, layout: PagedKVLayout, block_ids: npt.NDArray[np.int64]) -> None:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes < layout.nbytes:
            raise ArgumentError(
                f"buffer must be >= {layout.nbytes} uint8 bytes, got {buf.dtype} {buf.shape}"
            )
        assert layout.layer_stride is not None and layout.kv_stride is not None
        self.layout = layout
        self.ids = block_ids
        self._buf = buf
        self._plane_shape = (
            layout.num_blocks,
            layout.block_size,
            layout.num_heads,
            layout.head_dim,
        )

    @property
    def capacity(self) -> int:
        return int(self.ids.size) * self.layout.block_size

    def plane(self, layer: int, kv: int) -> F16:
        """The whole pool of ``layer``'s K (0) or V (1) plane, as a writable view."""
        lay = self.layout
        assert lay.layer_stride is not None and lay.kv_stride is not None
        start = lay.base_offset + layer * lay.layer_stride + kv * lay.kv_stride
        nbytes = lay.num_blocks * lay.block_bytes
        view: F16 = self._buf[start : start + nbytes].view(np.float16).reshape(self._plane_shape)
        return view

    def read(self, layer: int, n: int) -> tuple[F16, F16]:
        """K and V of tokens ``0..n-1``, each ``[heads, n, head_dim]`` (C-contiguous)."""
        if not 1 <= n <= self.capacity:
            raise ArgumentError(f"cannot read {n} tokens; capacity {self.capacity}")
        nb = -(-n // self.layout.block_size)
        out = []
        for kv in (0, 1):
            blocks = self.plane(layer, kv)[self.ids[:nb]]  # [nb, bs, H, hd]
            tok = blocks.reshape(-1, self.layout.num_heads, self.layout.head_dim)[:n]
            out.append(np.ascontiguousarray(tok.transpose(1, 0, 2)))
        return out[0], out[1]

    def write(self, layer: int, pos: int, k: F16, v: F16) -> None:
        """Store one token's K and V (each ``[heads, head_dim]``) at position ``pos``."""
        if not 0 <= pos < self.capacity:
            raise ArgumentError(f"position {pos} outside capacity {self.capacity}")
        block = self.ids[pos // self.layout.block_size]
        slot = pos % self.layout.block_size
        self.plane(layer, 0)[block, slot] = k
        self.plane(layer, 1)[block, slot] = v

    def write_prompt(self, layer: int, k: F16, v: F16) -> None:
        """Store K and V of tokens ``0..T-1`` (each ``[heads, T, head_dim]``)."""
        t = k.shape[1]
        bs = self.layout.block_size
        for kv, arr in ((0, k), (1, v)):
            plane = self.plane(layer, kv)
            for b in range(-(-t // bs)):
                t0, t1 = b * bs, min(t, (b + 1) * bs)
                plane[self.ids[b], : t1 - t0] = arr[:, t0:t1].transpose(1, 0, 2)


def kv_digest(k: F16, v: F16) -> str:
    """sha256 (hex) of K then V, each in ``[heads, tokens, head_dim]`` C order."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(k).tobytes())
    h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


def layer_descriptors(
    src: ContiguousKVLayout, dst: PagedKVLayout, block_ids: npt.NDArray[np.int64], layer: int
) -> tuple[NdStridedDesc, BlockListDesc]:
    """The one put for ``layer``: prefill's K and V rows (streamed token-major, to pair
    with the paged side) and decode's blocks for the prompt tokens."""
    layers = range(layer, layer + 1)
    local = src.descriptor(layers=layers, kv="kv", order="token")
    remote = dst.descriptor(block_ids, layers=layers, kv="kv", tokens=range(src.num_tokens))
    return local, remote


@dataclass(frozen=True, slots=True)
class WrCount:
    """Work requests of a transfer scheme: how many puts and how many WRs they post."""

    puts: int
    wrs: int


def strided_put_wrs(
    src: ContiguousKVLayout,
    dst: PagedKVLayout,
    block_ids: npt.NDArray[np.int64],
    limits: DeviceLimits,
) -> WrCount:
    """WRs of the demo's scheme: one put per layer, planned by :func:`plan_transfer`."""
    wrs = 0
    for layer in range(src.num_layers):
        local, remote = layer_descriptors(src, dst, block_ids, layer)
        wrs += plan_transfer(local, remote, Op.WRITE, limits).num_wrs
    return WrCount(puts=src.num_layers, wrs=wrs)


def per_head_put_wrs(
    src: ContiguousKVLayout,
    dst: PagedKVLayout,
    block_ids: npt.NDArray[np.int64],
    limits: DeviceLimits,
) -> WrCount:
    """WRs of the baseline: one put per (layer, K|V, head), each planned minimally.

    In the paged destination one head's tokens are ``heads * head_dim * 2`` bytes apart,
    so every token row of a head is its own remote run: one WR each. Layers are laid out
    alike (a constant offset apart), so layer 0 is planned and multiplied.
    """
    tokens = range(src.num_tokens)
    per_layer = 0
    for kv in ("k", "v"):
        for h in range(src.num_heads):
            heads = range(h, h + 1)
            local = src.descriptor(layers=range(1), kv=kv, heads=heads, alignment=None)
            remote = dst.descriptor(
                block_ids, layers=range(1), kv=kv, heads=heads, tokens=tokens, alignment=None
            )
            per_layer += plan_transfer(local, remote, Op.WRITE, limits).num_wrs
    return WrCount(puts=src.num_layers * 2 * src.num_heads, wrs=src.num_layers * per_layer)
