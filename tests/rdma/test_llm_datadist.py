"""hixl.compat.llm_datadist on a real verbs device: one test per call family, byte-exact.

Two instances per test (a prompt that listens, a decoder that links to it), in this
process; the vllm-ascend connector subset also runs the prefill side in a child process.
Buffers are numpy arrays registered by address, as callers register ``data_ptr()``.
Every byte is checked, the untouched ones included.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hixl.compat.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheManager,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from hixl.testbed.net import free_tcp_port

ROOT = Path(__file__).resolve().parents[2]
P_ID, D_ID = 0, 1
S = LLMStatusCode


def pattern(shape: tuple[int, ...], seed: int, dtype: type = np.uint8) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(
        0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize
    )
    return raw.astype(np.uint8).view(dtype).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (random bytes viewed as floats hold NaNs, which never compare equal)."""
    return bool(
        np.array_equal(
            np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
        )
    )


def addrs(arrays: list[np.ndarray]) -> list[int]:
    return [int(a.ctypes.data) for a in arrays]


def options(port: int | None, **extra: object) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.local_comm_res = ""
    config.sync_kv_timeout = 10_000
    if port is not None:
        config.listen_ip_info = f"127.0.0.1:{port}"
    for key, value in extra.items():
        setattr(config, key, value)
    return config.generate_options()


