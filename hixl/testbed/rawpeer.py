"""A handshake client written by hand, for attack tests on one host and across the wire.

A real :class:`~hixl.Engine` will not misbehave on purpose, so tests of the listener
speak the handshake themselves: HELLO under any engine id, wait for CHALLENGE, INFO for
a queue pair that does not exist.  :func:`raw_handshake` does that (optionally holding
the handshake open before INFO, the way a slow or hostile client would) and keeps every
message the server sent back in :attr:`RawClient.received`.

Nothing here is needed to move bytes; it lives in the test bed so that the single-host
tests (``tests/rdma``) and the two-host tier (``tests/hosts``) share one copy.
"""

from __future__ import annotations

import socket
import time

from hixl.core import wire
from hixl.core.seal import Sealer, session_keys

__all__ = ["RawClient", "accepted", "errors", "fake_info", "raw_handshake"]


class RawClient:
    """A TCP connection to an engine's listener that shows everything it receives.

    ``received`` holds every decoded message so far; :meth:`recv` hands them out one at
    a time.  ``info_sent`` is when :func:`raw_handshake` sent INFO (``time.monotonic``),
    None if it never got that far.  Close it with :meth:`close` (or use it as a context
    manager).
    """

    def __init__(self, target: str, source: str | None = None, timeout: float = 5.0) -> None:
        host, port = wire.parse_engine_id(target)
        self.sock = socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        )
        self.decoder = wire.Decoder()
        self.received: list[wire.Message] = []
        self.timeout = timeout
        self.info_sent: float | None = None
        self.hello: wire.Hello | None = None
        self.info: wire.Info | None = None
        self._taken = 0

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, msg: wire.Message) -> None:
        """Encode and send one message."""
        self.sock.sendall(wire.encode(msg))

    def recv(self) -> wire.Message | None:
        """The next message, or None on EOF, reset or ``timeout`` seconds of silence."""
        deadline = time.monotonic() + self.timeout
        while True:
            if len(self.received) > self._taken:
                self._taken += 1
                return self.received[self._taken - 1]
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except OSError:
                return None
            if not data:
                return None
            self.received.extend(self.decoder.feed(data))

    def sealer(self) -> Sealer:
        """The sealer of a handshake the server ACCEPTed without a token: anyone who saw
        the handshake can derive it (there is no authenticity without a token)."""
        challenge = next(m for m in self.received if isinstance(m, wire.Challenge))
        accept = next(m for m in self.received if isinstance(m, wire.Accept))
        assert self.hello is not None and self.info is not None
        client_to_server, _ = session_keys(None, self.hello, challenge, self.info, accept)
        return Sealer(client_to_server)

    def close(self) -> None:
        self.sock.close()


def fake_info(gid: bytes, proof: bytes = b"") -> wire.Info:
    """INFO for a queue pair that does not exist: enough for the server to act on."""
    return wire.Info(
        proof=proof,
        qpn=0x123,
        psn=0,
        gid=gid,
        mtu=1024,
        max_sge=1,
        recv_slots=0,
        recv_slot_size=0,
        regions=(),
    )


def raw_handshake(
    target: str,
    claim: str,
    gid: bytes,
    *,
    proof: bytes = b"",
    source: str | None = None,
    timeout: float = 5.0,
    hold: float = 0.0,
) -> RawClient:
    """HELLO to ``target`` as ``claim``; then, ``hold`` seconds after the CHALLENGE, INFO
    carrying ``proof`` (and READY if the server ACCEPTs).

    ``gid`` goes into INFO; ``source`` is the local address to connect from; each wait
    for a reply gives up after ``timeout`` seconds.  The replies are in ``.received``,
    and ``.info_sent`` says when INFO went out.  The caller closes the client.
    """
    c = RawClient(target, source, timeout + hold)
    try:
        c.hello = wire.Hello(engine_id=claim, nonce=wire.make_nonce())
        c.send(c.hello)
        if isinstance(c.recv(), wire.Challenge):
            time.sleep(hold)
            c.info_sent = time.monotonic()
            c.info = fake_info(gid, proof)
            c.send(c.info)
            if isinstance(c.recv(), wire.Accept):
                c.send(wire.Ready())
    except BaseException:
        c.close()
        raise
    return c


def accepted(c: RawClient) -> bool:
    """True when the server ACCEPTed ``c`` (and so sent it its regions' keys)."""
    return any(isinstance(m, wire.Accept) for m in c.received)


def errors(c: RawClient) -> list[wire.Error]:
    """The ERROR messages ``c`` received."""
    return [m for m in c.received if isinstance(m, wire.Error)]
