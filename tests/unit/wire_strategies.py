"""Hypothesis strategies, samples and frame helpers shared by the wire tests."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hixl.core import wire
from hixl.core.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    REMOTE_READ,
    REMOTE_WRITE,
    Accept,
    Bye,
    Challenge,
    Credit,
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
    Sealed,
    encode,
)
from hixl.errors import HandshakeError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- strategies

# str.isprintable() is false for exactly these categories (plus every space but " ").
_UNPRINTABLE: Any = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
printable_chars = st.characters(exclude_categories=_UNPRINTABLE) | st.just(" ")


def printable(min_size: int = 0, max_size: int = 16) -> st.SearchStrategy[str]:
    return st.text(printable_chars, min_size=min_size, max_size=max_size)


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
hostnames = (
    st.lists(labels, min_size=1, max_size=4)
    .map(".".join)
    .filter(lambda h: not all(c in "0123456789." for c in h))
)
hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
    hostnames,
)
suffixes = st.one_of(st.just(""), st.from_regex(r"~[0-9a-f]{1,16}", fullmatch=True))
engine_ids = st.builds(lambda h, p, s: f"{h}:{p}{s}", hosts, st.integers(0, 65535), suffixes)

u24 = st.integers(0, (1 << 24) - 1)
u32 = st.integers(0, (1 << 32) - 1)


@st.composite
def remote_regions(draw: st.DrawFn) -> RemoteRegion:
    addr = draw(st.integers(0, (1 << 64) - 1))
    length = draw(st.integers(1, min((1 << 64) - 1, (1 << 64) - addr)))
    return RemoteRegion(
        addr=addr,
        length=length,
        rkey=draw(u32),
        access=draw(st.sampled_from([REMOTE_WRITE, REMOTE_READ, REMOTE_WRITE | REMOTE_READ])),
        name=draw(printable(0, 128)),
    )


region_tuples = st.lists(remote_regions(), max_size=6, unique_by=lambda r: (r.rkey, r.addr)).map(
    tuple
)
nonces = st.binary(min_size=16, max_size=16)
lane_lists = st.lists(
    st.tuples(st.integers(1, (1 << 24) - 1), st.integers(0, (1 << 24) - 1)), max_size=7
).map(wire.pack_lanes)
proofs = st.one_of(st.just(b""), st.binary(min_size=32, max_size=32))


def qp_info(cls: type[Info] | type[Accept]) -> st.SearchStrategy[Info | Accept]:
    return st.builds(
        cls,
        proof=proofs,
        qpn=st.integers(1, (1 << 24) - 1),
        psn=u24,
        gid=st.binary(min_size=16, max_size=16),
        mtu=st.sampled_from([256, 512, 1024, 2048, 4096]),
        max_sge=st.integers(1, 1024),
        recv_slots=st.integers(0, 65536),
        recv_slot_size=st.integers(0, 65536),
        regions=region_tuples,
        lanes=lane_lists,
    ).map(_some_direct)


def _some_direct(m: wire.QpInfo) -> Info | Accept:
    """Half of the messages with extra lanes name the last one a direct lane."""
    assert isinstance(m, Info | Accept)
    return dataclasses.replace(m, direct=int(bool(m.lanes) and m.psn % 2))


texts = st.text(printable_chars | st.sampled_from("\t\n"), max_size=64)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, engine_id=engine_ids, nonce=nonces),
    st.builds(Challenge, engine_id=engine_ids, nonce=nonces),
    qp_info(Info),
    qp_info(Accept),
    st.just(Ready()),
    st.builds(Regions, add=region_tuples, remove=region_tuples),
    st.builds(Error, code=st.sampled_from(sorted(ErrorCode)), message=texts),
    st.builds(Bye, reason=texts),
    st.builds(Ping, nonce=nonces),
    st.builds(Pong, nonce=nonces),
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def frame(msg_type: int, payload: bytes, *, version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, msg_type, len(payload)) + payload


def json_frame(msg_type: MsgType, obj: object) -> bytes:
    return frame(msg_type, json.dumps(obj).encode())


def feed_all(decoder: Decoder, chunks: list[bytes]) -> list[Message]:
    """Feed every chunk; assert the buffering bound after each one."""
    out: list[Message] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
        assert decoder.buffered <= HEADER_SIZE + decoder.max_payload
    return out


def only_handshake_errors(decoder: Decoder, chunks: list[bytes]) -> list[Message]:
    """Feed untrusted chunks: either messages come out or HandshakeError, nothing else."""
    try:
        out = feed_all(decoder, chunks)
        decoder.eof()
    except HandshakeError:
        assert decoder.error_code in (ErrorCode.MALFORMED, ErrorCode.VERSION)
        assert decoder.buffered == 0
        with pytest.raises(HandshakeError, match="earlier error"):
            decoder.feed(b"")
        return []
    return out


def sample(msg_type: MsgType) -> Message:
    region = RemoteRegion(addr=0x1000, length=4096, rkey=0x42, access=REMOTE_READ, name="kv")
    info: dict[str, Any] = dict(
        proof=bytes(32), qpn=0x11, psn=7, gid=bytes(range(16)), mtu=1024, max_sge=4,
        recv_slots=8, recv_slot_size=256, regions=(region,),
    )  # fmt: skip
    samples: dict[MsgType, Message] = {
        MsgType.HELLO: Hello(engine_id="10.0.0.1:5000", nonce=bytes(16)),
        MsgType.CHALLENGE: Challenge(engine_id="[::1]:0~ab", nonce=bytes(16)),
        MsgType.INFO: Info(**info),
        MsgType.ACCEPT: Accept(**info),
        MsgType.READY: Ready(),
        MsgType.REGIONS: Regions(add=(region,), remove=()),
        MsgType.ERROR: Error(code="BUSY", message="try later"),
        MsgType.BYE: Bye(reason="done"),
        MsgType.PING: Ping(nonce=bytes(16)),
        MsgType.PONG: Pong(nonce=bytes(range(16))),
        MsgType.CREDIT: Credit(notes=64),
        MsgType.SEALED: Sealed(seq=3, mac=bytes(32), frame=encode(Bye(reason="done"))),
    }
    return samples[msg_type]


# Every type but SEALED, whose payload is binary.
JSON_TYPES = [t for t in MsgType if t is not MsgType.SEALED]


def sample_json(msg_type: MsgType) -> dict[str, Any]:
    obj = json.loads(encode(sample(msg_type))[HEADER_SIZE:])
    assert isinstance(obj, dict)
    return obj
