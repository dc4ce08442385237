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
    TensorName,
    block_runs,
    check_blocks,
    index_remote,
    parse_region_name,
    region_name,
    tensor_pairs,
)
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
    cache_id=st.integers(1, 2**63 - 1),
    n=st.integers(1, 240),
    model=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    blocks=st.booleans(),
    unit=st.integers(1, 2**40),
    units=st.integers(1, 2**31),
)
@settings(max_examples=200, deadline=None)
def test_region_names_round_trip(
    cache_id: int, n: int, model: int | None, blocks: bool, unit: int, units: int
) -> None:
    name = TensorName(
        cache_id=cache_id,
        tensor=n - 1,
        num_tensors=n,
        model_id=model if blocks else None,
        is_blocks=blocks,
        data_type=27,
        unit=unit,
        units=units,
    )
    text = region_name(name)
    assert len(text) <= 128 and text.isprintable()
    assert parse_region_name(text) == name


def test_foreign_region_names_are_ignored() -> None:
    for text in ["", "kv", "lldd", "lldd c1 t0/2 X0 d0 u4 k1", "lldd cx t0/2 B0 d0 u4 k1"]:
        assert parse_region_name(text) is None


def test_index_remote_groups_tensors_and_skips_incomplete_caches() -> None:
    def names(cache_id: int, n: int, model: int | None, blocks: bool) -> list[str]:
        return [region_name(TensorName(cache_id, t, n, model, blocks, 0, 40, 3)) for t in range(n)]

    regions = [(t, f"r{i}") for i, t in enumerate(names(1, 2, 0, True) + names(2, 1, None, False))]
    regions += [(names(3, 2, 5, True)[0], "half"), ("other", "x")]
    table = index_remote(regions)
    assert sorted(table.by_id) == [1, 2]
    assert table.by_model[0].tensors == ("r0", "r1")
    assert table.by_id[2].is_blocks is False and table.by_id[2].model_id is None
    assert 5 not in table.by_model


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
