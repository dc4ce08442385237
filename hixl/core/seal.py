"""Integrity of the control messages after the handshake, sans-I/O.

Every message an end sends after the handshake goes inside a SEALED frame (see
:class:`hixl.core.wire.Sealed`): a sequence number and an HMAC-SHA256 over both the number
and the whole inner frame, under a key for this connection and this direction.

Keys
----
Derived with HKDF-SHA256 (RFC 5869, one block) when the handshake completes::

    K    = SHA-256("hixl token\\0" token)            (b"" without a token)
    PRK  = HMAC-SHA256(salt="hixl/<version> session\\0" Nc Ns, K)
    TH   = SHA-256([HELLO] [CHALLENGE] [INFO] [ACCEPT])      (proofs included)
    Kcs  = HMAC-SHA256(PRK, "client->server\\0" TH 0x01)
    Ksc  = HMAC-SHA256(PRK, "server->client\\0" TH 0x01)

``Nc`` and ``Ns`` are the nonces of HELLO and CHALLENGE, ``[m]`` a message's length and
encoding as in :mod:`hixl.core.handshake`. Each connection gets its own keys (fresh
nonces), each direction its own (a message cannot be reflected back to its sender), and
the keys are bound to everything the handshake settled (ids, queue pairs, regions).

Sequence numbers
----------------
Each direction counts from 0, one per message. TCP delivers in order, so the receiver
wants exactly the next number: a replayed, dropped, reordered or injected message fails
the check, and the connection with it (:class:`IntegrityError`). After a failure an
:class:`Opener` refuses everything (a failure is final).

What it protects
----------------
With a token, nobody without it can inject, alter, replay or drop a control message
(REGIONS, BYE, ERROR, PING, PONG) without the receiving end noticing. Without a token the
keys come from the nonces alone, which anyone on the path has seen: the same machinery
then detects accidents, not attackers; there is **no authenticity without a token**.
Nothing here is encrypted, and the RDMA traffic itself (RoCE packets) carries no
authentication at all.
"""

from __future__ import annotations

import hashlib
import hmac

from hixl.core import wire
from hixl.errors import HandshakeError

__all__ = ["IntegrityError", "Opener", "Sealer", "session_keys"]

_U64 = (1 << 64) - 1


class IntegrityError(HandshakeError):
    """A control message after the handshake failed its MAC or sequence check."""


def _part(msg: wire.Message) -> bytes:
    data = wire.encode(msg)
    return len(data).to_bytes(4, "big") + data


def session_keys(
    token: bytes | None,
    hello: wire.Hello,
    challenge: wire.Challenge,
    info: wire.Info,
    accept: wire.Accept,
) -> tuple[bytes, bytes]:
    """``(client_to_server, server_to_client)``: the two 32-byte keys of one connection.

    ``info`` and ``accept`` are the messages as sent, proofs included. Without a token
    the keys depend on public values only (see the module doc).
    """
    ikm = b"" if token is None else hashlib.sha256(b"hixl token\0" + token).digest()
    salt = b"hixl/%d session\0" % wire.PROTOCOL_VERSION + hello.nonce + challenge.nonce
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    th = hashlib.sha256(b"".join(_part(m) for m in (hello, challenge, info, accept))).digest()
    cs = hmac.new(prk, b"client->server\0" + th + b"\x01", hashlib.sha256).digest()
    sc = hmac.new(prk, b"server->client\0" + th + b"\x01", hashlib.sha256).digest()
    return cs, sc


def _mac(key: bytes, seq: int, frame: bytes) -> bytes:
    return hmac.digest(key, seq.to_bytes(8, "big") + frame, "sha256")


class Sealer:
    """The sending half: :meth:`seal` wraps each encoded frame, numbering from 0.

    Frames must be sealed in the order they are sent (the caller serialises).
    """

    __slots__ = ("_key", "seq")

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"a session key has 32 bytes, got {len(key)}")
        self._key = key
        self.seq = 0  # the number of the next message

    def __repr__(self) -> str:
        return f"<Sealer next_seq={self.seq}>"

    def seal(self, frame: bytes) -> bytes:
        """The SEALED frame carrying ``frame`` (one whole encoded frame)."""
        seq = self.seq
        if seq > _U64:
            raise IntegrityError(f"sequence numbers exhausted after {seq} messages")
        self.seq = seq + 1
        return wire.encode(wire.Sealed(seq=seq, mac=_mac(self._key, seq, frame), frame=frame))


class Opener:
    """The receiving half: :meth:`open` checks a :class:`~hixl.core.wire.Sealed` and
    returns the message inside. The first failure is final."""

    __slots__ = ("_failed", "_key", "_max_payload", "seq")

    def __init__(self, key: bytes, *, max_payload: int = wire.MAX_PAYLOAD) -> None:
        if len(key) != 32:
            raise ValueError(f"a session key has 32 bytes, got {len(key)}")
        self._key = key
        self._max_payload = max_payload
        self._failed: str | None = None
        self.seq = 0  # the number expected next

    def __repr__(self) -> str:
        state = f"failed: {self._failed}" if self._failed else f"next_seq={self.seq}"
        return f"<Opener {state}>"

    def open(self, msg: wire.Message) -> wire.Message:
        """The message sealed in ``msg``.

        Raises :class:`IntegrityError` naming what is wrong: ``msg`` is not SEALED, its
        number is not the next one (a replay, a drop or an injection), its MAC does not
        match, or it seals another SEALED frame; :class:`HandshakeError` when the inner
        frame is malformed.
        """
        if self._failed is not None:
            raise IntegrityError(
                f"control channel unusable after an earlier failure: {self._failed}"
            )
        try:
            return self._open(msg)
        except HandshakeError as exc:
            self._failed = str(exc)
            raise

    def _open(self, msg: wire.Message) -> wire.Message:
        if not isinstance(msg, wire.Sealed):
            raise IntegrityError(
                f"a {msg.TYPE.name} message arrived unsealed after the handshake (message "
                f"{self.seq} expected sealed)"
            )
        expected = _mac(self._key, msg.seq, msg.frame)
        if not hmac.compare_digest(expected, msg.mac):
            raise IntegrityError(
                f"message {msg.seq} failed its MAC check (expected message {self.seq}): "
                "altered or injected on the way, or sent under another key"
            )
        if msg.seq != self.seq:
            raise IntegrityError(
                f"message {msg.seq} arrived where message {self.seq} was expected: replayed, "
                "reordered or one dropped on the way"
            )
        self.seq += 1
        inner = wire.decode(msg.frame, max_payload=self._max_payload)
        if isinstance(inner, wire.Sealed):
            raise IntegrityError(f"message {msg.seq} seals another SEALED frame")
        return inner
