"""hixl.compat without a device: status codes, option parsing, engine ids, desc grouping.

The RDMA behaviour (transfers, links, notifications) is tested on rxe in
``tests/rdma/test_compat.py``; here only what needs no verbs device.
"""

from __future__ import annotations

import subprocess
import sys
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
    status_of,
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
        (compat._Refusal(Status.NOT_CONNECTED, "x"), Status.NOT_CONNECTED),
        (compat._Refusal(Status.ALREADY_CONNECTED, "x"), Status.ALREADY_CONNECTED),
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
            compat.OPTION_DEVICE_MEM_AS_HOST: "1",
            compat.OPTION_ASYNC_TRANSFER_TIMEOUT: "2500",
        }
    )
    assert opts.auto_connect and opts.device_mem_as_host
    assert (opts.token, opts.alignment, opts.device, opts.async_timeout_ms) == (
        "s3cret",
        64,
        "rxe0",
        2500,
    )
    assert opts.ignored == () and opts.unknown == ()
    assert parse_options({compat.OPTION_ALIGNMENT: "0"}).alignment is None


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
    assert set(opts.ignored) == {
        "BufferPool",
        "RdmaTrafficClass",
        "RdmaServiceLevel",
        "GlobalResourceConfig",
        "LocalCommRes",
    }
    assert parse_options({"EnableUseFabricMem": "0"}).ignored == ("EnableUseFabricMem",)


def test_adxl_prefix_and_unknown_keys() -> None:
    assert parse_options({"adxl.BufferPool": "0:0"}).buffer_pool == (0, 0)
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
        ({"BufferPool": "4:8", "EnableUseFabricMem": "0"}, "together"),
        ({"AutoConnect": 1}, "str to str"),
    ],
)
def test_bad_options_are_param_invalid(options: dict[str, str], needle: str) -> None:
    with pytest.raises(ArgumentError, match=needle) as info:
        parse_options(options)
    assert status_of(info.value) is Status.PARAM_INVALID


def test_fabric_mem_is_unsupported() -> None:
    with pytest.raises(compat._Refusal) as info:
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
        (TransferOpDesc(-1, 0x90000, 8), "64-bit"),
        (TransferOpDesc((1 << 64) - 4, 0x90000, 8), "64-bit"),
        (TransferOpDesc(0x10000, 0x90000, True), "must be an int"),
        (TransferOpDesc(0x10000, 589824.0, 8), "must be an int"),  # type: ignore[arg-type]
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


def test_check_notify_limits() -> None:
    assert check_notify(NotifyDesc("ready", "block_0")) == ("ready", b"block_0")
    assert check_notify(NotifyDesc("n" * 256, "m" * 700))[0] == "n" * 256
    for bad in [
        NotifyDesc("", "x"),  # the engine needs a name
        NotifyDesc("n" * 257, ""),  # longer than the engine carries
        NotifyDesc("n", "m" * 1025),  # longer than hixl allows
        NotifyDesc("n", "m" * 1023),  # name + NUL + message over 1024 bytes
        NotifyDesc("n", "\u00e9" * 600),  # 1200 bytes in UTF-8
        NotifyDesc("a\0b", ""),
        ("name", "msg"),
    ]:
        with pytest.raises(ArgumentError):
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
