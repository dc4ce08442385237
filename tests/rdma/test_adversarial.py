"""A listening engine under attack, on rxe: what anyone who reaches its port can try.

Each test is one item of the listener-hardening issue, with the numbers in the assertion.
The attacker speaks the wire protocol directly (:mod:`hixl.core.wire`, raw sockets), or
sits between two honest engines as a proxy, as a real one would; the engines under test
are used through their public API only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import ipaddress
import logging
import multiprocessing as mp
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import numpy as np
import pytest

from hixl import (
    Access,
    ArgumentError,
    CompletionError,
    ConnectionFailed,
    ConnState,
    Engine,
    HandshakeError,
    HixlError,
    RegistrationError,
    StateError,
    StridedDesc,
    TransferRequest,
    TransferTimeout,
)
from hixl.core import seal, wire
from hixl.testbed.net import free_tcp_port
from hixl.testbed.rawpeer import accepted, errors, raw_handshake

from .adversary import (
    RW,
    Proxy,
    challenge_fields,
    passthrough,
    rss_bytes,
    serving_engine,
    wait_for,
)

# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def server() -> Iterator[Engine]:
    with serving_engine() as eng:
        yield eng


@pytest.fixture
def client() -> Iterator[Engine]:
    with Engine("127.0.0.1:0") as eng:
        yield eng


# --------------------------------------------------------------------------- 1. socket flood


def _flood(pipe: Pipe, target: tuple[str, int], sources: list[str], count: int) -> None:
    """Hold ``count`` idle sockets to ``target``; re-open each one the server closes."""
    sel = selectors.DefaultSelector()
    opened = closed = 0

    def open_one(source: str) -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        s.connect_ex(target)
        sel.register(s, selectors.EVENT_READ, source)
        opened += 1

    pipe.recv()
    for i in range(count):
        open_one(sources[i % len(sources)])
    pipe.send("holding")
    while not pipe.poll():
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                closed += 1
                open_one(key.data)
    pipe.send({"opened": opened, "closed": closed, "held": len(sel.get_map())})


def _device_ipv4() -> str:
    """The IPv4 address of the netdev under the RDMA device (its RoCEv2 GID)."""
    with Engine() as probe:
        mapped = ipaddress.IPv6Address(probe.device.gid).ipv4_mapped
    assert mapped is not None, f"the device's GID {probe.device.gid.hex()} is not IPv4"
    return str(mapped)


FLOOD_DEADLINE_S = 10.0  # each honest connect and put (the default handshake_timeout)


def _connect_put(cli: Engine, srv: Engine, src: Any, failures: list[str]) -> float | None:
    """Seconds one connect + put + disconnect took, or None (the failure appended)."""
    t0 = time.monotonic()
    try:
        cli.connect(srv.id, timeout=FLOOD_DEADLINE_S)
        cli.put(srv.id, src, "dst", timeout=FLOOD_DEADLINE_S)
        return time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - any failure counts, and is shown
        failures.append(f"{time.monotonic() - t0:.2f} s: {type(exc).__name__}: {exc}")
        return None
    finally:
        cli.disconnect(srv.id)


@pytest.mark.parametrize("sources", [1, 4], ids=["one-source", "four-sources"])
def test_idle_socket_flood_does_not_lock_out_peers(sources: int) -> None:
    """An attacker on loopback (all of 127.0.0.0/8 is one source) holds 200 idle sockets
    and re-opens each one the server refuses; an honest client from the host's own address
    still connects and puts, every time. The same pair without the flood, first, is the
    control the times are shown against."""
    port = free_tcp_port()
    host = _device_ipv4()
    token = secrets.token_hex(32)
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    attacker_ips = [f"127.0.0.{2 + i}" for i in range(sources)]
    proc = ctx.Process(target=_flood, args=(there, (host, port), attacker_ips, 200))
    proc.start()
    try:
        with (
            Engine(f"{host}:{port}", token=token) as srv,
            Engine(f"{host}:0", token=token) as cli,
        ):
            srv.register(np.zeros(4096, np.uint8), access=RW, name="dst")
            src = cli.register(np.ones(4096, np.uint8), access=Access.NONE)
            failures: list[str] = []
            control = [_connect_put(cli, srv, src, failures) for _ in range(5)]
            assert not failures, failures
            here.send("go")
            assert here.poll(30) and here.recv() == "holding"
            time.sleep(1.5)  # the server sees every idle socket by now
            attempts = 20
            times = [t for _ in range(attempts) if (t := _connect_put(cli, srv, src, failures))]
            here.send("stop")
            assert here.poll(30)
            stats = here.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    times.sort()
    print(
        f"flood from {sources} source(s): {len(times)}/{attempts} connect+put, median "
        f"{times[len(times) // 2] if times else 0:.3f} s, slowest {max(times, default=0):.3f} s; "
        f"without the flood (5): median {float(np.median([c or 0 for c in control])):.3f} s, "
        f"slowest {max(c or 0 for c in control):.3f} s; "
        f"attacker {stats}"
    )
    assert len(times) == attempts, (
        f"{len(times)} of {attempts} connect+put within {FLOOD_DEADLINE_S} s under a flood of "
        f"200 idle sockets from {sources} source(s) ({stats}); failures: {failures[:3]}"
    )


# --------------------------------------------------------------------------- 2. id takeover


def _put_loop(eng: Engine, peer: str, region: Any, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        eng.put(peer, region, "dst", timeout=10)
        out.append(time.monotonic() - t0)
        time.sleep(0.002)


# The impostor holds its handshake open this long before INFO: a listener whose handshake
# blocked the data path would stall the other peer's puts for about as long, where a put
# under emulation on a busy VM alone can take a fifth of a second.
TAKEOVER_HOLD_S = 2.0
TAKEOVER_STALL_S = 0.6


def test_id_takeover_is_refused_without_eviction_or_stall(server: Engine) -> None:
    with Engine(f"127.0.0.1:{free_tcp_port()}") as a, Engine(f"127.0.0.1:{free_tcp_port()}") as b:
        b_dst = np.zeros(4096, np.uint8)
        b.register(b_dst, access=RW, name="dst")
        src_a = a.register(np.full(4096, 7, np.uint8), access=Access.NONE)
        src_s = server.register(np.full(4096, 9, np.uint8), access=Access.NONE)
        a.connect(server.id)
        server.connect(b.id)
        stop, lat = threading.Event(), list[float]()
        worker = threading.Thread(target=_put_loop, args=(server, b.id, src_s, stop, lat))
        worker.start()
        try:
            time.sleep(0.5)
            before = len(lat)
            thief = raw_handshake(
                server.id, a.id, server.device.gid, timeout=10, hold=TAKEOVER_HOLD_S
            )
            assert thief.info_sent is not None, f"no CHALLENGE: {thief.received}"
            answered = time.monotonic() - thief.info_sent
            time.sleep(0.5)
            during = lat[before:]
        finally:
            stop.set()
            worker.join(15)
        codes = [e.code for e in errors(thief)]
        thief.close()
        state = server.connection(a.id).state if a.id in server.peers else None
        print(
            f"takeover: impostor answered {codes} after {answered:.3f} s; "
            f"{len(during)} puts to another peer meanwhile, slowest {max(during):.4f} s"
        )
        assert not accepted(thief), "the impostor was ACCEPTED and got the rkeys"
        assert codes == [wire.ErrorCode.ALREADY_CONNECTED], f"impostor got {codes}"
        assert answered < 1.0, f"the impostor waited {answered:.2f} s for its answer"
        assert state is ConnState.READY, f"the real peer's connection is {state}"
        assert a.connection(server.id).state is ConnState.READY
        a.put(server.id, src_a, "dst", timeout=5)
        assert during, "no put to another peer finished during the takeover attempt"
        assert max(during) < TAKEOVER_STALL_S, (
            f"puts to another peer stalled up to {max(during):.3f} s during the takeover "
            f"attempt ({len(during)} puts)"
        )


def test_honest_quick_reconnect_still_works(server: Engine, client: Engine) -> None:
    src = client.register(np.ones(4096, np.uint8), access=Access.NONE)
    for _ in range(5):
        t0 = time.monotonic()
        client.connect(server.id, timeout=5)
        client.put(server.id, src, "dst", timeout=5)
        client.disconnect(server.id)
        assert time.monotonic() - t0 < 3.0


# --------------------------------------------------------------------------- 3. notification flood


def test_rdma_notification_flood_waits_for_credits(server: Engine, client: Engine) -> None:
    """Nobody reads: the flooding sender runs out of credits and its calls time out; the
    receiver holds one grant of notifications, and the connection stays up."""
    client.connect(server.id)
    message = bytes(1000)
    gc.collect()
    rss0 = rss_bytes()
    sent, error = 0, None
    t0 = time.monotonic()
    try:
        while sent < 20_000:
            handles = [
                client.transfer_async(
                    server.id, [], notify="n", notify_message=message, timeout=1.0
                )
                for _ in range(64)
            ]
            for h in handles:
                h.wait(30)
            sent += len(handles)
    except HixlError as exc:
        error = exc
    took = time.monotonic() - t0
    grant = _grant(server)
    assert wait_for(lambda: server.diagnostics().notifications >= sent, 5) <= 5
    gc.collect()
    grown = rss_bytes() - rss0
    queued = len(server.notifications())
    print(f"notification flood: {sent} sent, {queued} queued, RSS +{grown / 2**20:.1f} MiB")
    assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB after {sent} notifications"
    assert isinstance(error, TransferTimeout) and "backlog" in str(error), repr(error)
    assert queued == sent == grant, (queued, sent, grant)
    assert took < 1.0 + 5.0, f"the sender was stopped after {took:.1f} s"
    assert client.connection(server.id).state is ConnState.READY
    client.notify(server.id, "after", timeout=5)  # taken: credits came back
    assert server.wait_notification("after", 5).peer == client.id


def _grant(receiver: Engine) -> int:
    return int(receiver._inbox.grant)


def _send_notes(sender: Engine, peer: str, count: int, timeout: float = 30) -> HixlError | None:
    try:
        for h in [
            sender.transfer_async(peer, [], notify="n", timeout=timeout) for _ in range(count)
        ]:
            h.wait(30)
    except HixlError as exc:
        return exc
    return None


def test_slow_reader_slows_senders_and_fails_nobody() -> None:
    """500 notifications against max_notifications_per_peer=50, read every 50 ms."""
    with (
        Engine(f"127.0.0.1:{free_tcp_port()}", max_notifications_per_peer=50) as srv,
        Engine() as a,
    ):
        a.connect(srv.id)
        got: list[str] = []
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                got.extend(n.peer for n in srv.notifications())
                time.sleep(0.05)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            error = _send_notes(a, srv.id, 500)
            assert wait_for(lambda: len(got) >= 500, 10) <= 10
        finally:
            stop.set()
            reader.join(10)
        assert error is None, f"the sender failed: {error}"
        assert got == [a.id] * 500, f"{len(got)} of 500 arrived"
        assert a.connection(srv.id).state is ConnState.READY
        assert srv.connection(a.id).state is ConnState.READY


def test_sender_out_of_credits_times_out_naming_the_backlog() -> None:
    with (
        Engine(f"127.0.0.1:{free_tcp_port()}", max_notifications_per_peer=50) as srv,
        Engine() as a,
    ):
        a.connect(srv.id)
        assert _send_notes(a, srv.id, 50) is None  # the whole grant
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"backlog.*the connection stays up"):
            a.notify(srv.id, "one-more", timeout=0.5)
        waited = time.monotonic() - t0
        assert 0.5 <= waited < 1.5, f"the notify gave up after {waited:.2f} s"
        assert a.connection(srv.id).state is ConnState.READY
        assert len(srv.notifications()) == 50  # taken: credits go back
        a.notify(srv.id, "one-more", timeout=5)
        assert srv.wait_notification("one-more", 5).peer == a.id


def test_global_cap_charges_the_peer_holding_the_most() -> None:
    """a sends its grant (40) and leaves; b sends 40 (80 in all: the cap); c's 40 then
    push out a's, the departed peer's, one by one (not b's, although b holds more than a
    after the first): nobody is cut off."""
    with (
        Engine(
            f"127.0.0.1:{free_tcp_port()}",
            max_notifications_per_peer=50,
            max_notifications=80,
            max_peers=2,
        ) as srv,
        Engine() as a,
        Engine() as b,
        Engine() as c,
    ):
        assert _grant(srv) == 40
        a.connect(srv.id)
        assert _send_notes(a, srv.id, 40) is None
        a.disconnect(srv.id)
        assert wait_for(lambda: a.id not in srv.peers, 5) <= 5
        b.connect(srv.id)
        assert _send_notes(b, srv.id, 40) is None
        c.connect(srv.id, timeout=10)
        assert _send_notes(c, srv.id, 40) is None
        assert wait_for(lambda: srv.diagnostics().notifications_dropped >= 40, 5) <= 5
        for eng in (b, c):
            assert eng.connection(srv.id).state is ConnState.READY, eng.connection(srv.id)
        notes = srv.notifications()
        assert srv.diagnostics().notifications_dropped == 40
        assert sorted(n.peer for n in notes) == sorted([b.id] * 40 + [c.id] * 40)


def test_tcp_notify_frames_are_not_accepted(server: Engine) -> None:
    c = raw_handshake(server.id, "127.0.0.1:0~bad", server.device.gid)
    assert accepted(c)
    body = b'{"name":"n","message":"' + b"00" * 4096 + b'"}'
    frame = struct.pack("!4sHHI", b"HIXL", wire.PROTOCOL_VERSION, 9, len(body)) + body
    gc.collect()
    rss0 = rss_bytes()
    sent = 0
    with contextlib.suppress(OSError):
        for _ in range(20_000):
            c.sock.sendall(frame)
            sent += 1
    time.sleep(1.0)
    gc.collect()
    grown = rss_bytes() - rss0
    notes = server.notifications()
    c.close()
    assert not notes, f"{len(notes)} TCP NOTIFY frames became notifications"
    assert grown < 8 << 20, f"RSS grew {grown / 2**20:.1f} MiB after {sent} NOTIFY frames"


# --------------------------------------------------------------------------- 4. max_peers


def test_max_peers_is_checked_before_any_rkey_is_sent() -> None:
    with Engine(f"127.0.0.1:{free_tcp_port()}", max_peers=2) as srv:
        srv.register(np.zeros(4096, np.uint8), access=RW, name="dst")
        with Engine("127.0.0.1:0") as p1, Engine("127.0.0.1:0") as p2:
            p1.connect(srv.id)
            p2.connect(srv.id)
            c = raw_handshake(srv.id, "127.0.0.1:0~abc", srv.device.gid)
            c.close()
            assert not accepted(c), "a peer over max_peers got an ACCEPT with the rkeys"
            assert errors(c) and "max_peers=2" in errors(c)[0].message
            with Engine("127.0.0.1:0") as p3:
                with pytest.raises(ConnectionFailed, match="max_peers=2"):
                    p3.connect(srv.id, timeout=5)
                assert p3.peers == []
            assert sorted(srv.peers) == sorted([p1.id, p2.id])


# --------------------------------------------------------------------------- 5-6. authentication


def test_no_proof_or_key_before_the_client_proves() -> None:
    with Engine(f"127.0.0.1:{free_tcp_port()}", token="abc123") as srv:
        srv.register(np.zeros(4096, np.uint8), access=RW, name="dst")
        c = raw_handshake(srv.id, "127.0.0.1:0~abc", srv.device.gid, proof=secrets.token_bytes(32))
        c.close()
        leaked = [
            (type(m).__name__, getattr(m, "proof", b"").hex())
            for m in c.received
            if getattr(m, "proof", b"") != b""
        ]
        assert not leaked, f"the server handed out proofs to an unproven client: {leaked}"
        assert not accepted(c)
        assert [e.code for e in errors(c)] == [wire.ErrorCode.AUTH]


def _bump_psn(msg: wire.Message) -> wire.Message:
    assert isinstance(msg, wire.Info | wire.Accept)
    return dataclasses.replace(msg, psn=(msg.psn + 1) % (1 << 24))


def _bad_rkey(msg: wire.Message) -> wire.Message:
    assert isinstance(msg, wire.Accept)
    r = msg.regions[0]
    return dataclasses.replace(msg, regions=(dataclasses.replace(r, rkey=r.rkey ^ 0xFF00),))


def _halve_mtu(msg: wire.Message) -> wire.Message:
    assert isinstance(msg, wire.Info | wire.Accept)
    return dataclasses.replace(msg, mtu=256)


TAMPERS: dict[str, tuple[str, type[Any], Callable[[wire.Message], wire.Message]]] = {
    "info-psn": ("up", wire.Info, _bump_psn),
    "info-mtu": ("up", wire.Info, _halve_mtu),
    "accept-psn": ("down", wire.Accept, _bump_psn),
    "accept-rkey": ("down", wire.Accept, _bad_rkey),
}


def _tamperer(case: str) -> Callable[[str, wire.Message], wire.Message]:
    way, kind, change = TAMPERS[case]
    return lambda w, msg: change(msg) if w == way and isinstance(msg, kind) else msg


@pytest.mark.parametrize("case", [None, *TAMPERS])
def test_tampered_transcript_is_rejected(case: str | None) -> None:
    token = secrets.token_hex(32)
    with Engine(f"127.0.0.1:{free_tcp_port()}", token=token) as srv, Engine(token=token) as cli:
        srv.register(np.zeros(4096, np.uint8), access=RW, name="dst")
        proxy = Proxy(srv.id, passthrough if case is None else _tamperer(case))
        try:
            # Dialled through the proxy as a port forward: the answer names srv.id.
            if case is None:  # the proxy itself changes nothing that matters
                cli.connect(srv.id, timeout=10, address=proxy.id)
                return
            with pytest.raises(HandshakeError):
                cli.connect(srv.id, timeout=10, address=proxy.id)
            assert cli.peers == []
        finally:
            proxy.close()


# --------------------------------------------------------------------------- 7. small items


def _fake_server(behaviour: str) -> tuple[str, threading.Thread, socket.socket]:
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            s, _ = lsock.accept()
            s.settimeout(5)
            dec = wire.Decoder()
            if behaviour == "close":
                s.close()
                return
            hello = dec.feed(s.recv(65536))
            if behaviour == "garbage":
                s.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            elif behaviour == "reset-after-info":
                assert isinstance(hello[0], wire.Hello)
                fields = challenge_fields("127.0.0.1:1", wire.make_nonce())
                s.sendall(wire.encode(wire.Challenge(**fields)))
                s.recv(65536)
            elif behaviour == "silent":
                time.sleep(3)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", t, lsock


@pytest.mark.parametrize(
    "behaviour", ["reset-after-hello", "reset-after-info", "close", "garbage", "silent"]
)
def test_connect_raises_only_hixl_errors(client: Engine, behaviour: str) -> None:
    peer, t, lsock = _fake_server(behaviour)
    t0 = time.monotonic()
    try:
        client.connect(peer, timeout=1.5)
    except HixlError:
        elapsed = time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - that is the failure under test
        pytest.fail(f"connect() raised {type(exc).__name__}: {exc}")
    else:
        pytest.fail("connect() to a broken server succeeded")
    finally:
        lsock.close()
        t.join(5)
    assert elapsed < 2.5, f"connect(timeout=1.5) took {elapsed:.2f} s"


class ResealingRkeyTamper:
    """A man in the middle of a connection without a token: it rewrites the region key in
    ACCEPT, then re-seals every later control message under the keys each end derived
    from the transcript it saw. Without a token those keys come from public values only,
    so neither end can notice (see :mod:`hixl.core.seal`)."""

    def __init__(self) -> None:
        self.seen: list[wire.Message] = []  # HELLO, CHALLENGE, INFO, ACCEPT as sent
        self.forged: wire.Message | None = None
        self.keys: dict[str, tuple[bytes, bytes]] = {}  # way -> (key checked, key re-sealed)

    def _derive(self) -> None:
        hello, challenge, info, accept = self.seen
        assert isinstance(hello, wire.Hello) and isinstance(challenge, wire.Challenge)
        assert isinstance(info, wire.Info) and isinstance(accept, wire.Accept)
        assert isinstance(self.forged, wire.Accept)
        server_cs, server_sc = seal.session_keys(None, hello, challenge, info, accept)
        client_cs, client_sc = seal.session_keys(None, hello, challenge, info, self.forged)
        self.keys = {"up": (client_cs, server_cs), "down": (server_sc, client_sc)}

    def __call__(self, way: str, msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.Hello | wire.Challenge | wire.Info | wire.Accept):
            self.seen.append(msg)
            if isinstance(msg, wire.Accept):
                self.forged = _bad_rkey(msg)
                return self.forged
            return msg
        if not isinstance(msg, wire.Sealed):
            return msg
        if not self.keys:
            self._derive()
        checked, resealed = self.keys[way]
        opener = seal.Opener(checked)
        opener.seq = msg.seq
        opener.open(msg)  # the original is genuine under its sender's key
        sealer = seal.Sealer(resealed)
        sealer.seq = msg.seq
        return wire.decode(sealer.seal(msg.frame))


def test_first_failing_request_reports_its_own_status(server: Engine, client: Engine) -> None:
    # A peer that announces a wrong key (here a proxy rewrites it; without a token nobody
    # can notice): every work request of the put fails, and the first one is not signaled.
    proxy = Proxy(server.id, ResealingRkeyTamper())
    try:
        src = client.register(np.ones(1 << 16, np.uint8), access=Access.NONE)
        client.connect(server.id, timeout=10, address=proxy.id)
        desc = StridedDesc(offset=0, count=32, size=256, stride=1024)
        with pytest.raises(CompletionError) as info:
            client.put(server.id, src, "dst", local_desc=desc, remote_desc=desc, timeout=10)
        assert info.value.status_name == "IBV_WC_REM_ACCESS_ERR", str(info.value)
    finally:
        proxy.close()


def test_notification_after_reads_is_fenced(
    server: Engine, client: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    # rxe executes a READ's responses before a later SEND, so the missing fence cannot be
    # seen in the data there; the engine's debug log says how each notification was posted.
    dst = client.register(np.zeros(4096, np.uint8), access=Access.LOCAL_WRITE)
    client.connect(server.id)
    with caplog.at_level(logging.DEBUG, logger="hixl.engine"):
        req = TransferRequest(op="read", local=dst, remote="dst")
        client.transfer(server.id, [req], notify="read-done")
        client.notify(server.id, "plain")
    server.wait_notification("read-done", timeout=10)
    posted = [r.getMessage() for r in caplog.records if "notification" in r.getMessage()]
    assert any("read-done" in m and "fenced" in m for m in posted), posted
    assert not any("plain" in m and "fenced" in m for m in posted), posted


@pytest.mark.parametrize("token", ["", b""])
def test_empty_token_is_refused(token: str | bytes) -> None:
    with pytest.raises(ArgumentError, match="token"):
        Engine("127.0.0.1:0", token=token)


@pytest.mark.parametrize(
    ("server_token", "client_token", "phrase"),
    [
        ("s3cret", None, "requires a token"),
        (None, "s3cret", "has no token"),
        ("s3cret", "wrong", "does not match"),
    ],
)
def test_auth_failures_blame_the_right_side(
    server_token: str | None, client_token: str | None, phrase: str
) -> None:
    with (
        Engine(f"127.0.0.1:{free_tcp_port()}", token=server_token) as srv,
        Engine(token=client_token) as cli,
    ):
        with pytest.raises(HandshakeError) as info:
            cli.connect(srv.id, timeout=5)
        assert phrase in str(info.value)
        assert "could not prove" not in str(info.value)


def test_wait_notification_on_a_closed_engine_raises_state_error() -> None:
    eng = Engine("127.0.0.1:0")
    caught: list[BaseException] = []

    def waiter() -> None:
        try:
            eng.wait_notification("never", timeout=20)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            caught.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    eng.close()
    t.join(5)
    assert caught and isinstance(caught[0], StateError), caught
    assert time.monotonic() - t0 < 2
    with pytest.raises(StateError):
        eng.wait_notification("never", timeout=1)


def _register_many(eng: Engine, buf: np.ndarray, n: int, budget: float) -> list[float]:
    """Register ``n`` 256-byte remote regions of ``buf``; per-call times in seconds."""
    times: list[float] = []
    start = time.monotonic()
    for i in range(n):
        t0 = time.monotonic()
        eng.register(buf[i * 256 : (i + 1) * 256], access=RW)
        times.append(time.monotonic() - t0)
        if time.monotonic() - start > budget:
            pytest.fail(
                f"registering {n} regions took over {budget} s: call #{i + 1} took "
                f"{times[-1] * 1e3:.1f} ms, call #1 {times[0] * 1e3:.1f} ms"
            )
    return times


def test_register_cost_does_not_grow_with_regions(server: Engine, client: Engine) -> None:
    client.connect(server.id)  # a peer to tell about each new region
    buf = np.zeros(1000 * 256, np.uint8)
    times = _register_many(server, buf, 1000, budget=60)
    first = float(np.median(times[:100]))
    last = float(np.median(times[-100:]))
    print(f"register(): median {first * 1e3:.2f} ms (1-100), {last * 1e3:.2f} ms (901-1000)")
    assert last < 3 * first + 0.001, (
        f"register() median {first * 1e3:.2f} ms for regions 1-100, {last * 1e3:.2f} ms "
        "for regions 901-1000"
    )
    deadline = time.monotonic() + 10
    while len(client.connection(server.id).remote_regions) < 1001:
        assert time.monotonic() < deadline, "the peer did not learn of every region"
        time.sleep(0.05)


def test_exposed_region_limit_fails_that_register(server: Engine) -> None:
    limit = wire.MAX_REGIONS
    buf = np.zeros((limit + 1) * 256, np.uint8)
    _register_many(server, buf, limit - 1, budget=60)  # "dst" is one already
    with pytest.raises(RegistrationError, match=str(limit)):
        server.register(buf[limit * 256 :], access=RW)
    server.register(buf[limit * 256 :], access=Access.LOCAL_WRITE)  # local ones are fine
    with Engine("127.0.0.1:0") as late:
        conn = late.connect(server.id, timeout=30)
        assert len(conn.remote_regions) == limit
