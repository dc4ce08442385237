"""The handshake, sans-I/O: which message comes when, and the proofs that bind them.

This module is pure (no sockets, no clock, no pyverbs). :class:`ClientHandshake` and
:class:`ServerHandshake` take the messages an end receives and make the ones it sends; the
engine moves the bytes and creates the queue pairs. Each step is allowed in one state only.

Message sequence
----------------
::

    client                                         server
      HELLO(engine_id=C, nonce=Nc)           ->
                                             <-    CHALLENGE(engine_id=S, nonce=Ns)
      INFO(qpn, psn, gid, mtu, max_sge,
           recv_slots, recv_slot_size,
           regions, proof=Pc)                 ->
                                                   check Pc: on failure ERROR(AUTH), close
                                                   check limits: ERROR(LIMIT / BUSY /
                                                   ALREADY_CONNECTED), close
                                                   make the QP, move it to RTR and RTS
                                             <-    ACCEPT(qpn, psn, ..., regions, proof=Ps)
      check Ps: on failure close
      move the QP to RTR and RTS
      READY                                   ->

Proofs
------
With a shared token (bytes) both ends prove that they know it, over the whole transcript::

    K  = SHA-256("hixl token\\0" token)
    T  = [HELLO] [CHALLENGE] [INFO with proof=b""]
    Pc = HMAC-SHA256(K, "hixl/<version> client\\0" T)
    Ps = HMAC-SHA256(K, "hixl/<version> server\\0" T [ACCEPT with proof=b""])

The key is a hash of the token, not the token itself: HMAC pads a short key with zero
bytes, so two tokens that differ only in trailing zero bytes would otherwise be one key.

where ``[m]`` is the 4-byte big-endian length of ``encode(m)`` followed by ``encode(m)``.
``encode`` is canonical (one byte string per message value) and includes the frame header,
so every field of every handshake message (ids, both nonces, QPN, PSN, GID, MTU, limits,
regions with their keys) and the protocol version are covered; changing any of them on the
way makes the proof fail. What that gives:

* **The client proves first.** The server sends nothing that depends on the token (the
  CHALLENGE carries no proof) before it has checked Pc, so anyone who can reach a listener
  learns nothing to test token guesses against offline, and gets no rkeys.
* **No replay, no reflection.** Each proof covers both ends' fresh nonces; the role label
  and the different transcripts keep a client proof from passing as a server proof.
* **The server's answer is authentic.** Ps covers the ACCEPT the client acts on (its QP
  number, PSN, GID and every region with its rkey).

* **The server is the one dialled.** The client checks that the CHALLENGE names the engine
  id it dialled (a relay at another address that passes the handshake on is refused).
* **Messages after the handshake are authentic.** Both ends derive a key per connection
  and direction from the token and the transcript, and seal every later message with a
  sequence number and a MAC (:mod:`hixl.core.seal`, :meth:`session`).

What the token does not protect: the bytes are not encrypted (an on-path observer sees the
regions and their rkeys, and RoCE packets carry no authentication at all), and a client
that connects to an impostor hands the impostor Pc, against which a weak token can be
guessed offline. Use a random token (``hixl token`` prints 256 bits) and a private fabric.

Without a token every proof is empty. An end with a token refuses an empty proof and an end
without one refuses a non-empty proof, each with a message that says which side lacks it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import hmac
import ipaddress

from hixl.core import wire
from hixl.core.seal import Opener, Sealer, session_keys
from hixl.errors import AuthenticationError, HandshakeError

__all__ = [
    "ClientHandshake",
    "ServerHandshake",
    "claim_mismatch",
    "source_for",
    "source_key",
    "client_proof",
    "server_proof",
]

_LABEL = b"hixl/%d " % wire.PROTOCOL_VERSION


def _check_token(token: bytes | None) -> None:
    if token is not None and (not isinstance(token, bytes) or not token):
        raise ValueError("token must be non-empty bytes, or None for no authentication")


def _part(msg: wire.Message) -> bytes:
    data = wire.encode(msg)
    return len(data).to_bytes(4, "big") + data


def _unproven(msg: wire.Info | wire.Accept) -> wire.Info | wire.Accept:
    return dataclasses.replace(msg, proof=b"")


def _mac(token: bytes | None, role: bytes, parts: tuple[wire.Message, ...]) -> bytes:
    _check_token(token)
    if token is None:
        return b""
    data = b"".join((_LABEL, role, b"\0", *(_part(m) for m in parts)))
    return hmac.new(_key(token), data, hashlib.sha256).digest()


def _key(token: bytes) -> bytes:
    """The MAC key of a token: one fixed-length key per token (see the module doc)."""
    return hashlib.sha256(b"hixl token\0" + token).digest()


def client_proof(
    token: bytes | None, hello: wire.Hello, challenge: wire.Challenge, info: wire.Info
) -> bytes:
    """Pc, the client's proof over HELLO, CHALLENGE and INFO (its own proof field ignored).

    32 bytes, or ``b""`` without a token. Raises :class:`ValueError` for an empty token.
    """
    return _mac(token, b"client", (hello, challenge, _unproven(info)))


def server_proof(
    token: bytes | None,
    hello: wire.Hello,
    challenge: wire.Challenge,
    info: wire.Info,
    accept: wire.Accept,
) -> bytes:
    """Ps, the server's proof over HELLO, CHALLENGE, INFO and ACCEPT (proof fields ignored).

    32 bytes, or ``b""`` without a token. Raises :class:`ValueError` for an empty token.
    """
    return _mac(token, b"server", (hello, challenge, _unproven(info), _unproven(accept)))


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def claim_mismatch(claim: str, source: str) -> str | None:
    """Why a client connecting from the IP address ``source`` may not use the engine id
    ``claim``, or None when it may.

    A listening id (``host:port``, port not 0) whose host is an IP address must be the
    address the connection comes from: otherwise anyone could take the id of an engine
    that is not connected yet and receive what is meant for it. Not checked: ids that do
    not listen (port 0: nobody dials them, and their random suffix keeps them apart) and
    ids that name their host by name (no name lookups here).
    """
    host, port = wire.parse_engine_id(claim)
    claimed, src = _ip(host), _ip(source)
    if port == 0 or claimed is None or src is None or claimed == src:
        return None
    return (
        f"the client claims engine id {claim}, but its connection comes from {source}, "
        f"not {host}: an engine's id must be the address it connects from (an engine "
        "behind NAT or a proxy needs Engine(trust_peer_hosts=True) on the server)"
    )


def source_for(engine_id: str, dest_host: str) -> str | None:
    """The local address a client with ``engine_id`` binds before dialling ``dest_host``,
    so that the server sees it come from its id's host (see :func:`claim_mismatch`), or
    None to let the system choose: for an id that does not listen, a host name, the
    unspecified address, or an address of another family or scope (loopback or not)
    than the destination."""
    host, port = wire.parse_engine_id(engine_id)
    own, dest = _ip(host), _ip(dest_host)
    if port == 0 or own is None or dest is None or own.is_unspecified:
        return None
    if own.version != dest.version or own.is_loopback != dest.is_loopback:
        return None
    return host


_LOOPBACK_V4 = ipaddress.ip_network("127.0.0.0/8")


@functools.lru_cache(maxsize=1024)  # a flood comes from few sources, again and again
def source_key(source: str) -> str:
    """What a per-source limit counts the connection from IP address ``source`` under.

    One host can take many addresses: all of 127.0.0.0/8 on any Linux machine, a whole
    IPv6 /64 on a typical subnet. So an IPv4 address is its own source (/32), except
    that 127.0.0.0/8 is one; an IPv6 address counts as its /64 (an IPv4-mapped one as
    its IPv4 address, the zone dropped). Anything that is not an IP address counts as
    itself.
    """
    ip = _ip(source)
    if ip is None:
        return source
    if isinstance(ip, ipaddress.IPv4Address):
        return str(_LOOPBACK_V4) if ip in _LOOPBACK_V4 else str(ip)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


def _matches(expected: bytes, got: bytes) -> bool:
    return len(got) == len(expected) and hmac.compare_digest(expected, got)


class _Step(enum.Enum):
    START = "start"
    HELLO = "hello"  # client: HELLO sent; server: HELLO received
    CHALLENGE = "challenge"
    INFO = "info"
    ACCEPT = "accept"
    DONE = "done"
    FAILED = "failed"


class _Machine:
    """Order of steps: each method may run in one state only, and a failure is final."""

    _step: _Step
    role: str

    def _advance(self, want: _Step, to: _Step, what: str) -> None:
        if self._step is not want:
            raise HandshakeError(
                f"{self.role} handshake: {what} is not allowed in state {self._step.value} "
                f"(only in {want.value})"
            )
        self._step = to

    def _fail(self, exc: HandshakeError) -> HandshakeError:
        self._step = _Step.FAILED
        return exc

    @property
    def done(self) -> bool:
        """True once the handshake completed on this end."""
        return self._step is _Step.DONE

    _token: bytes | None
    _transcript: tuple[wire.Hello, wire.Challenge, wire.Info, wire.Accept] | None = None

    def session(self) -> tuple[Sealer, Opener]:
        """This end's :class:`Sealer` and :class:`Opener` for the messages after the
        handshake (keys from :func:`hixl.core.seal.session_keys`); once ACCEPT is settled."""
        if self._transcript is None:
            raise HandshakeError(
                f"{self.role} handshake: no session before ACCEPT (state {self._step.value})"
            )
        cs, sc = session_keys(self._token, *self._transcript)
        if self.role == "client":
            return Sealer(cs), Opener(sc)
        return Sealer(sc), Opener(cs)


class ClientHandshake(_Machine):
    """The connecting end. Use in this order::

        hs = ClientHandshake(my_id, token)
        send(hs.hello)
        hs.on_challenge(receive())        # CHALLENGE
        send(hs.info(draft_info))         # INFO, with the proof filled in
        accept = hs.on_accept(receive())  # ACCEPT, checked; then connect the QP
        send(hs.ready())

    ``token`` is the shared secret (non-empty bytes) or None. ``peer`` names the server in
    error messages. ``expect_id``, when given, is the engine id the client dialled: a
    CHALLENGE naming another one is refused (:class:`AuthenticationError`). ``nonce`` is
    for tests; by default a fresh one is drawn.
    """

    role = "client"

    def __init__(
        self,
        engine_id: str,
        token: bytes | None,
        *,
        peer: str = "the server",
        expect_id: str | None = None,
        nonce: bytes | None = None,
    ) -> None:
        _check_token(token)
        self._token = token
        self.peer = peer
        self.expect_id = expect_id
        self.hello = wire.Hello(engine_id=engine_id, nonce=nonce or wire.make_nonce())
        self.challenge: wire.Challenge | None = None
        self._info: wire.Info | None = None
        self._step = _Step.HELLO

    def on_challenge(self, msg: wire.Challenge) -> None:
        """Take the server's CHALLENGE (its id and nonce).

        Raises :class:`AuthenticationError` when it names another engine than
        ``expect_id``.
        """
        self._advance(_Step.HELLO, _Step.CHALLENGE, "CHALLENGE")
        if self.expect_id is not None and msg.engine_id != self.expect_id:
            raise self._fail(
                AuthenticationError(
                    f"{self.peer} answered as engine {msg.engine_id!r}, not the "
                    f"{self.expect_id!r} dialled: a relay or a misdirected address"
                )
            )
        self.challenge = msg

    def info(self, draft: wire.Info) -> wire.Info:
        """``draft`` with the client's proof over the transcript so far."""
        self._advance(_Step.CHALLENGE, _Step.INFO, "sending INFO")
        assert self.challenge is not None
        info = dataclasses.replace(draft, proof=b"")
        info = dataclasses.replace(
            info, proof=client_proof(self._token, self.hello, self.challenge, info)
        )
        self._info = info
        return info

    def on_accept(self, msg: wire.Accept) -> wire.Accept:
        """Check the server's proof; return the ACCEPT to act on.

        Raises :class:`AuthenticationError` naming the side at fault when the proof does
        not match what this end holds (a wrong token, no token on one side, or a handshake
        altered on the way).
        """
        self._advance(_Step.INFO, _Step.ACCEPT, "ACCEPT")
        assert self.challenge is not None and self._info is not None
        if self._token is None:
            if msg.proof:
                raise self._fail(
                    AuthenticationError(
                        f"{self.peer} proved a token in its ACCEPT, but this engine has no "
                        "token: give Engine(token=...) the same token on both ends"
                    )
                )
            self._transcript = (self.hello, self.challenge, self._info, msg)
            return msg
        expected = server_proof(self._token, self.hello, self.challenge, self._info, msg)
        if not msg.proof:
            raise self._fail(
                AuthenticationError(
                    f"{self.peer} has no token (its ACCEPT carries no proof) but this engine "
                    "has one: use the same token on both ends, or none"
                )
            )
        if not _matches(expected, msg.proof):
            raise self._fail(
                AuthenticationError(
                    f"{self.peer}'s proof in ACCEPT does not match this engine's token: a "
                    "different token, or the handshake was altered on the way"
                )
            )
        self._transcript = (self.hello, self.challenge, self._info, msg)
        return msg

    def ready(self) -> wire.Ready:
        """The READY to send once the client's queue pair is in RTS."""
        self._advance(_Step.ACCEPT, _Step.DONE, "sending READY")
        return wire.Ready()


