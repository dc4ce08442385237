"""hixl.compat without a device: status codes, option parsing, engine ids, desc grouping.

The RDMA behaviour (transfers, links, notifications) is tested on rxe in
``tests/rdma/test_compat.py``; here only what needs no verbs device.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hixl import compat
from hixl.compat import (
    FAILED,
    PARAM_INVALID,
    SUCCESS,
    ChannelPool,
    CompatOptions,
    Hixl,
    MemDesc,
    MemType,
    NotifyDesc,
    Status,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
    check_notify,
    checked_desc,
    engine_id_for,
    get_capability,
    group_op_descs,
    parse_options,
    plan_relay,
    status_of,
)
from hixl.compat import _hixl as hixl_module
from hixl.compat._connect import ConnectExecutor
from hixl.compat._notify import ENVELOPE_NAME, encode_notify, open_envelope
from hixl.compat._options import Refusal
from hixl.core import notify as core_notify
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
    VerbsError,
)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ codes and enums


def test_status_values_are_hixls() -> None:
    assert {s.name: int(s) for s in Status} == {
        "SUCCESS": 0,
        "PARAM_INVALID": 103900,
        "TIMEOUT": 103901,
        "NOT_CONNECTED": 103902,
        "ALREADY_CONNECTED": 103903,
        "NOTIFY_FAILED": 103904,
        "UNSUPPORTED": 103905,
        "FAILED": 503900,
        "RESOURCE_EXHAUSTED": 203900,
    }
    for s in Status:
        assert getattr(compat, s.name) is s  # module-level constants, as hixl.SUCCESS
    assert SUCCESS == 0 and isinstance(FAILED, int)


def test_enum_values_are_hixls() -> None:
    assert (int(MemType.MEM_DEVICE), int(MemType.MEM_HOST)) == (0, 1)
    assert (int(TransferOp.READ), int(TransferOp.WRITE)) == (0, 1)
    assert [int(s) for s in TransferStatus] == [0, 1, 2, 3]
    assert [s.name for s in TransferStatus] == ["WAITING", "COMPLETED", "TIMEOUT", "FAILED"]


def test_value_types_take_hixls_arguments() -> None:
    assert MemDesc(0x1000, 64) == MemDesc(addr=0x1000, len=64, local_only=False)
    d = TransferOpDesc(local_addr=1, remote_addr=2, len=3)
    assert (d.local_addr, d.remote_addr, d.len) == (1, 2, 3)
    n = NotifyDesc(name="cache_ready", notify_msg="block_0")
    assert (n.name, n.notify_msg) == ("cache_ready", "block_0")
    args = compat.TransferArgs()
    args.user_data = 12345  # mutable, as in hixl
    assert args.user_data == 12345
    q = compat.GetTransferStatusArgs(max_query_count=10, skip_waiting=True)
    assert (q.max_query_count, q.skip_waiting) == (10, True)


# ------------------------------------------------------------------ status mapping


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ArgumentError("x"), Status.PARAM_INVALID),
        (DescriptorError("x"), Status.PARAM_INVALID),
        (AlignmentError("x"), Status.PARAM_INVALID),
        (BoundsError("x"), Status.PARAM_INVALID),
        (RegistrationError("x"), Status.PARAM_INVALID),
        (ValueError("x"), Status.PARAM_INVALID),
        (TypeError("x"), Status.PARAM_INVALID),
        (TransferTimeout("x"), Status.TIMEOUT),
        (TimeoutError("x"), Status.TIMEOUT),
        (CompletionError("RDMA transfer", 10, "IBV_WC_REM_ACCESS_ERR"), Status.FAILED),
        (VerbsError("reg_mr", "no", 14), Status.FAILED),
        (ConnectionFailed("x"), Status.FAILED),
        (HandshakeError("x"), Status.FAILED),
        (StateError("x"), Status.FAILED),
        (DeviceError("x"), Status.FAILED),
        (RuntimeError("x"), Status.FAILED),
        (Refusal(Status.NOT_CONNECTED, "x"), Status.NOT_CONNECTED),
        (Refusal(Status.ALREADY_CONNECTED, "x"), Status.ALREADY_CONNECTED),
    ],
)
def test_status_of(exc: BaseException, code: Status) -> None:
    assert status_of(exc) is code


# ------------------------------------------------------------------ options


def test_no_options_give_the_defaults() -> None:
    assert parse_options(None) == CompatOptions()
    assert parse_options({}) == CompatOptions()
    assert CompatOptions().alignment is None  # hixl callers pass arbitrary addresses
    assert CompatOptions().auto_connect is False


def test_honoured_options() -> None:
    opts = parse_options(
        {
            compat.OPTION_AUTO_CONNECT: "1",
            compat.OPTION_TOKEN: "s3cret",
            compat.OPTION_ALIGNMENT: "64",
            compat.OPTION_DEVICE: "rxe0",
            compat.OPTION_ASYNC_TRANSFER_TIMEOUT: "2500",
        }
    )
    assert opts.auto_connect
    assert (opts.token, opts.alignment, opts.device, opts.async_timeout_ms) == (
        "s3cret",
        64,
        "rxe0",
        2500,
    )
    assert opts.ignored == () and opts.unknown == () and opts.notes == ()
    assert parse_options({compat.OPTION_ALIGNMENT: "0"}).alignment is None


def test_the_switch_interval_is_the_applications_choice() -> None:
    assert CompatOptions().gil_switch_interval is None  # the process's interval is left alone
    opts = parse_options({compat.OPTION_GIL_SWITCH_INTERVAL: "0.0005"})
    assert opts.gil_switch_interval == 0.0005 and opts.unknown == ()


def test_initialize_passes_the_switch_interval_to_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[object] = []

    def engine(*args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("gil_switch_interval", "missing"))
        raise DeviceError("no device in this test")

    monkeypatch.setattr(hixl_module, "Engine", engine)
    hixl = Hixl()
    assert hixl.initialize("127.0.0.1:0") is Status.FAILED
    assert hixl.initialize("127.0.0.1:0", {"hixl.GilSwitchInterval": "0.002"}) is Status.FAILED
    assert seen == [None, 0.002]


def test_ignored_options_are_checked_then_recorded() -> None:
    opts = parse_options(
        {
            "BufferPool": "4:8",
            "RdmaTrafficClass": "132",
            "RdmaServiceLevel": "4",
            "GlobalResourceConfig": '{"connect_pool.thread_num": "2"}',
            "LocalCommRes": "",
        }
    )
    assert opts.buffer_pool == (4, 8)
    assert (opts.traffic_class, opts.service_level) == (132, 4)
    assert set(opts.ignored) == {"RdmaTrafficClass", "RdmaServiceLevel", "LocalCommRes"}
    assert opts.connect_threads == 2 and opts.channel_pool is None
    assert len(opts.notes) == 2  # traffic class and service level have no effect here
    assert parse_options({"EnableUseFabricMem": "0"}).ignored == ("EnableUseFabricMem",)


def test_adxl_prefix_and_unknown_keys() -> None:
    assert parse_options({"adxl.BufferPool": "0:0"}).buffer_pool is None  # pool off
    assert parse_options({"SomethingElse": "1"}).unknown == ("SomethingElse",)
    with pytest.raises(ArgumentError, match="twice"):
        parse_options({"adxl.BufferPool": "0:0", "BufferPool": "0:0"})


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"AutoConnect": "yes"}, "AutoConnect"),
        ({"BufferPool": "4"}, "BUFFER_NUM:BUFFER_SIZE"),
        ({"BufferPool": "a:8"}, "decimal"),
        ({"RdmaTrafficClass": "130"}, "multiple of 4"),
        ({"RdmaTrafficClass": "256"}, "range"),
        ({"RdmaServiceLevel": "8"}, "range"),
        ({"GlobalResourceConfig": "{not json"}, "JSON"),
        ({"LocalCommRes": "[1, 2]"}, "JSON object"),
        ({"hixl.Alignment": "48"}, "power of two"),
        ({"hixl.Token": ""}, "empty"),
        ({"hixl.AsyncTransferTimeout": "0"}, "range"),
        ({"hixl.GilSwitchInterval": "0"}, r"\(0, 1\]"),
        ({"hixl.GilSwitchInterval": "fast"}, r"\(0, 1\]"),
        ({"BufferPool": "4:8", "EnableUseFabricMem": "0"}, "together"),
        ({"AutoConnect": 1}, "str to str"),
    ],
)
def test_bad_options_are_param_invalid(options: dict[str, str], needle: str) -> None:
    with pytest.raises(ArgumentError, match=needle) as info:
        parse_options(options)
    assert status_of(info.value) is Status.PARAM_INVALID


def test_fabric_mem_is_unsupported() -> None:
    with pytest.raises(Refusal) as info:
        parse_options({"EnableUseFabricMem": "1"})
    assert status_of(info.value) is Status.UNSUPPORTED


# ------------------------------------------------------------------ engine ids


@pytest.mark.parametrize(
    ("local_engine", "engine_id"),
    [
        ("10.0.0.1:16000", "10.0.0.1:16000"),
        ("10.0.0.1", "10.0.0.1:0"),
        ("10.0.0.1:0", "10.0.0.1:0"),
        ("10.0.0.1:-1", "10.0.0.1:0"),
        ("[fe80::1]:16000", "[fe80::1]:16000"),
        ("[::1]", "[::1]:0"),
        (" localhost:5 ", "localhost:5"),
    ],
)
def test_engine_id_for(local_engine: str, engine_id: str) -> None:
    assert engine_id_for(local_engine) == engine_id


@pytest.mark.parametrize("bad", ["", "fe80::1", "[::1", "[::1]x", ":16000", "h:65536", "h:x", 7])
def test_engine_id_for_rejects(bad: object) -> None:
    with pytest.raises(ArgumentError):
        engine_id_for(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ descs


@dataclass
class Loose:
    """A desc-like object of any field types (the binding's own class checks its fields)."""

    local_addr: object
    remote_addr: object
    len: object


@dataclass(frozen=True)
class Span:
    addr: int
    length: int


def finder(spans: list[Span], side: str) -> Callable[[int, int], Span]:
    def find(addr: int, nbytes: int) -> Span:
        for s in spans:
            if s.addr <= addr and addr + nbytes <= s.addr + s.length:
                return s
        raise RegistrationError(f"{side} memory not registered: addr={addr:#x} nbytes={nbytes}")

    return find


LOCAL = [Span(0x10000, 0x1000), Span(0x20000, 0x1000)]
REMOTE = [Span(0x90000, 0x2000)]


def test_descs_are_grouped_per_region_pair_in_list_order() -> None:
    descs = [
        TransferOpDesc(0x10010, 0x90000, 16),
        TransferOpDesc(0x20000, 0x90100, 32),
        TransferOpDesc(0x10000, 0x90200, 8),
    ]
    groups = group_op_descs(descs, finder(LOCAL, "local"), finder(REMOTE, "remote"))
    assert [g.indices for g in groups] == [(0, 2), (1,)]
    first, second = groups
    assert (first.local, first.remote) == (LOCAL[0], REMOTE[0])
    assert first.local_desc.segments.pairs() == [(0x10, 16), (0, 8)]
    assert first.remote_desc.segments.pairs() == [(0, 16), (0x200, 8)]
    assert second.local_desc.segments.pairs() == [(0, 32)]
    assert second.remote_desc.segments.pairs() == [(0x100, 32)]
    assert first.local_desc.alignment is None  # the compat default policy


def test_alignment_policy_applies_when_asked() -> None:
    descs = [TransferOpDesc(0x10001, 0x90000, 16)]
    with pytest.raises(AlignmentError):
        group_op_descs(descs, finder(LOCAL, "l"), finder(REMOTE, "r"), alignment=64)


@pytest.mark.parametrize(
    ("desc", "needle"),
    [
        (TransferOpDesc(0x10000, 0x90000, 0), "len=0"),
        (Loose(-1, 0x90000, 8), "64-bit"),
        (TransferOpDesc((1 << 64) - 4, 0x90000, 8), "64-bit"),
        (Loose(0x10000, 0x90000, True), "must be an int"),
        (Loose(0x10000, 589824.0, 8), "must be an int"),
        ((0x10000, 0x90000, 8), "must be an int"),
    ],
)
def test_bad_desc_is_argument_error(desc: object, needle: str) -> None:
    with pytest.raises(ArgumentError, match=needle):
        checked_desc(0, desc)


def test_unregistered_or_out_of_bounds_memory_names_the_desc() -> None:
    ok = TransferOpDesc(0x10000, 0x90000, 8)
    for bad, side in [
        (TransferOpDesc(0x30000, 0x90000, 8), "local"),  # in no local region
        (TransferOpDesc(0x10FF8, 0x90000, 16), "local"),  # runs past the region's end
        (TransferOpDesc(0x10000, 0x91FF0, 0x20), "remote"),  # past the peer region's end
    ]:
        with pytest.raises(RegistrationError, match=rf"op_descs\[1\]: {side}") as info:
            group_op_descs([ok, bad], finder(LOCAL, "local"), finder(REMOTE, "remote"))
        assert status_of(info.value) is Status.PARAM_INVALID


def test_empty_or_non_list_descs() -> None:
    bads: list[object] = [[], "abc", None]
    for bad in bads:
        with pytest.raises(ArgumentError):
            group_op_descs(bad, finder(LOCAL, "l"), finder(REMOTE, "r"))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 1),  # local region
            st.integers(0, 2),  # remote region
            st.integers(0, 4095),  # local offset
            st.integers(0, 4095),  # remote offset
            st.integers(1, 64),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_grouping_maps_every_desc_exactly_once(
    raw: list[tuple[int, int, int, int, int]],
) -> None:
    local = [Span(0x100000, 4096 + 64), Span(0x300000, 4096 + 64)]
    remote = [Span(0x800000, 4096 + 64), Span(0x900000, 4096 + 64), Span(0xA00000, 4096 + 64)]
    descs = [
        TransferOpDesc(local[li].addr + lo, remote[ri].addr + ro, n) for li, ri, lo, ro, n in raw
    ]
    groups = group_op_descs(descs, finder(local, "l"), finder(remote, "r"))
    seen = sorted(i for g in groups for i in g.indices)
    assert seen == list(range(len(descs)))
    assert len({(id(g.local), id(g.remote)) for g in groups}) == len(groups)
    for g in groups:
        assert list(g.indices) == sorted(g.indices)  # list order kept inside a group
        lpairs = g.local_desc.segments.pairs()
        rpairs = g.remote_desc.segments.pairs()
        for k, i in enumerate(g.indices):
            d = descs[i]
            assert (g.local.addr + lpairs[k][0], lpairs[k][1]) == (d.local_addr, d.len)
            assert (g.remote.addr + rpairs[k][0], rpairs[k][1]) == (d.remote_addr, d.len)
        assert g.local_desc.nbytes == g.remote_desc.nbytes == sum(descs[i].len for i in g.indices)


