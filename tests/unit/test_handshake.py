"""Tests for hixl.core.handshake: the message order and the transcript proofs.

The two ends run in one process and talk through encode/decode, as over a socket. A
"network" in the middle may rewrite one message; the properties state that with a token any
such change is caught before the end that would act on it does so, that proofs never pass
under another token, nonce or role, and that nothing the server sends before the client
has proven itself depends on the token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hixl.core import wire
from hixl.core.handshake import (
    ClientHandshake,
    ServerHandshake,
    claim_mismatch,
    client_proof,
    server_proof,
    source_for,
    source_key,
)
from hixl.errors import AuthenticationError, HandshakeError

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- strategies

hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.from_regex(r"[a-z][a-z0-9]{0,8}(\.[a-z][a-z0-9]{0,8}){0,2}", fullmatch=True),
)
suffixes = st.one_of(st.just(""), st.from_regex(r"~[0-9a-f]{1,16}", fullmatch=True))
engine_ids = st.builds(lambda h, p, s: f"{h}:{p}{s}", hosts, st.integers(0, 65535), suffixes)
tokens = st.binary(min_size=1, max_size=64)
nonces = st.binary(min_size=16, max_size=16)
u24 = st.integers(0, (1 << 24) - 1)
regions = st.lists(
    st.builds(
        wire.RemoteRegion,
        addr=st.integers(0, 1 << 48),
        length=st.integers(1, 1 << 32),
        rkey=st.integers(0, (1 << 32) - 1),
        access=st.sampled_from([wire.REMOTE_WRITE, wire.REMOTE_READ, 6]),
        name=st.text("abcxyz0-_", max_size=12),
    ),
    max_size=4,
    unique_by=lambda r: (r.rkey, r.addr),
).map(tuple)

# One strategy per field name of the handshake messages: what a tamperer may put there.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "engine_id": engine_ids,
    "nonce": nonces,
    "proof": st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    "qpn": st.integers(1, (1 << 24) - 1),
    "psn": u24,
    "gid": st.binary(min_size=16, max_size=16),
    "mtu": st.sampled_from([256, 512, 1024, 2048, 4096]),
    "max_sge": st.integers(1, 1024),
    "recv_slots": st.integers(0, 65536),
    "recv_slot_size": st.integers(0, 65536),
    "regions": regions,
    "lanes": st.lists(st.tuples(st.integers(1, (1 << 24) - 1), u24), max_size=7).map(
        wire.pack_lanes
    ),
    "direct": st.integers(0, 1),  # 1 only with an extra lane (see qp_drafts, tampers)
}


def qp_drafts(cls: type[wire.Info] | type[wire.Accept]) -> st.SearchStrategy[Any]:
    skip = ("engine_id", "nonce", "proof", "direct")
    return st.builds(
        cls,
        proof=st.just(b""),
        **{k: v for k, v in FIELD_VALUES.items() if k not in skip},
    ).map(lambda m: dataclasses.replace(m, direct=int(bool(m.lanes) and m.qpn % 2)))


Tamper = Callable[[wire.Message], wire.Message]


def over_wire(msg: wire.Message, tamper: Tamper | None = None) -> Any:
    """``msg`` as the other end decodes it, after an optional change on the way."""
    if tamper is not None:
        msg = tamper(msg)
    return wire.decode(wire.encode(msg))


@dataclasses.dataclass
class Run:
    """What happened in one handshake between a client and a server."""

    client_error: HandshakeError | None = None
    server_error: HandshakeError | None = None
    server_acted: bool = False  # the server passed INFO: it would make a QP and send rkeys
    client_acted: bool = False  # the client passed ACCEPT: it would connect its QP
    done: bool = False


def run(
    client_token: bytes | None,
    server_token: bytes | None,
    ids: tuple[str, str],
    drafts: tuple[wire.Info, wire.Accept],
    tampers: dict[type[Any], Tamper] | None = None,
) -> Run:
    tampers = tampers or {}
    out = Run()
    client = ClientHandshake(ids[0], client_token)
    server = ServerHandshake(ids[1], server_token)
    challenge = server.on_hello(over_wire(client.hello, tampers.get(wire.Hello)))
    client.on_challenge(over_wire(challenge, tampers.get(wire.Challenge)))
    info = client.info(drafts[0])
    try:
        server.on_info(over_wire(info, tampers.get(wire.Info)))
    except HandshakeError as exc:
        out.server_error = exc
        return out
    out.server_acted = True
    accept = server.accept(drafts[1])
    try:
        client.on_accept(over_wire(accept, tampers.get(wire.Accept)))
    except HandshakeError as exc:
        out.client_error = exc
        return out
    out.client_acted = True
    server.on_ready(over_wire(client.ready()))
    out.done = client.done and server.done
    return out


# --------------------------------------------------------------------------- properties


@PROPS
@given(
    st.one_of(st.none(), tokens),
    st.tuples(engine_ids, engine_ids),
    st.tuples(qp_drafts(wire.Info), qp_drafts(wire.Accept)),
)
def test_honest_handshake_completes(
    token: bytes | None, ids: tuple[str, str], drafts: tuple[wire.Info, wire.Accept]
) -> None:
    assert run(token, token, ids, drafts).done


@st.composite
def tampers(draw: st.DrawFn) -> tuple[type[Any], str, Tamper]:
    """A change to one field of one handshake message, to a different valid value."""
    kind = draw(st.sampled_from([wire.Hello, wire.Challenge, wire.Info, wire.Accept]))
    names = [f.name for f in dataclasses.fields(kind)]
    name = draw(st.sampled_from(names))
    value = draw(FIELD_VALUES[name])

    def change(msg: wire.Message) -> wire.Message:
        fields: dict[str, Any] = {name: value}
        if isinstance(msg, wire.QpInfo):
            if name == "direct" and not msg.lanes:
                return msg  # a direct lane needs an extra queue pair: nothing to change
            if name == "lanes" and not value and msg.direct:
                fields["direct"] = 0  # (the drawn lanes are empty: no direct lane left)
        return dataclasses.replace(msg, **fields)

    return kind, name, change


@PROPS
@given(
    tokens,
    st.tuples(engine_ids, engine_ids),
    st.tuples(qp_drafts(wire.Info), qp_drafts(wire.Accept)),
    tampers(),
)
def test_any_tampered_field_fails_verification(
    token: bytes,
    ids: tuple[str, str],
    drafts: tuple[wire.Info, wire.Accept],
    tamper: tuple[type[Any], str, Tamper],
) -> None:
    kind, name, change = tamper
    # Only a real change counts: the value drawn may equal the one sent.
    probe = ServerHandshake(ids[1], token, nonce=bytes(16))
    client = ClientHandshake(ids[0], token, nonce=bytes(16))
    options: dict[type[Any], wire.Message] = {
        wire.Hello: client.hello,
        wire.Challenge: probe.on_hello(client.hello),
        wire.Info: drafts[0],
        wire.Accept: drafts[1],
    }
    sent = options[kind]
    # (INFO and ACCEPT carry a 32-byte proof once sent; no drawn value equals it.)
    proven = kind in (wire.Info, wire.Accept) and name == "proof"
    assume(proven or getattr(sent, name) != getattr(change(sent), name))
    result = run(token, token, ids, drafts, {kind: change})
    assert not result.done
    if kind is wire.Accept:
        # The server acted on an honest INFO; the client refuses the altered ACCEPT.
        assert isinstance(result.client_error, AuthenticationError)
        assert not result.client_acted
    else:
        # Changed before the client's proof was checked: the server sends nothing more.
        assert isinstance(result.server_error, AuthenticationError), (kind, name)
        assert not result.server_acted


@PROPS
@given(
    tokens,
    tokens,
    st.tuples(engine_ids, engine_ids),
    st.tuples(qp_drafts(wire.Info), qp_drafts(wire.Accept)),
)
def test_proofs_never_pass_under_another_token(
    token: bytes, other: bytes, ids: tuple[str, str], drafts: tuple[wire.Info, wire.Accept]
) -> None:
    assume(token != other)
    result = run(token, other, ids, drafts)
    assert isinstance(result.server_error, AuthenticationError)
    assert "does not match" in str(result.server_error)
    assert not result.server_acted


@PROPS
@given(
    tokens,
    st.tuples(engine_ids, engine_ids),
    st.tuples(qp_drafts(wire.Info), qp_drafts(wire.Accept)),
    nonces,
    nonces,
)
def test_proofs_never_pass_under_another_nonce_or_role(
    token: bytes,
    ids: tuple[str, str],
    drafts: tuple[wire.Info, wire.Accept],
    nonce_s: bytes,
    nonce_s2: bytes,
) -> None:
    assume(nonce_s != nonce_s2)
    client = ClientHandshake(ids[0], token)
    first = ServerHandshake(ids[1], token, nonce=nonce_s)
    client.on_challenge(first.on_hello(client.hello))
    info = client.info(drafts[0])
    # Replayed into a handshake with a fresh server nonce, the INFO fails.
    second = ServerHandshake(ids[1], token, nonce=nonce_s2)
    second.on_hello(client.hello)
    with pytest.raises(AuthenticationError, match="does not match"):
        second.on_info(info)
    # A replayed client nonce: a new client's HELLO, the old INFO.
    third = ServerHandshake(ids[1], token, nonce=nonce_s)
    third.on_hello(ClientHandshake(ids[0], token).hello)
    with pytest.raises(AuthenticationError):
        third.on_info(info)
    # Reflection: the client's proof is no server proof for the same transcript, and the
    # server's proof is no client proof.
    first.on_info(info)
    accept = first.accept(drafts[1])
    ch = client.challenge
    assert ch is not None
    assert server_proof(token, client.hello, ch, info, accept) != info.proof
    assert client_proof(token, client.hello, ch, info) != accept.proof
    reflected = ServerHandshake(ids[1], token, nonce=nonce_s)
    reflected.on_hello(client.hello)
    with pytest.raises(AuthenticationError):
        reflected.on_info(dataclasses.replace(info, proof=accept.proof))


@PROPS
@given(tokens, tokens, engine_ids, nonces, st.one_of(st.none(), tokens))
def test_nothing_before_the_client_proves_depends_on_the_token(
    token: bytes, other: bytes, server_id: str, nonce: bytes, client_token: bytes | None
) -> None:
    # The same CHALLENGE bytes whatever the token: an attacker who reaches the listener
    # has nothing to test guesses against.
    hello = ClientHandshake("10.0.0.9:0~aa", client_token).hello
    a = ServerHandshake(server_id, token, nonce=nonce).on_hello(hello)
    b = ServerHandshake(server_id, other, nonce=nonce).on_hello(hello)
    assert wire.encode(a) == wire.encode(b)
    assert getattr(a, "proof", b"") == b""


def test_accept_only_after_a_proven_info() -> None:
    token = b"k" * 32
    server = ServerHandshake("10.0.0.1:5000", token)
    draft = wire.Accept(
        proof=b"", qpn=1, psn=0, gid=bytes(16), mtu=1024, max_sge=1, recv_slots=0,
        recv_slot_size=0,
    )  # fmt: skip
    with pytest.raises(HandshakeError, match="sending ACCEPT is not allowed in state start"):
        server.accept(draft)
    server.on_hello(ClientHandshake("10.0.0.2:0~1", token).hello)
    with pytest.raises(HandshakeError, match="not allowed in state challenge"):
        server.accept(draft)
    with pytest.raises(AuthenticationError):
        server.on_info(wire.Info(**{**_fields(draft), "proof": bytes(32)}))
    with pytest.raises(HandshakeError, match="not allowed in state failed"):
        server.accept(draft)


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def test_steps_out_of_order_are_refused() -> None:
    client = ClientHandshake("10.0.0.2:0~1", None)
    with pytest.raises(HandshakeError, match="client handshake: sending INFO is not allowed"):
        client.info(_draft(wire.Info))
    with pytest.raises(HandshakeError, match="ACCEPT is not allowed in state hello"):
        client.on_accept(_draft(wire.Accept))
    server = ServerHandshake("10.0.0.1:1", None)
    with pytest.raises(HandshakeError, match="server handshake: INFO is not allowed"):
        server.on_info(_draft(wire.Info))
    with pytest.raises(HandshakeError, match="READY is not allowed"):
        server.on_ready(wire.Ready())
    challenge = server.on_hello(client.hello)
    with pytest.raises(HandshakeError, match="HELLO is not allowed in state challenge"):
        server.on_hello(client.hello)
    client.on_challenge(challenge)
    with pytest.raises(HandshakeError, match="CHALLENGE is not allowed"):
        client.on_challenge(challenge)


def _draft(cls: Any) -> Any:
    return cls(
        proof=b"", qpn=7, psn=9, gid=bytes(16), mtu=4096, max_sge=2, recv_slots=1,
        recv_slot_size=64,
    )  # fmt: skip


IDS = ("10.0.0.2:0~1f", "10.0.0.1:7000")


@pytest.mark.parametrize(
    ("client_token", "server_token", "side", "phrase"),
    [
        (None, b"s3cret", "server", "requires a token and client 10.0.0.2:0~1f sent no proof"),
        (b"s3cret", None, "server", "server 10.0.0.1:7000 has no token but client"),
        (b"wrong", b"s3cret", "server", "does not match the token of server 10.0.0.1:7000"),
    ],
)
def test_auth_failures_blame_the_side_that_lacks_the_token(
    client_token: bytes | None, server_token: bytes | None, side: str, phrase: str
) -> None:
    result = run(client_token, server_token, IDS, (_draft(wire.Info), _draft(wire.Accept)))
    error = result.server_error if side == "server" else result.client_error
    assert isinstance(error, AuthenticationError)
    assert phrase in str(error)


def test_client_blames_a_server_without_token_or_with_a_bad_proof() -> None:
    token = b"s3cret"
    # A server that answers without a proof (no token) although we sent one.
    client = ClientHandshake(IDS[0], token, peer="10.0.0.1:7000")
    server = ServerHandshake(IDS[1], token)
    client.on_challenge(server.on_hello(client.hello))
    server.on_info(client.info(_draft(wire.Info)))
    with pytest.raises(AuthenticationError, match="10.0.0.1:7000 has no token"):
        client.on_accept(_draft(wire.Accept))
    # A server that proves a token we do not have.
    client = ClientHandshake(IDS[0], None, peer="10.0.0.1:7000")
    client.on_challenge(ServerHandshake(IDS[1], None).on_hello(client.hello))
    client.info(_draft(wire.Info))
    proven = dataclasses.replace(_draft(wire.Accept), proof=bytes(32))
    with pytest.raises(AuthenticationError, match="this engine has no token"):
        client.on_accept(proven)


@pytest.mark.parametrize(
    ("token", "other"), [(b"\0", b"\0\0"), (b"k", b"k\0"), (b"k" * 64, b"k" * 64 + b"\0")]
)
def test_tokens_that_differ_in_trailing_zero_bytes_do_not_match(token: bytes, other: bytes) -> None:
    """HMAC pads a short key with zeros: keyed with the raw token, these pairs matched."""
    drafts = (_draft(wire.Info), _draft(wire.Accept))
    result = run(token, other, ("10.0.0.2:0~1", "10.0.0.1:1"), drafts)
    assert isinstance(result.server_error, AuthenticationError)
    assert not result.server_acted


def test_proof_is_hmac_sha256_over_the_length_prefixed_frames() -> None:
    token = b"secret"
    hello = wire.Hello(engine_id="10.0.0.2:0~1", nonce=bytes(16))
    ch = ServerHandshake("10.0.0.1:1", token, nonce=bytes(range(16))).on_hello(hello)
    info = _draft(wire.Info)

    def part(m: wire.Message) -> bytes:
        data = wire.encode(m)
        return len(data).to_bytes(4, "big") + data

    data = b"hixl/%d client\0" % wire.PROTOCOL_VERSION + part(hello) + part(ch) + part(info)
    key = hashlib.sha256(b"hixl token\0" + token).digest()
    assert client_proof(token, hello, ch, info) == hmac.new(key, data, hashlib.sha256).digest()
    assert client_proof(None, hello, ch, info) == b""
    with pytest.raises(ValueError, match="token must be non-empty bytes"):
        client_proof(b"", hello, ch, info)
    with pytest.raises(ValueError, match="token must be non-empty bytes"):
        ClientHandshake("10.0.0.2:0~1", b"")


# --------------------------------------------------------------------------- claimed ids


@pytest.mark.parametrize(
    ("claim", "source", "refused"),
    [
        ("10.0.0.2:5000", "10.0.0.2", False),
        ("10.0.0.2:5000", "10.0.0.9", True),
        ("10.0.0.2:5000", "::ffff:10.0.0.2", False),
        ("127.0.0.5:5000", "127.0.0.1", True),
        ("0.0.0.0:5000", "10.0.0.2", True),
        ("[fe80::1%eth0]:5000", "fe80::1", False),
        ("10.0.0.2:0~ab", "10.0.0.9", False),  # does not listen
        ("node-b:5000", "10.0.0.9", False),  # a host name: not looked up
    ],
)
def test_a_listening_id_must_name_the_connections_source(
    claim: str, source: str, refused: bool
) -> None:
    problem = claim_mismatch(claim, source)
    assert (problem is not None) == refused, problem
    if problem is not None:
        assert claim in problem and source in problem and "trust_peer_hosts" in problem


@pytest.mark.parametrize(
    ("own", "dest", "bound"),
    [
        ("10.0.0.2:5000", "10.0.0.1", "10.0.0.2"),
        ("127.0.0.5:5000", "127.0.0.1", "127.0.0.5"),
        ("127.0.0.5:5000", "10.0.0.1", None),  # loopback cannot reach another host
        ("10.0.0.2:0~ab", "10.0.0.1", None),
        ("0.0.0.0:5000", "10.0.0.1", None),
        ("10.0.0.2:5000", "fe80::1", None),
        ("node-b:5000", "10.0.0.1", None),
    ],
)
def test_client_binds_its_ids_address_when_it_can(own: str, dest: str, bound: str | None) -> None:
    assert source_for(own, dest) == bound


@pytest.mark.parametrize(
    ("source", "key"),
    [
        ("10.0.0.1", "10.0.0.1"),
        ("::ffff:10.0.0.1", "10.0.0.1"),  # a dual-stack listener's view of an IPv4 client
        ("127.0.0.1", "127.0.0.0/8"),
        ("127.200.3.4", "127.0.0.0/8"),
        ("::ffff:127.0.0.2", "127.0.0.0/8"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:ffff:ffff:ffff", "2001:db8::/64"),
        ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::1", "::/64"),
        ("node-b", "node-b"),
    ],
)
def test_per_source_limits_count_a_host_that_takes_many_addresses_once(
    source: str, key: str
) -> None:
    assert source_key(source) == key


def test_peer_text_is_escaped_for_one_log_line() -> None:
    from hixl.engine.handshake import escape

    assert escape("plain text") == "plain text"
    assert escape("forged\nINFO all is well\x1b[2J") == "forged\\nINFO all is well\\x1b[2J"
    assert escape("x" * 400) == "x" * 300 + "..."
