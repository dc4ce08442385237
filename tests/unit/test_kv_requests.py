"""A request's chain as the engine builds it (no device), and the errors its handle raises."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hixl.core.kvblocks import KVGeometry, TensorGeometry
from hixl.core.plan import DeviceLimits, Op
from hixl.core.window import Chunk
from hixl.engine.handles import TransferHandle, TransferStatus
from hixl.engine.kv import BlocksHandle, build_request
from hixl.errors import (
    CompletionError,
    ConnectionFailed,
    DescriptorError,
    HixlError,
    TransferTimeout,
)


def flash_attention(layers: int, blocks: int, heads: int) -> KVGeometry:
    shape = (2, blocks, 4, heads, 8)
    a = np.empty(shape, np.float16)
    tensors = tuple(
        TensorGeometry(
            dtype="float16",
            itemsize=2,
            shape=shape,
            strides=a.strides,
            region=k,
            block_axis=1,
            heads_axis=3,
        )
        for k in range(layers)
    )
    return KVGeometry(region_lengths=(a.nbytes,) * layers, tensors=tensors)


def test_one_chain_carries_each_tensors_keys_and_fuses_runs() -> None:
    local, remote = flash_attention(3, 16, 4), flash_attention(3, 16, 4)
    lregs = [(0x10000 * (k + 1), 100 + k) for k in range(3)]
    rregs = [(0x900000 * (k + 1), 200 + k) for k in range(3)]
    chain, nbytes, key, lids, rids, _ = build_request(
        Op.WRITE, local, lregs, remote, rregs, [1, 2, 3, 9], [5, 6, 7, 0],
        tensors=None, heads=None, remote_heads=None, limits=DeviceLimits(),
    )  # fmt: skip
    block = 4 * 4 * 8 * 2  # bytes of one block of one plane
    assert nbytes == 3 * 4 * 2 * block
    # a run of 3 blocks per plane (K, V) and one lone block per plane, per tensor
    assert chain.num_wrs == 3 * (2 + 2)
    assert sorted(set(chain.wrs["rkey"].tolist())) == [200, 201, 202]
    assert sorted(set(chain.sges["lkey"].tolist())) == [100, 101, 102]
    assert key[0] == "kv" and key[1] >= chain.num_wrs and key[2] >= chain.num_sges
    assert lids.tolist() == [1, 2, 3, 9] and rids.tolist() == [5, 6, 7, 0]
    # each WR of a run moves 3 blocks of one plane of one tensor as one range
    assert sorted(set(chain.sges["length"].tolist())) == [block, 3 * block]


def test_requests_between_the_same_tensors_follow_each_requests_regions() -> None:
    # The same geometries and pairing, but the caches' storage registered again elsewhere
    # (new addresses and keys): the second chain must point at the second regions only.
    local, remote = flash_attention(2, 8, 4), flash_attention(2, 8, 4)
    for base, key in ((0x10000, 100), (0x7000000, 300)):
        lregs = [(base * (k + 1), key + k) for k in range(2)]
        rregs = [(base * (k + 9), key + 50 + k) for k in range(2)]
        for lids, rids in (([0, 2], [4, 6]), ([3, 5, 7], [1, 0, 2])):
            built = build_request(
                Op.WRITE, local, lregs, remote, rregs, lids, rids,
                tensors=None, heads=(1, 3), remote_heads=(1, 3), limits=DeviceLimits(),
            )  # fmt: skip
            chain = built.chain
            span = local.region_lengths[0]
            sge_addr = chain.sges["addr"].astype(np.int64)
            raddr = chain.wrs["remote_addr"].astype(np.int64)
            assert sorted(set(chain.sges["lkey"].tolist())) == [key, key + 1]
            assert sorted(set(chain.wrs["rkey"].tolist())) == [key + 50, key + 51]
            assert all(any(a <= x < a + span for a, _ in lregs) for x in sge_addr.tolist())
            assert all(any(a <= x < a + span for a, _ in rregs) for x in raddr.tolist())


def test_mismatch_and_bad_ids_raise_before_any_chain() -> None:
    local, remote = flash_attention(2, 16, 4), flash_attention(2, 8, 2)
    regs = [(0x1000, 1), (0x2000, 2)]

    def build(lb: list[int], rb: list[int], **kw: object) -> object:
        args: dict[str, object] = {"tensors": None, "heads": None, "remote_heads": None}
        args.update(kw)
        return build_request(
            Op.WRITE,
            local,
            regs,
            remote,
            regs,
            lb,
            rb,
            limits=DeviceLimits(),
            **args,  # type: ignore[arg-type]
        )

    with pytest.raises(DescriptorError, match=r"block shape \(2, 4, 4, 8\) vs \(2, 4, 2, 8\)"):
        build([0], [0])
    build([0], [0], heads=(2, 4))
    with pytest.raises(DescriptorError, match=r"remote_blocks\[0\]=8 is outside \[0, 8\)"):
        build([0], [8], heads=(2, 4))
    with pytest.raises(DescriptorError, match="repeats destination block 1"):
        build([0, 2], [1, 1], heads=(2, 4))
    with pytest.raises(DescriptorError, match="2 ids and remote_blocks 1"):
        build([0, 2], [1], heads=(2, 4))


def test_a_failed_handle_names_the_request_and_its_blocks() -> None:
    inner = TransferHandle("peer-1", 4096, 2, time.monotonic() + 30)
    h = BlocksHandle(inner, "req-7", [1, 2], [8, 9])
    assert isinstance(h, TransferHandle) and h.status is TransferStatus.PENDING
    inner.finish(TransferTimeout("transfer to peer-1 did not complete within its deadline"))
    with pytest.raises(TransferTimeout) as info:
        h.wait()
    err = info.value
    assert "request 'req-7': blocks not known to have landed: local [1, 2], remote [8, 9]" in str(
        err
    )
    assert err.request == "req-7"  # type: ignore[attr-defined]
    assert err.remote_blocks == [8, 9]  # type: ignore[attr-defined]
    assert h.error is err and h.done()
    assert h.status.value == "failed"


def test_a_blocking_wait_returns_only_once_the_engine_has_failed_the_transfer() -> None:
    """Past its deadline (and its waiter's grace), a blocks handle still waits for the
    engine to fail the transfer (which stops its queue pairs first) before raising."""
    inner = TransferHandle("peer-1", 4096, 2, time.monotonic() - 5)
    h = BlocksHandle(inner, "req-8", [1], [2])
    engine_error = TransferTimeout("transfer to peer-1 did not complete within its deadline")
    timer = threading.Timer(0.3, inner.finish, args=(engine_error,))
    timer.start()
    try:
        with pytest.raises(TransferTimeout) as info:
            h.wait()
    finally:
        timer.cancel()
    assert info.value.__cause__ is engine_error
    assert h.status.value == "failed"


@pytest.mark.parametrize(
    "error",
    [
        CompletionError("post_send", 10, "IBV_WC_REM_ACCESS_ERR", 5),
        ConnectionFailed("connection to peer-1 failed: a transfer timed out"),
        TransferTimeout("transfer to peer-1 did not complete within its deadline"),
    ],
)
def test_every_transfer_error_is_annotated_keeping_its_class_and_fields(
    error: HixlError,
) -> None:
    inner = TransferHandle("peer-1", 4096, 2, time.monotonic() + 30)
    h = BlocksHandle(inner, "req-9", list(range(40)), list(range(40, 80)))
    inner.finish(error)
    err = h.error
    assert type(err) is type(error) and err.__cause__ is error
    text = str(err)
    assert text.startswith(str(error)) and "request 'req-9'" in text
    assert "local [0, 1, 2" in text and "... (40 in all)" in text
    if isinstance(error, CompletionError):
        assert isinstance(err, CompletionError)
        assert (err.status_name, err.wr_id, err.op) == ("IBV_WC_REM_ACCESS_ERR", 5, "post_send")


def test_a_failed_request_reports_the_blocks_its_completed_groups_carried() -> None:
    """Two queue pairs' shares of a 24-WR chain (3 tensors x 4 lone blocks x K and V),
    in signal groups of 6.  The first share completed; the second failed in its second
    group, whose completion the window counted as done: only the group before the
    failed WR is known, so 3 of the 4 block pairs have landed."""
    geo = flash_attention(3, 16, 4)
    regs = [(0x100000 * (k + 1), k + 1) for k in range(3)]
    req = build_request(
        Op.WRITE, geo, regs, geo, regs, [9, 7, 5, 3], [0, 2, 4, 6],
        tensors=None, heads=None, remote_heads=None, limits=DeviceLimits(),
    )  # fmt: skip
    assert req.chain.num_wrs == 24  # a block's K and V are two ranges: 6 WRs a block
    inner = TransferHandle("peer-1", req.nbytes, 24, time.monotonic() + 30)
    first = Chunk(req.chain, 0, 12, inner, 6, 100, groups=2, posted=12, done=12)
    second = Chunk(req.chain, 12, 24, inner, 6, 102, groups=2, posted=12, done=12)
    h = BlocksHandle(inner, "req-3", [9, 7, 5, 3], [0, 2, 4, 6], req.plan, [first, second])
    inner.finish(CompletionError("RDMA transfer to peer-1", 10, "IBV_WC_REM_ACCESS_ERR", 103))
    err = h.error
    assert err is not None and "(3 of 4 known to have landed)" in str(err)
    assert err.landed_local_blocks == [9, 7, 5]  # type: ignore[attr-defined]
    assert err.landed_remote_blocks == [0, 2, 4]  # type: ignore[attr-defined]
    assert err.local_blocks == [3] and err.remote_blocks == [6]  # type: ignore[attr-defined]
    # a connection failure names no WR: every completed group counts
    inner2 = TransferHandle("peer-1", req.nbytes, 24, time.monotonic() + 30)
    h2 = BlocksHandle(inner2, "req-4", [9, 7, 5, 3], [0, 2, 4, 6], req.plan, [first, second])
    inner2.finish(ConnectionFailed("connection to peer-1 failed"))
    assert h2.error.landed_remote_blocks == [0, 2, 4, 6]  # type: ignore[union-attr]


def test_a_large_head_range_request_takes_its_chain_from_the_engines_reserve() -> None:
    """A 32-layer request of 64 blocks with a quarter of the heads (4096 WRs, 65536 SGEs)
    made right after the engine's planner: its chain fits the touched reserve beside the
    blank chain, so the first such request pays no page faults for new heap memory."""
    from hixl.engine.datapath import Planner

    limits = DeviceLimits()
    layers, blocks, rows, head_dim = 32, 128, 16, 128

    def cache(heads: int) -> KVGeometry:
        shape = (2, blocks, rows, heads, head_dim)
        step, out = 2, []
        for n in reversed(shape):
            out.append(step)
            step *= n
        strides = tuple(reversed(out))
        return KVGeometry(
            region_lengths=(step,) * layers,
            tensors=tuple(
                TensorGeometry(
                    dtype="float16",
                    itemsize=2,
                    shape=shape,
                    strides=strides,
                    region=k,
                    block_axis=1,
                    heads_axis=3,
                )
                for k in range(layers)
            ),
        )

    plan = Planner(limits, 64)
    try:
        assert plan.memory.heap_blocks == 0
        ids = np.arange(0, 2 * 64, 2)  # 64 blocks, none adjacent: no runs to merge
        chain, *_ = build_request(
            Op.WRITE, cache(8), [(1 << 40, 1)] * layers, cache(2), [(1 << 41, 2)] * layers,
            ids, ids[::-1].copy(), tensors=None, heads=(2, 4), remote_heads=None,
            limits=limits, memory=plan.memory,
        )  # fmt: skip
        assert (chain.num_wrs, chain.num_sges) == (4096, 65536)
        assert plan.memory.heap_blocks == 0, repr(plan.memory)
    finally:
        plan.close()
