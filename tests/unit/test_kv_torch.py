"""torch CPU tensors as KV caches: registered by ``Engine.register_kv``, moved byte for byte.

The engines run on the null device (benchmarks/backends/nulldev.py), so registration,
the geometry a peer reads (sent as bytes, parsed as untrusted) and the request's chain are
the engine's own; the chain's work requests are then carried out with ``memmove``
(tests/unit/kvreplay.py) and every byte is checked against torch slicing, untouched
blocks included.  The RDMA tier moves the same layouts as numpy arrays on rxe; a cold
``import torch`` costs minutes under the VM's emulation, seconds here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from kvreplay import replay

from benchmarks.backends.nulldev import null_device
from hixl import Engine
from hixl.core.kvblocks import KVGeometry
from hixl.core.plan import DeviceLimits, Op
from hixl.engine.kv import KVCache, build_request
from hixl.errors import DescriptorError

NB, BS, H, D = 24, 4, 8, 16  # blocks, tokens per block, KV heads, head dim


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    with (
        null_device(),
        Engine("127.0.0.1:0", direct_lane=False) as prefill,
        Engine("127.0.0.1:0", direct_lane=False) as decode,
    ):
        yield prefill, decode


def move(
    op: Op,
    mine: KVCache,
    theirs: KVCache,
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    **kw: Any,
) -> int:
    """What put_blocks (WRITE) or get_blocks (READ) of ``mine`` against the peer's
    ``theirs`` moves: the peer's geometry as its announcement carries it."""
    announced = KVGeometry.from_bytes(theirs.geometry.to_bytes())
    args: dict[str, Any] = {"tensors": None, "heads": None, "remote_heads": None} | kw
    req = build_request(
        op,
        mine.geometry,
        [(r.addr, r.lkey) for r in mine.regions],
        announced,
        [(r.addr, r.remote.rkey) for r in theirs.regions if r.remote is not None],
        list(local_blocks),
        list(remote_blocks),
        limits=DeviceLimits(),
        **args,
    )
    moved = replay(op, req.chain)
    assert moved == req.nbytes
    return moved


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_separate_k_v_tensors_bf16_a_layer_subset_and_a_remapped_layer(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    layers = 4
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(NB, BS, H, D, generator=gen).to(torch.bfloat16) for _ in range(2 * layers)]
    dst = [torch.zeros(NB, BS, H, D, dtype=torch.bfloat16) for _ in range(2 * layers)]
    kv_p = prefill.register_kv("p", src, heads_axis=2)
    kv_d = decode.register_kv("d", dst, heads_axis=2)
    assert kv_p.geometry.tensors[0].dtype == "bfloat16"
    assert len(kv_p.regions) == 2 * layers  # one region per tensor's storage
    sids, dids = [2, 3, 4, 5], [10, 11, 12, 13]
    chosen = range(2, 6)  # layers 1 and 2, K and V
    move(Op.WRITE, kv_p, kv_d, sids, dids, tensors=chosen)
    for t in range(2 * layers):
        if t in chosen:
            assert as_bytes(dst[t][dids]) == as_bytes(src[t][sids])
        else:
            assert not dst[t].view(torch.int16).any()
        rest = [j for j in range(NB) if j not in dids]
        assert not dst[t][rest].view(torch.int16).any()
    # layer 0 here into layer 3 there (a layer range remapped)
    move(Op.WRITE, kv_p, kv_d, [0, 1], [0, 1], tensors=[0, 1], remote_tensors=[6, 7])
    for t in (0, 1):
        assert as_bytes(dst[6 + t][[0, 1]]) == as_bytes(src[t][[0, 1]])


