"""``hixl demo``: a prefill worker pushes a real model's KV cache to a decode worker.

Theory of operation
-------------------
Two processes share one soft-RoCE device (on the host, or in the hixl VM):

* **decode** builds the model, registers a vLLM-style *paged* KV cache (per layer, K and V
  are ``[blocks][16 tokens][heads][head_dim]`` fp16) with ``REMOTE_WRITE``, listens, and
  tells prefill which blocks (scattered, from a shuffled pool) its request owns.
* **prefill** runs a small decoder-only transformer (numpy, float32 math, fp16 KV) over
  the prompt. Its K/V live in the layout its attention wants: head-major, each head's
  token rows padded to a power of two (head_dim 96 is 192 bytes, stride 256). As soon as
  layer ``i`` is computed it posts **one strided put** that moves that layer's K and V
  into decode's blocks, with notification ``layer{i}`` whose message is the sha256 of
  the layer's K/V as prefill computed them. The put converts layouts on the way (head
  major to token major, padding dropped): each work request gathers up to ``max_sge``
  head rows into one contiguous run of a block.
* decode waits for ``layer0``, ``layer1``, ... (RC delivers a notification after the
  data before it, so the bytes are in place), hashes what landed and compares. After
  ``done`` (carrying prefill's first generated token) it recomputes the prefill itself,
  greedily generates from the received cache and from its own cache, and compares.

The orchestrator (:func:`run_demo`) starts both as subprocesses, forwards their output,
kills the other side as soon as one fails, and prints the summary; every wait has a
deadline. Both processes read ``time.monotonic()``, one clock for the whole machine, so
their timestamps can be compared.

The model math, the KV views, the descriptor choices and the summary arithmetic are pure
(no engine, no clock) and tested in ``tests/unit/test_demo_model.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from hixl.core.descriptors import BlockListDesc, NdStridedDesc
from hixl.core.kv import ContiguousKVLayout, PagedKVLayout, padded_stride
from hixl.core.plan import DeviceLimits, Op, plan_transfer
from hixl.errors import ArgumentError, HixlError
from hixl.testbed.net import free_tcp_port

__all__ = [
    "DEFAULT_PROMPT",
    "DemoConfig",
    "PagedKV",
    "TinyLM",
    "format_summary",
    "run_demo",
    "summarize",
]

F32 = npt.NDArray[np.float32]
F16 = npt.NDArray[np.float16]
U8 = npt.NDArray[np.uint8]
Emit = Callable[[str], None]

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


# =====================================================================================
# Summary arithmetic (pure)
# =====================================================================================

Interval = tuple[float, float]


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``[start, end]`` intervals (empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Sequence[Interval]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


def overlap(xs: Sequence[Interval], ys: Sequence[Interval]) -> float:
    """Length of ``union(xs) ∩ union(ys)``."""
    total = 0.0
    uy = union(ys)
    for a, b in union(xs):
        for c, d in uy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def summarize(cfg: DemoConfig, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """Combine both roles' results into the summary (all times in ms, sizes in bytes).

    Transfer ``i`` runs from the moment layer ``i``'s K/V are in the registered region
    until its put's completion is seen (data and notification acknowledged): hashing,
    planning, posting and the wire; MB/s counts from the start of posting. *Overlapped*
    is the part of the union of transfers that falls inside the union of compute
    intervals (layer math and writing K/V into the source region); *exposed* is the rest.
    """
    lim = prefill["limits"]
    limits = DeviceLimits(lim["max_sge"], lim["max_sge_rd"], lim["max_msg_sz"])
    ids = np.asarray(decode["block_ids"], dtype=np.int64)
    src = source_layout(cfg)
    dst = paged_layout(cfg, decode["pool_blocks"], decode["block_size"])
    ours = strided_put_wrs(src, dst, ids, limits)
    base = per_head_put_wrs(src, dst, ids, limits)

    pl, dl = prefill["layers"], decode["layers"]
    t0 = pl[0]["compute"][0]
    computes = [tuple(r["compute"]) for r in pl]
    transfers = [tuple(r["transfer"]) for r in pl]
    rows = []
    for r, d in zip(pl, dl, strict=True):
        x = tuple(r["transfer"])
        dur = x[1] - x[0]
        wire = x[1] - r["post"][0]
        rows.append(
            {
                "layer": r["layer"],
                "compute_ms": 1e3 * (r["compute"][1] - r["compute"][0]),
                "transfer_ms": 1e3 * dur,
                "post_ms": 1e3 * (r["post"][1] - r["post"][0]),
                "hidden_fraction": overlap([x], computes) / dur if dur > 0 else 1.0,
                "bytes": r["nbytes"],
                "wrs": r["num_wrs"],
                "mb_per_s": r["nbytes"] / wire / 1e6 if wire > 0 else 0.0,
                "arrived_ms": 1e3 * (d["arrived"] - t0),
                "bit_exact": bool(d["bit_exact"]),
            }
        )
    busy = length(transfers)
    hidden = overlap(transfers, computes)
    posted = sum(r["num_wrs"] for r in pl)
    exact = sum(1 for d in dl if d["bit_exact"])
    tokens_equal = decode["tokens_received"] == decode["tokens_local"]
    ok = exact == cfg.layers and tokens_equal and posted == ours.wrs
    return {
        "ok": ok,
        "config": asdict(cfg),
        "device": prefill["device"],
        "limits": lim,
        "layout": {
            "source_row_bytes": src.stride_token,
            "data_row_bytes": src.vector_bytes,
            "block_size": decode["block_size"],
            "pool_blocks": decode["pool_blocks"],
            "block_ids": decode["block_ids"],
        },
        "bytes_moved": sum(r["nbytes"] for r in pl),
        "puts": len(pl),
        "wrs_posted": posted,
        "wrs_planned": ours.wrs,
        "per_head": {"puts": base.puts, "wrs": base.wrs},
        "wrs_avoided": base.wrs - posted,
        "layers": rows,
        "compute_ms": 1e3 * length(computes),
        "transfer_busy_ms": 1e3 * busy,
        "overlapped_ms": 1e3 * hidden,
        "exposed_ms": 1e3 * (busy - hidden),
        "overlap_fraction": hidden / busy if busy > 0 else 1.0,
        "prefill_to_last_landed_ms": 1e3 * (transfers[-1][1] - t0),
        "tail_after_compute_ms": 1e3 * max(0.0, transfers[-1][1] - computes[-1][1]),
        "layers_bit_exact": exact,
        "received_equals_recompute": bool(decode["received_equals_recompute"]),
        "first_token": {"prefill": prefill["first_token"], "decode": decode["first_token"]},
        "tokens_received": decode["tokens_received"],
        "tokens_local": decode["tokens_local"],
        "tokens_equal": tokens_equal,
        "timings_s": {
            "prefill_model_build": prefill["build_s"],
            "decode_model_build": decode["build_s"],
            "decode_recompute": decode["recompute_s"],
            "decode_generate": decode["generate_s"],
        },
    }


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable summary of :func:`summarize`'s result."""
    cfg, lay, per_head = s["config"], s["layout"], s["per_head"]
    busy_s = s["transfer_busy_ms"] / 1e3
    pad = lay["source_row_bytes"] - lay["data_row_bytes"]
    avoided_pct = 100.0 * s["wrs_avoided"] / per_head["wrs"] if per_head["wrs"] else 0.0
    yes = {True: "yes", False: "NO"}
    lines = [
        f"hixl demo: {'VERIFIED' if s['ok'] else 'FAILED'}",
        f"  model         {cfg['layers']} layers, {cfg['heads']} heads x head_dim "
        f"{cfg['head_dim']}, fp16 KV; d_model {cfg['d_model']}, ffn {cfg['ffn']}, "
        f"seed {cfg['seed']}",
        f"  request       {cfg['tokens']} prompt tokens, then {cfg['gen_tokens']} generated",
        f"  device        {s['device']}",
        f"  prefill KV    [layer][K|V][head][token] rows of {lay['data_row_bytes']} B padded "
        f"by {pad} B to {lay['source_row_bytes']} B",
        f"  decode KV     paged: {len(lay['block_ids'])} blocks of {lay['block_size']} "
        f"tokens x heads x head_dim, ids {lay['block_ids']} of a pool of "
        f"{lay['pool_blocks']}",
        "",
        "  layer  compute  transfer  (posting)  hidden  WRs      bytes   MB/s  decode saw it"
        "  bit-exact",
    ]
    for r in s["layers"]:
        lines.append(
            f"  {r['layer']:>5}  {r['compute_ms']:>5.0f}ms  {r['transfer_ms']:>6.0f}ms  "
            f"({r['post_ms']:>5.0f}ms)  {100 * r['hidden_fraction']:>5.0f}%  {r['wrs']:>4}  "
            f"{r['bytes']:>9,}  {r['mb_per_s']:>5.1f}  {r['arrived_ms'] / 1e3:>11.2f} s  "
            f"{yes[r['bit_exact']]}"
        )
    lines += [
        "  (transfer: from the layer's K/V being ready to its completion; posting: the",
        "   put_async call; hidden: share of the transfer during later layers' compute;",
        "   decode saw it: seconds after prefill started computing)",
        "",
        f"  bytes moved   {s['bytes_moved']:,} B ({s['bytes_moved'] / (1 << 20):.2f} MiB) of "
        f"K/V data (no padding) in {s['puts']} strided puts, one per layer",
        f"  work requests {s['wrs_posted']:,} posted, each gathering up to "
        f"{s['limits']['max_sge']} head rows into one block run",
        f"                a put per (layer, K|V, head) = {per_head['puts']:,} puts would post "
        f"{per_head['wrs']:,} WRs",
        f"                (a head's rows are {cfg['heads'] * cfg['head_dim'] * 2} B apart in a "
        f"paged block): {s['wrs_avoided']:,} WRs avoided ({avoided_pct:.1f}%)",
        f"  transfer      {busy_s:.2f} s busy in all; {s['overlapped_ms'] / 1e3:.2f} s of it "
        f"overlapped prefill's compute ({100 * s['overlap_fraction']:.0f}%), "
        f"{s['exposed_ms'] / 1e3:.2f} s exposed",
        f"  pipeline      compute {s['compute_ms'] / 1e3:.2f} s; the last layer landed "
        f"{s['tail_after_compute_ms']:.0f} ms after the last compute ended",
        f"  KV check      {s['layers_bit_exact']}/{cfg['layers']} layers bit-exact "
        f"(sha256 of prefill's K/V == sha256 of what landed)",
        f"                received cache == decode's own recompute, byte for byte: "
        f"{yes[s['received_equals_recompute']]}",
        f"  generation    {len(s['tokens_received'])} greedy tokens (the first from prefill): "
        f"received cache {'==' if s['tokens_equal'] else '!='} local cache: "
        f"{'EQUAL' if s['tokens_equal'] else 'DIFFERENT'}",
        f"                received {s['tokens_received']}",
        f"                local    {s['tokens_local']}",
    ]
    if "elapsed_s" in s:
        t = s["timings_s"]
        lines.append(
            f"  time          {s['elapsed_s']:.1f} s for the demo; of it: model build "
            f"{t['prefill_model_build']:.1f} s, decode's recompute {t['decode_recompute']:.1f} "
            f"s, generation {t['decode_generate']:.1f} s"
        )
    return "\n".join(lines)