# ------------------------------------------------------------------ notifies, capability


def test_check_notify_limits_are_hixls() -> None:
    assert check_notify(NotifyDesc("ready", "block_0")) == (b"ready", b"block_0")
    assert check_notify(NotifyDesc("", "")) == (b"", b"")  # hixl allows an empty name
    assert check_notify(NotifyDesc("n" * 1024, "m" * 1024)) == (b"n" * 1024, b"m" * 1024)
    for bad, needle in [
        (NotifyDesc("n" * 1025, ""), "1025/0 bytes"),
        (NotifyDesc("n", "m" * 1025), "1/1025 bytes"),
        (NotifyDesc("n", "\u00e9" * 513), "1/1026 bytes"),  # bytes, not characters
        (("name", "msg"), "NotifyDesc"),
    ]:
        with pytest.raises(ArgumentError, match=needle):
            check_notify(bad)


def test_get_capability() -> None:
    assert get_capability(compat.FeatureType.AUTO_CONNECT) == (SUCCESS, compat.FEATURE_SUPPORTED)
    assert get_capability(compat.FeatureType.CLIENT_SERVER_COMM) == (
        SUCCESS,
        compat.FEATURE_SUPPORTED,
    )
    assert get_capability(99) == (SUCCESS, compat.FEATURE_NOT_SUPPORTED)
    assert get_capability(-1) == (PARAM_INVALID, compat.FEATURE_NOT_SUPPORTED)


