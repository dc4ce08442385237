"""A hixl engine in its own process, driven by commands over a pipe.

The process is forked from the test process (before it opens a device for
itself), so it starts in milliseconds even under emulation, yet it is a real
separate process: its own address space, verbs context, queue pairs and
registered memory.  It registers ``size`` bytes as region ``buf`` (remote
read and write), filled from ``seed`` (zeros without one).  Every call on
:class:`PeerProcess` has a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def _serve(pipe: Connection, engine_id: str, size: int, seed: int | None) -> None:
    from hixl import Access, ContiguousDesc, Engine, HixlError, StridedDesc

    eng = Engine(engine_id)
    buf = np.zeros(size, np.uint8)
    if seed is not None:
        buf[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    eng.register(buf, access=Access.REMOTE_READ | Access.REMOTE_WRITE, name="buf")
    scratch = np.zeros(size, np.uint8)
    rscratch = eng.register(scratch)
    pipe.send({"ready": eng.id, "pid": os.getpid()})
    while True:
        req = pipe.recv()
        reply: dict[str, Any] = {"ok": True}
        try:
            if req["cmd"] == "quit":
                break
            if req["cmd"] == "sha":
                reply["sha"] = hashlib.sha256(buf.tobytes()).hexdigest()
            elif req["cmd"] == "wait":
                note = eng.wait_notification(req["name"], timeout=req["timeout"])
                # Hash the buffer the moment the notification is seen.
                reply.update(
                    peer=note.peer,
                    message=note.message.hex(),
                    sha=hashlib.sha256(buf.tobytes()).hexdigest(),
                )
            elif req["cmd"] == "get":
                count, size_, stride = req["count"], req["size"], req["stride"]
                scratch[:] = 0
                eng.get(
                    req["peer"],
                    rscratch,
                    req["remote"],
                    local_desc=ContiguousDesc(offset=0, nbytes=count * size_),
                    remote_desc=StridedDesc(
                        offset=req["offset"], count=count, size=size_, stride=stride
                    ),
                    timeout=req["timeout"],
                )
                reply["sha"] = hashlib.sha256(scratch[: count * size_].tobytes()).hexdigest()
            else:
                reply = {"ok": False, "error": f"unknown command {req['cmd']!r}"}
        except HixlError as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        pipe.send(reply)
    eng.close()


class PeerProcess:
    """Test-side handle on a peer process."""

    def __init__(self, engine_id: str, size: int, seed: int | None = None) -> None:
        ctx = mp.get_context("fork")
        self._pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, engine_id, size, seed), daemon=True)
        self.proc.start()
        child.close()
        self.id = ""

    def wait_ready(self, timeout: float = 60.0) -> str:
        self.id = str(self._read(timeout)["ready"])
        return self.id

    def _read(self, timeout: float) -> dict[str, Any]:
        if not self._pipe.poll(timeout):
            raise TimeoutError(f"peer process {self.proc.pid} silent for {timeout} s")
        try:
            return dict(self._pipe.recv())
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"peer process exited with {self.proc.exitcode}") from None

    def call(self, deadline: float = 60.0, **req: Any) -> dict[str, Any]:
        """Send one command; wait at most ``deadline`` seconds for its reply."""
        self._pipe.send(req)
        return self._read(deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, TimeoutError, RuntimeError, EOFError):
                self.call(deadline=10, cmd="quit")
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
        self._pipe.close()