# =====================================================================================
# The two roles (engine)
# =====================================================================================


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def left(self, what: str) -> float:
        from hixl.errors import TransferTimeout

        left = self.at - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what}: the demo's deadline of {self.seconds:.0f} s passed")
        return left


def _wait_note(engine: Any, name: str, peer: str, deadline: _Deadline) -> Any:
    """Wait for notification ``name`` from ``peer``; fail early if the connection fails."""
    from hixl.engine import ConnState
    from hixl.errors import ConnectionFailed, TransferTimeout

    while True:
        left = deadline.left(f"waiting for notification {name!r} from {peer}")
        try:
            return engine.wait_notification(name, timeout=min(1.0, left), peer=peer)
        except TransferTimeout:
            conn = engine.connection(peer)
            if conn.state is not ConnState.READY:
                raise ConnectionFailed(
                    f"connection to {peer} is {conn.state.name} while waiting for {name!r}: "
                    f"{conn.failure}"
                ) from None


TOKEN_ENV = "HIXL_DEMO_TOKEN"
"""The variable that gives both roles their engines' shared token (none when unset: then
decode must listen on loopback)."""


def demo_token() -> str | None:
    """The roles' shared engine token, from ``$HIXL_DEMO_TOKEN`` (None when unset)."""
    return os.environ.get(TOKEN_ENV) or None