# ------------------------------------------------------------------ Hixl without a device


def test_calls_before_initialize_fail_without_raising() -> None:
    h = Hixl()
    assert h.register_mem(MemDesc(0x1000, 64), MemType.MEM_HOST) == (FAILED, 0)
    assert h.deregister_mem(1) is FAILED
    assert h.connect("127.0.0.1:1") is FAILED
    assert h.disconnect("127.0.0.1:1") is FAILED
    assert h.transfer_sync("127.0.0.1:1", TransferOp.READ, []) is FAILED
    assert h.transfer_async("127.0.0.1:1", TransferOp.READ, []) == (FAILED, 0)
    assert h.get_transfer_status(1) == (FAILED, TransferStatus.FAILED)
    assert h.get_all_transfer_status() == (FAILED, [])
    assert h.send_notify("127.0.0.1:1", NotifyDesc("a", "b")) is FAILED
    assert h.get_notifies() == (FAILED, [])
    assert h.connect_async("127.0.0.1:1") is FAILED
    assert h.disconnect_async("127.0.0.1:1") is FAILED
    assert h.get_async_connect_status("127.0.0.1:1") == (FAILED, compat.NOT_CONNECT)
    assert h.get_all_async_connect_status() == (FAILED, {})
    assert "initialize" in h.last_error
    h.finalize()
    h.finalize()  # twice is fine


