"""Tests for hixl.core.wire: frames, message values and the sans-I/O decoder.

The handshake's order and proofs are tested in test_handshake.py.

Everything a peer sends is untrusted: the fuzz tests state that whatever bytes arrive, only
HandshakeError escapes the decoder, and that it never holds more than one frame's worth.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from wire_strategies import (
    FUZZ,
    JSON_TYPES,
    ROUND_TRIP,
    chunked,
    engine_ids,
    feed_all,
    frame,
    json_frame,
    messages,
    only_handshake_errors,
    remote_regions,
    sample,
    sample_json,
)

from hixl.core import wire
from hixl.core.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    MAX_REGIONS,
    PROTOCOL_VERSION,
    REMOTE_READ,
    REMOTE_WRITE,
    Accept,
    Bye,
    Challenge,
    Decoder,
    Error,
    ErrorCode,
    Hello,
    Info,
    Message,
    MsgType,
    Ping,
    Pong,
    Ready,
    Regions,
    RemoteRegion,
    decode,
    encode,
    expect,
    make_nonce,
    parse_engine_id,
    region_size,
)
from hixl.errors import HandshakeError, PeerError

# --------------------------------------------------------------------------- round trips


@ROUND_TRIP
@given(st.lists(messages, min_size=1, max_size=5), st.lists(st.integers(0, 1 << 20), max_size=8))
def test_round_trip_in_any_chunking(msgs: list[Message], cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in msgs)
    decoder = Decoder()
    assert feed_all(decoder, chunked(stream, cuts)) == msgs
    assert decoder.buffered == 0
    decoder.eof()


@ROUND_TRIP
@given(messages)
def test_round_trip_byte_by_byte_and_decode(msg: Message) -> None:
    data = encode(msg)
    assert data[:4] == MAGIC
    assert HEADER.unpack(data[:HEADER_SIZE]) == (
        MAGIC,
        PROTOCOL_VERSION,
        msg.TYPE,
        len(data) - HEADER_SIZE,
    )
    assert decode(data) == msg
    decoder = Decoder()
    out: list[Message] = []
    for i in range(len(data)):
        out += decoder.feed(data[i : i + 1])
    assert out == [msg]
    assert type(out[0]) is type(msg)


@pytest.mark.parametrize("msg_type", list(MsgType))
def test_every_type_has_a_sample_that_round_trips(msg_type: MsgType) -> None:
    msg = sample(msg_type)
    assert msg.TYPE is msg_type
    assert decode(bytearray(encode(msg))) == msg
    assert decode(memoryview(encode(msg))) == msg


def test_payload_is_compact_json_with_lowercase_hex() -> None:
    data = encode(Hello(engine_id="h:1", nonce=bytes(range(0xF0, 0x100))))
    assert data[HEADER_SIZE:] == b'{"engine_id":"h:1","nonce":"f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"}'
    assert encode(Ready())[HEADER_SIZE:] == b"{}"


def test_info_and_accept_are_distinct_messages() -> None:
    info, accept = sample(MsgType.INFO), sample(MsgType.ACCEPT)
    assert info != accept
    assert not isinstance(accept, Info)
    assert isinstance(decode(encode(accept)), Accept)


def test_error_code_is_the_enum() -> None:
    msg = decode(encode(Error(code="AUTH", message="bad proof\nclosing")))
    assert isinstance(msg, Error)
    assert msg.code is ErrorCode.AUTH
    assert msg.code == "AUTH"


# --------------------------------------------------------------------------- value checks


def test_messages_are_frozen_slotted_keyword_only() -> None:
    msg = Hello(engine_id="10.0.0.1:5000", nonce=bytes(16))
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.engine_id = "x:1"  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    with pytest.raises(TypeError):
        Hello("h:1", bytes(16))  # type: ignore[call-arg]
    region = RemoteRegion(addr=1, length=2, rkey=3, access=REMOTE_WRITE)
    assert not hasattr(region, "__dict__")
    assert region.end == 3


def test_bytes_and_lists_are_normalized() -> None:
    region = RemoteRegion(addr=0, length=1, rkey=1, access=REMOTE_READ)
    msg = Regions(add=[region], remove=[])  # type: ignore[arg-type]
    assert msg.add == (region,) and msg.remove == ()
    hello = Hello(engine_id="h:1", nonce=bytearray(16))  # type: ignore[arg-type]
    assert type(hello.nonce) is bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(addr=-1, length=1, rkey=0, access=2), r"addr=-1 out of range"),
        (dict(addr=1 << 64, length=1, rkey=0, access=2), r"addr=18446744073709551616"),
        (dict(addr=0, length=0, rkey=0, access=2), r"length=0 out of range"),
        (dict(addr=(1 << 64) - 1, length=2, rkey=0, access=2), r"ends past 2\*\*64.*length=2"),
        (dict(addr=0, length=1, rkey=1 << 32, access=2), r"rkey=4294967296"),
        (dict(addr=0, length=1, rkey=0, access=0), r"access=0x0"),
        (dict(addr=0, length=1, rkey=0, access=1), r"access=0x1"),
        (dict(addr=0, length=1, rkey=0, access=2 | 8), r"access=0xa"),
        (dict(addr=True, length=1, rkey=0, access=2), r"addr must be an integer, got bool"),
        (dict(addr=0, length=1.0, rkey=0, access=2), r"length must be an integer, got float"),
        (dict(addr=0, length=1, rkey=0, access=2, name="x" * 129), r"129 characters"),
        (dict(addr=0, length=1, rkey=0, access=2, name="a\nb"), r"unprintable.*index 1"),
        (dict(addr=0, length=1, rkey=0, access=2, name="\ud800"), r"unprintable"),
    ],
)
def test_remote_region_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(HandshakeError, match=match):
        RemoteRegion(**kwargs)


def test_remote_region_edges() -> None:
    top = RemoteRegion(addr=(1 << 64) - 1, length=1, rkey=(1 << 32) - 1, access=6, name="x" * 128)
    assert top.end == 1 << 64
    assert RemoteRegion(addr=0, length=(1 << 64) - 1, rkey=0, access=4).length == (1 << 64) - 1


def _info(**changes: object) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        proof=b"", qpn=1, psn=0, gid=bytes(16), mtu=4096, max_sge=1, recv_slots=0,
        recv_slot_size=0, regions=(),
    )  # fmt: skip
    base.update(changes)
    return base


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(qpn=0), r"Info.qpn=0 out of range \[1, 16777215\]"),
        (dict(qpn=1 << 24), r"qpn=16777216"),
        (dict(psn=-1), r"psn=-1"),
        (dict(gid=bytes(15)), r"gid must be 16 bytes long, got 15"),
        (dict(proof=bytes(31)), r"proof must be 0 or 32 bytes long, got 31"),
        (dict(mtu=1000), r"mtu=1000 must be one of 256, 512, 1024, 2048, 4096"),
        (dict(mtu=8192), r"mtu=8192"),
        (dict(max_sge=0), r"max_sge=0"),
        (dict(max_sge=1025), r"max_sge=1025"),
        (dict(recv_slots=65537), r"recv_slots=65537"),
        (dict(recv_slot_size=65537), r"recv_slot_size=65537"),
        (dict(recv_slots=False), r"recv_slots must be an integer, got bool"),
        (dict(gid="00" * 16), r"gid must be bytes, got str"),
        (dict(regions=("x",)), r"regions\[0\] must be a RemoteRegion, got str"),
        (dict(regions={}), r"regions must be a tuple"),
        (dict(lanes=bytes(5)), r"Info.lanes has 5 bytes, not a multiple of 6"),
        (dict(lanes=bytes(6)), r"Info.lanes\[0\] has QP number 0"),
        (dict(lanes=b"\0\0\1\0\0\0" * 8), r"Info.lanes has 48 bytes, at most 42"),
        (dict(lanes="00"), r"Info.lanes must be bytes, got str"),
        (dict(direct=1), r"Info.direct=1 needs an extra queue pair"),
        (dict(direct=2, lanes=b"\0\0\1\0\0\0"), r"Info.direct=2 out of range \[0, 1\]"),
        (dict(direct=True, lanes=b"\0\0\1\0\0\0"), r"Info.direct must be an integer, got bool"),
    ],
)
def test_info_rejects(changes: dict[str, object], match: str) -> None:
    with pytest.raises(HandshakeError, match=match):
        Info(**_info(**changes))


@given(
    st.lists(st.tuples(st.integers(1, (1 << 24) - 1), st.integers(0, (1 << 24) - 1)), max_size=7)
)
def test_lanes_round_trip(pairs: list[tuple[int, int]]) -> None:
    info = Info(**_info(lanes=wire.pack_lanes(pairs)))
    got = wire.decode(wire.encode(info))
    assert isinstance(got, Info) and got.extra_lanes() == tuple(pairs)
    assert got.ordinary_lanes() == ((info.qpn, info.psn), *pairs) and got.direct_lane() is None


@given(
    st.lists(
        st.tuples(st.integers(1, (1 << 24) - 1), st.integers(0, (1 << 24) - 1)),
        min_size=1,
        max_size=7,
    )
)
def test_a_direct_lane_is_the_last_extra_one_and_not_an_ordinary_lane(
    pairs: list[tuple[int, int]],
) -> None:
    info = Info(**_info(lanes=wire.pack_lanes(pairs), direct=1))
    got = wire.decode(wire.encode(info))
    assert isinstance(got, Info) and got.direct == 1
    assert got.direct_lane() == pairs[-1]
    assert got.ordinary_lanes() == ((info.qpn, info.psn), *pairs[:-1])


def test_regions_limits() -> None:
    a = RemoteRegion(addr=0x1000, length=8, rkey=5, access=2)
    b = RemoteRegion(addr=0x1000, length=16, rkey=5, access=4, name="other")
    with pytest.raises(HandshakeError, match=r"add\[1\] repeats .*add\[0\]: rkey=0x5"):
        Regions(add=(a, b))
    with pytest.raises(HandshakeError, match=r"Regions.remove\[1\] repeats"):
        Regions(remove=(a, b))
    # same addr under another rkey, or the same rkey at another addr, is fine
    Regions(add=(a, RemoteRegion(addr=0x1000, length=8, rkey=6, access=2)))
    Regions(add=(a,), remove=(a,))  # gone and back: remove applies first
    many = tuple(RemoteRegion(addr=i, length=1, rkey=i, access=2) for i in range(MAX_REGIONS + 1))
    assert len(Regions(add=many[:MAX_REGIONS]).add) == MAX_REGIONS
    with pytest.raises(HandshakeError, match=r"4097 regions, at most 4096"):
        Regions(add=many)
    # the largest region list still fits one frame
    assert decode(encode(Regions(add=many[:MAX_REGIONS]))) == Regions(add=many[:MAX_REGIONS])


@given(remote_regions())
def test_region_size_is_what_a_region_adds_to_a_message(region: RemoteRegion) -> None:
    one = len(encode(Regions(add=(region,))))
    two = len(encode(Regions(add=(region, dataclasses.replace(region, rkey=region.rkey ^ 1)))))
    assert two - one == region_size(region)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Hello(engine_id="h:1", nonce=bytes(15)), r"Hello.nonce must be 16 bytes"),
        (lambda: Hello(engine_id="h", nonce=bytes(16)), r"Hello.engine_id: .*no ':port'"),
        (
            lambda: Hello(engine_id=5, nonce=bytes(16)),  # type: ignore[arg-type]
            r"engine_id must be a str, got int",
        ),
        (lambda: Challenge(engine_id="h:1", nonce=bytes(15)), r"Challenge.nonce must be 16"),
        (
            lambda: Error(code="NOPE", message=""),
            r"Error.code='NOPE' must be one of ALREADY_CONNECTED, AUTH",
        ),
        (
            lambda: Error(code=1, message=""),  # type: ignore[arg-type]
            r"Error.code=1",
        ),
        (lambda: Error(code="AUTH", message="x" * 4097), r"4097 characters"),
        (lambda: Error(code="AUTH", message="\x1b[31m"), r"unprintable character '\\x1b'"),
        (lambda: Bye(reason="x" * 1025), r"Bye.reason has 1025 characters"),
        (lambda: Ping(nonce=bytes(8)), r"Ping.nonce must be 16 bytes long, got 8"),
        (lambda: Pong(nonce=b""), r"Pong.nonce must be 16 bytes long, got 0"),
    ],
)
def test_message_values_reject(build: Any, match: str) -> None:
    with pytest.raises(HandshakeError, match=match):
        build()


def test_handshake_error_is_a_peer_and_connection_error() -> None:
    with pytest.raises(HandshakeError) as info:
        Decoder().feed(b"NOPE")
    assert isinstance(info.value, PeerError)
    assert isinstance(info.value, ConnectionError)


# --------------------------------------------------------------------------- engine ids


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:5000", ("10.0.0.1", 5000)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("localhost:65535", ("localhost", 65535)),
        ("node-1.cluster.local:80~deadbeef", ("node-1.cluster.local", 80)),
        ("h:0~0123456789abcdef", ("h", 0)),
        ("h:0~ABC", ("h", 0)),
        ("[::1]:9", ("::1", 9)),
        ("[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
        ("[2001:db8::8a2e:370:7334]:443~1", ("2001:db8::8a2e:370:7334", 443)),
        ("a" * 63 + ".b:1", ("a" * 63 + ".b", 1)),
    ],
)
def test_parse_engine_id_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_engine_id(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("host", r"no ':port'"),
        (":80", r"empty host"),
        ("h:", r"port ''"),
        ("h:65536", r"port 65536 out of range"),
        ("h:080", r"leading zeros"),
        ("h:-1", r"port '-1'"),
        ("h:+1", r"port '\+1'"),
        ("h: 1", r"port ' 1'"),
        ("h:1_0", r"port '1_0'"),
        ("h:\u0661", r"port"),
        ("h:1~", r"port '1~'"),
        ("h:1~xyz", r"port '1~xyz'"),
        ("h:1~12345678901234567", r"port"),
        ("::1:80", r"must be written in brackets"),
        ("[::1:80", r"not a port|closing"),
        ("[::1]80", r"not a port|no ':port'|closing"),
        ("[::g]:80", r"'::g' is not an IPv6 address"),
        ("[1.2.3.4]:80", r"not an IPv6 address"),
        ("[::1%]:80", r"bad IPv6 scope"),
        ("[::1%a b]:80", r"bad IPv6 scope"),
        ("1.2.3:80", r"'1.2.3' is not an IPv4 address"),
        ("256.1.1.1:80", r"not an IPv4 address"),
        ("01.1.1.1:80", r"not an IPv4 address"),
        ("123:80", r"not an IPv4 address"),
        ("-h:80", r"label '-h'"),
        ("h-:80", r"label 'h-'"),
        ("a..b:80", r"label ''"),
        ("a.:80", r"label ''"),
        ("under_score:80", r"label 'under_score'"),
        ("h\u00e9:80", r"label"),
        ("a" * 64 + ":80", r"label"),
        (".".join(["a" * 60] * 5) + ":1", r"hostname has 304 characters, at most 253"),
        ("x" * 400 + ":1", r"402 characters, at most 320"),
        ("h\n:80", r"label"),
    ],
)
def test_parse_engine_id_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_engine_id(text)


def test_parse_engine_id_refuses_non_str() -> None:
    with pytest.raises(ValueError, match="must be a str, got bytes"):
        parse_engine_id(b"h:1")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(engine_ids)
def test_generated_engine_ids_parse(text: str) -> None:
    host, port = parse_engine_id(text)
    assert 0 <= port <= 65535
    assert host.strip("[]") in text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_parse_engine_id_raises_only_value_error(text: str) -> None:
    try:
        host, port = parse_engine_id(text)
    except ValueError:
        return
    assert text.isascii() and 0 <= port <= 65535 and host


# --------------------------------------------------------------------------- frame errors


def test_bad_magic_fails_on_the_first_byte() -> None:
    decoder = Decoder()
    with pytest.raises(HandshakeError, match=r"bad frame magic b'G', expected b'HIXL'"):
        decoder.feed(b"G")
    assert decoder.error_code is ErrorCode.MALFORMED
    with pytest.raises(HandshakeError, match=r"bad frame magic b'GET ', expected b'HIXL'"):
        Decoder().feed(b"GET / HTTP/1.1\r\n")


def test_version_mismatch_names_both_versions() -> None:
    decoder = Decoder()
    ours = wire.PROTOCOL_VERSION
    other = ours + 1
    with pytest.raises(
        HandshakeError, match=rf"unsupported protocol version {other}: .*speaks version {ours}"
    ):
        decoder.feed(frame(MsgType.HELLO, b"{}", version=other)[:6])
    assert decoder.error_code is ErrorCode.VERSION
    with pytest.raises(HandshakeError, match=f"earlier error.*version {other}"):
        decoder.feed(b"")


@pytest.mark.parametrize("raw_type", [0, 14, 0xFFFF])
def test_unknown_type(raw_type: int) -> None:
    with pytest.raises(
        HandshakeError,
        match=rf"unknown message type {raw_type} \(known: 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13\)",
    ):
        Decoder().feed(frame(raw_type, b"{}"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 16), st.integers(1, (1 << 32) - 1))
def test_oversized_length_is_refused_from_the_header(max_payload: int, excess: int) -> None:
    max_payload += 2
    length = min(max_payload + excess, (1 << 32) - 1)
    assume(length > max_payload)
    decoder = Decoder(max_payload=max_payload)
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.BYE, length)
    with pytest.raises(HandshakeError, match=rf"{length}-byte payload.*max_payload={max_payload}"):
        decoder.feed(header)  # refused before a single payload byte arrives
    assert decoder.buffered == 0


def test_payload_of_exactly_max_payload_is_accepted() -> None:
    msg = Bye(reason="n" * 100)
    data = encode(msg)
    size = len(data) - HEADER_SIZE
    assert Decoder(max_payload=size).feed(data) == [msg]
    with pytest.raises(
        HandshakeError, match=f"{size}-byte payload, more than max_payload={size - 1}"
    ):
        Decoder(max_payload=size - 1).feed(data)


def test_decoder_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="max_payload=1 out of range"):
        Decoder(max_payload=1)
    with pytest.raises(ValueError, match="out of range"):
        Decoder(max_payload=1 << 32)
    with pytest.raises(TypeError):
        Decoder(max_payload=True)
    assert Decoder().max_payload == MAX_PAYLOAD


def test_encode_refuses_a_payload_the_peer_would_refuse() -> None:
    names = "\U0001f600" * 128  # 512 UTF-8 bytes per name
    regions = tuple(
        RemoteRegion(addr=i << 20, length=1 << 20, rkey=i, access=6, name=names)
        for i in range(MAX_REGIONS)
    )
    with pytest.raises(HandshakeError, match=r"REGIONS payload of \d+ bytes exceeds max_payload"):
        encode(Regions(add=regions))
    with pytest.raises(HandshakeError, match=r"HELLO payload of \d+ bytes exceeds max_payload=10"):
        encode(sample(MsgType.HELLO), max_payload=10)
    with pytest.raises(TypeError, match="got dict"):
        encode({})  # type: ignore[arg-type]


def test_eof_inside_a_frame() -> None:
    data = encode(sample(MsgType.INFO))
    decoder = Decoder()
    assert decoder.feed(data[:5]) == []
    with pytest.raises(HandshakeError, match=r"inside a frame header: got 5 of 12 bytes"):
        decoder.eof()
    assert decoder.error_code is ErrorCode.MALFORMED
    with pytest.raises(HandshakeError, match="earlier error.*inside a frame header"):
        decoder.feed(data[5:])
    decoder = Decoder()
    assert decoder.feed(data[:-1]) == []
    body = len(data) - HEADER_SIZE
    with pytest.raises(HandshakeError, match=rf"inside a INFO frame: got {body - 1} of {body}"):
        decoder.eof()


def test_decode_wants_exactly_one_frame() -> None:
    data = encode(Ready())
    with pytest.raises(HandshakeError, match="exactly one frame, got 2"):
        decode(data + data)
    with pytest.raises(HandshakeError, match="inside a frame header"):
        decode(data + data[:3])
    with pytest.raises(HandshakeError, match="exactly one frame, got 0"):
        decode(b"")


def test_messages_before_a_bad_frame_are_dropped_with_the_error() -> None:
    decoder = Decoder()
    with pytest.raises(HandshakeError):
        decoder.feed(encode(Ready()) + b"XXXX")
    with pytest.raises(HandshakeError, match="earlier error"):
        decoder.feed(encode(Ready()))
    assert "poisoned" in repr(decoder)


# --------------------------------------------------------------------------- payload errors


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", r"not valid JSON"),
        (b"\xff\xfe{}", r"not UTF-8"),
        (b'{"reason":"\xc3"}', r"not UTF-8"),
        (b"\xef\xbb\xbf{}", r"not valid JSON"),
        (b"[]", r"must be a JSON object, got list"),
        (b'"x"', r"must be a JSON object, got str"),
        (b"null", r"got NoneType"),
        (b"{", r"not valid JSON"),
        (b'{"reason":"a"} {}', r"not valid JSON"),
        (b'{"reason":"a","reason":"b"}', r"key 'reason' appears twice"),
        (b'{"reason":NaN}', r"constant NaN"),
        (b'{"reason":-Infinity}', r"constant -Infinity"),
        (b"[" * 100_000 + b"]" * 100_000, r"nests JSON too deeply|not valid JSON"),
        (b'{"reason":' + b"1" * 100_000 + b"}", r"integer literal of 100000 characters"),
        (b"{}", r"BYE: missing keys \['reason'\]"),
        (b'{"reason":"a","x":1}', r"unexpected keys \['x'\]"),
        (b'{"reason":1}', r"BYE.reason must be a JSON string, got int 1"),
        (b'{"reason":["a"]}', r"BYE.reason must be a JSON string, got list"),
        (b'{"reason":"\\u0000"}', r"invalid BYE message: Bye.reason has the unprintable"),
        (b'{"reason":"\\ud800"}', r"unprintable character '\\ud800'"),
    ],
)
def test_bad_bye_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(HandshakeError, match=match):
        Decoder().feed(frame(MsgType.BYE, payload))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("qpn", True, r"INFO.qpn must be a JSON integer, got bool True"),
        ("qpn", 1.0, r"INFO.qpn must be a JSON integer, got float 1.0"),
        ("qpn", "17", r"INFO.qpn must be a JSON integer, got str '17'"),
        ("qpn", None, r"INFO.qpn must be a JSON integer, got NoneType"),
        ("qpn", 0, r"invalid INFO message: Info.qpn=0 out of range"),
        ("psn", 1 << 24, r"Info.psn=16777216 out of range"),
        ("mtu", 1e300, r"INFO.mtu must be a JSON integer, got float 1e\+300"),
        ("mtu", 1e999, r"INFO payload is not valid JSON: .*constant Infinity"),
        ("mtu", -(10**20), r"Info.mtu=-100000000000000000000"),
        ("gid", "00" * 15, r"Info.gid must be 16 bytes long, got 15"),
        ("gid", "0" * 31, r"INFO.gid must be an even number of lowercase hex digits"),
        ("gid", "AB" * 16, r"lowercase hex"),
        ("gid", " " + "00" * 16, r"lowercase hex"),
        ("gid", "0x" + "00" * 15, r"lowercase hex"),
        ("gid", {"a": 1}, r"INFO.gid must be a JSON string, got dict"),
        ("proof", "00", r"Info.proof must be 0 or 32 bytes long, got 1"),
        ("regions", {}, r"INFO.regions must be a JSON array, got dict"),
        ("regions", [1], r"INFO.regions\[0\] must be a JSON object, got int 1"),
        ("regions", [{}], r"INFO.regions\[0\]: missing keys \['addr', 'length'"),
        ("regions", [[]], r"INFO.regions\[0\] must be a JSON object, got list"),
    ],
)
def test_bad_info_fields(field: str, value: object, match: str) -> None:
    obj = sample_json(MsgType.INFO)
    obj[field] = value
    with pytest.raises(HandshakeError, match=match):
        Decoder().feed(json_frame(MsgType.INFO, obj))


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("addr", -1, r"INFO.regions\[0\]: RemoteRegion.addr=-1 out of range"),
        ("addr", False, r"INFO.regions\[0\].addr must be a JSON integer, got bool"),
        ("length", 0, r"RemoteRegion.length=0"),
        ("length", 1 << 64, r"RemoteRegion.length=18446744073709551616"),
        ("rkey", 1 << 32, r"rkey=4294967296"),
        ("access", 1, r"access=0x1"),
        ("access", 7, r"access=0x7"),
        ("name", 5, r"INFO.regions\[0\].name must be a JSON string, got int"),
        ("name", "x" * 129, r"RemoteRegion.name has 129 characters"),
    ],
)
def test_bad_region_fields(key: str, value: object, match: str) -> None:
    obj = sample_json(MsgType.INFO)
    obj["regions"][0][key] = value
    with pytest.raises(HandshakeError, match=match):
        Decoder().feed(json_frame(MsgType.INFO, obj))


def test_region_keys_are_exact() -> None:
    obj = sample_json(MsgType.REGIONS)
    obj["add"][0]["extra"] = 1
    with pytest.raises(HandshakeError, match=r"REGIONS.add\[0\]: unexpected keys \['extra'\]"):
        Decoder().feed(json_frame(MsgType.REGIONS, obj))
    obj = sample_json(MsgType.REGIONS)
    obj["add"] = obj["add"] * 2
    with pytest.raises(HandshakeError, match=r"invalid REGIONS message: .*repeats"):
        Decoder().feed(json_frame(MsgType.REGIONS, obj))
    obj["remove"] = [obj["add"][0]] * (MAX_REGIONS + 1)
    with pytest.raises(HandshakeError, match=r"REGIONS.remove has 4097 regions"):
        Decoder().feed(json_frame(MsgType.REGIONS, obj))


@pytest.mark.parametrize(
    ("msg_type", "field", "value", "match"),
    [
        (MsgType.HELLO, "engine_id", "no-port", r"Hello.engine_id: engine id 'no-port'"),
        (MsgType.HELLO, "engine_id", "[::1]:1\n", r"Hello.engine_id"),
        (MsgType.HELLO, "nonce", "", r"Hello.nonce must be 16 bytes long, got 0"),
        (MsgType.CHALLENGE, "engine_id", "x" * 10_000, r"10000 characters, at most 320"),
        (MsgType.ERROR, "code", "auth", r"Error.code='auth'"),
        (MsgType.ERROR, "code", None, r"ERROR.code must be a JSON string"),
        (MsgType.PING, "nonce", "00" * 17, r"Ping.nonce must be 16 bytes long, got 17"),
        (MsgType.REGIONS, "add", {}, r"REGIONS.add must be a JSON array"),
        (MsgType.READY, "x", 1, r"READY: unexpected keys \['x'\]"),
    ],
)
def test_bad_fields_of_other_messages(
    msg_type: MsgType, field: str, value: object, match: str
) -> None:
    obj = sample_json(msg_type)
    obj[field] = value
    with pytest.raises(HandshakeError, match=match):
        Decoder().feed(json_frame(msg_type, obj))


def test_huge_extra_key_list_is_shown_truncated() -> None:
    obj = sample_json(MsgType.BYE)
    obj.update({f"k{i}": i for i in range(10_000)})
    with pytest.raises(HandshakeError) as info:
        Decoder().feed(json_frame(MsgType.BYE, obj))
    assert len(str(info.value)) < 400


# --------------------------------------------------------------------------- fuzzing

json_junk = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=512), st.lists(st.integers(0, 1024), max_size=6))
def test_fuzz_random_bytes(data: bytes, cuts: list[int]) -> None:
    only_handshake_errors(Decoder(), chunked(data, cuts))


@FUZZ
@given(
    st.sampled_from(list(MsgType)) | st.integers(0, 0xFFFF),
    st.binary(max_size=256),
    st.lists(st.integers(0, 512), max_size=4),
)
def test_fuzz_valid_header_random_payload(raw_type: int, payload: bytes, cuts: list[int]) -> None:
    only_handshake_errors(Decoder(), chunked(frame(raw_type, payload), cuts))


@FUZZ
@given(messages, st.data())
def test_fuzz_truncated_frames(msg: Message, data: st.DataObject) -> None:
    raw = encode(msg)
    cut = data.draw(st.integers(0, len(raw) - 1))
    decoder = Decoder()
    assert decoder.feed(raw[:cut]) == []
    if cut:
        with pytest.raises(HandshakeError, match="connection closed inside"):
            decoder.eof()


@FUZZ
@given(messages, st.data())
def test_fuzz_bit_flips(msg: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    flips = data.draw(st.lists(st.integers(0, len(raw) * 8 - 1), min_size=1, max_size=3))
    for bit in flips:
        raw[bit // 8] ^= 1 << (bit % 8)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=3))
    for out in only_handshake_errors(Decoder(), chunked(bytes(raw), cuts)):
        # anything that still decodes is a valid value and re-encodes to a frame
        assert decode(encode(out)) == out


@FUZZ
@given(st.sampled_from(JSON_TYPES), json_junk)
def test_fuzz_json_junk_payload(msg_type: MsgType, junk: object) -> None:
    only_handshake_errors(Decoder(), [json_frame(msg_type, junk)])


@FUZZ
@given(st.sampled_from(JSON_TYPES), st.data())
def test_fuzz_json_field_replaced_added_or_removed(msg_type: MsgType, data: st.DataObject) -> None:
    obj = sample_json(msg_type)
    action = data.draw(st.sampled_from(["replace", "add", "remove", "region"]))
    keys = sorted(obj)
    if action == "replace" and keys:
        obj[data.draw(st.sampled_from(keys))] = data.draw(json_junk)
    elif action == "remove" and keys:
        del obj[data.draw(st.sampled_from(keys))]
    elif action == "region" and ("regions" in obj or "add" in obj):
        region = (obj["regions"] if "regions" in obj else obj["add"])[0]
        region[data.draw(st.sampled_from(sorted(region)))] = data.draw(json_junk)
    else:
        obj[data.draw(st.text(max_size=8).filter(lambda k: k not in obj))] = data.draw(json_junk)
    only_handshake_errors(Decoder(), [json_frame(msg_type, obj)])


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 4096), st.lists(messages, min_size=1, max_size=4), st.data())
def test_fuzz_small_max_payload_bounds_the_buffer(
    max_payload: int, msgs: list[Message], data: st.DataObject
) -> None:
    stream = b"".join(encode(m) for m in msgs)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    decoder = Decoder(max_payload=max_payload)
    out = only_handshake_errors(decoder, chunked(stream, cuts))
    assert out in ([], msgs)
    assert decoder.buffered <= HEADER_SIZE + max_payload


def test_one_big_feed_of_many_frames_never_buffers_more_than_one() -> None:
    msg = Bye(reason="n" * 1024)
    decoder = Decoder(max_payload=len(encode(msg)) - HEADER_SIZE)
    stream = encode(msg) * 200 + encode(msg)[:100]
    assert decoder.feed(stream) == [msg] * 200
    assert decoder.buffered == 100 - HEADER_SIZE


# --------------------------------------------------------------------------- expect


def test_expect() -> None:
    hello = sample(MsgType.HELLO)
    assert expect(hello, Hello) is hello
    with pytest.raises(HandshakeError, match="expected a CHALLENGE message, got HELLO"):
        expect(hello, Challenge)
    with pytest.raises(HandshakeError, match="expected a ACCEPT message, got INFO"):
        expect(sample(MsgType.INFO), Accept)
    with pytest.raises(HandshakeError, match=r"peer sent ERROR AUTH: 'bad proof' while ACCEPT"):
        expect(Error(code="AUTH", message="bad proof"), Accept)
    err = Error(code="BUSY", message="")
    assert expect(err, Error) is err


# --------------------------------------------------------------------------- nonces


def test_make_nonce() -> None:
    nonces = {make_nonce() for _ in range(100)}
    assert len(nonces) == 100
    assert all(type(n) is bytes and len(n) == 16 for n in nonces)


def test_notify_frames_of_version_1_are_refused_as_unknown() -> None:
    body = json.dumps({"name": "n", "message": "00"}).encode()
    with pytest.raises(HandshakeError, match=r"unknown message type 9 \(NOTIFY .* retired\)"):
        Decoder().feed(frame(9, body))


# --------------------------------------------------------------------------- purity


ROOT = Path(__file__).resolve().parents[2]
# The package root imports the engine (sockets, pyverbs); the wire module must not need it,
# so the probe loads hixl.core.wire through a bare package object.
PURITY_PROBE = f"""
import sys, types
for name in ("pyverbs", "socket", "select", "selectors", "time", "threading", "subprocess"):
    sys.modules[name] = None
pkg = types.ModuleType("hixl")
pkg.__path__ = [{str(ROOT / "hixl")!r}]
sys.modules["hixl"] = pkg
import hixl.core.wire as w
msg = w.Hello(engine_id="10.0.0.1:0~ab", nonce=w.make_nonce())
assert w.decode(w.encode(msg)) == msg
assert sys.modules["socket"] is None and sys.modules["pyverbs"] is None
print("wire-ok")
"""


def test_imports_without_pyverbs_or_sockets() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PURITY_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "wire-ok"


def test_struct_header_layout() -> None:
    assert HEADER.format == "!4sHHI"
    assert HEADER_SIZE == struct.calcsize("!4sHHI") == 12