def run_decode(cfg: DemoConfig, listen: str, seconds: float, emit: Emit) -> dict[str, Any]:
    """The decode role: receive, verify, recompute, generate, compare. Returns results."""
    from hixl.engine import Access, ConnState, Engine

    deadline = _Deadline(seconds)
    t = time.monotonic()
    model = TinyLM(cfg)
    build_s = time.monotonic() - t
    pool, ids = allocate_blocks(cfg)
    dst = paged_layout(cfg, pool, cfg.block_size)
    cache = np.zeros(dst.nbytes, dtype=np.uint8)
    view = PagedKV(cache, dst, ids)
    layers: list[dict[str, Any]] = []
    with Engine(listen, token=demo_token()) as engine:
        engine.register(cache, access=Access.REMOTE_WRITE, name="kv")
        emit(
            f"listening on {listen}; paged KV cache {dst.nbytes / (1 << 20):.2f} MiB "
            f"({cfg.layers} layers x K|V x {pool} blocks of {cfg.block_size} tokens); "
            f"this request owns blocks {ids.tolist()}"
        )
        peer = None
        while peer is None:
            deadline.left("waiting for prefill to connect")
            for p in engine.peers:
                with contextlib.suppress(HixlError):
                    if engine.connection(p).state is ConnState.READY:
                        peer = p
            time.sleep(0.02)
        emit(f"prefill {peer} connected; sending the block table")
        engine.notify(
            peer,
            "blocks",
            encode_blocks(pool, cfg.block_size, ids),
            timeout=deadline.left("sending the block table"),
        )
        for i in range(cfg.layers):
            note = _wait_note(engine, f"layer{i}", peer, deadline)
            arrived = time.monotonic()
            k, v = view.read(i, cfg.tokens)
            got = kv_digest(k, v)
            want = note.message.decode("ascii", "replace")
            exact = got == want
            layers.append(
                {
                    "layer": i,
                    "arrived": arrived,
                    "bit_exact": exact,
                    "sha256": got,
                    "prefill_sha256": want,
                }
            )
            emit(
                f"layer {i}: landed; sha256 {got[:16]}... "
                f"{'== prefill (bit-exact)' if exact else '!= prefill ' + want[:16]}"
            )
        done = _wait_note(engine, "done", peer, deadline)
        info = json.loads(done.message)
        _expect_goodbye()
        engine.notify(peer, "ack", b"", timeout=deadline.left("acknowledging"))
        _await_hangup(engine, peer, deadline)
    first = int(info["first_token"])
    received_prompt = cache.copy()

    emit("recomputing the prefill locally for comparison ...")
    t = time.monotonic()
    local = np.zeros_like(cache)
    local_view = PagedKV(local, dst, ids)
    run = model.prefill(cfg.prompt_tokens())
    for i in range(cfg.layers):
        k, v = run.step()
        local_view.write_prompt(i, k, v)
        deadline.left("recomputing the prefill")
    local_first = run.next_token()
    recompute_s = time.monotonic() - t
    same = bool(np.array_equal(received_prompt, local))

    t = time.monotonic()
    got_tokens = [first, *model.generate(view, first, cfg.tokens, cfg.gen_tokens)]
    deadline.left("generating from the received cache")
    local_tokens = [
        local_first,
        *model.generate(local_view, local_first, cfg.tokens, cfg.gen_tokens),
    ]
    generate_s = time.monotonic() - t
    emit(f"generated {len(got_tokens)} tokens from the received cache: {got_tokens}")
    emit(
        f"generated {len(local_tokens)} tokens from the local cache:    {local_tokens} "
        f"({'equal' if got_tokens == local_tokens else 'DIFFERENT'})"
    )
    return {
        "role": "decode",
        "pool_blocks": pool,
        "block_size": cfg.block_size,
        "block_ids": ids.tolist(),
        "layers": layers,
        "first_token": local_first,
        "prefill_first_token": first,
        "received_equals_recompute": same,
        "tokens_received": got_tokens,
        "tokens_local": local_tokens,
        "build_s": build_s,
        "recompute_s": recompute_s,
        "generate_s": generate_s,
    }