def test_initialize_rejects_bad_arguments_before_touching_a_device() -> None:
    h = Hixl()
    assert h.initialize("fe80::1:5000") is PARAM_INVALID
    assert h.initialize("127.0.0.1:5000", {"RdmaServiceLevel": "9"}) is PARAM_INVALID
    assert h.initialize("127.0.0.1:5000", {"EnableUseFabricMem": "1"}) is Status.UNSUPPORTED
    assert h.engine is None


PROBE = """
import sys
sys.modules["pyverbs"] = None
from hixl import compat as hixl
h = hixl.Hixl()
ret = h.initialize("127.0.0.1:0")
assert ret == hixl.FAILED, ret
assert "pyverbs" in h.last_error or "RDMA" in h.last_error, h.last_error
assert h.register_mem(hixl.MemDesc(4096, 64), hixl.MemType.MEM_HOST) == (hixl.FAILED, 0)
h.finalize()
print("compat-ok")
"""


def test_without_pyverbs_initialize_reports_failed() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "compat-ok"


# ------------------------------------------------------------------ the binding's surface

# The names Huawei's hixl/__init__.py exports (hicann/hixl src/python/hixl_py/hixl/__init__.py).
BINDING_NAMES = [
    "SUCCESS",
    "PARAM_INVALID",
    "TIMEOUT",
    "NOT_CONNECTED",
    "ALREADY_CONNECTED",
    "NOTIFY_FAILED",
    "UNSUPPORTED",
    "FAILED",
    "RESOURCE_EXHAUSTED",
    "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES",
    "FEATURE_SUPPORTED",
    "FEATURE_NOT_SUPPORTED",
    "MemType",
    "MEM_DEVICE",
    "MEM_HOST",
    "TransferOp",
    "READ",
    "WRITE",
    "TransferStatus",
    "AsyncConnectStatus",
    "NOT_CONNECT",
    "CONNECT_PENDING",
    "CONNECTING",
    "CONNECTED",
    "CONNECT_FAILED",
    "DISCONNECT_PENDING",
    "DISCONNECTING",
    "FeatureType",
    "AUTO_CONNECT",
    "CLIENT_SERVER_COMM",
    "MemDesc",
    "TransferOpDesc",
    "TransferArgs",
    "GetTransferStatusArgs",
    "TransferResult",
    "NotifyDesc",
    "Hixl",
    "get_capability",
]