def test_a_head_range_read_into_a_cache_split_two_ways(engines: tuple[Engine, Engine]) -> None:
    """Decode at TP 2 reads its half of the heads from a prefill cache that has them all."""
    prefill, decode = engines
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(NB, BS, H, D, generator=gen).half() for _ in range(2)]
    half = [torch.zeros(NB, BS, H // 2, D, dtype=torch.float16) for _ in range(2)]
    kv_full = prefill.register_kv("full", full, heads_axis=2)
    kv_half = decode.register_kv("half", half, heads_axis=2)
    mine, theirs = [0, 7, 8, 9], [3, 4, 5, 20]
    move(Op.READ, kv_half, kv_full, mine, theirs, remote_heads=(H // 2, H))
    for t in range(2):
        assert as_bytes(half[t][mine]) == as_bytes(full[t][theirs][:, :, H // 2 :])
        rest = [j for j in range(NB) if j not in mine]
        assert not half[t][rest].view(torch.int16).any()


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.float32]
)
def test_float8_as_its_own_dtype_and_as_uint8_views(
    engines: tuple[Engine, Engine], dtype: torch.dtype
) -> None:
    prefill, decode = engines
    n = NB * BS * H * D
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.arange(n * size, dtype=torch.int64).remainder(251).to(torch.uint8)
    src = raw.view(dtype).reshape(NB, BS, H, D)
    out = torch.zeros(NB, BS, H, D, dtype=dtype)
    out_u8 = torch.zeros(NB, BS, H, D * size, dtype=torch.uint8)
    kv_p = prefill.register_kv("p", [src, src.view(torch.uint8)])
    kv_d = decode.register_kv("d", [out, out_u8])
    assert len(kv_p.regions) == 1  # the uint8 view shares its storage's region
    sids, dids = [0, 5, 6, 7, 20], [1, 2, 3, 10, 23]
    move(Op.WRITE, kv_p, kv_d, sids, dids)
    want = as_bytes(src[sids])
    assert as_bytes(out[dids]) == want and as_bytes(out_u8[dids]) == want
    rest = [j for j in range(NB) if j not in dids]
    assert not out_u8[rest].any() and not out.view(torch.uint8)[rest].any()


def test_a_dense_permuted_view_is_registered_by_its_storage(
    engines: tuple[Engine, Engine],
) -> None:
    """HND storage seen as NHD: one region over the storage, blocks as strided ranges."""
    prefill, decode = engines
    hnd = torch.randn(NB, H, BS, D, generator=torch.Generator().manual_seed(7)).half()
    nhd = hnd.permute(0, 2, 1, 3)
    out = torch.zeros(NB, BS, H, D, dtype=torch.float16)
    kv_p = prefill.register_kv("p", [nhd], heads_axis=2)
    kv_d = decode.register_kv("d", [out], heads_axis=2)
    assert kv_p.regions[0].length == hnd.numel() * 2
    move(Op.WRITE, kv_p, kv_d, [1, 2, 3], [4, 5, 6], heads=(2, 6), remote_heads=(2, 6))
    assert as_bytes(out[[4, 5, 6]][:, :, 2:6]) == as_bytes(nhd[[1, 2, 3]][:, :, 2:6])
    assert not out[:, :, :2].view(torch.int16).any() and not out[:, :, 6:].view(torch.int16).any()


def test_a_view_of_half_the_heads_moves_only_its_heads(engines: tuple[Engine, Engine]) -> None:
    """A strided view (every block's first half of the heads of a wider storage) is
    registered by the span of its storage, and only its own bytes move."""
    prefill, decode = engines
    wide = torch.randn(NB, BS, 2 * H, D, generator=torch.Generator().manual_seed(9)).half()
    out_wide = torch.zeros(NB, BS, 2 * H, D, dtype=torch.float16)
    kv_p = prefill.register_kv("p", [wide[:, :, :H]], heads_axis=2)
    kv_d = decode.register_kv("d", [out_wide[:, :, :H]], heads_axis=2)
    move(Op.WRITE, kv_p, kv_d, [0, 1, 2], [5, 6, 9])
    assert as_bytes(out_wide[[5, 6, 9]][:, :, :H]) == as_bytes(wide[[0, 1, 2]][:, :, :H])
    assert not out_wide[:, :, H:].view(torch.int16).any()


def test_a_dtype_mismatch_is_named_before_anything_is_built(
    engines: tuple[Engine, Engine],
) -> None:
    prefill, decode = engines
    kv_p = prefill.register_kv("p", [torch.zeros(NB, BS, H, D, dtype=torch.float16)])
    kv_d = decode.register_kv("d", [torch.zeros(NB, BS, H, D, dtype=torch.bfloat16)])
    with pytest.raises(DescriptorError, match="float16 vs bfloat16"):
        move(Op.WRITE, kv_p, kv_d, [0], [0])