def cluster(remote_id: int, port: int | None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    if port is not None:
        info.append_remote_ip_info("127.0.0.1", port)
    return info


class Pair:
    """A listening prompt and a decoder linked to it."""

    def __init__(self, **extra: object) -> None:
        self.port = free_tcp_port()
        self.p = LLMDataDist(LLMRole.PROMPT, P_ID)
        self.d = LLMDataDist(LLMRole.DECODER, D_ID)
        self.p.init(options(self.port, **extra))
        self.d.init(options(None, **extra))
        self.keep: list[np.ndarray] = []

    @property
    def pm(self) -> CacheManager:
        return self.p.cache_manager

    @property
    def dm(self) -> CacheManager:
        return self.d.cache_manager

    def link(self) -> None:
        ret, rets = self.d.link_clusters([cluster(P_ID, self.port)], 10_000)
        assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

    def blocks(
        self, manager: CacheManager, arrays: list[np.ndarray], model_id: int | None, dt: DataType
    ) -> Cache:
        self.keep += arrays
        desc = CacheDesc(len(arrays), list(arrays[0].shape), dt, Placement.DEVICE)
        key = (
            None
            if model_id is None
            else BlocksCacheKey(P_ID if manager is self.pm else D_ID, model_id)
        )
        return manager.register_blocks_cache(desc, addrs(arrays), key)

    def close(self) -> None:
        self.d.finalize()
        self.p.finalize()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def raises(expected: LLMStatusCode, fn: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(LLMException) as exc:
        fn(*args, **kwargs)  # type: ignore[operator]
    assert exc.value.status_code is expected, exc.value
    return str(exc.value)


# -- lifecycle and links ----------------------------------------------------------------------


def test_link_unlink_listener_reuse_and_switch_role() -> None:
    port = free_tcp_port()
    p = LLMDataDist(LLMRole.PROMPT, P_ID)
    d = LLMDataDist(LLMRole.DECODER, D_ID)
    try:
        p.init(options(port))
        p.init(options(port))  # a second init does nothing
        d.init(options(None))
        assert d.link_clusters([cluster(P_ID, port)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.link_clusters([cluster(P_ID, port)], 5000) == (
            S.LLM_ALREADY_LINK,
            [S.LLM_ALREADY_LINK],
        )
        raises(S.LLM_EXIST_LINK, d.switch_role, LLMRole.PROMPT, {})
        assert d.unlink_clusters([cluster(P_ID, None)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # a cluster never linked: nothing to do, as on Ascend
        assert p.unlink_clusters([cluster(D_ID, None)], 5000, force=True)[0] == S.LLM_SUCCESS

        # the same port, right after finalize
        p.finalize()
        p.init(options(port))
        assert d.link_clusters([cluster(P_ID, port)], 5000)[0] == S.LLM_SUCCESS
        d.unlink_clusters([cluster(P_ID, None)])

        # switch roles: the prompt stops listening, the decoder listens on a new port
        p.switch_role(LLMRole.DECODER)
        assert d.link_clusters([cluster(P_ID, port)], 2000)[0] in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT)
        port2 = free_tcp_port()
        d.switch_role(LLMRole.PROMPT, options(port2))
        assert d.role is LLMRole.PROMPT
        assert p.link_clusters([cluster(D_ID, port2)], 5000)[0] == S.LLM_SUCCESS
        # the old listener's port is free again
        p.unlink_clusters([cluster(D_ID, None)])
        p.switch_role(LLMRole.PROMPT, options(port))
        assert d.link_clusters([cluster(P_ID, port)], 5000)[0] == S.LLM_SUCCESS

        # nothing listens: a per-cluster failure, not an exception
        dead = cluster(7, free_tcp_port())
        ret, rets = d.link_clusters([dead], 1000)
        assert ret == rets[0] and ret in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT)
        no_addr = LLMClusterInfo()
        no_addr.remote_cluster_id = 8
        no_addr.append_local_ip_info("127.0.0.1", 0)
        assert d.link_clusters([no_addr], 1000) == (S.LLM_PARAM_INVALID, [S.LLM_PARAM_INVALID])
        too_many = [cluster(100 + i, port) for i in range(17)]
        assert d.link_clusters(too_many)[0] == S.LLM_CLUSTER_NUM_EXCEED_LIMIT
    finally:
        d.finalize()
        p.finalize()
        d.finalize()  # twice is fine


def test_hixl_backend_keeps_its_listener() -> None:
    port = free_tcp_port()
    p = LLMDataDist(LLMRole.PROMPT, P_ID)
    try:
        p.init(options(port, transfer_backend="hixl"))
        raises(
            S.LLM_FEATURE_NOT_ENABLED,
            p.switch_role,
            LLMRole.DECODER,
            {"llm.listenIpInfo": f"127.0.0.1:{free_tcp_port()}"},
        )
        p.switch_role(LLMRole.DECODER)  # no listener change: allowed
        assert p.role is LLMRole.DECODER
    finally:
        p.finalize()


# -- blocks ---------------------------------------------------------------------------------


def test_push_and_pull_blocks_every_byte(pair: Pair) -> None:
    layers, nblocks, block = 3, 8, (4, 2, 16)  # 3 layers x (K, V), fp16
    shape = (nblocks, *block)
    p_arr = [pattern(shape, 10 + i, np.float16) for i in range(2 * layers)]
    d_arr = [pattern(shape, 50 + i, np.float16) for i in range(2 * layers)]
    p_cache = pair.blocks(pair.pm, p_arr, 0, DataType.DT_FLOAT16)
    d_cache = pair.blocks(pair.dm, d_arr, 3, DataType.DT_FLOAT16)
    pair.link()
    p_orig = [a.copy() for a in p_arr]
    d_orig = [a.copy() for a in d_arr]

    src, dst = [0, 1, 2, 6, 3], [5, 6, 7, 0, 1]  # runs (0..2 -> 5..7), (6 -> 0), (3 -> 1)
    pair.dm.pull_blocks(BlocksCacheKey(P_ID, 0), d_cache, src_blocks=src, dst_blocks=dst)
    expect = [a.copy() for a in d_orig]
    for t in range(2 * layers):
        expect[t][dst] = p_orig[t][src]
        assert same(d_arr[t], expect[t]), t

    # layer ranges: source layer 2 into destination layer 0, one tensor per layer too
    pair.dm.pull_blocks(
        BlocksCacheKey(P_ID, 0),
        d_cache,
        [4],
        [2],
        src_layer_range=range(2, 3),
        dst_layer_range=range(0, 1),
    )
    expect[0][2] = p_orig[4][4]
    expect[1][2] = p_orig[5][4]
    pair.dm.pull_blocks(
        BlocksCacheKey(P_ID, 0),
        d_cache,
        [7],
        [3],
        src_layer_range=range(5, 6),
        tensor_num_per_layer=1,
    )
    expect[5][3] = p_orig[5][7]
    for t in range(2 * layers):
        assert same(d_arr[t], expect[t]), t

    # push: decoder blocks into the prompt's cache, layers 0..1 only
    pair.dm.push_blocks(BlocksCacheKey(P_ID, 0), d_cache, [0, 1], [7, 3], range(0, 2), range(1, 3))
    p_expect = [a.copy() for a in p_orig]
    for k in range(4):
        p_expect[2 + k][[7, 3]] = expect[k][[0, 1]]
    for t in range(2 * layers):
        assert same(p_arr[t], p_expect[t]), t
        assert same(d_arr[t], expect[t]), t  # a push leaves the source alone

    # the prompt, which made no link, pushes and pulls over the link the decoder made
    p1 = [a.copy() for a in p_arr]
    pair.pm.push_blocks(BlocksCacheKey(D_ID, 3), p_cache, [6, 7], [4, 5])
    pair.pm.pull_blocks(BlocksCacheKey(D_ID, 3), p_cache, [2], [0], tensor_num_per_layer=1)
    for t in range(2 * layers):
        expect[t][[4, 5]] = p1[t][[6, 7]]
        p1[t][0] = expect[t][2]
        assert same(d_arr[t], expect[t]), t
        assert same(p_arr[t], p1[t]), t

    # errors, with nothing moved
    before = [a.copy() for a in d_arr]
    raises(
        S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_blocks, BlocksCacheKey(P_ID, 9), d_cache, [0], [0]
    )
    msg = raises(
        S.LLM_PARAM_INVALID, pair.dm.pull_blocks, BlocksCacheKey(P_ID, 0), d_cache, [8], [0]
    )
    assert "src_blocks[0]=8" in msg
    raises(S.LLM_PARAM_INVALID, pair.dm.pull_blocks, BlocksCacheKey(P_ID, 0), d_cache, [0], [0, 1])
    raises(S.LLM_PARAM_INVALID, pair.dm.pull_blocks, BlocksCacheKey(P_ID, 0), d_cache, [0], [])
    raises(
        S.LLM_PARAM_INVALID,
        pair.dm.pull_blocks,
        BlocksCacheKey(P_ID, 0),
        d_cache,
        [0],
        [0],
        src_layer_range=range(2, 4),
    )
    raises(S.LLM_NOT_YET_LINK, pair.dm.pull_blocks, BlocksCacheKey(5, 0), d_cache, [0], [0])
    with pytest.raises(TypeError):
        pair.dm.pull_blocks(BlocksCacheKey(P_ID, 0), d_cache, [0.5], [0])  # type: ignore[list-item]
    for t in range(2 * layers):
        assert same(d_arr[t], before[t])


def test_mismatched_caches_are_refused(pair: Pair) -> None:
    p_arr = [pattern((4, 64), i) for i in range(2)]
    d_arr = [pattern((4, 32), 9 + i) for i in range(2)]
    pair.blocks(pair.pm, p_arr, 0, DataType.DT_UINT8)
    d_cache = pair.blocks(pair.dm, d_arr, 0, DataType.DT_UINT8)
    pair.link()
    before = [a.copy() for a in d_arr]
    msg = raises(
        S.LLM_PARAM_INVALID, pair.dm.pull_blocks, BlocksCacheKey(P_ID, 0), d_cache, [0], [0]
    )
    assert "64 bytes" in msg and "32 bytes" in msg
    raises(S.LLM_PARAM_INVALID, pair.dm.push_blocks, BlocksCacheKey(P_ID, 0), d_cache, [0], [0])
    assert all(same(a, b) for a, b in zip(d_arr, before, strict=True))


# -- plain caches ---------------------------------------------------------------------------


def test_push_and_pull_cache_by_batch_index(pair: Pair) -> None:
    shape = (3, 40)  # 3 batch entries of 40 floats
    p_arr = [pattern(shape, i, np.float32) for i in range(4)]
    d_arr = [pattern(shape, 20 + i, np.float32) for i in range(4)]
    desc = CacheDesc(4, list(shape), DataType.DT_FLOAT)
    pair.keep += p_arr + d_arr
    p_cache = pair.pm.register_cache(desc, addrs(p_arr))
    d_cache = pair.dm.register_cache(desc, addrs(d_arr))
    assert (p_cache.cache_id, d_cache.cache_id) == (1, 1)  # ids count from 1 per instance
    pair.link()
    p0 = [a.copy() for a in p_arr]
    d0 = [a.copy() for a in d_arr]

    pair.dm.pull_cache(CacheKeyByIdAndIndex(P_ID, p_cache.cache_id, 2), d_cache, 0)
    for t in range(4):
        assert same(d_arr[t][0], p0[t][2])
        assert same(d_arr[t][1:], d0[t][1:])
    pair.dm.pull_cache(
        CacheKeyByIdAndIndex(P_ID, p_cache.cache_id, 1),
        d_cache,
        1,
        size=8,
        src_layer_range=range(1, 2),
        dst_layer_range=range(0, 1),
    )
    assert same(d_arr[0][1][:2], p0[2][1][:2])
    assert same(d_arr[0][1][2:], d0[0][1][2:])
    assert same(d_arr[1][1][:2], p0[3][1][:2])
    assert same(d_arr[2][1], d0[2][1]) and same(d_arr[3][1], d0[3][1])  # layer 1: not pulled

    d1 = [a.copy() for a in d_arr]
    pair.dm.push_cache(CacheKeyByIdAndIndex(P_ID, p_cache.cache_id, 0), d_cache, 2)
    for t in range(4):
        assert same(p_arr[t][0], d1[t][2])
        assert same(p_arr[t][1:], p0[t][1:])

    raises(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.pull_cache, CacheKeyByIdAndIndex(P_ID, 42), d_cache)
    raises(S.LLM_PARAM_INVALID, pair.dm.pull_cache, CacheKeyByIdAndIndex(P_ID, 1, 3), d_cache)
    raises(
        S.LLM_PARAM_INVALID, pair.dm.push_cache, CacheKeyByIdAndIndex(P_ID, 1), d_cache, 0, size=4
    )
    raises(S.LLM_PARAM_INVALID, pair.dm.pull_cache, CacheKeyByIdAndIndex(P_ID, 1), d_cache, 0, 400)


# -- layer by layer ---------------------------------------------------------------------------


class Recorder(LayerSynchronizer):
    """Lets layer i go only once ``release(i)`` was called; records the order asked."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.events = [threading.Event() for _ in range(16)]

    def release(self, layer: int) -> None:
        self.events[layer].set()

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        return self.events[layer_index].wait(30)


def test_batch_entries_cut_into_blocks(pair: Pair) -> None:
    """A peer's batch entry into local blocks (pull_blocks by CacheKeyByIdAndIndex) and a
    local entry into the peer's blocks (transfer_cache_async): 40 bytes in blocks of 16,
    the last piece 8 bytes; the rest of that block stays."""
    p_arr = [pattern((3, 40), i) for i in range(4)]  # 2 layers, 3 entries of 40 bytes
    d_arr = [pattern((5, 16), 20 + i) for i in range(4)]  # 2 layers, 5 blocks of 16 bytes
    pair.keep += p_arr
    p_plain = pair.pm.register_cache(CacheDesc(4, [3, 40], DataType.DT_UINT8), addrs(p_arr))
    d_blocks = pair.blocks(pair.dm, d_arr, 2, DataType.DT_UINT8)
    pair.link()
    expect = [a.copy() for a in d_arr]

    # entry 2 of the prompt's layer 1 into blocks 4, 0, 1 of the decoder's layer 0
    key = CacheKeyByIdAndIndex(P_ID, p_plain.cache_id, 2)
    pair.dm.pull_blocks(
        key, d_blocks, [], [4, 0, 1], src_layer_range=range(1, 2), dst_layer_range=range(0, 1)
    )
    for k in range(2):
        entry = p_arr[2 + k][2]
        expect[k][4], expect[k][0], expect[k][1, :8] = entry[:16], entry[16:32], entry[32:]
    for t in range(4):
        assert same(d_arr[t], expect[t]), t
    raises(S.LLM_PARAM_INVALID, pair.dm.pull_blocks, key, d_blocks, [], [0, 1, 2, 3])

    # the prompt's entry 0, every layer, into blocks 3, 2, 4 of the decoder (over the link
    # the decoder made)
    sync = Recorder()
    sync.release(0)
    sync.release(1)
    config = TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 2), range(0, 2), range(0, 2))
    task = pair.pm.transfer_cache_async(p_plain, sync, [config], None, [3, 2, 4], 16)
    assert task.synchronize(30_000) == S.LLM_SUCCESS
    for t in range(4):
        entry = p_arr[t][0]
        expect[t][3], expect[t][2], expect[t][4, :8] = entry[:16], entry[16:32], entry[32:]
        assert same(d_arr[t], expect[t]), t
    assert all(same(a, pattern((3, 40), i)) for i, a in enumerate(p_arr))  # sources unchanged


def test_transfer_cache_async_layer_by_layer(pair: Pair) -> None:
    layers, shape = 4, (6, 96)
    p_arr = [pattern(shape, i) for i in range(2 * layers)]
    d_arr = [pattern(shape, 40 + i) for i in range(2 * layers)]
    p_cache = pair.blocks(pair.pm, p_arr, 0, DataType.DT_UINT8)
    pair.blocks(pair.dm, d_arr, 0, DataType.DT_UINT8)
    # the prompt links to the decoder here: the decoder needs a listener
    pair.d.switch_role(LLMRole.DECODER, options(d_port := free_tcp_port()))
    assert pair.p.link_clusters([cluster(D_ID, d_port)], 10_000)[0] == S.LLM_SUCCESS
    d0 = [a.copy() for a in d_arr]

    sync = Recorder()
    configs = [TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 0), range(1, 3), range(0, 2))]
    task = pair.pm.transfer_cache_async(p_cache, sync, configs, [0, 1, 5], [2, 3, 0])
    assert task.get_results(200) == [S.LLM_TIMEOUT]  # layer 1 not released yet
    assert all(same(a, b) for a, b in zip(d_arr, d0, strict=True))
    sync.release(1)
    sync.release(2)
    assert task.synchronize(30_000) == S.LLM_SUCCESS
    assert task.get_results() == [S.LLM_SUCCESS]
    assert sync.asked == [1, 2]  # layers 0 and 3 go nowhere: never asked
    expect = [a.copy() for a in d0]
    for src_layer, dst_layer in ((1, 0), (2, 1)):
        for k in range(2):
            expect[2 * dst_layer + k][[2, 3, 0]] = p_arr[2 * src_layer + k][[0, 1, 5]]
    for t in range(2 * layers):
        assert same(d_arr[t], expect[t]), t

    # batch entry 3 to batch entry 0 of the same cache, every layer
    sync2 = Recorder()
    for i in range(layers):
        sync2.release(i)
    task = pair.pm.transfer_cache_async(
        p_cache,
        sync2,
        [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(D_ID, 1, 5), range(0, 4), range(0, 4), 3)],
    )
    assert task.synchronize() == S.LLM_SUCCESS
    for t in range(2 * layers):
        expect[t][5] = p_arr[t][3]
        assert same(d_arr[t], expect[t]), t

    # a layer the synchronizer refuses: the config fails, later layers are not sent
    sync3 = Recorder()

    class No(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return layer_index < 1

    task = pair.pm.transfer_cache_async(
        p_cache,
        No(),
        [TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 0), range(0, 2), range(0, 2))],
        [4],
        [4],
    )
    assert task.get_results(30_000) == [S.LLM_PARAM_INVALID]
    del sync3

    with pytest.raises(TypeError):  # remote cache access is on: configs need cache keys
        pair.pm.transfer_cache_async(p_cache, sync2, [TransferConfig(D_ID, [1, 2])])
    raises(
        S.LLM_PARAM_INVALID,
        pair.pm.transfer_cache_async,
        p_cache,
        sync2,
        [TransferWithCacheKeyConfig(BlocksCacheKey(D_ID, 0), range(3, 5), range(0, 2))],
    )
    raises(S.LLM_PARAM_INVALID, pair.pm.transfer_cache_async, p_cache, sync2, configs, [0, 1], None)


def test_transfer_cache_async_to_raw_addresses() -> None:
    """Without remote cache access: TransferConfig with the peer's tensor addresses."""
    p_port, d_port = free_tcp_port(), free_tcp_port()
    p = LLMDataDist(LLMRole.PROMPT, P_ID)
    d = LLMDataDist(LLMRole.DECODER, D_ID)
    keep = []
    try:
        plain = {"llm.EnableCacheManager": "1", "llm.SyncKvCacheWaitTime": "10000"}
        p.init({**plain, "llm.listenIpInfo": f"127.0.0.1:{p_port}"})
        d.init({**plain, "llm.listenIpInfo": f"127.0.0.1:{d_port}"})
        shape = (2, 64)
        p_arr = [pattern(shape, i) for i in range(4)]
        d_arr = [pattern(shape, 10 + i) for i in range(4)]
        keep = p_arr + d_arr
        desc = CacheDesc(4, list(shape), DataType.DT_UINT8)
        p_cache = p.cache_manager.register_cache(desc, addrs(p_arr))
        d.cache_manager.register_cache(desc, addrs(d_arr))
        assert p.link_clusters([cluster(D_ID, d_port)])[0] == S.LLM_SUCCESS
        d0 = [a.copy() for a in d_arr]
        sync = Recorder()
        sync.release(1)
        # layer 1, batch entry 1, to the decoder's layer-1 tensors at entry 0
        dst = [int(d_arr[2].ctypes.data), int(d_arr[3].ctypes.data)]
        task = p.cache_manager.transfer_cache_async(
            p_cache, sync, [TransferConfig(D_ID, dst, range(1, 2), 1)]
        )
        assert task.synchronize(30_000) == S.LLM_SUCCESS
        assert same(d_arr[2][0], p_arr[2][1]) and same(d_arr[3][0], p_arr[3][1])
        assert same(d_arr[2][1], d0[2][1]) and same(d_arr[0], d0[0])
        # push needs remote cache access, as in CANN
        raises(
            S.LLM_PARAM_INVALID, p.cache_manager.push_cache, CacheKeyByIdAndIndex(D_ID, 1), p_cache
        )
    finally:
        del keep
        d.finalize()
        p.finalize()


# -- local copies ----------------------------------------------------------------------------


def test_copy_and_swap_blocks(pair: Pair) -> None:
    arr = [pattern((5, 32), i) for i in range(2)]
    cache = pair.blocks(pair.dm, arr, 0, DataType.DT_INT8)
    orig = [a.copy() for a in arr]
    pair.dm.copy_blocks(cache, {0: [3, 4], 2: [1]})
    for t in range(2):
        exp = orig[t].copy()
        exp[[3, 4]] = orig[t][0]
        exp[1] = orig[t][2]
        assert same(arr[t], exp)
    host = [np.zeros((5, 32), np.uint8) for _ in range(2)]
    host_cache = Cache.create_cpu_cache(
        CacheDesc(2, [5, 32], DataType.DT_INT8, Placement.HOST), addrs(host)
    )
    pair.dm.swap_blocks(cache, host_cache, {4: 0, 2: 3})  # swap out
    for t in range(2):
        assert same(host[t][0], arr[t][4]) and same(host[t][3], arr[t][2])
        assert not host[t][[1, 2, 4]].any()
    host[0][1] = 7
    pair.dm.swap_blocks(host_cache, cache, {1: 0})  # swap in
    assert (arr[0][0] == 7).all()
    raises(S.LLM_PARAM_INVALID, pair.dm.swap_blocks, cache, cache, {0: 1})  # DEVICE to DEVICE
    raises(S.LLM_PARAM_INVALID, pair.dm.copy_blocks, cache, {0: [5]})

    plain = [pattern((2, 16), 70 + i) for i in range(2)]
    pair.keep += plain
    desc = CacheDesc(1, [2, 16], DataType.DT_UINT8)
    a = pair.dm.register_cache(desc, addrs(plain[:1]))
    b = pair.dm.register_cache(desc, addrs(plain[1:]))
    src = plain[0].copy()
    pair.dm.copy_cache(b, a, 1, 0, offset=4, size=8)
    assert same(plain[1][1][4:12], src[0][4:12])
    pair.dm.unregister_cache(b.cache_id)
    raises(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.unregister_cache, b.cache_id)
    raises(S.LLM_KV_CACHE_NOT_EXIST, pair.dm.copy_cache, b, a)


# -- vllm-ascend's connector subset -------------------------------------------------------------

PREFILL = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from hixl.compat.llm_datadist import *

    port, layers, nblocks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = LLMConfig()
    config.device_id = 0
    config.local_comm_res = ""
    config.listen_ip_info = f"127.0.0.1:{port}"
    dd = LLMDataDist(LLMRole.PROMPT, 0)
    dd.init(config.generate_options())
    rng = np.random.default_rng(1234)
    caches = []
    for layer in range(layers):
        k = rng.integers(0, 256, (nblocks, 16, 2, 64), dtype=np.uint8).view(np.float16)
        v = rng.integers(0, 256, (nblocks, 16, 2, 64), dtype=np.uint8).view(np.float16)
        caches.append((k, v))
        desc = CacheDesc(2, list(k.shape), DataType.DT_FLOAT16, Placement.DEVICE)
        dd.cache_manager.register_blocks_cache(
            desc, [k.ctypes.data, v.ctypes.data], BlocksCacheKey(0, layer)
        )
    # and one cache of every layer's K then V tensors (copies), for pulls by layer range
    allk = [c[0].copy() for c in caches] + [c[1].copy() for c in caches]
    desc = CacheDesc(len(allk), list(allk[0].shape), DataType.DT_FLOAT16, Placement.DEVICE)
    ptrs = [a.ctypes.data for a in allk]
    dd.cache_manager.register_blocks_cache(desc, ptrs, BlocksCacheKey(0, 100))
    print("READY", flush=True)
    sys.stdin.readline()  # the decoder is done
    dd.finalize()
    print("BYE", flush=True)
    """
)


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split block pairs where either side stops going up by one (what the connector pulls
    per call)."""
    runs: list[tuple[list[int], list[int]]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0][-1] + 1 and d == runs[-1][1][-1] + 1:
            runs[-1][0].append(s)
            runs[-1][1].append(d)
        else:
            runs.append(([s], [d]))
    return runs


def test_vllm_ascend_connector_subset() -> None:
    """link; register_blocks_cache per layer; pull_blocks per contiguous block run, also with
    layer ranges; every byte checked against the prefill's arrays (same seed)."""
    layers, nblocks = 4, 24
    port = free_tcp_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", PREFILL, str(port), str(layers), str(nblocks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    d = LLMDataDist(LLMRole.DECODER, 1)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "READY"
        rng = np.random.default_rng(1234)
        prefill = []
        for _ in range(layers):
            k = rng.integers(0, 256, (nblocks, 16, 2, 64), dtype=np.uint8).view(np.float16)
            v = rng.integers(0, 256, (nblocks, 16, 2, 64), dtype=np.uint8).view(np.float16)
            prefill.append((k, v))
        d.init(options(None))
        mine = [
            (
                pattern((nblocks, 16, 2, 32), 7 + 2 * i, np.float16),
                pattern((nblocks, 16, 2, 32), 8 + 2 * i, np.float16),
            )
            for i in range(layers)
        ]
        orig = [(k.copy(), v.copy()) for k, v in mine]
        caches = []
        for k, v in mine:
            desc = CacheDesc(2, list(k.shape), DataType.DT_FLOAT16, Placement.DEVICE)
            caches.append(d.cache_manager.register_blocks_cache(desc, addrs([k, v])))
        assert d.link_clusters([cluster(0, port)], 20_000)[0] == S.LLM_SUCCESS

        # request 1: scattered prefill blocks into scattered decode blocks, layer by layer
        src = [3, 4, 5, 9, 10, 0, 17]
        dst = [10, 11, 12, 2, 3, 20, 21]
        runs = contiguous_runs(src, dst)
        assert len(runs) == 4
        for layer in range(layers):
            for s, t in runs:
                d.cache_manager.pull_blocks(BlocksCacheKey(0, layer), caches[layer], s, t)
        expect = [(k.copy(), v.copy()) for k, v in orig]
        for layer in range(layers):
            for n in range(2):
                expect[layer][n][dst] = prefill[layer][n][src]
                assert same(mine[layer][n], expect[layer][n]), (layer, n)

        # request 2: from the all-layers cache (K of layer l is tensor l, V tensor layers + l),
        # by layer range with one tensor per layer: K and V of layers 1..2 only
        src2, dst2 = [20, 21, 22, 1], [5, 6, 7, 8]
        for s, t in contiguous_runs(src2, dst2):
            for layer in (1, 2):
                for n, base in ((0, 0), (1, layers)):
                    d.cache_manager.pull_blocks(
                        BlocksCacheKey(0, 100),
                        caches[layer],
                        s,
                        t,
                        src_layer_range=range(base + layer, base + layer + 1),
                        dst_layer_range=range(n, n + 1),
                        tensor_num_per_layer=1,
                    )
        for layer in (1, 2):
            for n in range(2):
                expect[layer][n][dst2] = prefill[layer][n][src2]
        for layer in range(layers):
            for n in range(2):
                assert same(mine[layer][n], expect[layer][n]), (layer, n)
        assert d.unlink_clusters([cluster(0, None)])[0] == S.LLM_SUCCESS
    finally:
        d.finalize()
        if proc.stdin is not None:
            proc.stdin.write("done\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