def test_every_name_of_the_binding_is_exported_in_its_order() -> None:
    missing = [n for n in BINDING_NAMES if not hasattr(compat, n)]
    assert missing == []
    assert compat.__all__[: len(BINDING_NAMES)] == BINDING_NAMES


def test_export_values_give_module_level_members() -> None:
    assert compat.MEM_DEVICE is MemType.MEM_DEVICE and compat.MEM_HOST is MemType.MEM_HOST
    assert compat.READ is TransferOp.READ and compat.WRITE is TransferOp.WRITE
    assert compat.AUTO_CONNECT is compat.FeatureType.AUTO_CONNECT
    assert compat.CLIENT_SERVER_COMM is compat.FeatureType.CLIENT_SERVER_COMM
    acs = compat.AsyncConnectStatus
    assert [(s.name, int(s)) for s in acs] == [
        ("NOT_CONNECT", 0),
        ("CONNECT_PENDING", 1),
        ("CONNECTING", 2),
        ("CONNECTED", 3),
        ("CONNECT_FAILED", 4),
        ("DISCONNECT_PENDING", 5),
        ("DISCONNECTING", 6),
    ]
    for s in acs:
        assert getattr(compat, s.name) is s
    # TransferStatus does not export its values: hixl.TIMEOUT and hixl.FAILED stay status codes.
    assert compat.TIMEOUT == 103901 and compat.FAILED == 503900
    assert not hasattr(compat, "WAITING") and not hasattr(compat, "COMPLETED")


def test_unscoped_enums_equal_ints_scoped_ones_do_not() -> None:
    assert compat.MEM_HOST == 1 and compat.WRITE == 1 and compat.CLIENT_SERVER_COMM == 1
    # enum class in C++: pybind11 compares strictly, int() still works
    zero: object = 0
    three: object = 3
    assert zero != TransferStatus.WAITING and int(TransferStatus.WAITING) == 0
    assert three != compat.CONNECTED and int(compat.CONNECTED) == 3
    assert TransferStatus.FAILED == TransferStatus.FAILED
    assert len({TransferStatus.WAITING, TransferStatus.WAITING}) == 1  # hashable


