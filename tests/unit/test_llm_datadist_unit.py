"""hixl.compat.llm_datadist without a device: option parsing, status mapping, value types,
region names, layer and block planning, and the calls that are out of scope.

Transfers and links are tested on rxe in ``tests/rdma/test_llm_datadist.py``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvreplay import replay

import hixl.compat.llm_datadist as lldd
from hixl.compat.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheManager,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    code_of,
    parse_options,
)
from hixl.compat.llm_datadist._node import Node
from hixl.compat.llm_datadist._plan import (
    BlockMove,
    CacheName,
    block_runs,
    cache_name,
    check_blocks,
    entry_pieces,
    index_remote,
    local_name,
    parse_cache_name,
    prefix_move,
    tensor_pairs,
)
from hixl.core.kvblocks import KVGeometry, TensorGeometry
from hixl.core.plan import DeviceLimits, Op
from hixl.engine.kv import build_request
from hixl.errors import (
    AlignmentError,
    ArgumentError,
    BoundsError,
    CompletionError,
    ConnectionFailed,
    DescriptorError,
    DeviceError,
    HandshakeError,
    RegistrationError,
    StateError,
    TransferTimeout,
)

P = LLMStatusCode


def code(exc: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc.value.status_code


# -- status codes ---------------------------------------------------------------------------


def test_status_codes_are_canns_numbers() -> None:
    assert int(P.LLM_SUCCESS) == 0
    assert int(P.LLM_FAILED) == 0xFFFFFFFF
    assert int(P.LLM_WAIT_PROCESS_TIMEOUT) == 0x5010B001
    assert int(P.LLM_KV_CACHE_NOT_EXIST) == 0x5010B002
    assert int(P.LLM_PARAM_INVALID) == 0x5010B005
    assert int(P.LLM_NOT_YET_LINK) == 0x5010B007
    assert int(P.LLM_ALREADY_LINK) == 0x5010B008
    assert int(P.LLM_LINK_FAILED) == 0x5010B009
    assert int(P.LLM_CLUSTER_NUM_EXCEED_LIMIT) == 0x5010B00C
    assert int(P.LLM_EXIST_LINK) == 0x5010B018
    assert int(P.LLM_FEATURE_NOT_ENABLED) == 0x5010B019
    assert int(P.LLM_TIMEOUT) == 0x5010B01A
    assert int(P.LLM_OUT_OF_MEMORY) == 0x5010B01C
    assert int(P.LLM_UNKNOWN_ERROR) == -1
    assert str(P.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"


def test_exception_carries_its_code() -> None:
    exc = LLMException("boom", status_code=P.LLM_TIMEOUT)
    assert isinstance(exc, RuntimeError)
    assert exc.status_code is P.LLM_TIMEOUT
    assert LLMException("x").status_code is P.LLM_SUCCESS


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (TransferTimeout("late"), P.LLM_TIMEOUT),
        (ArgumentError("bad"), P.LLM_PARAM_INVALID),
        (DescriptorError("overlap"), P.LLM_PARAM_INVALID),
        (AlignmentError("misaligned"), P.LLM_PARAM_INVALID),
        (BoundsError("past the end"), P.LLM_PARAM_INVALID),
        (RegistrationError("unregistered"), P.LLM_PARAM_INVALID),
        (HandshakeError("refused"), P.LLM_LINK_FAILED),
        (ConnectionFailed("gone"), P.LLM_NOT_YET_LINK),
        (CompletionError("write", 10, "IBV_WC_REM_ACCESS_ERR"), P.LLM_FAILED),
        (DeviceError("no device"), P.LLM_FAILED),
        (StateError("closed"), P.LLM_FAILED),
        (LLMException("k", status_code=P.LLM_KV_CACHE_NOT_EXIST), P.LLM_KV_CACHE_NOT_EXIST),
        (RuntimeError("bug"), P.LLM_FAILED),
    ],
)
def test_engine_errors_map_to_status_codes(error: BaseException, expected: LLMStatusCode) -> None:
    assert code_of(error) is expected


# -- options --------------------------------------------------------------------------------


def test_generate_options_writes_canns_keys() -> None:
    config = LLMConfig()
    config.device_id = 3
    config.sync_kv_timeout = 2500
    config.listen_ip_info = "10.0.0.1:26000"
    config.local_comm_res = ""
    config.transfer_backend = "hixl"
    config.link_total_time = 20
    config.link_retry_count = 3
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.rdma_traffic_class = 132
    config.ge_options = {"ge.flowGraphMemMaxSize": "1024"}
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "3"
    assert options["ge.session_device_id"] == "3"
    assert options["llm.SyncKvCacheWaitTime"] == "2500"
    assert options["llm.listenIpInfo"] == "10.0.0.1:26000"
    assert options["llm.LocalCommRes"] == ""
    assert options["llm.TransferBackend"] == "hixl"
    assert options["llm.LinkTotalTime"] == "20"
    assert options["llm.LinkRetryCount"] == "3"
    assert options["llm.EnableCacheManager"] == "1"
    assert options["llm.EnableRemoteCacheAccessible"] == "1"
    assert options["llm.RdmaTrafficClass"] == "132"
    assert options["ge.flowGraphMemMaxSize"] == "1024"
    assert all(isinstance(v, str) for v in options.values())
    config.device_id = [1, 2]
    assert config.generate_options()["ge.exec.deviceId"] == "1;2"


def test_config_setters_check_like_cann() -> None:
    config = LLMConfig()
    with pytest.raises(TypeError):
        config.device_id = "0"  # type: ignore[assignment]
    with pytest.raises(LLMException) as exc:
        config.device_id = -1
    assert code(exc) is P.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        config.sync_kv_timeout = 0
    with pytest.raises(LLMException):
        config.sync_kv_timeout = "1s"
    with pytest.raises(LLMException):
        config.link_retry_count = 101
    with pytest.raises(LLMException):
        config.link_total_time = -1
    with pytest.raises(TypeError):
        config.enable_cache_manager = 1  # type: ignore[assignment]
    with pytest.raises(ValueError):
        config.rdma_service_level = -1


def test_parse_options_reads_the_sample_configurations() -> None:
    config = LLMConfig()
    config.device_id = 0
    config.local_comm_res = ""
    config.listen_ip_info = "127.0.0.1:26000"
    opts = parse_options(config.generate_options(), LLMRole.PROMPT)
    assert opts.listen == ("127.0.0.1", 26000)
    assert opts.device_id == 0
    assert opts.cache_manager and opts.remote_cache_accessible  # on with local_comm_res
    assert not opts.hixl_backend
    assert opts.sync_kv_timeout_ms == 1000
    assert (opts.link_retry_count, opts.link_total_time_s) == (1, 0)
    assert any("llm.LocalCommRes" in note for note in opts.notes)

    # transfer_cache_async's: cache manager and remote access set explicitly, a backend
    config = LLMConfig()
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transfer_backend = "hixl"
    config.listen_ip_info = "127.0.0.1:26001"
    opts = parse_options(config.generate_options(), LLMRole.DECODER)
    assert opts.hixl_backend and opts.remote_cache_accessible and opts.cache_manager

    # the client of pull_blocks_xpyd: no listener
    config = LLMConfig()
    config.local_comm_res = ""
    assert parse_options(config.generate_options(), LLMRole.DECODER).listen is None

    # the init example: cache manager without remote access
    opts = parse_options({"llm.EnableCacheManager": "1"}, LLMRole.PROMPT)
    assert opts.cache_manager and not opts.remote_cache_accessible


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"llm.listenIpInfo": "127.0.0.1"}, "format should be"),
        ({"llm.listenIpInfo": "127.0.0.1:0"}, "port must be"),
        ({"llm.listenIpInfo": "127.0.0.1:70000"}, "port must be"),
        ({"llm.SyncKvCacheWaitTime": "0"}, "SyncKvCacheWaitTime"),
        ({"llm.SyncKvCacheWaitTime": "fast"}, "SyncKvCacheWaitTime"),
        ({"llm.LinkRetryCount": "0"}, "LinkRetryCount"),
        ({"llm.LinkTotalTime": "-5"}, "LinkTotalTime"),
        ({"llm.EnableCacheManager": "yes"}, "EnableCacheManager"),
        ({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"}, "EnableCacheManager"),
        ({"llm.TransferBackend": "hixl"}, "EnableCacheManager"),
        (
            {"llm.TransferBackend": "hixl", "llm.EnableCacheManager": "1"},
            "listenIpInfo",
        ),
        (
            {
                "llm.TransferBackend": "hixl",
                "llm.EnableCacheManager": "1",
                "llm.EnableRemoteCacheAccessible": "0",
                "llm.listenIpInfo": "127.0.0.1:1",
            },
            "EnableRemoteCacheAccessible",
        ),
        (
            {
                "llm.TransferBackend": "adxl",
                "llm.EnableCacheManager": "1",
                "llm.listenIpInfo": "127.0.0.1:1",
            },
            "only backend",
        ),
        ({"llm.GlobalResourceConfig": "{not json"}, "JSON"),
        ({"llm.GlobalResourceConfig": "[1]"}, "JSON object"),
        ({"ge.exec.deviceId": "npu0"}, "deviceId"),
        ({"ge.flowGraphMemMaxSize": "4G"}, "flowGraphMemMaxSize"),
    ],
)
def test_parse_options_refuses_with_the_key_named(options: dict[str, str], fragment: str) -> None:
    with pytest.raises(LLMException) as exc:
        parse_options(options, LLMRole.PROMPT)
    assert code(exc) is P.LLM_PARAM_INVALID
    assert fragment in str(exc.value)


def test_parse_options_types_and_unknown_keys() -> None:
    with pytest.raises(TypeError):
        parse_options({"llm.SyncKvCacheWaitTime": 1000}, LLMRole.PROMPT)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        parse_options([("a", "b")], LLMRole.PROMPT)  # type: ignore[arg-type]
    opts = parse_options({"made.up": "1", "llm.RdmaServiceLevel": "4"}, LLMRole.PROMPT)
    assert opts.unknown == ("made.up",)
    assert any("RdmaServiceLevel" in n for n in opts.notes)
    opts = parse_options({"hixl.Device": "rxe1", "hixl.Token": "s3cret"}, LLMRole.MIX)
    assert (opts.device, opts.token, opts.unknown) == ("rxe1", "s3cret", ())


# -- value types ----------------------------------------------------------------------------


def test_data_types_and_element_sizes() -> None:
    sizes = {
        DataType.DT_FLOAT: 4,
        DataType.DT_FLOAT16: 2,
        DataType.DT_BF16: 2,
        DataType.DT_INT8: 1,
        DataType.DT_UINT8: 1,
        DataType.DT_INT16: 2,
        DataType.DT_UINT16: 2,
        DataType.DT_INT32: 4,
        DataType.DT_UINT32: 4,
        DataType.DT_INT64: 8,
        DataType.DT_UINT64: 8,
        DataType.DT_BOOL: 1,
        DataType.DT_DOUBLE: 8,
        DataType.DT_STRING: None,
    }
    assert {dt: dt.element_size for dt in DataType} == sizes
    assert (DataType.DT_FLOAT.value, DataType.DT_FLOAT16.value, DataType.DT_BF16.value) == (
        0,
        1,
        27,
    )


def test_cache_desc_sizes_and_checks() -> None:
    desc = CacheDesc(num_tensors=4, shape=[8, 16, 2, 64], data_type=DataType.DT_BF16)
    assert desc.placement is Placement.DEVICE
    assert desc.size == 8 * 16 * 2 * 64 * 2
    assert desc.unit_size == desc.size // 8
    assert desc.batch_size == 8
    with pytest.raises(LLMException):
        CacheDesc(1, [2, 3], DataType.DT_FLOAT, batch_dim_index=2)
    with pytest.raises(ValueError):
        CacheDesc(-1, [2, 4], DataType.DT_INT8)
    with pytest.raises(TypeError):
        CacheDesc(1, [2, 4], "fp16")  # type: ignore[arg-type]
    with pytest.raises(LLMException):
        _ = CacheDesc(1, [2, 4], DataType.DT_STRING).size
    with pytest.raises(LLMException):
        _ = CacheDesc(1, [0, 4], DataType.DT_INT8).size


def test_keys_take_canns_arguments() -> None:
    key = BlocksCacheKey(3, 1)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (3, 3, 1)
    assert BlocksCacheKey(prompt_cluster_id=7).model_id == 0
    with pytest.raises(LLMException):
        BlocksCacheKey()
    with pytest.raises(LLMException):
        BlocksCacheKey(1, 2, 3)
    with pytest.raises(LLMException):
        BlocksCacheKey(1, shard=2)
    with pytest.raises(TypeError):
        BlocksCacheKey("1")
    ck = CacheKey(1, 5)
    assert (ck.cluster_id, ck.req_id, ck.model_id, ck.prefix_id) == (1, 5, 0, 2**64 - 1)
    with pytest.raises(LLMException):
        CacheKey(1)
    by_id = CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=2)
    assert (by_id.cluster_id, by_id.cache_id, by_id.batch_index) == (0, 1, 2)
    with pytest.raises(ValueError):
        CacheKeyByIdAndIndex(-1, 1)


def test_cluster_info_keeps_ips_as_cann_does() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 9
    info.append_remote_ip_info("10.1.2.3", 26000)
    info.append_local_ip_info(0x0100007F, 0)
    assert info.remote_ip_info_list == [(int.from_bytes(bytes([10, 1, 2, 3]), "little"), 26000)]
    assert info.local_ip_info_list == [(0x0100007F, 0)]
    assert "10.1.2.3:26000" in repr(info)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("10.1.2.3", 70000)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("not an ip", 1)


def test_transfer_configs_check_ranges() -> None:
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 2), range(2, 4))
    assert cfg.dst_cluster_id == 1
    with pytest.raises(LLMException):
        TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 2), range(0, 3))
    with pytest.raises(LLMException):
        TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 4, 2), range(0, 2))
    with pytest.raises(LLMException):
        TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 1), range(0, 1), src_batch_index=1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(BlocksCacheKey(1), None, range(0, 1))
    tc = TransferConfig(1, [1, 2], range(0, 1))
    assert tc.dst_addrs == [1, 2]
    with pytest.raises(LLMException):
        TransferConfig(1, [1, 2], range(3, 1))


def test_create_cpu_cache() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_UINT8, Placement.HOST)
    cache = Cache.create_cpu_cache(desc, [0x1000, 0x2000])
    assert cache.cache_id == -1 and cache.is_blocks_cache
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_UINT8), [1, 2])
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(desc, [1])


# -- names and planning ---------------------------------------------------------------------


@given(
    cache_id=st.integers(1, 2**40),
    n=st.integers(1, 240),
    model=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    blocks=st.booleans(),
    unit=st.integers(1, 2**40),
    units=st.integers(1, 2**22),
)
@settings(max_examples=200, deadline=None)
def test_cache_names_round_trip(
    cache_id: int, n: int, model: int | None, blocks: bool, unit: int, units: int
) -> None:
    name = CacheName(
        cache_id=cache_id,
        num_tensors=n,
        model_id=model if blocks else None,
        is_blocks=blocks,
        data_type=27,
        unit=unit,
        units=units,
    )
    text = cache_name(name)
    # what register_kv takes as a cache name
    assert len(text) <= 96 and text.isprintable() and "/" not in text
    assert parse_cache_name(text) == name


def test_foreign_and_local_names_are_ignored() -> None:
    texts = ["", "kv", "lldd", "lldd c1 n2 X0 d0 u4 k1", "lldd cx n2 B0 d0 u4 k1", local_name(3)]
    # a storage region of a cache ("<name>/<k>") is not a cache
    texts.append(cache_name(CacheName(1, 2, 0, True, 0, 4, 1)) + "/0")
    for text in texts:
        assert parse_cache_name(text) is None
    assert index_remote(texts).by_id == {}


def test_index_remote_finds_caches_by_id_and_model() -> None:
    names = [
        cache_name(CacheName(1, 2, 7, True, 0, 40, 3)),
        cache_name(CacheName(2, 1, None, False, 0, 40, 3)),
        cache_name(CacheName(4, 2, 7, True, 0, 40, 3)),  # same key, registered later
        "other",
    ]
    table = index_remote(names)
    assert sorted(table.by_id) == [1, 2, 4]
    assert table.by_model[7].cache_id == 4 and table.by_model[7].kv == names[2]
    assert table.by_id[2].is_blocks is False and table.by_id[2].model_id is None
    assert table.by_id[1].num_tensors == 2 and table.by_id[1].unit == 40


def test_tensor_pairs_follow_layer_ranges() -> None:
    assert tensor_pairs(4, 4, None, None, 2) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert tensor_pairs(6, 6, range(1, 3), range(0, 2), 2) == [(2, 0), (3, 1), (4, 2), (5, 3)]
    assert tensor_pairs(2, 2, range(0, 2), range(0, 2), 1) == [(0, 0), (1, 1)]
    # a missing range takes the other side's: range(3, 4) on a 1-layer destination is past it
    with pytest.raises(LLMException) as exc:
        tensor_pairs(8, 2, range(3, 4), None, 2)
    assert "dst_layer_range" in str(exc.value)
    assert tensor_pairs(8, 2, range(3, 4), range(0, 1), 2) == [(6, 0), (7, 1)]
    with pytest.raises(LLMException):
        tensor_pairs(4, 2, None, None, 2)
    with pytest.raises(LLMException):
        tensor_pairs(5, 5, range(0, 1), None, 2)  # 2 does not divide 5
    with pytest.raises(LLMException):
        tensor_pairs(4, 4, range(0, 2), range(0, 1), 2)
    with pytest.raises(LLMException):
        tensor_pairs(4, 4, range(0, 3), None, 2)
    with pytest.raises(LLMException):
        tensor_pairs(4, 4, None, None, 0)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=40))
@settings(max_examples=300, deadline=None)
def test_block_runs_cover_every_pair_once(pairs: list[tuple[int, int]]) -> None:
    src = np.array([p[0] for p in pairs], np.int64)
    dst = np.array([p[1] for p in pairs], np.int64)
    s, d, n = block_runs(src, dst)
    expanded = [(int(a) + k, int(b) + k) for a, b, c in zip(s, d, n, strict=True) for k in range(c)]
    assert expanded == pairs
    assert all(c >= 1 for c in n)
    # maximal: no run could join the one before it
    for i in range(1, len(s)):
        assert not (s[i] == s[i - 1] + n[i - 1] and d[i] == d[i - 1] + n[i - 1])


def test_check_blocks_names_the_culprit() -> None:
    assert check_blocks("b", [0, 2], 3, "local cache").tolist() == [0, 2]
    with pytest.raises(LLMException) as exc:
        check_blocks("dst_blocks", [0, 3], 3, "local cache")
    assert "dst_blocks[1]=3" in str(exc.value) and "[0, 3)" in str(exc.value)


def compat_geometry(arrays: list[np.ndarray]) -> KVGeometry:
    """The geometry register_kv derives from the cache's views: per tensor a uint8
    ``(blocks, block bytes)`` array of its own region, bytes as the heads axis."""
    return KVGeometry(
        region_lengths=tuple(a.nbytes for a in arrays),
        tensors=tuple(
            TensorGeometry(
                dtype="uint8",
                itemsize=1,
                shape=a.shape,
                strides=a.strides,
                region=k,
                block_axis=0,
                heads_axis=1,
            )
            for k, a in enumerate(arrays)
        ),
    )


def execute(
    op: Op,
    local: list[np.ndarray],
    remote: list[np.ndarray],
    pairs: list[tuple[int, int]],
    moves: list[BlockMove],
) -> None:
    """Build each move's chain as put_blocks/get_blocks does and carry out its work
    requests with memmove (the RDMA tests do it on the wire)."""
    lregs = [(int(a.ctypes.data), 1) for a in local]
    rregs = [(int(a.ctypes.data), 2) for a in remote]
    for m in moves:
        chain, nbytes, _, _, _, _ = build_request(
            op, compat_geometry(local), lregs, compat_geometry(remote), rregs,
            m.local, m.remote, tensors=[lt for lt, _ in pairs],
            remote_tensors=[rt for _, rt in pairs], heads=m.heads,
            remote_heads=m.remote_heads, limits=DeviceLimits(),
        )  # fmt: skip
        moved = replay(op, chain)
        assert moved == nbytes


def caches(n: int, units: int, unit: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (units, unit), dtype=np.uint8) for _ in range(n)]


def test_pull_blocks_from_a_batch_entry_moves_each_piece_into_its_block() -> None:
    # the peer's plain cache: 4 tensors (2 layers), 3 entries of 60 bytes; ours: blocks of 24
    remote, local = caches(4, 3, 60, 1), caches(4, 5, 24, 2)
    before = [a.copy() for a in local]
    pairs = tensor_pairs(4, 4, range(1, 2), range(0, 1), 2)  # its layer 1 into our layer 0
    dst = np.array([4, 0, 2], np.int64)
    moves = entry_pieces(1, 60, 24, dst, entry_is_local=False)
    execute(Op.READ, local, remote, [(d, s) for s, d in pairs], moves)
    for s, d in pairs:
        expect = before[d].copy()
        entry = remote[s][1]
        expect[4], expect[0] = entry[:24], entry[24:48]
        expect[2, :12] = entry[48:]  # the last piece is 12 bytes; the rest of block 2 stays
        assert np.array_equal(local[d], expect)
    for t in (2, 3):
        assert np.array_equal(local[t], before[t])


def test_push_blocks_runs_and_an_entry_prefix() -> None:
    local, remote = caches(2, 6, 16, 3), caches(2, 6, 16, 4)
    before = [a.copy() for a in remote]
    src, dst = np.array([0, 1, 2, 5], np.int64), np.array([3, 4, 5, 0], np.int64)
    execute(Op.WRITE, local, remote, [(0, 0), (1, 1)], [BlockMove(src, dst)])
    for t in range(2):
        expect = before[t].copy()
        expect[dst] = local[t][src]
        assert np.array_equal(remote[t], expect)
    # the first 5 bytes of entry 2 into entry 1, tensor 1 into tensor 0
    before = [a.copy() for a in remote]
    execute(Op.WRITE, local, remote, [(1, 0)], [prefix_move(2, 1, 5)])
    expect = before[0].copy()
    expect[1, :5] = local[1][2, :5]
    assert np.array_equal(remote[0], expect) and np.array_equal(remote[1], before[1])


def test_an_entry_cut_into_the_peers_blocks() -> None:
    # transfer_cache_async, an entry to blocks: 40 bytes into blocks of 16 (16, 16, 8)
    local, remote = caches(2, 2, 40, 5), caches(2, 4, 16, 6)
    before = [a.copy() for a in remote]
    moves = entry_pieces(1, 40, 16, np.array([3, 1, 0], np.int64), entry_is_local=True)
    assert [(m.heads, m.remote_heads) for m in moves] == [
        ((0, 16), (0, 16)),
        ((16, 32), (0, 16)),
        ((32, 40), (0, 8)),
    ]
    execute(Op.WRITE, local, remote, [(0, 0), (1, 1)], moves)
    for t in range(2):
        expect = before[t].copy()
        expect[3], expect[1], expect[0, :8] = local[t][1, :16], local[t][1, 16:32], local[t][1, 32:]
        assert np.array_equal(remote[t], expect)
    with pytest.raises(LLMException):  # more blocks than pieces
        entry_pieces(1, 40, 16, np.array([0, 1, 2, 3], np.int64), entry_is_local=True)


# -- out of scope ---------------------------------------------------------------------------


def test_out_of_scope_calls_raise_llm_exception() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 0)
    calls: list[Callable[[], object]] = [
        lambda: dd.link("comm", {0: 0, 1: 1}, "{}"),
        lambda: dd.unlink(1),
        lambda: dd.query_register_mem_status(1),
        lambda: dd.check_link_status(1),
        lambda: dd.kv_cache_manager,
    ]
    manager = CacheManager(cast(Node, None))
    desc = CacheDesc(1, [2, 4], DataType.DT_INT8)
    calls += [
        lambda: manager.allocate_cache(desc),
        lambda: manager.allocate_blocks_cache(desc),
        lambda: manager.deallocate_cache(cast(Cache, None)),
        lambda: manager.deallocate_blocks_cache(cast(Cache, None)),
        lambda: manager.remove_cache_key(CacheKey(0, 1)),
        lambda: manager.remap_registered_memory([]),
        lambda: lldd.KvCacheManager,
        lambda: lldd.TensorDesc,
    ]
    for call in calls:
        with pytest.raises(LLMException) as exc:
            call()
        assert code(exc) is P.LLM_FEATURE_NOT_ENABLED
        assert len(str(exc.value)) > 30  # says why
    with pytest.raises(AttributeError):
        _ = lldd.NoSuchName


def test_calls_before_init_raise() -> None:
    dd = LLMDataDist(LLMRole.DECODER, 1)
    with pytest.raises(RuntimeError):
        _ = dd.cache_manager
    with pytest.raises(RuntimeError):
        dd.link_clusters([LLMClusterInfo()])
    dd.finalize()  # nothing to do, no error
    with pytest.raises(TypeError):
        LLMDataDist("prompt", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)


def test_pure_modules_import_without_pyverbs() -> None:
    code_ = (
        "import sys; sys.modules['pyverbs'] = None; "
        "import hixl.compat.llm_datadist._plan, hixl.compat.llm_datadist._config"
    )
    subprocess.run([sys.executable, "-c", code_], check=True)


def test_token_from_the_environment_when_the_options_give_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HIXL_TOKEN", "from-env")
    assert parse_options({}, LLMRole.PROMPT).token == "from-env"
    assert parse_options({"hixl.Token": "given"}, LLMRole.PROMPT).token == "given"
    monkeypatch.delenv("HIXL_TOKEN")
    assert parse_options({}, LLMRole.PROMPT).token is None