def _connect(engine: Any, peer: str, deadline: _Deadline) -> Any:
    from hixl.errors import ConnectionFailed, TransferTimeout

    last: Exception | None = None
    while True:
        left = deadline.left(f"connecting to decode at {peer} (last error: {last})")
        try:
            return engine.connect(peer, timeout=min(5.0, left))
        except (ConnectionFailed, TransferTimeout) as exc:
            last = exc
            time.sleep(0.1)


def _await_hangup(engine: Any, peer: str, deadline: _Deadline, limit: float = 10.0) -> None:
    """Let ``peer`` close first (at most ``limit`` s). Closing right after our last
    notification races with its delivery: the peer's engine may read our goodbye on the
    control socket before it polls that notification's receive completion, and it drops
    receive completions of a connection that is no longer ready."""
    from hixl.engine import ConnState

    end = time.monotonic() + min(limit, max(0.0, deadline.at - time.monotonic()))
    while time.monotonic() < end:
        try:
            if engine.connection(peer).state is not ConnState.READY:
                return
        except HixlError:
            return
        time.sleep(0.02)


def _expect_goodbye() -> None:
    """From here on the peer closing its engine is the plan, not news: keep its INFO line
    (Debian's pyverbs sets up root logging at INFO on import) out of the demo output."""
    logging.getLogger("hixl").setLevel(logging.WARNING)