def test_transfer_result_defaults_and_read_only_status() -> None:
    r = compat.TransferResult()
    assert (r.req, r.user_data, r.status) == (0, 0, TransferStatus.WAITING)
    r.req = 7
    r.user_data = 9
    assert (r.req, r.user_data) == (7, 9)
    with pytest.raises(AttributeError, match="read-only"):
        r.status = TransferStatus.COMPLETED
    with pytest.raises(TypeError):
        compat.TransferResult(1, 2, TransferStatus.COMPLETED)  # type: ignore[call-arg]


def test_value_fields_are_c_integers_as_in_the_binding() -> None:
    with pytest.raises(TypeError):
        MemDesc()  # type: ignore[call-arg]  # addr and len are required
    with pytest.raises(TypeError, match="outside"):
        MemDesc(-1, 8)
    with pytest.raises(TypeError, match="outside"):
        TransferOpDesc(0, 1 << 64, 8)
    with pytest.raises(TypeError, match="must be an int"):
        TransferOpDesc(0, 0, 8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compat.TransferArgs(5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="outside"):
        compat.GetTransferStatusArgs(1 << 32)
    with pytest.raises(TypeError, match="must be a str"):
        NotifyDesc(1, "x")  # type: ignore[arg-type]
    d = MemDesc(addr=0x1000, len=64)
    with pytest.raises(TypeError):
        d.len = -5
    assert (d.addr, d.len, d.local_only) == (0x1000, 64, False)
    args = compat.GetTransferStatusArgs()
    assert (args.max_query_count, args.skip_waiting) == (0xFFFFFFFF, False)


def test_positional_and_keyword_arguments_as_in_the_binding() -> None:
    h = Hixl()
    with pytest.raises(TypeError):  # the binding names no arguments of register_mem
        h.register_mem(mem_desc=MemDesc(0x1000, 64), mem_type=MemType.MEM_HOST)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        get_capability(feature_type=compat.AUTO_CONNECT)  # type: ignore[call-arg]
    kw = {"remote_engine": "127.0.0.1:1", "timeout_in_millis": 5}
    assert h.connect(**kw) is FAILED  # type: ignore[arg-type]
    assert h.connect_async(**kw) is FAILED  # type: ignore[arg-type]
    assert h.disconnect_async(**kw) is FAILED  # type: ignore[arg-type]
    assert h.send_notify("127.0.0.1:1", notify=NotifyDesc("a", "b"), timeout_in_millis=5) is FAILED
    assert h.get_all_transfer_status(args=compat.GetTransferStatusArgs()) == (FAILED, [])


# ------------------------------------------------------------------ resource config, buffer pool


def grc(config: dict[str, object]) -> CompatOptions:
    return parse_options({compat.OPTION_GLOBAL_RESOURCE_CONFIG: json.dumps(config)})


def test_channel_pool_marks_follow_hixls_formula() -> None:
    opts = grc(
        {
            "channel_pool.max_channel": "10",
            "channel_pool.high_waterline": "0.3",
            "channel_pool.low_waterline": "0.1",
        }
    )
    assert opts.channel_pool == ChannelPool(max_channel=10, high_mark=3, low_mark=1)
    # without max_channel hixl's default of 512 applies
    opts = grc({"channel_pool.high_waterline": 0.5, "channel_pool.low_waterline": 0.25})
    assert opts.channel_pool == ChannelPool(512, 256, 128)
    assert grc({}).channel_pool is None


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"channel_pool.max_channel": "10"}, "needs both"),
        (
            {
                "channel_pool.max_channel": "2",
                "channel_pool.high_waterline": "0.6",
                "channel_pool.low_waterline": "0.5",
            },
            "marks 1 and 1",
        ),
        ({"channel_pool.max_channel": "513", "channel_pool.high_waterline": "0.5"}, "range"),
        ({"channel_pool.high_waterline": "1.0", "channel_pool.low_waterline": "0.1"}, r"\(0, 1\)"),
        ({"connect_pool.thread_num": "65"}, "range"),
        ({"connect_pool.task_queue_capacity": "0"}, "range"),
        ({"comm_resource_config.protocol_desc": ["roce"]}, "protocol:placement"),
        ({"comm_resource_config.protocol_desc": "roce:device"}, "list"),
        ({"comm_resource_config.listen_port": "0"}, "range"),
    ],
)
def test_bad_global_resource_config(config: dict[str, object], needle: str) -> None:
    with pytest.raises(ArgumentError, match=needle):
        grc(config)


