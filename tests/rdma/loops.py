"""A call repeated on a thread of its own until it raises, and the killed-peer check that
the blocking paths (direct posts, channels) share."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from hixl import Access, ConnectionFailed, ConnState, Engine, Region, TransferTimeout
from hixl.testbed.net import free_tcp_port

from .peerproc import PeerProcess


class UntilError:
    """Calls ``call`` again and again on its own thread until it raises.

    ``calls`` counts the calls that returned; ``errors`` holds what the last one raised
    (one item once the thread has ended).
    """

    def __init__(self, call: Callable[[], object]) -> None:
        self.calls = 0
        self.errors: list[BaseException] = []
        self._call = call
        self._done_one = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._call()
                self.calls += 1
                self._done_one.set()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.errors.append(exc)

    def wait_first(self, timeout: float) -> bool:
        """True once a call has returned; False after ``timeout`` seconds without one."""
        return self._done_one.wait(timeout)

    def join(self, timeout: float) -> float:
        """Wait for the thread to end; the seconds it took (the thread may still run)."""
        t0 = time.monotonic()
        self.thread.join(timeout)
        return time.monotonic() - t0


def killing_the_peer_ends_the_loop(
    start: Callable[[Engine, str, Region], Callable[[], object]],
    check: Callable[[Engine], None] | None = None,
) -> None:
    """A peer process is killed while a thread loops on ``start(client, peer, region)()``
    (8 MiB a call, 3 s timeouts): the call under way, or the next, ends with an error
    naming the peer, within 10 s, and the connection is FAILED.  ``check`` runs once a
    call has returned, before the kill."""
    victim = PeerProcess(f"127.0.0.1:{free_tcp_port()}", 8 << 20)
    try:
        victim.wait_ready()
        with Engine("127.0.0.1:0") as client:
            r = client.register(np.ones(8 << 20, np.uint8), access=Access.NONE)
            conn = client.connect(victim.id, timeout=30)
            loop = UntilError(start(client, victim.id, r))
            assert loop.wait_first(30), f"no call returned before the kill: {loop.errors}"
            if check is not None:
                check(client)
            victim.kill()
            took = loop.join(30)
            assert not loop.thread.is_alive(), "a call to a dead peer never ended"
            assert took < 10, f"the loop took {took:.1f} s to end"
            assert len(loop.errors) == 1, loop.errors
            err = loop.errors[0]
            assert isinstance(err, ConnectionFailed | TransferTimeout), err
            assert victim.id in str(err)
            assert conn.state is ConnState.FAILED
    finally:
        victim.close()
