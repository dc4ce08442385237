"""Prefill and decode in separate processes: 8 peers, strided puts and gets, notifications."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Iterator

import numpy as np
import pytest

from hixl import Access, ConnState, ContiguousDesc, Engine, StridedDesc, TransferHandle
from hixl.errors import ConnectionFailed, TransferTimeout
from hixl.testbed.net import free_tcp_port

from .peerproc import PeerProcess

PEERS = 8
HEADS, TOKENS, HEAD_BYTES, STRIDE = 16, 32, 192, 256  # fp16 head_dim 96, padded to 256
SIZE = HEADS * TOKENS * STRIDE


@pytest.fixture
def decoders() -> Iterator[list[PeerProcess]]:
    procs = [PeerProcess(f"127.0.0.1:{free_tcp_port()}", SIZE) for _ in range(PEERS)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.close()


def test_prefill_to_eight_decode_processes(decoders: list[PeerProcess]) -> None:
    with Engine(f"127.0.0.1:{free_tcp_port()}") as prefill:
        layers = [
            np.random.default_rng(i).integers(0, 256, HEADS * TOKENS * HEAD_BYTES, dtype=np.uint8)
            for i in range(PEERS)
        ]
        regions = [
            prefill.register(layer, access=Access.REMOTE_READ, name=f"layer{i}")
            for i, layer in enumerate(layers)
        ]
        for d in decoders:
            prefill.connect(d.id, timeout=30)
        # One strided put per decoder: packed rows into 256-byte padded rows, then notify.
        handles = [
            prefill.put_async(
                d.id,
                regions[i],
                "buf",
                remote_desc=StridedDesc(
                    offset=0, count=HEADS * TOKENS, size=HEAD_BYTES, stride=STRIDE
                ),
                notify=f"req1/layer{i}",
                notify_message=bytes([i]),
            )
            for i, d in enumerate(decoders)
        ]
        for i, d in enumerate(decoders):
            expect = np.zeros(SIZE, np.uint8)
            expect.reshape(-1, STRIDE)[:, :HEAD_BYTES] = layers[i].reshape(-1, HEAD_BYTES)
            got = d.call(cmd="wait", name=f"req1/layer{i}", timeout=60)
            assert got["ok"], got
            assert got["peer"] == prefill.id and got["message"] == f"{i:02x}"
            # The bytes are checked inside the decode process the moment it saw the notice.
            assert got["sha"] == hashlib.sha256(expect.tobytes()).hexdigest()
        for h in handles:
            h.wait(60)
        # Reverse direction on the same connections: each decoder reads head 3 of every
        # token of its layer straight out of the prefill process (strided get).
        for i, d in enumerate(decoders):
            got = d.call(
                cmd="get",
                peer=prefill.id,
                remote=f"layer{i}",
                offset=3 * 64,
                count=TOKENS,
                size=64,
                stride=HEADS * HEAD_BYTES,
                timeout=60,
            )
            assert got["ok"], got
            rows = layers[i].reshape(TOKENS, HEADS * HEAD_BYTES)[:, 3 * 64 : 4 * 64]
            assert got["sha"] == hashlib.sha256(rows.tobytes()).hexdigest()


def test_engine_accepts_eight_incoming_peers() -> None:
    with Engine(f"127.0.0.1:{free_tcp_port()}") as server:
        dst = np.zeros(PEERS * 4096, np.uint8)
        server.register(dst, access=Access.REMOTE_WRITE, name="dst")
        clients = [Engine("127.0.0.1:0") for _ in range(PEERS)]
        try:
            for i, c in enumerate(clients):
                src = np.full(4096, i + 1, np.uint8)
                r = c.register(src, access=Access.NONE)
                c.connect(server.id)
                c.put(server.id, r, "dst", remote_desc=ContiguousDesc(offset=i * 4096, nbytes=4096))
            # The server adopts a connection when its handshake thread reads READY, which
            # may come a moment after the client's first put has already landed.
            want = sorted(c.id for c in clients)
            deadline = time.monotonic() + 10
            while sorted(server.peers) != want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sorted(server.peers) == want
            assert np.array_equal(dst.reshape(PEERS, 4096)[:, 0], np.arange(1, PEERS + 1))
        finally:
            for c in clients:
                c.close()


def test_peer_killed_mid_transfer() -> None:
    victim = PeerProcess(f"127.0.0.1:{free_tcp_port()}", 8 << 20)
    survivor = PeerProcess(f"127.0.0.1:{free_tcp_port()}", 4096)
    try:
        victim.wait_ready()
        survivor.wait_ready()
        with Engine("127.0.0.1:0") as prefill:
            big = np.ones(8 << 20, np.uint8)
            r = prefill.register(big, access=Access.NONE)
            prefill.connect(victim.id, timeout=30)
            prefill.connect(survivor.id, timeout=30)
            # Keep four 8 MiB puts in flight until the kill has taken effect: a fixed batch
            # can finish before the kill on a fast host, and then nothing is mid-transfer.
            # The kill runs on its own thread (it waits for the process to go), so the
            # stream stays full while the peer dies.
            live: deque[TransferHandle] = deque()
            failed: list[BaseException] = []
            handle_failed = False
            killed_at: list[float] = []

            def kill() -> None:
                killed_at.append(time.monotonic())
                victim.kill()

            def settle(h: TransferHandle) -> bool:
                try:
                    h.wait(30)
                except (ConnectionFailed, TransferTimeout) as exc:
                    failed.append(exc)
                    return True
                return False

            killer = threading.Timer(0.2, kill)
            killer.start()
            try:
                while not failed:
                    if killed_at:
                        assert time.monotonic() - killed_at[0] < 25, "puts succeed after the kill"
                    if len(live) == 4:
                        handle_failed |= settle(live.popleft())
                        continue
                    try:
                        live.append(prefill.put_async(victim.id, r, "buf", timeout=20))
                    except ConnectionFailed as exc:
                        failed.append(exc)
                while live:
                    handle_failed |= settle(live.popleft())
            finally:
                killer.join(15)
            assert killed_at and time.monotonic() - killed_at[0] < 25
            assert handle_failed, "no transfer under way when the peer died ended in an error"
            for err in failed:
                assert victim.id in str(err)  # the error names the peer that went away
            assert prefill.connection(victim.id).state is ConnState.FAILED
            with pytest.raises(ConnectionFailed):
                prefill.put(victim.id, r, "buf", timeout=5)
            # the engine still serves the other peer
            prefill.put(
                survivor.id, r, "buf", local_desc=ContiguousDesc(offset=0, nbytes=4096), timeout=30
            )
            assert (
                survivor.call(cmd="sha")["sha"]
                == hashlib.sha256(np.ones(4096, np.uint8).tobytes()).hexdigest()
            )
    finally:
        victim.close()
        survivor.close()