def test_global_resource_config_honours_connect_pool_and_warns_for_the_rest() -> None:
    opts = grc(
        {
            "connect_pool.thread_num": "3",
            "connect_pool.task_queue_capacity": 7,
            "comm_resource_config.protocol_desc": ["roce:device", "hccs:device"],
            "fabric_memory.max_capacity": "128",
            "local_comm_res_path": "/x.json",
            "no.such.key": "1",
        }
    )
    assert (opts.connect_threads, opts.connect_queue) == (3, 7)
    joined = "\n".join(opts.notes)
    for needle in [
        "hccs:device",
        "fabric_memory.max_capacity",
        "local_comm_res_path",
        "no.such.key",
    ]:
        assert needle in joined
    assert "roce:device" not in joined  # RoCE is what is used here
    assert len(opts.notes) == 4


@pytest.mark.parametrize(
    ("value", "want"),
    [("4:8", (4, 8)), (" 2:1 ", (2, 1)), ("0:0", None), ("16:64", (16, 64))],
)
def test_buffer_pool_values(value: str, want: tuple[int, int] | None) -> None:
    assert parse_options({compat.OPTION_BUFFER_POOL: value}).buffer_pool == want


@pytest.mark.parametrize("value", ["0:8", "4:0", "4:8:1", "4", "-1:8", "4:x", ""])
def test_bad_buffer_pool_values(value: str) -> None:
    with pytest.raises(ArgumentError, match="BufferPool"):
        parse_options({compat.OPTION_BUFFER_POOL: value})


def test_buffer_pool_default_is_hixls() -> None:
    assert parse_options({}).buffer_pool == (4, 8)  # "4:8": 4 buffers of 8 MiB


# ------------------------------------------------------------------ relay planning


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=30),
    st.integers(1, 4096),
)
def test_plan_relay_maps_every_byte_once_within_a_buffer(sizes: list[int], size: int) -> None:
    descs = []
    local, remote = 0x10000, 0x900000
    for n in sizes:
        descs.append((local, remote, n))
        local += n + 13  # gaps: descs are not contiguous
        remote += n + 7
    chunks = plan_relay(descs, size)
    covered: list[tuple[int, int]] = []
    for chunk in chunks:
        assert chunk, "no empty chunk"
        assert sum(p.nbytes for p in chunk) <= size
        offset = 0
        for p in chunk:  # packed back to back from the start of the buffer
            assert p.buf_off == offset and p.nbytes >= 1
            offset += p.nbytes
        covered.extend((p.local_addr, p.nbytes) for p in chunk)
    for chunk in chunks[:-1]:
        assert sum(p.nbytes for p in chunk) == size  # every chunk but the last is full
    # the pieces, in order, rebuild every desc exactly: same bytes, same local/remote pairing
    pieces = [p for chunk in chunks for p in chunk]
    i = 0
    for local_addr, remote_addr, n in descs:
        done = 0
        while done < n:
            p = pieces[i]
            assert (p.local_addr, p.remote_addr) == (local_addr + done, remote_addr + done)
            done += p.nbytes
            i += 1
        assert done == n
    assert i == len(pieces)


def test_plan_relay_packs_many_small_descs_in_one_buffer() -> None:
    descs = [(0x1000 + i * 0x100, 0x8000 + i * 0x40, 0x40) for i in range(64)]
    chunks = plan_relay(descs, 8 << 20)
    assert len(chunks) == 1 and len(chunks[0]) == 64
    with pytest.raises(ArgumentError):
        plan_relay(descs, 0)


# ------------------------------------------------------------------ notify envelopes


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.text(max_size=400))
def test_every_notify_within_hixls_limits_survives_the_engine(name: str, msg: str) -> None:
    raw_name, raw_msg = name.encode(errors="surrogateescape"), msg.encode(errors="surrogateescape")
    if len(raw_name) > 1024 or len(raw_msg) > 1024:
        return
    engine_name, body = encode_notify(raw_name, raw_msg)
    # what the engine sends and what its receiver parses back
    note = core_notify.decode("peer", core_notify.encode(engine_name, body))
    assert note is not None and (note.name, note.message) == (engine_name, body)
    if note.name == ENVELOPE_NAME:
        got = open_envelope(note.message)
    else:
        got = (note.name, note.message.decode("utf-8", "replace"))
    assert got == (raw_name.decode("utf-8", "replace"), raw_msg.decode("utf-8", "replace"))