class _LayerSender:
    """Posts each layer's put from a background thread; another stamps completions.

    The main thread only computes: it hands layer ``i`` over once its K/V are in the
    registered region. The sender hashes them, builds the layer's descriptors and posts
    the put (planning and posting are Python work that would otherwise hold up the next
    layer's compute; BLAS releases the GIL, so they interleave). The watcher waits on the
    handles in posting order (an RC queue pair completes in order) and records when each
    layer landed.
    """

    def __init__(
        self,
        engine: Any,
        peer: str,
        region: Any,
        src: ContiguousKVLayout,
        dst: PagedKVLayout,
        ids: npt.NDArray[np.int64],
        deadline: _Deadline,
        emit: Emit,
    ) -> None:
        self._engine, self._peer, self._region = engine, peer, region
        self._src, self._dst, self._ids = src, dst, ids
        self._deadline = deadline
        self._emit = emit
        self.rows: dict[int, dict[str, Any]] = {}
        self.errors: list[BaseException] = []
        self._todo: queue.Queue[tuple[int, F16, F16, float] | None] = queue.Queue()
        self._posted: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="demo-sender", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="demo-watch", daemon=True)
        self._sender.start()
        self._watcher.start()

    def send(self, layer: int, k: F16, v: F16, ready: float) -> None:
        """Queue ``layer`` (its K/V, each ``[heads, tokens, head_dim]``, ready at ``ready``)."""
        if self.errors:
            raise self.errors[0]
        self._todo.put((layer, k, v, ready))

    def _send_loop(self) -> None:
        while (item := self._todo.get()) is not None:
            i, k, v, ready = item
            try:
                digest = kv_digest(k, v)
                local, remote = layer_descriptors(self._src, self._dst, self._ids, i)
                p0 = time.monotonic()
                handle = self._engine.put_async(
                    self._peer,
                    self._region,
                    "kv",
                    local_desc=local,
                    remote_desc=remote,
                    notify=f"layer{i}",
                    notify_message=digest.encode(),
                    timeout=self._deadline.left(f"posting layer {i}"),
                )
                p1 = time.monotonic()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.errors.append(exc)
                break
            self.rows[i] = {
                "ready": ready,
                "post_start": p0,
                "post_end": p1,
                "nbytes": handle.nbytes,
                "num_wrs": handle.num_wrs,
                "sha256": digest,
            }
            self._posted.put((i, handle))
        self._posted.put(None)

    def _watch_loop(self) -> None:
        while (item := self._posted.get()) is not None:
            i, handle = item
            try:
                handle.wait(timeout=max(0.0, self._deadline.at - time.monotonic()))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.errors.append(exc)
                return
            done = time.monotonic()
            row = self.rows[i]
            row["done"] = done
            self._emit(
                f"layer {i}: landed {1e3 * (done - row['ready']):.0f} ms after it was "
                f"computed: one put of {row['nbytes']:,} B as {row['num_wrs']} WRs, posted "
                f"in {1e3 * (row['post_end'] - row['post_start']):.0f} ms, then notify "
                f"layer{i}"
            )

    def finish(self) -> None:
        """Wait until every queued layer has landed; raise the first error."""
        self._todo.put(None)
        for th in (self._sender, self._watcher):
            th.join(timeout=max(0.0, self._deadline.at - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        if self._watcher.is_alive():
            self._deadline.left("waiting for the last layers to land")
        missing = [i for i, r in self.rows.items() if "done" not in r]
        if missing:
            raise HixlError(f"layers {missing} were posted but never completed")

    def stop(self) -> None:
        """Let both threads end (they are daemons; an engine close fails any handle)."""
        self._todo.put(None)


def run_prefill(cfg: DemoConfig, peer: str, seconds: float, emit: Emit) -> dict[str, Any]:
    """The prefill role: compute layer by layer, put each layer at once. Returns results."""
    from hixl.engine import Access, Engine

    deadline = _Deadline(seconds)
    t = time.monotonic()
    model = TinyLM(cfg)
    build_s = time.monotonic() - t
    src = source_layout(cfg)
    buf = np.zeros(src.nbytes, dtype=np.uint8)
    kv = source_view(buf, src)
    with Engine("127.0.0.1:0", token=demo_token()) as engine:
        region = engine.register(buf, access=Access.NONE, name="prefill-kv")
        conn = _connect(engine, peer, deadline)
        dev = engine.device
        device = f"{dev.name} port {dev.port} GID index {dev.gid_index}, MTU {conn.mtu}"
        note = _wait_note(engine, "blocks", peer, deadline)
        pool, block_size, ids = decode_blocks(note.message)
        dst = paged_layout(cfg, pool, block_size)
        emit(f"connected to decode {peer} over {device}; decode's blocks {ids.tolist()}")

        sender = _LayerSender(engine, peer, region, src, dst, ids, deadline, emit)
        computes: list[list[float]] = []
        run = model.prefill(cfg.prompt_tokens())
        try:
            for i in range(cfg.layers):
                c0 = time.monotonic()
                k, v = run.step()
                kv[i, 0] = k
                kv[i, 1] = v
                c1 = time.monotonic()
                computes.append([c0, c1])
                emit(f"layer {i}: computed in {1e3 * (c1 - c0):.0f} ms; handed to the sender")
                sender.send(i, k, v, c1)
            first = run.next_token()
            sender.finish()
        finally:
            sender.stop()
        rows = []
        for i in range(cfg.layers):
            r = sender.rows[i]
            rows.append(
                {
                    "layer": i,
                    "compute": computes[i],
                    "transfer": [r["ready"], r["done"]],
                    "post": [r["post_start"], r["post_end"]],
                    "nbytes": r["nbytes"],
                    "num_wrs": r["num_wrs"],
                    "sha256": r["sha256"],
                }
            )
        tail = rows[-1]["transfer"][1] - computes[-1][1]
        emit(
            f"all {cfg.layers} layers landed, the last {1e3 * tail:.0f} ms after the last "
            f"compute ended; first generated token {first}"
        )
        engine.notify(
            peer,
            "done",
            json.dumps({"first_token": first}).encode(),
            timeout=deadline.left("sending done"),
        )
        _wait_note(engine, "ack", peer, deadline)
        limits = engine.limits
    return {
        "role": "prefill",
        "device": device,
        "limits": {
            "max_sge": limits.max_sge,
            "max_sge_rd": limits.max_sge_rd,
            "max_msg_sz": limits.max_msg_sz,
        },
        "layers": rows,
        "first_token": first,
        "build_s": build_s,
    }


# =====================================================================================
# Orchestration and command line
# =====================================================================================


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that make a :class:`DemoConfig`."""
    d = DemoConfig()
    p.add_argument("--layers", type=int, default=d.layers, help=f"layers (default {d.layers})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"KV heads (default {d.heads})")
    p.add_argument(
        "--head-dim",
        type=int,
        default=d.head_dim,
        help=f"head dimension, e.g. 64, 96, 128 (default {d.head_dim})",
    )
    p.add_argument(
        "--d-model", type=int, default=d.d_model, help=f"residual width (default {d.d_model})"
    )
    p.add_argument("--ffn", type=int, default=0, help="MLP width (default 2 x d_model)")
    p.add_argument(
        "--tokens", type=int, default=d.tokens, help=f"prompt tokens (bytes) (default {d.tokens})"
    )
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=d.gen_tokens,
        help=f"tokens to generate after the first (default {d.gen_tokens})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="weights seed (default 0)")
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="decode's paged block size in tokens (default 16, larger if needed)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (repeated to fit)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        d_model=args.d_model,
        ffn=args.ffn,
        tokens=args.tokens,
        gen_tokens=args.gen_tokens,
        seed=args.seed,
        block_size=args.block_size,
        prompt=args.prompt,
    )


def add_demo_options(p: argparse.ArgumentParser) -> None:
    """Options of ``hixl demo``."""
    add_model_options(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="fail (and stop both workers) after S seconds (default 600)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")


def _forward(
    stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock, tail: list[str]
) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        del tail[:-20]
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # One BLAS thread each: the two workers share the CPUs, and the same thread count
    # on both sides keeps decode's recompute bit-identical to prefill's math.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    # (In the hixl VM the guest also picks OpenBLAS's kernel: hixl.testbed.guest.)
    return env


def run_demo(
    cfg: DemoConfig,
    *,
    timeout: float = 300.0,
    json_path: str | None = None,
    out: IO[str] | None = None,
) -> dict[str, Any]:
    """Run decode and prefill as two processes on this machine's RDMA device.

    Streams both workers' progress to ``out`` (default stdout), prints the summary and
    returns it (see :func:`summarize`); also writes it to ``json_path`` if given. Raises
    :class:`HixlError` when a worker fails (the other is killed at once) or the whole
    run exceeds ``timeout`` seconds (both are killed).
    """
    out = out or sys.stdout
    lock = threading.Lock()
    listen = f"127.0.0.1:{free_tcp_port()}"
    budget = f"{max(1.0, timeout - 5.0):.1f}"
    with tempfile.TemporaryDirectory(prefix="hixl-demo-") as tmp:
        base = [sys.executable, "-u", "-m", "hixl.demo.kvdemo"]
        roles = {
            "decode": [*base, "decode", "--listen", listen],
            "prefill": [*base, "prefill", "--peer", listen],
        }
        procs: dict[str, subprocess.Popen[bytes]] = {}
        tails: dict[str, list[str]] = {}
        threads = []
        start = time.monotonic()
        try:
            for role, cmd in roles.items():
                result = str(Path(tmp) / f"{role}.json")
                procs[role] = subprocess.Popen(
                    [*cmd, "--result", result, "--seconds", budget, *cfg.to_argv()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=_child_env(),
                )
                tails[role] = []
                stdout = procs[role].stdout
                assert stdout is not None
                th = threading.Thread(
                    target=_forward,
                    args=(stdout, f"[{role:<7}] ", out, lock, tails[role]),
                    daemon=True,
                )
                th.start()
                threads.append(th)
            _supervise(procs, start + timeout, timeout)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            for th in threads:
                th.join(timeout=5)
        results = {}
        for role in procs:
            path = Path(tmp) / f"{role}.json"
            try:
                results[role] = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise HixlError(f"demo {role} worker left no result ({exc})") from None
    summary = summarize(cfg, results["prefill"], results["decode"])
    summary["elapsed_s"] = time.monotonic() - start
    with lock:
        out.write("\n" + format_summary(summary) + "\n")
        out.flush()
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _supervise(procs: dict[str, subprocess.Popen[bytes]], kill_at: float, timeout: float) -> None:
    """Wait for every worker; on the first failure or the deadline, kill the rest."""
    while True:
        codes = {role: p.poll() for role, p in procs.items()}
        failed = [(role, rc) for role, rc in codes.items() if rc not in (None, 0)]
        if failed:
            role, rc = failed[0]
            others = [r for r, c in codes.items() if c is None]
            for r in others:
                procs[r].kill()
            stopped = f"; stopped {', '.join(others)}" if others else ""
            raise HixlError(
                f"demo {role} worker failed (exit status {rc}){stopped}; its last output is above"
            )
        if all(rc == 0 for rc in codes.values()):
            return
        if time.monotonic() > kill_at:
            running = [r for r, c in codes.items() if c is None]
            for r in running:
                procs[r].kill()
            raise HixlError(
                f"demo exceeded its timeout of {timeout:.0f} s; killed {', '.join(running)}"
            )
        time.sleep(0.05)


def cmd_demo(args: argparse.Namespace) -> int:
    """``hixl demo``: run here if this host has RDMA, else re-run itself in the VM."""
    cfg = config_from_args(args)
    json_path = str(Path(args.json).resolve()) if args.json else None
    if json_path and not Path(json_path).parent.is_dir():
        raise ArgumentError(f"--json: directory {Path(json_path).parent} does not exist")
    from hixl.testbed.vm import VMConfig, host_has_rdma, run_with_rdma

    if os.environ.get("HIXL_IN_VM") != "1" and not host_has_rdma():
        print(
            "hixl demo: this host has no RDMA device; running in the hixl VM "
            "(boot takes 30-60 s under emulation)",
            flush=True,
        )
        cmd = [sys.executable, "-m", "hixl", "demo", *cfg.to_argv(), f"--timeout={args.timeout}"]
        rw: tuple[Path, ...] = ()
        if json_path:
            cmd.append(f"--json={json_path}")
            rw = (Path(json_path).parent,)
        t = time.monotonic()
        rc = run_with_rdma(cmd, VMConfig(rw_dirs=rw, timeout=args.timeout + 300.0))
        print(f"hixl demo: {time.monotonic() - t:.0f} s in all, VM boot included", flush=True)
        return rc
    summary = run_demo(cfg, timeout=args.timeout, json_path=json_path)
    return 0 if summary["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m hixl.demo.kvdemo {decode,prefill} ...`` (used by
    :func:`run_demo`); writes its result as JSON to ``--result``."""
    p = argparse.ArgumentParser(prog="python -m hixl.demo.kvdemo")
    p.add_argument("role", choices=("decode", "prefill"))
    p.add_argument("--listen", help="decode: engine id to listen on")
    p.add_argument("--peer", help="prefill: decode's engine id")
    p.add_argument("--result", required=True, help="where to write the JSON result")
    p.add_argument("--seconds", type=float, default=300.0, help="deadline for everything")
    add_model_options(p)
    args = p.parse_args(argv)

    def emit(line: str) -> None:
        print(line, flush=True)

    try:
        cfg = config_from_args(args)
        if args.role == "decode":
            if not args.listen:
                raise ArgumentError("decode needs --listen")
            result = run_decode(cfg, args.listen, args.seconds, emit)
        else:
            if not args.peer:
                raise ArgumentError("prefill needs --peer")
            result = run_prefill(cfg, args.peer, args.seconds, emit)
    except HixlError as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        return 1
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
