"""Descriptor types, the Segments normal form, validation and the alignment policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl.core.descriptors import (
    DEFAULT_ALIGNMENT,
    INT64_MAX,
    BlockListDesc,
    ContiguousDesc,
    Descriptor,
    NdStridedDesc,
    Segments,
    StridedDesc,
    as_segments,
    desc_from_view,
    normalize_alignment,
    sort_offsets,
)
from hixl.core.plan import check_bounds
from hixl.errors import AlignmentError, BoundsError, DescriptorError, HixlError

PROPS = settings(max_examples=200, deadline=None)


def stream_of(buf: bytes, seg: Segments) -> bytes:
    view = memoryview(buf)
    return b"".join(bytes(view[o : o + n]) for o, n in seg.pairs())


# --------------------------------------------------------------------------- Segments


def test_segments_basics() -> None:
    seg = Segments.from_pairs([(0, 64), (64, 64), (256, 32)])
    assert seg.count == len(seg) == 3
    assert seg.nbytes == 160
    assert seg.extent() == (0, 288)
    assert seg.pairs() == [(0, 64), (64, 64), (256, 32)]
    assert seg.offsets.dtype == np.int64 and seg.lengths.dtype == np.int64
    assert seg.merged() == Segments([0, 256], [128, 32])
    assert seg.merged().merged() == seg.merged()
    assert seg.to_segments() is seg and as_segments(seg) is seg
    assert repr(seg) == "<Segments count=3 nbytes=160 extent=(0, 288)>"
    assert isinstance(seg, Descriptor)


def test_segments_are_frozen_copies() -> None:
    offsets = np.array([0, 128])
    seg = Segments(offsets, [64, 64])
    offsets[0] = 999
    assert seg.offsets.tolist() == [0, 128]
    with pytest.raises(ValueError, match="read-only"):
        seg.offsets[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        seg.nbytes = 1  # type: ignore[misc]
    assert seg != Segments([0, 128], [64, 32])
    assert seg.__eq__(object()) is NotImplemented


def test_merge_keeps_stream_order() -> None:
    # Adjacent in memory but reversed in stream order: not mergeable.
    seg = Segments([64, 0], [64, 64])
    assert seg.merged() == seg


@pytest.mark.parametrize(
    ("offsets", "lengths", "message"),
    [
        ([], [], "offsets is empty"),
        ([0, 64], [64], "differ in size: 2 offsets, 1 lengths"),
        ([0, 64], [64, 0], "segment 1 has length 0: lengths must be >= 1"),
        ([0], [-8], "segment 0 has length -8"),
        ([0, -64], [64, 64], "segment 1 has offset -64: offsets must be >= 0"),
        ([INT64_MAX - 10], [11], f"segment 0 overflows int64: offset={INT64_MAX - 10} length=11"),
        ([0, 0], [2**62, 2**62], "total length overflows int64: the first 2 of 2 segments"),
        ([0.5], [64], "offsets must be integers, got dtype float64"),
        ([True], [64], "offsets must be integers, got dtype bool"),
        ([[0]], [[64]], r"offsets must be 1-D, got shape \(1, 1\)"),
        ([2**64 - 1], [1], "offsets\\[0\\]=18446744073709551615 exceeds the int64 limit"),
        ([2**70], [1], "offsets must be int64 integers"),
    ],
)
def test_segments_reject(offsets: list[Any], lengths: list[Any], message: str) -> None:
    with pytest.raises(DescriptorError, match=message):
        Segments(offsets, lengths)


def test_segments_reject_uint64_array_beyond_int64() -> None:
    with pytest.raises(DescriptorError, match="exceeds the int64 limit"):
        Segments(np.array([1 << 63], dtype=np.uint64), np.array([1], dtype=np.uint64))
    assert Segments(np.array([8], np.uint64), np.array([8], np.uint32)).pairs() == [(8, 8)]


def test_from_pairs_rejects_junk() -> None:
    with pytest.raises(DescriptorError, match="no \\(offset, length\\) pairs"):
        Segments.from_pairs([])
    with pytest.raises(DescriptorError, match="expected \\(offset, length\\) pairs"):
        Segments.from_pairs([(0, 1, 2)])  # type: ignore[list-item]


def test_overlap_detection() -> None:
    assert Segments([0, 64, 128], [64, 64, 64]).first_overlap() is None
    assert Segments([128, 0, 64], [64, 64, 64]).first_overlap() is None
    assert Segments([128, 0, 100], [64, 64, 64]).first_overlap() == (2, 0)
    with pytest.raises(DescriptorError, match=r"segment 0 \[128, 192\) and segment 2 \[100, 164\)"):
        Segments([128, 0, 100], [64, 64, 64]).check_disjoint()
    # A long segment hiding a later short one is found too.
    with pytest.raises(DescriptorError, match="share 8 bytes"):
        Segments([0, 100, 50], [1000, 8, 8]).check_disjoint("remote")


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        Segments([0], [0])
    assert issubclass(AlignmentError, DescriptorError)
    assert issubclass(DescriptorError, HixlError)


# --------------------------------------------------------------------------- descriptor types


def test_contiguous() -> None:
    desc = ContiguousDesc(offset=128, nbytes=1000)
    assert (desc.count, desc.nbytes) == (1, 1000)
    assert desc.to_segments().pairs() == [(128, 1000)]
    with pytest.raises(AlignmentError, match="element 0 starts at offset 100, not a multiple"):
        ContiguousDesc(offset=100, nbytes=8)
    assert ContiguousDesc(offset=100, nbytes=8, alignment=None).to_segments().pairs() == [(100, 8)]
    with pytest.raises(DescriptorError, match="ContiguousDesc.nbytes must be >= 1, got 0"):
        ContiguousDesc(offset=0, nbytes=0)
    with pytest.raises(DescriptorError, match="ContiguousDesc overflows int64"):
        ContiguousDesc(offset=INT64_MAX - 63, nbytes=64, alignment=None)


_INTS = st.one_of(
    st.integers(-3, 5000),
    st.integers(INT64_MAX - 5000, INT64_MAX + 3),
    st.integers(-3, 5000).map(np.int64),
    st.booleans(),
)


@settings(max_examples=1000)
@given(
    offset=_INTS,
    nbytes=_INTS,
    alignment=st.sampled_from([None, 0, 1, 3, 8, 8, 64, 64, 64, 100, -64, np.int64(64), True]),
)
def test_contiguous_accepts_exactly_the_valid_ranges(
    offset: Any, nbytes: Any, alignment: Any
) -> None:
    """Plain ints take a short check, everything else the full conversion; either way a
    range is accepted exactly when it is valid, and its fields end up as plain ints."""

    def invalid() -> type[Exception] | None:
        for v in (offset, nbytes, alignment):
            if isinstance(v, bool | np.bool_):
                return DescriptorError
        o, n = int(offset), int(nbytes)
        if o < 0 or n < 1 or o > INT64_MAX or n > INT64_MAX or o > INT64_MAX - n:
            return DescriptorError
        if alignment is None or alignment == 0:
            return None
        a = int(alignment)
        if a < 0 or a & (a - 1):
            return DescriptorError
        return AlignmentError if o % a else None

    want = invalid()
    if want is not None:
        with pytest.raises(want):
            ContiguousDesc(offset=offset, nbytes=nbytes, alignment=alignment)
        return
    d = ContiguousDesc(offset=offset, nbytes=nbytes, alignment=alignment)
    assert (d.offset, d.nbytes) == (int(offset), int(nbytes))
    assert type(d.offset) is int and type(d.nbytes) is int
    assert d.alignment == (int(alignment) if alignment else None)
    assert d.alignment is None or type(d.alignment) is int


def test_strided() -> None:
    desc = StridedDesc(offset=64, count=4, size=100, stride=128)
    assert desc.to_segments().pairs() == [(64, 100), (192, 100), (320, 100), (448, 100)]
    assert desc.nbytes == 400 and desc.alignment == DEFAULT_ALIGNMENT
    assert desc.to_nd().to_segments() == desc.to_segments()
    # Negative strides walk down; they must stay at or above offset 0.
    down = StridedDesc(offset=192, count=4, size=64, stride=-64)
    assert down.to_segments().offsets.tolist() == [192, 128, 64, 0]
    with pytest.raises(DescriptorError, match="puts the last element at -64"):
        StridedDesc(offset=192, count=5, size=64, stride=-64)
    with pytest.raises(DescriptorError, match="StridedDesc.count must be >= 1, got 0"):
        StridedDesc(offset=0, count=0, size=64, stride=64)
    with pytest.raises(DescriptorError, match="StridedDesc.size must be >= 1, got -1"):
        StridedDesc(offset=0, count=1, size=-1, stride=64)
    with pytest.raises(DescriptorError, match="StridedDesc.count must be an integer, got float"):
        StridedDesc(offset=0, count=2.0, size=64, stride=64)  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="got bool"):
        StridedDesc(offset=0, count=True, size=64, stride=64)
    assert StridedDesc(offset=np.int64(0), count=np.uint8(2), size=64, stride=64).count == 2  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="StridedDesc overflows int64"):
        StridedDesc(offset=0, count=3, size=64, stride=2**62)


def test_strided_alignment_policy() -> None:
    with pytest.raises(AlignmentError, match="StridedDesc element 1 starts at offset 96"):
        StridedDesc(offset=0, count=2, size=64, stride=96)
    StridedDesc(offset=0, count=1, size=64, stride=96)  # one element: stride is irrelevant
    StridedDesc(offset=0, count=2, size=64, stride=96, alignment=32)
    StridedDesc(offset=0, count=2, size=64, stride=96, alignment=0)
    StridedDesc(offset=0, count=2, size=64, stride=96, alignment=None)
    with pytest.raises(DescriptorError, match="power of two in bytes, got 96"):
        StridedDesc(offset=0, count=2, size=64, stride=96, alignment=96)
    assert normalize_alignment(0) is None and normalize_alignment(4096) == 4096
    with pytest.raises(DescriptorError, match="alignment must be >= 0, got -64"):
        normalize_alignment(-64)


def test_nd_strided() -> None:
    desc = NdStridedDesc(offset=64, shape=(2, 3), strides=(1024, 128), size=64)
    assert desc.count == 6 and desc.nbytes == 384
    assert desc.to_segments().offsets.tolist() == [64, 192, 320, 1088, 1216, 1344]
    assert NdStridedDesc(offset=0, shape=(), strides=(), size=64).to_segments().pairs() == [(0, 64)]
    with pytest.raises(DescriptorError, match=r"shape \(2, 3\) has 2 dims but strides \(64,\)"):
        NdStridedDesc(offset=0, shape=(2, 3), strides=(64,), size=64)
    with pytest.raises(DescriptorError, match=r"NdStridedDesc.shape\[1\] must be >= 1, got 0"):
        NdStridedDesc(offset=0, shape=(2, 0), strides=(64, 64), size=64)
    with pytest.raises(DescriptorError, match="lowest element starts at -128"):
        NdStridedDesc(offset=0, shape=(3,), strides=(-64,), size=64)
    with pytest.raises(DescriptorError, match="NdStridedDesc overflows int64"):
        NdStridedDesc(offset=0, shape=(2, 2), strides=(2**62, 2**62), size=64)
    with pytest.raises(DescriptorError, match="total overflows int64"):
        NdStridedDesc(offset=0, shape=(2**40,), strides=(0,), size=2**30)
    with pytest.raises(DescriptorError, match="expands to 1099511627776 segments"):
        NdStridedDesc(offset=0, shape=(2**40,), strides=(0,), size=64).to_segments()
    with pytest.raises(AlignmentError, match="NdStridedDesc element 3 starts at offset 96"):
        NdStridedDesc(offset=0, shape=(2, 3), strides=(96, 64), size=64)


def test_nd_simplified() -> None:
    # Layers x heads x tokens, fully packed: one element.
    packed = NdStridedDesc(
        offset=0, shape=(4, 8, 16), strides=(8 * 16 * 256, 16 * 256, 256), size=256
    )
    assert packed.simplified() == NdStridedDesc(
        offset=0, shape=(), strides=(), size=4 * 8 * 16 * 256
    )
    # A token range of every head: heads stay, tokens fold into the element.
    rng = NdStridedDesc(offset=5 * 256, shape=(8, 4), strides=(16 * 256, 256), size=256)
    assert rng.simplified() == NdStridedDesc(offset=1280, shape=(8,), strides=(4096,), size=1024)
    # Extent-1 dims vanish; mergeable outer dims fuse.
    odd = NdStridedDesc(offset=0, shape=(1, 2, 3, 1), strides=(7, 3 * 128, 128, 5), size=64)
    assert odd.simplified() == NdStridedDesc(offset=0, shape=(6,), strides=(128,), size=64)


nd_st = st.integers(1, 4).flatmap(
    lambda ndim: st.tuples(
        st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim),
        st.lists(st.integers(-48, 96), min_size=ndim, max_size=ndim),
        st.integers(1, 24),
    )
)


@PROPS
@given(nd_st)
def test_simplified_streams_the_same_bytes(spec: tuple[list[int], list[int], int]) -> None:
    shape, strides, size = spec
    offset = sum(max(0, -(n - 1) * s) for n, s in zip(shape, strides, strict=True))
    desc = NdStridedDesc(
        offset=offset, shape=tuple(shape), strides=tuple(strides), size=size, alignment=None
    )
    simple = desc.simplified()
    assert len(simple.shape) <= len(desc.shape) and simple.nbytes == desc.nbytes
    buf = bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))
    assert stream_of(buf, simple.to_segments()) == stream_of(buf, desc.to_segments())


def test_block_list() -> None:
    desc = BlockListDesc.from_pairs([(0, 4096), (8192, 4096)])
    assert (desc.count, desc.nbytes) == (2, 8192)
    assert desc.to_segments().pairs() == [(0, 4096), (8192, 4096)]
    assert desc == BlockListDesc(offsets=[0, 8192], lengths=[4096, 4096])
    assert desc != BlockListDesc(offsets=[0, 8192], lengths=[4096, 4096], alignment=None)
    assert repr(desc) == "<BlockListDesc count=2 nbytes=8192 alignment=64>"
    with pytest.raises(AlignmentError, match="BlockListDesc element 1 starts at offset 8200"):
        BlockListDesc(offsets=[0, 8200], lengths=[8, 8])
    with pytest.raises(DescriptorError, match="segment 0 has length 0"):
        BlockListDesc(offsets=[0], lengths=[0], alignment=None)


def test_as_segments_rejects_non_descriptors() -> None:
    with pytest.raises(DescriptorError, match="expected a descriptor or Segments, got list"):
        as_segments([(0, 64)])  # type: ignore[arg-type]

    class Liar:
        def to_segments(self) -> list[int]:
            return [1]

    with pytest.raises(DescriptorError, match="returned list, not Segments"):
        as_segments(Liar())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- numpy views


def test_view_of_one_layer_k_slice() -> None:
    layers, heads, tokens, head_dim = 4, 8, 16, 128
    kv = np.zeros((layers, 2, heads, tokens, head_dim), dtype=np.float16)
    k3 = desc_from_view(kv[3, 0], kv)
    plane = heads * tokens * head_dim * 2
    assert k3 == NdStridedDesc(offset=3 * 2 * plane, shape=(), strides=(), size=plane)
    # Head 2 of every layer's K plane: one element per layer.
    h2 = desc_from_view(kv[:, 0, 2], kv)
    assert h2.shape == (layers,) and h2.strides == (2 * plane,) and h2.size == tokens * 256
    # New tokens 4..7 of every head of layer 1 (K and V).
    new = desc_from_view(kv[1, :, :, 4:8], kv)
    assert new.shape == (2 * heads,) and new.strides == (tokens * 256,) and new.size == 4 * 256


views = st.tuples(
    st.slices(4), st.slices(3), st.slices(5), st.sampled_from([np.int8, np.float16, np.float32])
)


@PROPS
@given(views)
def test_view_descriptor_streams_the_view_bytes(
    spec: tuple[slice, slice, slice, type[np.generic]],
) -> None:
    s0, s1, s2, dtype = spec
    base = np.random.default_rng(1).integers(0, 256, 4 * 3 * 5 * 4, dtype=np.uint8)
    view = base.view(dtype).reshape(4, 3, -1)[:, :, :5][s0, s1, s2]
    if view.size == 0:
        with pytest.raises(DescriptorError, match="view is empty"):
            desc_from_view(view, base)
        return
    desc = desc_from_view(view, base, alignment=None)
    assert desc.nbytes == view.nbytes
    assert stream_of(base.tobytes(), desc.to_segments()) == view.tobytes()


def test_view_errors() -> None:
    base = np.zeros(1024, dtype=np.uint8)
    other = np.zeros(1024, dtype=np.uint8)
    with pytest.raises(
        DescriptorError, match=r"view is not inside base: view bytes \[.*base nbytes=1024"
    ):
        desc_from_view(other[:64], base)
    with pytest.raises(DescriptorError, match="base must be a contiguous buffer"):
        desc_from_view(base[::2][:4], base[::2])
    with pytest.raises(DescriptorError, match="view is empty"):
        desc_from_view(base[:0], base)
    with pytest.raises(DescriptorError, match="needs numpy arrays"):
        desc_from_view(memoryview(b"x"), base)  # type: ignore[arg-type]
    with pytest.raises(AlignmentError, match="element 0 starts at offset 8"):
        desc_from_view(base[8:72], base)
    assert desc_from_view(base[8:72], base, alignment=8).offset == 8


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=400),
    st.sampled_from([1, 4096, 1 << 40, 1 << 52, 1 << 56]),
)
def test_sort_offsets_is_the_stable_argsort(values: list[int], scale: int) -> None:
    """Offsets with repeats (ties keep their index order), short and long lists (a
    stable argsort below 64, packed keys above), and offsets too large to pack."""
    off = np.array(values, dtype=np.int64) * np.int64(scale)
    order, ordered = sort_offsets(off)
    want = np.argsort(off, kind="stable")
    assert np.array_equal(order, want)
    assert np.array_equal(ordered, off[want])


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096, 48, 1 << 30])
@pytest.mark.parametrize("base", [0, 8, 64, 4096 + 24, (1 << 47) + 64])
def test_first_misaligned_finds_the_first_bad_start(alignment: int, base: int) -> None:
    """Powers of two (checked with a mask) and other alignments give the same answer
    as the arithmetic on Python ints."""
    off = np.array([0, 64, 128, 8, 4096, 4104, 192, 1 << 40], dtype=np.int64)
    seg = Segments(off, np.ones(off.size, dtype=np.int64))
    bad = [i for i, o in enumerate(off.tolist()) if (base + o) % alignment]
    want = None if not bad else (bad[0], base + int(off[bad[0]]))
    assert seg.first_misaligned(base, alignment) == want


def test_a_block_list_is_checked_against_its_own_alignment_once_and_others_in_full() -> None:
    """Blocks checked at 64 bytes when made need no second pass for 64 or 8 at an
    aligned base; a coarser alignment or a misaligned base is checked block by block,
    and a list that was never checked (alignment off) is checked in full."""
    off = [0, 64, 192, 4096 + 64, 8192]
    ln = [8] * len(off)
    desc = BlockListDesc(offsets=off, lengths=ln, alignment=64)
    assert desc.first_misaligned(0, 64) is None
    assert desc.first_misaligned(4096, 8) is None
    assert desc.first_misaligned(0, 4096) == (1, 64)
    assert desc.first_misaligned(32, 64) == (0, 32)
    loose = BlockListDesc(offsets=[0, 8, 64], lengths=[8, 8, 8], alignment=None)
    assert loose.first_misaligned(0, 64) == (1, 8)
    with pytest.raises(AlignmentError, match="element 1 starts at offset 8"):
        BlockListDesc(offsets=[0, 8, 64], lengths=[8, 8, 8], alignment=64)


def test_max_end_is_the_highest_end_and_bounds_name_the_first_block_past_it() -> None:
    seg = Segments([100, 0, 40], [10, 200, 5])
    assert seg.max_end() == 200
    assert seg.max_end() == 200  # kept
    check_bounds(seg, 200)
    with pytest.raises(BoundsError, match="offset=0 nbytes=200 region_length=199"):
        check_bounds(seg, 199)