def test_only_names_the_engine_cannot_carry_go_in_an_envelope() -> None:
    assert encode_notify(b"ready", b"block_0") == ("ready", b"block_0")
    assert encode_notify(b"n" * 1024, b"m" * 1024) == ("n" * 1024, b"m" * 1024)
    for name in [b"", b"\xff", b"a\nb", ENVELOPE_NAME.encode()]:
        engine_name, body = encode_notify(name, b"x")
        assert engine_name == ENVELOPE_NAME
        assert open_envelope(body) == (name.decode("utf-8", "replace"), "x")


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\x00", "shorter than its header"),
        (struct.pack("!HH", 2000, 0), "limit 1024"),
        (struct.pack("!HH", 0, 1025) + b"m" * 1025, "limit 1024"),
        (struct.pack("!HH", 3, 0) + b"ab", "header says"),
        (struct.pack("!HH", 1, 1) + b"abc", "header says"),
    ],
)
def test_malformed_envelopes_are_refused(raw: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        open_envelope(raw)


# ------------------------------------------------------------------ async connect pool


def wait_for(fn: Callable[[], object], want: object, timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return got


def test_connect_executor_status_sequence() -> None:
    acs = compat.AsyncConnectStatus
    ex = ConnectExecutor(threads=1, capacity=2)
    gate = threading.Event()

    def slow_ok() -> Status:
        assert gate.wait(10)
        return Status.SUCCESS

    try:
        assert ex.status("a") is acs.NOT_CONNECT and ex.statuses() == {}
        assert ex.submit("a", True, slow_ok) is SUCCESS
        assert wait_for(lambda: ex.status("a"), acs.CONNECTING) is acs.CONNECTING
        # the only worker is busy: b waits, pending
        assert ex.submit("b", True, lambda: Status.FAILED) is SUCCESS
        assert ex.status("b") is acs.CONNECT_PENDING
        assert ex.submit("c", True, lambda: Status.ALREADY_CONNECTED) is SUCCESS
        full = ex.submit("d", True, lambda: Status.SUCCESS)  # the queue holds 2
        assert full is compat.RESOURCE_EXHAUSTED
        gate.set()
        assert wait_for(lambda: ex.status("a"), acs.CONNECTED) is acs.CONNECTED
        assert wait_for(lambda: ex.status("b"), acs.CONNECT_FAILED) is acs.CONNECT_FAILED
        assert wait_for(lambda: ex.status("c"), acs.CONNECTED) is acs.CONNECTED
        gate.clear()
        assert ex.submit("a", False, slow_ok) is SUCCESS
        assert wait_for(lambda: ex.status("a"), acs.DISCONNECTING) is acs.DISCONNECTING
        gate.set()
        assert wait_for(lambda: ex.status("a"), acs.NOT_CONNECT) is acs.NOT_CONNECT
        assert ex.statuses() == {"b": acs.CONNECT_FAILED, "c": acs.CONNECTED}
    finally:
        gate.set()
        ex.shutdown(5)
    assert ex.submit("e", True, lambda: Status.SUCCESS) is FAILED


def test_connect_executor_shows_the_latest_request() -> None:
    acs = compat.AsyncConnectStatus
    ex = ConnectExecutor(threads=2, capacity=8)
    gate = threading.Event()

    def slow_ok() -> Status:
        assert gate.wait(10)
        return Status.SUCCESS

    try:
        ex.submit("x", True, slow_ok)
        assert wait_for(lambda: ex.status("x"), acs.CONNECTING) is acs.CONNECTING
        ex.submit("x", False, lambda: Status.SUCCESS)  # waits: one task per remote at a time
        assert ex.status("x") is acs.DISCONNECT_PENDING
        gate.set()
        # the connect's CONNECTED does not hide the disconnect asked for since
        assert wait_for(lambda: ex.status("x"), acs.NOT_CONNECT) is acs.NOT_CONNECT
    finally:
        gate.set()
        ex.shutdown(5)


def test_token_from_the_environment_when_the_options_give_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HIXL_TOKEN", "from-env")
    assert parse_options(None).token == "from-env"
    assert parse_options({}).token == "from-env"
    assert parse_options({"hixl.Token": "given"}).token == "given"
    monkeypatch.delenv("HIXL_TOKEN")
    assert parse_options({}).token is None
