"""The pure KV-block core against numpy slicing: patterns, plans, geometry documents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl.core.kvblocks import (
    KVGeometry,
    TensorGeometry,
    block_ids,
    check_alignment,
    check_unique,
    landed_blocks,
    pair_tensors,
    plan_request,
    runs,
)
from hixl.core.plan import DeviceLimits, Op
from hixl.errors import AlignmentError, DescriptorError
from hixl.verbs.chain import WR_DTYPE, SendChain

Arr = np.ndarray[Any, Any]


def geometry(a: Arr, base: Arr, block_axis: int, heads_axis: int | None) -> TensorGeometry:
    return TensorGeometry(
        dtype=a.dtype.name,
        itemsize=a.itemsize,
        shape=a.shape,
        strides=a.strides,
        offset=a.__array_interface__["data"][0] - base.__array_interface__["data"][0],
        block_axis=block_axis,
        heads_axis=heads_axis,
    )


def run(plan: Any, src: Arr, dst: Arr) -> None:
    """Execute a RequestPlan as WRITEs from src's buffer into dst's (addresses = offsets)."""
    s, d = src.view(np.uint8).reshape(-1), dst.view(np.uint8).reshape(-1)
    wr_remote, _, sge_start, sge_addr, sge_length, _ = plan.arrays()
    for w in range(plan.num_wrs):
        r = int(wr_remote[w])
        for j in range(int(sge_start[w]), int(sge_start[w + 1])):
            a, n = int(sge_addr[j]), int(sge_length[j])
            d[r : r + n] = s[a : a + n]
            r += n


# layouts: (shape maker, block_axis, heads_axis) with nb blocks, h heads
LAYOUTS = {
    "flash_attention": (lambda nb, h: (2, nb, 2, h, 4), 1, 3),
    "flashinfer": (lambda nb, h: (nb, 2, 2, h, 4), 0, 3),
    "nhd": (lambda nb, h: (nb, 2, h, 4), 0, 2),
    "hnd": (lambda nb, h: (nb, h, 2, 4), 0, 1),
    "mla": (lambda nb, h: (nb, 2, 8), 0, None),
}


@st.composite
def cases(draw: st.DrawFn) -> tuple[Any, ...]:
    name = draw(st.sampled_from(sorted(LAYOUTS)))
    make, baxis, haxis = LAYOUTS[name]
    nb_l = draw(st.integers(2, 12))
    nb_r = draw(st.integers(2, 12))
    n = draw(st.integers(1, min(nb_l, nb_r)))
    lids = draw(st.permutations(range(nb_l)))[:n]
    rids = draw(st.permutations(range(nb_r)))[:n]
    if draw(st.booleans()):  # runs of adjacent blocks
        lids = sorted(lids)
        rids = sorted(rids)
    h_l = h_r = 4
    heads = remote_heads = None
    if haxis is not None:
        h_l = draw(st.sampled_from([1, 2, 4]))
        h_r = draw(st.sampled_from([1, 2, 4]))
        k = min(h_l, h_r)
        if k < h_l:
            s0 = draw(st.integers(0, h_l - k))
            heads = (s0, s0 + k)
        if k < h_r:
            s0 = draw(st.integers(0, h_r - k))
            remote_heads = (s0, s0 + k)
    ntensors = draw(st.integers(1, 3))
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    limits = DeviceLimits(
        draw(st.sampled_from([1, 2, 32])), 32, draw(st.sampled_from([16, 64, 1 << 20]))
    )
    return (
        name,
        make,
        baxis,
        haxis,
        nb_l,
        nb_r,
        h_l,
        h_r,
        lids,
        rids,
        heads,
        remote_heads,
        ntensors,
        op,
        limits,
    )


@settings(max_examples=150, deadline=None)
@given(cases())
def test_request_plan_moves_exactly_the_blocks(case: tuple[Any, ...]) -> None:
    name, make, baxis, haxis, nb_l, nb_r, h_l, h_r, lids, rids, heads, rheads, nt, op, limits = case
    rng = np.random.default_rng(len(lids))
    # One flat buffer per side; tensors placed one after another (a region each, offset 0
    # inside a shared buffer to exercise offsets).
    lshape, rshape = make(nb_l, h_l), make(nb_r, h_r)
    lbuf = rng.integers(1, 255, nt * int(np.prod(lshape)) * 2 + 64, dtype=np.uint8)
    rbuf = rng.integers(1, 255, nt * int(np.prod(rshape)) * 2 + 64, dtype=np.uint8)
    lsz, rsz = int(np.prod(lshape)) * 2, int(np.prod(rshape)) * 2
    lt = [
        lbuf[32 + i * lsz : 32 + (i + 1) * lsz].view(np.float16).reshape(lshape) for i in range(nt)
    ]
    rt = [
        rbuf[32 + i * rsz : 32 + (i + 1) * rsz].view(np.float16).reshape(rshape) for i in range(nt)
    ]
    lgeo = KVGeometry(
        region_lengths=(lbuf.size,), tensors=tuple(geometry(a, lbuf, baxis, haxis) for a in lt)
    )
    rgeo = KVGeometry(
        region_lengths=(rbuf.size,), tensors=tuple(geometry(a, rbuf, baxis, haxis) for a in rt)
    )
    # the local tensors in order, paired with the remote ones in a shuffled order
    perm = [int(x) for x in np.random.default_rng(len(lids) + nt).permutation(nt)]
    pairs = pair_tensors(lgeo, rgeo, range(nt), heads, rheads, remote_tensors=perm)
    lid = block_ids("local_blocks", lids, nb_l)
    rid = block_ids("remote_blocks", rids, nb_r)
    items = [
        (lp, rp, lgeo.tensors[i].offset, rgeo.tensors[j].offset, 1, 2) for i, j, lp, rp in pairs
    ]
    plan = plan_request(items, lid, rid, op, limits)
    wr_remote, wr_key, sge_start, sge_addr, sge_length, sge_key = plan.arrays()
    assert int(sge_length.max()) <= limits.max_msg_sz
    per_wr = np.diff(sge_start)
    assert per_wr.min() >= 1 and per_wr.max() <= limits.sge_limit(op)
    assert (wr_key == 2).all() and (sge_key == 1).all()
    # The chain the engine posts holds exactly these work requests.
    chain = SendChain.blank(plan.num_wrs + 3, plan.num_sges + 5)
    chain.fill_tiles(7, plan.tiles)
    chain.set_signals(5, 2)  # a pooled chain was signalled for its last transfer
    chain.fill_tiles(7, plan.tiles)
    assert not chain.wrs["wr_id"].any() and not chain.wrs["send_flags"].any()
    links = chain.wrs["next"].astype(np.int64)
    assert links[-1] == 0
    assert (links[:-1] == chain.wr_base + WR_DTYPE.itemsize * np.arange(1, plan.num_wrs)).all()
    wrs, sges = chain.wrs, chain.sges
    assert wrs.size == plan.num_wrs and sges.size == plan.num_sges
    assert (wrs["remote_addr"] == wr_remote.astype(np.uint64)).all()
    assert (wrs["rkey"] == 2).all() and (wrs["opcode"] == 7).all()
    assert (wrs["num_sge"] == per_wr).all()
    assert (wrs["sg_list"] == chain.sge_base + 16 * sge_start[:-1].astype(np.uint64)).all()
    assert (sges["addr"] == sge_addr.astype(np.uint64)).all()
    assert (sges["length"] == sge_length).all() and (sges["lkey"] == 1).all()

    def sel(a: Arr, ids: list[int], hr: tuple[int, int] | None) -> Arr:
        b = np.take(a, ids, axis=baxis)
        if hr is not None:
            assert haxis is not None
            b = np.take(b, range(*hr), axis=haxis)
        return np.moveaxis(b, baxis, 0)

    # A READ pairs the same bytes as a WRITE (the remote side is then the source): the
    # plan is executed as a copy from local to remote either way.
    src, dst, dst_t, src_t = lbuf, rbuf.copy(), rt, lt
    expect_dst = [a.copy() for a in dst_t]
    for t, s in enumerate(src_t):
        e = expect_dst[perm[t]]
        sub = sel(s, lids, heads)
        # write sub into e at (rids, rheads)
        view = np.moveaxis(e, baxis, 0)
        for k, j in enumerate(rids):
            blk = view[j]
            if rheads is not None:
                hax = haxis - (1 if haxis > baxis else 0)
                bidx: list[Any] = [slice(None)] * blk.ndim
                bidx[hax] = slice(*rheads)
                blk[tuple(bidx)] = sub[k]
            else:
                blk[...] = sub[k]
    # Both directions pair the same bytes; execute as a copy local -> remote.
    run(plan, src, dst)
    got = [
        dst[32 + i * rsz : 32 + (i + 1) * rsz].view(np.float16).reshape(rshape) for i in range(nt)
    ]
    for g, e in zip(got, expect_dst, strict=True):
        assert g.tobytes() == e.tobytes()  # moved blocks and untouched ones
    assert plan.nbytes == len(lids) * nt * pairs[0][2].nbytes


def test_incompatible_caches_name_the_mismatch() -> None:
    a = np.zeros((4, 2, 8, 16), np.float16)
    b = np.zeros((4, 2, 4, 16), np.float16)
    c = np.zeros((4, 2, 8, 16), np.float32)

    def g(x: Arr) -> KVGeometry:
        return KVGeometry(region_lengths=(x.nbytes,), tensors=(geometry(x, x, 0, 2),) * 4)

    with pytest.raises(DescriptorError, match="tensor 0: dtype float16 vs float32"):
        pair_tensors(g(a), g(c), None, None, None)
    with pytest.raises(
        DescriptorError, match=r"tensor 0: block shape \(2, 8, 16\) vs \(2, 4, 16\)"
    ):
        pair_tensors(g(a), g(b), None, None, None)
    assert len(pair_tensors(g(a), g(b), [1, 3], (4, 8), None)) == 2
    with pytest.raises(DescriptorError, match=r"heads=\(4, 9\)"):
        pair_tensors(g(a), g(b), None, (4, 9), None)
    with pytest.raises(DescriptorError, match=r"tensor 7 \(peer's 7\) is outside"):
        pair_tensors(g(a), g(b), [7], (0, 4), None)
    # a layer range of one cache into another range of the other
    pairs = pair_tensors(g(a), g(b), range(2, 4), (4, 8), None, remote_tensors=[0, 1])
    assert [(i, j) for i, j, _, _ in pairs] == [(2, 0), (3, 1)]
    with pytest.raises(DescriptorError, match="lists 2 tensors and remote_tensors= 1"):
        pair_tensors(g(a), g(b), [2, 3], (4, 8), None, remote_tensors=[0])
    with pytest.raises(DescriptorError, match=r"tensor 3 \(peer's 1\) is listed twice"):
        pair_tensors(g(a), g(b), [2, 3], (4, 8), None, remote_tensors=[1, 1])
    with pytest.raises(DescriptorError, match="remote_tensors= needs tensors="):
        pair_tensors(g(a), g(b), None, (4, 8), None, remote_tensors=[1])


def test_block_lists_are_checked() -> None:
    with pytest.raises(DescriptorError, match=r"local_blocks\[2\]=9 is outside \[0, 8\)"):
        block_ids("local_blocks", [1, 2, 9], 8)
    with pytest.raises(DescriptorError, match="repeats destination block 5"):
        check_unique("remote_blocks", np.array([5, 1, 5]))
    with pytest.raises(DescriptorError, match="non-empty"):
        block_ids("local_blocks", [], 8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=24))
def test_runs_are_the_maximal_stretches_where_both_ids_go_up_by_one(
    pairs: list[tuple[int, int]],
) -> None:
    lids = np.array([a for a, _ in pairs], np.int64)
    rids = np.array([b for _, b in pairs], np.int64)
    want: list[tuple[int, int]] = []
    for i in range(len(pairs)):
        if i and lids[i] == lids[i - 1] + 1 and rids[i] == rids[i - 1] + 1:
            want[-1] = (want[-1][0], want[-1][1] + 1)
        else:
            want.append((i, 1))
    start, length = runs(lids, rids)
    assert start.dtype == length.dtype == np.int64
    assert list(zip(start.tolist(), length.tolist(), strict=True)) == want


def test_block_ids_name_the_first_bad_entry() -> None:
    with pytest.raises(DescriptorError, match=r"remote_blocks\[1\]=-1 is outside \[0, 8\)"):
        block_ids("remote_blocks", np.array([3, -1, 8]), 8)
    with pytest.raises(DescriptorError, match=r"local_blocks\[0\]=8 is outside"):
        block_ids("local_blocks", np.array([8, 1], np.uint64), 8)
    assert block_ids("local_blocks", np.array([0, 7], np.uint8), 8).dtype == np.int64


def test_geometry_document_round_trips_and_refuses_bad_input() -> None:
    a = np.zeros((2, 6, 4, 8, 16), np.float16)
    geo = KVGeometry(region_lengths=(a.nbytes,), tensors=(geometry(a[:, :, :, 2:4], a, 1, 3),))
    assert KVGeometry.from_bytes(geo.to_bytes() + b"\0\0") == geo
    for bad in (b"", b"[]", b'{"version":1}', geo.to_bytes().replace(b'"region"', b'"regio"')):
        with pytest.raises(DescriptorError):
            KVGeometry.from_bytes(bad)
    lying = geo.to_bytes().replace(b'"block_bytes":', b'"block_bytes":1')
    with pytest.raises(DescriptorError, match="bytes per block"):
        KVGeometry.from_bytes(lying)
    short = geo.to_bytes().replace(str(a.nbytes).encode(), b"64")
    with pytest.raises(DescriptorError, match="ends at byte"):
        KVGeometry.from_bytes(short)


def test_overlapping_tensors_are_refused() -> None:
    with pytest.raises(DescriptorError, match="overlap"):
        TensorGeometry(dtype="float16", itemsize=2, shape=(4, 8), strides=(8, 2))


def _element_addresses(t: TensorGeometry) -> Arr:
    """The byte offset (from the start of its region) of every element of ``t``."""
    idx = np.indices(t.shape, dtype=np.int64)
    return t.offset + np.tensordot(np.asarray(t.strides, np.int64), idx, axes=1)


def stacked(shape: tuple[int, ...], n: int, baxis: int, haxis: int | None) -> KVGeometry:
    """``n`` C-contiguous fp16 tensors of ``shape``, one after another in one region."""
    a = np.empty(shape, np.float16)
    tensors = tuple(
        TensorGeometry(dtype="float16", itemsize=2, shape=shape, strides=a.strides,
                       offset=i * a.nbytes, block_axis=baxis, heads_axis=haxis)
        for i in range(n)
    )  # fmt: skip
    return KVGeometry(region_lengths=(n * a.nbytes,), tensors=tensors)


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_landed_blocks_are_those_whose_every_work_request_completed(
    case: tuple[Any, ...], data: st.DataObject
) -> None:
    """Oracle: each remote byte of a moved block is labelled with its pair's position;
    a pair has landed exactly when every WR whose remote range holds one of its bytes is
    done, for any set of completed WRs."""
    name, make, baxis, haxis, nb_l, nb_r, h_l, h_r, lids, rids, heads, rheads, nt, op, limits = case
    lgeo = stacked(make(nb_l, h_l), nt, baxis, haxis)
    rgeo = stacked(make(nb_r, h_r), nt, baxis, haxis)
    ra = np.empty(make(nb_r, h_r), np.float16)
    pairs = pair_tensors(lgeo, rgeo, None, heads, rheads)
    lid = block_ids("local_blocks", lids, nb_l)
    rid = block_ids("remote_blocks", rids, nb_r)
    items = [
        (lp, rp, lgeo.tensors[i].offset, rgeo.tensors[j].offset, 1, 2) for i, j, lp, rp in pairs
    ]
    plan = plan_request(items, lid, rid, op, limits)
    owner = np.full(nt * ra.nbytes, -1, np.int64)
    for t in rgeo.tensors:
        addrs = np.moveaxis(_element_addresses(t), baxis, 0)
        for k, j in enumerate(rids):
            block = addrs[j]
            if rheads is not None:
                assert haxis is not None
                hax = haxis - (1 if haxis > baxis else 0)
                block = np.take(block, range(*rheads), axis=hax)
            for b in range(t.itemsize):
                owner[block.ravel() + b] = k
    wr_remote = plan.arrays()[0]
    lengths = np.concatenate([np.tile(t.plan.wr_length, t.copies) for t in plan.tiles])
    done = np.asarray(data.draw(st.lists(st.booleans(), min_size=plan.num_wrs,
                                         max_size=plan.num_wrs)), bool)  # fmt: skip
    want = np.ones(len(lids), bool)
    for w in range(plan.num_wrs):
        carried = owner[int(wr_remote[w]) : int(wr_remote[w] + lengths[w])]
        assert (carried >= 0).all()  # a WR writes only moved blocks' bytes
        if not done[w]:
            want[np.unique(carried)] = False
    assert landed_blocks(plan, done, len(lids)).tolist() == want.tolist()
    assert landed_blocks(plan, np.ones(plan.num_wrs, bool), len(lids)).all()


def test_the_chain_goes_run_by_run_so_a_done_prefix_is_whole_blocks() -> None:
    """Three tensors, lone blocks: the first 3k WRs of the chain are k whole blocks."""
    a = np.empty((8, 2, 4, 8), np.float16)
    tensors = tuple(
        TensorGeometry(dtype="float16", itemsize=2, shape=a.shape, strides=a.strides,
                       offset=i * a.nbytes, block_axis=0)
        for i in range(3)
    )  # fmt: skip
    geo = KVGeometry(region_lengths=(3 * a.nbytes,), tensors=tensors)
    pairs = pair_tensors(geo, geo, None, None, None)
    items = [(lp, rp, tensors[i].offset, tensors[j].offset, 1, 2) for i, j, lp, rp in pairs]
    lid = np.array([5, 3, 1, 7], np.int64)
    rid = np.array([0, 2, 4, 6], np.int64)
    plan = plan_request(items, lid, rid, Op.WRITE, DeviceLimits())
    assert plan.num_wrs == 12
    block = a.nbytes // 8
    want = [t * a.nbytes + int(r) * block for r in rid for t in range(3)]
    assert plan.arrays()[0].tolist() == want  # block 0 of each tensor, then block 1...
    for k in range(5):
        done = np.arange(12) < 3 * k
        assert landed_blocks(plan, done, 4).tolist() == [i < k for i in range(4)]
    with pytest.raises(DescriptorError, match="shape"):
        landed_blocks(plan, np.ones(5, bool), 4)


def test_the_alignment_policy_applies_to_where_blocks_start() -> None:
    """A tensor's start in its region and its block stride follow the policy; the
    pieces inside a block (here 32-byte head rows of an HND block seen as NHD) do not."""
    hnd = np.empty((8, 4, 2, 16), np.float16)  # blocks of 4 heads x 2 tokens x 32 bytes
    nhd = hnd.transpose(0, 2, 1, 3)

    def geo(offset: int, a: Arr = nhd) -> KVGeometry:
        t = TensorGeometry(dtype="float16", itemsize=2, shape=a.shape, strides=a.strides,
                           offset=offset, heads_axis=2)  # fmt: skip
        return KVGeometry(region_lengths=(offset + a.nbytes,), tensors=(t,))

    check_alignment(geo(256), 64)
    check_alignment(geo(32), None)
    with pytest.raises(AlignmentError, match="cache 'c': tensor 0 starts at offset 32 in its"):
        check_alignment(geo(32), 64, "cache 'c': ")
    odd = np.empty((8, 3, 2, 16), np.float16)  # blocks of 192 bytes
    check_alignment(geo(0, odd), 64)
    with pytest.raises(AlignmentError, match="block stride of 192 bytes.* policy 128 bytes"):
        check_alignment(geo(0, odd), 128)
    one = np.empty((1, 3, 2, 16), np.float16)  # a lone block: only its start counts
    check_alignment(geo(128, one), 128)