class ServerHandshake(_Machine):
    """The listening end. Use in this order::

        hs = ServerHandshake(my_id, token)
        send(hs.on_hello(receive()))       # HELLO in, CHALLENGE out
        info = hs.on_info(receive())       # INFO, checked: AuthenticationError -> ERROR(AUTH)
        ...check limits, make and connect the QP...
        send(hs.accept(draft_accept))      # ACCEPT, with the server's proof
        hs.on_ready(receive())             # READY

    No step before :meth:`on_info` has succeeded produces anything that depends on the
    token, and :meth:`accept` refuses to run before it.
    """

    role = "server"

    def __init__(self, engine_id: str, token: bytes | None, *, nonce: bytes | None = None):
        _check_token(token)
        self._token = token
        self.engine_id = engine_id
        self._nonce = nonce or wire.make_nonce()
        self.hello: wire.Hello | None = None
        self._challenge: wire.Challenge | None = None
        self._info: wire.Info | None = None
        self._step = _Step.START

    @property
    def peer(self) -> str | None:
        """The id the client claims (proven only once :meth:`on_info` passed with a token)."""
        return None if self.hello is None else self.hello.engine_id

    def on_hello(self, msg: wire.Hello) -> wire.Challenge:
        """Take the client's HELLO; return the CHALLENGE to send (no proof in it)."""
        self._advance(_Step.START, _Step.CHALLENGE, "HELLO")
        self.hello = msg
        self._challenge = wire.Challenge(engine_id=self.engine_id, nonce=self._nonce)
        return self._challenge

    def on_info(self, msg: wire.Info) -> wire.Info:
        """Check the client's proof; return the INFO to act on.

        Raises :class:`AuthenticationError` with a message meant for the client (send it
        in ERROR(AUTH)) that says which side lacks the token or that the proof is wrong.
        """
        self._advance(_Step.CHALLENGE, _Step.INFO, "INFO")
        assert self.hello is not None and self._challenge is not None
        who = f"client {self.hello.engine_id}"
        if self._token is None:
            if msg.proof:
                raise self._fail(
                    AuthenticationError(
                        f"server {self.engine_id} has no token but {who} sent a proof: use the "
                        "same token on both ends, or none"
                    )
                )
        elif not msg.proof:
            raise self._fail(
                AuthenticationError(
                    f"server {self.engine_id} requires a token and {who} sent no proof: give "
                    "Engine(token=...) the server's token"
                )
            )
        else:
            expected = client_proof(self._token, self.hello, self._challenge, msg)
            if not _matches(expected, msg.proof):
                raise self._fail(
                    AuthenticationError(
                        f"the proof of {who} does not match the token of server "
                        f"{self.engine_id}: a different token, or the handshake was altered "
                        "on the way"
                    )
                )
        self._info = msg
        return msg

    def accept(self, draft: wire.Accept) -> wire.Accept:
        """``draft`` with the server's proof; only after :meth:`on_info` passed."""
        self._advance(_Step.INFO, _Step.ACCEPT, "sending ACCEPT")
        assert self.hello is not None and self._challenge is not None
        assert self._info is not None
        proof = server_proof(self._token, self.hello, self._challenge, self._info, draft)
        accept = dataclasses.replace(draft, proof=proof)
        self._transcript = (self.hello, self._challenge, self._info, accept)
        return accept

    def on_ready(self, msg: wire.Ready) -> None:
        """Take the client's READY: the handshake is complete."""
        self._advance(_Step.ACCEPT, _Step.DONE, "READY")
