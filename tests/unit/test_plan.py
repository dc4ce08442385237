"""Unit tests of the planner: the worked examples of docs/descriptors.md and the checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plan_oracle import apply_plan

from benchmarks.drivers.plan import reference_plan
from hixl.core.descriptors import ContiguousDesc, NdStridedDesc, Segments, StridedDesc
from hixl.core.plan import (
    DEFAULT_LIMITS,
    DeviceLimits,
    Op,
    Plan,
    check_alignment,
    check_bounds,
    plan_transfer,
)
from hixl.errors import AlignmentError, BoundsError, DescriptorError, HixlError

MiB = 1 << 20


# --------------------------------------------------------------------------- worked examples


def test_example_1_strided_gather_into_contiguous() -> None:
    # 64 head vectors of 256 bytes, one per 1 KiB row, written to a packed 16 KiB range.
    local = StridedDesc(offset=0, count=64, size=256, stride=1024)
    remote = ContiguousDesc(offset=0, nbytes=64 * 256)
    plan = plan_transfer(local, remote, Op.WRITE, DEFAULT_LIMITS)
    assert plan.num_wrs == 2
    assert plan.wr_remote_offset.tolist() == [0, 8192]
    assert plan.wr_length.tolist() == [8192, 8192]
    assert plan.sges_per_wr.tolist() == [32, 32]
    assert plan.sge_local_offset.tolist() == [1024 * i for i in range(64)]
    assert set(plan.sge_length.tolist()) == {256}
    first = next(plan.wrs())
    assert first[0] == 0 and first[1][:2] == [(0, 256), (1024, 256)]


def test_example_2_stride_equal_to_size_is_one_segment() -> None:
    local = StridedDesc(offset=4096, count=64, size=256, stride=256)
    remote = ContiguousDesc(offset=0, nbytes=64 * 256)
    plan = plan_transfer(local, remote, Op.WRITE)
    assert (plan.num_wrs, plan.num_sges) == (1, 1)
    assert list(plan.wrs()) == [(0, [(4096, 16384)])]


def test_example_3_large_range_is_cut_at_max_msg_sz() -> None:
    local = ContiguousDesc(offset=0, nbytes=20 * MiB)
    remote = ContiguousDesc(offset=64, nbytes=20 * MiB)
    plan = plan_transfer(local, remote, Op.WRITE)
    assert plan.wr_length.tolist() == [8 * MiB, 8 * MiB, 4 * MiB]
    assert plan.wr_remote_offset.tolist() == [64, 64 + 8 * MiB, 64 + 16 * MiB]
    assert plan.sge_local_offset.tolist() == [0, 8 * MiB, 16 * MiB]


def test_example_4_read_uses_max_sge_rd() -> None:
    limits = DeviceLimits(max_sge=32, max_sge_rd=4)
    local = StridedDesc(offset=0, count=64, size=256, stride=1024)
    remote = ContiguousDesc(offset=0, nbytes=64 * 256)
    assert plan_transfer(local, remote, Op.WRITE, limits).num_wrs == 2
    read = plan_transfer(local, remote, Op.READ, limits)
    assert read.num_wrs == 16
    assert read.sges_per_wr.tolist() == [4] * 16


def test_example_5_both_sides_strided_with_different_elements() -> None:
    local = StridedDesc(offset=0, count=4, size=128, stride=256)
    remote = StridedDesc(offset=0, count=2, size=256, stride=512)
    plan = plan_transfer(local, remote, Op.WRITE)
    assert list(plan.wrs()) == [
        (0, [(0, 128), (256, 128)]),
        (512, [(512, 128), (768, 128)]),
    ]


def test_example_6_both_limits_bind() -> None:
    # Three 3 MiB pieces exceed 8 MiB, so the first WR is cut by bytes inside piece 2.
    limits = DeviceLimits(max_sge=3, max_msg_sz=8 * MiB)
    local = StridedDesc(offset=0, count=4, size=3 * MiB, stride=4 * MiB)
    remote = ContiguousDesc(offset=0, nbytes=12 * MiB)
    plan = plan_transfer(local, remote, Op.WRITE, limits)
    assert list(plan.wrs()) == [
        (0, [(0, 3 * MiB), (4 * MiB, 3 * MiB), (8 * MiB, 2 * MiB)]),
        (8 * MiB, [(10 * MiB, 1 * MiB), (12 * MiB, 3 * MiB)]),
    ]


def test_example_7_transpose_is_one_remote_run() -> None:
    # Local [heads=2][tokens=3] of 64-byte vectors, remote [tokens=3][heads=2]: both are
    # streamed (head, token). Ordered by remote address, the remote side is one run.
    local = NdStridedDesc(offset=0, shape=(2, 3), strides=(192, 64), size=64)
    remote = NdStridedDesc(offset=0, shape=(2, 3), strides=(64, 128), size=64)
    plan = plan_transfer(local, remote, Op.WRITE)
    assert list(plan.wrs()) == [
        (0, [(0, 64), (192, 64), (64, 64), (256, 64), (128, 64), (320, 64)]),
    ]
    src = bytearray(np.arange(384, dtype=np.uint16).astype(np.uint8).tobytes()[:384])
    dst = bytearray(384)
    apply_plan(plan, src, dst)
    for h in range(2):
        for t in range(3):
            a, b = h * 192 + t * 64, t * 128 + h * 64
            assert dst[b : b + 64] == src[a : a + 64]


def test_example_8_kv_layer_block_transfer_counts() -> None:
    # 4 layers x 8 heads x 16 blocks of 4 KiB: local paged (non-adjacent), remote packed.
    rng = np.random.default_rng(1)
    ids = rng.permutation(64)[:16]
    local_off = (
        np.arange(4)[:, None, None] * (64 * 8 * 4096)
        + ids[None, None, :] * (8 * 4096)
        + np.arange(8)[None, :, None] * 4096
    ).ravel()
    local = Segments(local_off, np.full(local_off.size, 4096))
    remote = ContiguousDesc(offset=0, nbytes=4 * 8 * 16 * 4096)
    plan = plan_transfer(local, remote, Op.WRITE)
    # One remote run, 512 local pieces (block ids are not adjacent), 32 per WR.
    assert plan.num_wrs == 4 * 8 * 16 // 32
    assert plan.num_sges == 512


# --------------------------------------------------------------------------- plan checks


def test_totals_must_match() -> None:
    with pytest.raises(DescriptorError, match=r"local nbytes=256 in 1 segments.*remote nbytes=320"):
        plan_transfer(
            ContiguousDesc(offset=0, nbytes=256),
            StridedDesc(offset=0, count=5, size=64, stride=128),
            Op.WRITE,
        )


def test_write_destination_must_not_overlap() -> None:
    remote = Segments([0, 64], [128, 128])
    with pytest.raises(
        DescriptorError,
        match=r"remote \(the WRITE destination\) overlaps itself: segment 0 \[0, 128\) and "
        r"segment 1 \[64, 192\) share 64 bytes",
    ):
        plan_transfer(ContiguousDesc(offset=0, nbytes=256), remote, Op.WRITE)


def test_read_destination_must_not_overlap() -> None:
    local = StridedDesc(offset=0, count=4, size=128, stride=64)
    with pytest.raises(DescriptorError, match=r"local \(the READ destination\) overlaps"):
        plan_transfer(local, ContiguousDesc(offset=0, nbytes=512), Op.READ)


def test_sources_may_overlap() -> None:
    # Broadcast: one remote 64-byte vector read into four local places.
    remote = StridedDesc(offset=0, count=4, size=64, stride=0)
    local = ContiguousDesc(offset=0, nbytes=256)
    plan = plan_transfer(local, remote, Op.READ)
    lbuf, rbuf = bytearray(256), bytearray(range(64))
    apply_plan(plan, lbuf, rbuf)
    assert lbuf == rbuf * 4
    # And the write direction, with the overlapping side as the local source.
    plan = plan_transfer(remote, local, Op.WRITE)
    lbuf, rbuf = bytearray(range(64)), bytearray(256)
    apply_plan(plan, lbuf, rbuf)
    assert rbuf == lbuf * 4


def test_bad_arguments() -> None:
    desc = ContiguousDesc(offset=0, nbytes=64)
    with pytest.raises(DescriptorError, match="op must be"):
        plan_transfer(desc, desc, "write")  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="limits must be DeviceLimits"):
        plan_transfer(desc, desc, Op.WRITE, {"max_sge": 1})  # type: ignore[arg-type]
    with pytest.raises(DescriptorError, match="expected a descriptor"):
        plan_transfer([(0, 64)], desc, Op.WRITE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_sge": 0}, "max_sge must be >= 1, got 0"),
        ({"max_sge_rd": -3}, "max_sge_rd must be >= 1, got -3"),
        ({"max_msg_sz": 1.5}, "max_msg_sz must be an int, got float"),
        ({"max_sge": True}, "max_sge must be an int, got bool"),
        ({"max_msg_sz": 1 << 32}, "max_msg_sz=4294967296 exceeds the 32-bit verbs limit"),
    ],
)
def test_device_limits_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(DescriptorError, match=message):
        DeviceLimits(**kwargs)  # type: ignore[arg-type]


def test_device_limits_defaults_are_rxe() -> None:
    limits = DeviceLimits()
    assert (limits.max_sge, limits.max_sge_rd, limits.max_msg_sz) == (32, 32, 8 * MiB)
    assert limits.sge_limit(Op.WRITE) == 32 and DeviceLimits(max_sge_rd=2).sge_limit(Op.READ) == 2
    assert DeviceLimits(max_sge=np.int32(4)).max_sge == 4  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_sge = 1  # type: ignore[misc]


def test_plan_value() -> None:
    plan = plan_transfer(
        StridedDesc(offset=0, count=3, size=64, stride=128),
        ContiguousDesc(offset=0, nbytes=192),
        Op.WRITE,
    )
    assert repr(plan) == "<Plan op=write wrs=1 sges=3 nbytes=192>"
    assert plan.wr_sge_start.tolist() == [0, 3]
    assert plan.wr_remote_offset.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        plan.sge_length[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.op = Op.READ  # type: ignore[misc]
    same = Plan(
        op=Op.WRITE,
        limits=DEFAULT_LIMITS,
        wr_remote_offset=np.array([0]),
        wr_length=np.array([192]),
        wr_sge_start=np.array([0, 3]),
        sge_local_offset=np.array([0, 128, 256]),
        sge_length=np.array([64, 64, 64]),
    )
    assert same == plan and same != plan_transfer(
        ContiguousDesc(offset=0, nbytes=192), ContiguousDesc(offset=0, nbytes=192), Op.WRITE
    )


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (([0], [64], [0], [0], [64]), r"1 indptr entries \(want 2\)"),
        (([0], [64], [0, 1], [0, 1], [64]), "2 SGE offsets but 1 lengths"),
        (([0], [64], [1, 1], [0], [64]), "must rise from 0"),
        (([0], [64], [0, 1], [0], [32]), "moves 64 bytes by WR lengths but 32"),
        (([[0]], [64], [0, 1], [0], [64]), "must be 1-D"),
    ],
)
def test_plan_rejects_inconsistent_arrays(arrays: tuple[list[int], ...], message: str) -> None:
    names = ("wr_remote_offset", "wr_length", "wr_sge_start", "sge_local_offset", "sge_length")
    with pytest.raises(DescriptorError, match=message):
        Plan(op=Op.WRITE, limits=DEFAULT_LIMITS, **dict(zip(names, arrays, strict=True)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- region checks


def test_check_bounds_message() -> None:
    desc = ContiguousDesc(offset=4096, nbytes=8192)
    with pytest.raises(BoundsError) as info:
        check_bounds(desc, 8192)
    assert str(info.value) == "remote out of bounds: offset=4096 nbytes=8192 region_length=8192"
    assert isinstance(info.value, ValueError) and isinstance(info.value, HixlError)
    check_bounds(desc, 4096 + 8192)


def test_check_bounds_names_the_segment() -> None:
    desc = StridedDesc(offset=0, count=4, size=64, stride=128)
    check_bounds(desc, 448, what="local")
    with pytest.raises(
        BoundsError,
        match=r"^local out of bounds: offset=384 nbytes=64 region_length=440 \(segment 3 of 4\)$",
    ):
        check_bounds(desc, 440, what="local")


def test_check_bounds_bad_length() -> None:
    desc = ContiguousDesc(offset=0, nbytes=64)
    with pytest.raises(DescriptorError, match="region_length must be >= 0, got -1"):
        check_bounds(desc, -1)
    with pytest.raises(DescriptorError, match="must be an int"):
        check_bounds(desc, 64.0)  # type: ignore[arg-type]


def test_check_alignment_on_absolute_addresses() -> None:
    desc = StridedDesc(offset=0, count=4, size=64, stride=96, alignment=None)
    with pytest.raises(
        AlignmentError,
        match=r"remote element 1 starts at address 0x1060 \(base_address=0x1000 \+ offset=96\), "
        r"not a multiple of alignment=64 bytes \(misaligned by 32\)",
    ):
        check_alignment(desc, 0x1000, 64)
    check_alignment(desc, 0x1000, 32)
    check_alignment(desc, 0x1010, None)
    check_alignment(desc, 0x1010, 0)
    with pytest.raises(AlignmentError, match="local element 0 starts at address 0x1010"):
        check_alignment(desc, 0x1010, 64, what="local")


def test_check_alignment_on_segments_and_nd() -> None:
    seg = Segments([0, 128, 200], [64, 64, 8])
    with pytest.raises(AlignmentError, match="element 2 starts at address 0x2c8"):
        check_alignment(seg, 0x200, 64)
    check_alignment(seg, 0x200, 8)
    nd = NdStridedDesc(offset=0, shape=(2, 3, 1), strides=(4096, 192, 7), size=64)
    check_alignment(nd, 1 << 40, 64)  # the extent-1 dimension's stride is irrelevant
    with pytest.raises(AlignmentError, match="element 1 starts at address 0xc0"):
        check_alignment(nd, 0, 128)


def test_check_alignment_bad_policy() -> None:
    desc = ContiguousDesc(offset=0, nbytes=64)
    with pytest.raises(DescriptorError, match="power of two in bytes, got 48"):
        check_alignment(desc, 0, 48)
    with pytest.raises(DescriptorError, match="base_address must be >= 0, got -64"):
        check_alignment(desc, -64, 64)
    with pytest.raises(DescriptorError, match="expected a descriptor"):
        check_alignment(object(), 0, 64)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- at scale


@pytest.mark.parametrize("seed", range(8))
def test_large_random_transfers_match_the_reference(seed: int) -> None:
    # Thousands of segments, realistic limits: exercises the vectorized paths at scale
    # (closed-form runs and the walk where both limits bind).
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1000, 4000))
    sizes = rng.choice([64, 256, 4096, 65536, 3 << 20], size=n, p=[0.3, 0.3, 0.3, 0.09, 0.01])
    total = int(sizes.sum())
    # Destination: the elements in a shuffled order, with gaps or adjacent.
    order = rng.permutation(n)
    gaps = rng.choice([0, 0, 64, 4096], size=n)
    slots = np.cumsum(sizes[order] + gaps[order]) - sizes[order]
    dst_off = np.empty(n, dtype=np.int64)
    dst_off[order] = slots
    dst = Segments(dst_off, sizes)
    # Source: another cut of the same stream.
    cuts = np.unique(rng.integers(1, total, size=n // 2))
    src_len = np.diff(np.concatenate(([0], cuts, [total])))
    src = Segments(np.cumsum(src_len + 64) - src_len, src_len)  # 64-byte gaps
    limits = DeviceLimits(
        max_sge=int(rng.integers(1, 33)),
        max_sge_rd=int(rng.integers(1, 33)),
        max_msg_sz=int(rng.choice([4096, 65536, 1 << 20, 8 << 20])),
    )
    op = Op.WRITE if seed % 2 == 0 else Op.READ
    local, remote = (src, dst) if op is Op.WRITE else (dst, src)
    plan = plan_transfer(local, remote, op, limits)
    assert plan == reference_plan(local, remote, op, limits)
    assert int(plan.sges_per_wr.max()) <= limits.sge_limit(op)
    assert int(plan.wr_length.max()) <= limits.max_msg_sz
    assert plan.nbytes == total
