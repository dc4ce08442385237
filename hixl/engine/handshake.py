"""The connection handshake, client and server side, over a blocking TCP socket.

Client                                  Server (listener, one short-lived thread each)
HELLO(id, nonce_c)             ->
                               <-       CHALLENGE(id, nonce_s, proof_s)
INFO(proof_c, QP, GID, regions) ->
                               <-       ACCEPT(QP, GID, regions)   or ERROR(code)
READY                          ->
The socket then stays open as the connection's control channel.  Every step has the
handshake's deadline; socket I/O here never runs under the engine lock.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from hixl.core import wire
from hixl.core.states import ConnState
from hixl.errors import ConnectionFailed, HandshakeError, HixlError, TransferTimeout

if TYPE_CHECKING:
    from hixl.engine.connection import Connection
    from hixl.engine.engine import Engine

__all__ = ["Channel", "client_handshake", "printable", "serve_handshake"]

log = logging.getLogger("hixl.engine")


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with anything the wire refuses replaced."""
    return "".join(c if c.isprintable() or c in "\t\n" else "?" for c in text[:limit])


class Channel:
    """Blocking framed messaging over the handshake socket, with deadlines."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.decoder = wire.Decoder(max_payload=1 << 20)
        self.pending: deque[wire.Message] = deque()

    def send(self, msg: wire.Message, deadline: float) -> None:
        self._timeout(deadline)
        try:
            self.sock.sendall(wire.encode(msg))
        except TimeoutError as exc:
            raise TransferTimeout(f"handshake with {self.peer}: send timed out") from exc
        except OSError as exc:
            raise ConnectionFailed(f"handshake with {self.peer}: {exc.strerror or exc}") from exc

    def _timeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"handshake with {self.peer} exceeded its deadline")
        self.sock.settimeout(left)

    def recv(self, deadline: float) -> wire.Message:
        while not self.pending:
            self._timeout(deadline)
            try:
                data = self.sock.recv(65536)
            except TimeoutError as exc:
                raise TransferTimeout(f"handshake with {self.peer}: no answer in time") from exc
            except OSError as exc:
                raise ConnectionFailed(
                    f"handshake with {self.peer}: {exc.strerror or exc}"
                ) from exc
            if not data:
                self.decoder.eof()
                raise ConnectionFailed(f"{self.peer} closed the connection during the handshake")
            self.pending.extend(self.decoder.feed(data))
        return self.pending.popleft()

    def expect(self, kind: type[Any], deadline: float) -> Any:
        msg = self.recv(deadline)
        if isinstance(msg, wire.Error):
            raise ConnectionFailed(f"{self.peer} refused: {msg.code}: {msg.message}")
        return wire.expect(msg, kind)

    def refuse(self, code: Any, message: str) -> None:
        """Best effort: tell the peer why, within a second, then give up on it."""
        try:
            self.sock.settimeout(1.0)
            self.sock.sendall(wire.encode(wire.Error(code=code, message=printable(message, 1000))))
        except (OSError, HixlError):
            pass


def client_handshake(
    engine: Engine, sock: socket.socket, peer: str, token: bytes | None, deadline: float
) -> Connection:
    """Run the client side on a connected socket; return the adopted connection."""
    chan = Channel(sock, peer)
    conn: Connection | None = None
    try:
        nonce = wire.make_nonce()
        chan.send(wire.Hello(engine_id=engine.id, nonce=nonce), deadline)
        ch = chan.expect(wire.Challenge, deadline)
        if not wire.verify_proof(token, "server", nonce, ch.engine_id, ch.proof):
            raise HandshakeError(f"peer {peer} could not prove it knows the token")
        conn = engine._new_connection(peer, outbound=True)
        own = wire.proof(token, "client", ch.nonce, engine.id)
        chan.send(conn.local_info(wire.Info, own, engine._exposed()), deadline)
        acc = chan.expect(wire.Accept, deadline)
        conn.establish(acc)
        chan.send(wire.Ready(), deadline)
        engine._adopt(conn, chan)
        return conn
    except BaseException:
        if conn is not None:
            engine._discard(conn)
        sock.close()
        raise


def serve_handshake(
    engine: Engine, sock: socket.socket, addr: Any, token: bytes | None, timeout: float
) -> None:
    """Server side of the handshake, in its own short-lived thread; never raises."""
    deadline = time.monotonic() + timeout
    chan = Channel(sock, f"{addr[0]}:{addr[1]}")
    conn: Connection | None = None
    try:
        hello = chan.expect(wire.Hello, deadline)
        chan.peer = hello.engine_id
        nonce = wire.make_nonce()
        chan.send(
            wire.Challenge(
                engine_id=engine.id,
                nonce=nonce,
                proof=wire.proof(token, "server", hello.nonce, engine.id),
            ),
            deadline,
        )
        info = chan.expect(wire.Info, deadline)
        if not wire.verify_proof(token, "client", nonce, hello.engine_id, info.proof):
            chan.refuse(wire.ErrorCode.AUTH, "authentication failed")
            raise HandshakeError(f"peer {hello.engine_id} failed authentication")
        old = engine._conns.get(hello.engine_id)
        if old is not None and old.state is ConnState.READY:
            # A peer that disconnects and reconnects at once: its goodbye (or EOF) may be
            # waiting unread on the old control socket.  Read it (never blocks) first.
            engine._read_control(old)
        conn = engine._replace_connection(hello.engine_id)
        if conn is None:
            chan.refuse(
                wire.ErrorCode.ALREADY_CONNECTED,
                f"{hello.engine_id} is already connected to {engine.id}",
            )
            raise ConnectionFailed(f"peer {hello.engine_id} is already connected")
        conn.establish(info)
        chan.send(conn.local_info(wire.Accept, b"", engine._exposed()), deadline)
        chan.expect(wire.Ready, deadline)
        engine._adopt(conn, chan)
        log.debug("accepted %r", conn)
    except Exception as exc:  # noqa: BLE001 - a bad peer must never stop the listener
        log.info("handshake from %s rejected: %s", chan.peer, exc)
        if isinstance(exc, HandshakeError) and chan.decoder.error_code is not None:
            chan.refuse(chan.decoder.error_code, str(exc))
        if conn is not None and engine._conns.get(conn.peer) is not conn:
            engine._discard(conn)
        with contextlib.suppress(OSError):
            sock.close()
