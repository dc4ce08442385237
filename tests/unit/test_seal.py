"""The sealing of control messages after the handshake (hixl.core.seal), pure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.core import wire
from hixl.core.handshake import ClientHandshake, ServerHandshake
from hixl.core.seal import IntegrityError, Opener, Sealer, session_keys
from hixl.errors import AuthenticationError, HandshakeError

TOKEN = b"s3cret-token"


def info(cls: type[wire.Info] | type[wire.Accept], qpn: int) -> wire.Info | wire.Accept:
    return cls(
        proof=b"", qpn=qpn, psn=1, gid=bytes(16), mtu=1024, max_sge=1, recv_slots=0,
        recv_slot_size=0,
    )  # fmt: skip


def handshake(
    client_token: bytes | None, server_token: bytes | None
) -> tuple[ClientHandshake, ServerHandshake]:
    c = ClientHandshake("10.0.0.2:0~ab", client_token, expect_id="10.0.0.1:5000")
    s = ServerHandshake("10.0.0.1:5000", server_token)
    c.on_challenge(s.on_hello(c.hello))
    s.on_info(c.info(info(wire.Info, 0x11)))  # type: ignore[arg-type]
    c.on_accept(s.accept(info(wire.Accept, 0x22)))  # type: ignore[arg-type]
    s.on_ready(c.ready())
    return c, s


@pytest.mark.parametrize("token", [TOKEN, None])
def test_both_ends_derive_matching_keys_per_direction(token: bytes | None) -> None:
    c, s = handshake(token, token)
    c_seal, c_open = c.session()
    s_seal, s_open = s.session()
    for i in range(3):
        bye = wire.Bye(reason=f"up {i}")
        assert s_open.open(wire.decode(c_seal.seal(wire.encode(bye)))) == bye
        ping = wire.Ping(nonce=bytes([i]) * 16)
        assert c_open.open(wire.decode(s_seal.seal(wire.encode(ping)))) == ping
    assert c_seal.seq == s_open.seq == 3


def test_keys_differ_per_connection_direction_and_token() -> None:
    c1, _ = handshake(TOKEN, TOKEN)
    c2, _ = handshake(TOKEN, TOKEN)
    assert c1._transcript is not None and c2._transcript is not None
    k1 = session_keys(TOKEN, *c1._transcript)
    assert k1[0] != k1[1]
    assert k1 != session_keys(TOKEN, *c2._transcript)  # fresh nonces
    assert k1 != session_keys(b"other", *c1._transcript)
    assert k1 != session_keys(None, *c1._transcript)


def _pair() -> tuple[Sealer, Opener]:
    c, s = handshake(TOKEN, TOKEN)
    return c.session()[0], s.session()[1]


def test_replay_is_refused_and_failure_is_final() -> None:
    sealer, opener = _pair()
    first = sealer.seal(wire.encode(wire.Bye(reason="a")))
    opener.open(wire.decode(first))
    with pytest.raises(IntegrityError, match="message 0 arrived where message 1 was expected"):
        opener.open(wire.decode(first))
    good = sealer.seal(wire.encode(wire.Bye(reason="b")))
    with pytest.raises(IntegrityError, match="unusable after an earlier failure"):
        opener.open(wire.decode(good))


def test_dropped_message_is_noticed() -> None:
    sealer, opener = _pair()
    sealer.seal(wire.encode(wire.Bye(reason="lost")))
    with pytest.raises(IntegrityError, match="message 1 arrived where message 0"):
        opener.open(wire.decode(sealer.seal(wire.encode(wire.Bye(reason="next")))))


def test_unsealed_injected_and_reflected_messages_are_refused() -> None:
    c, s = handshake(TOKEN, TOKEN)
    c_seal, c_open = c.session()
    _, s_open = s.session()
    regions = wire.Regions(add=(), remove=())
    with pytest.raises(IntegrityError, match="REGIONS message arrived unsealed"):
        s_open.open(regions)
    _, fresh = s.session()
    forged = wire.Sealed(seq=0, mac=bytes(32), frame=wire.encode(regions))
    with pytest.raises(IntegrityError, match="failed its MAC check"):
        fresh.open(forged)
    # Sealed by the client for the server: the client's own opener refuses it.
    with pytest.raises(IntegrityError, match="MAC"):
        c_open.open(wire.decode(c_seal.seal(wire.encode(regions))))


@given(st.integers(0, 200), st.integers(0, 7))
def test_any_flipped_bit_fails_the_mac(index: int, bit: int) -> None:
    sealer, opener = _pair()
    data = bytearray(sealer.seal(wire.encode(wire.Bye(reason="x" * 100))))
    pos = wire.HEADER_SIZE + index % (len(data) - wire.HEADER_SIZE)
    data[pos] ^= 1 << bit
    with pytest.raises(HandshakeError):
        opener.open(wire.decode(bytes(data)))


def test_without_a_token_anyone_with_the_transcript_can_seal() -> None:
    """What the docs say: no token, no authenticity (the keys are public values)."""
    c, s = handshake(None, None)
    assert c._transcript is not None
    cs, _ = session_keys(None, *c._transcript)
    forged = Sealer(cs).seal(wire.encode(wire.Bye(reason="forged")))
    assert s.session()[1].open(wire.decode(forged)) == wire.Bye(reason="forged")


def test_sealed_frame_may_carry_a_full_payload() -> None:
    inner = wire.encode(wire.Bye(reason="x" * 1000))
    frame = Sealer(bytes(32)).seal(inner)
    decoder = wire.Decoder(max_payload=len(inner) - wire.HEADER_SIZE)
    (msg,) = decoder.feed(frame)
    assert isinstance(msg, wire.Sealed) and msg.frame == inner


def test_client_refuses_a_challenge_from_another_engine() -> None:
    c = ClientHandshake("10.0.0.2:0~ab", TOKEN, expect_id="10.0.0.1:5000")
    relay = ServerHandshake("10.0.0.9:7000", None)
    with pytest.raises(AuthenticationError, match=r"answered as engine '10.0.0.9:7000'"):
        c.on_challenge(relay.on_hello(c.hello))


def test_no_session_before_accept() -> None:
    c = ClientHandshake("10.0.0.2:0~ab", TOKEN)
    with pytest.raises(HandshakeError, match="no session before ACCEPT"):
        c.session()
    assert dataclasses.is_dataclass(wire.Sealed)
