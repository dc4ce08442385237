"""The far ends of the four-host fleet tests: run on host1..host3, driven from host0.

``make test-fleet`` starts this on every host but host0, where ``tests/fleet`` runs. It
serves one control channel (JSON lines, :class:`hixl.testbed.hosts.Control`) on
``HIXL_HOST_ADDR:CONTROL_PORT`` and answers ``{"op": ..., ...}`` with ``{"ok": true, ...}``
or ``{"error": "..."}``. Every wait has a deadline; an agent nobody talks to for ``IDLE_S``
seconds exits 1, so a driver that dies never leaves it hanging.

Ops: ``spawn`` (a fleet worker, ``python -m hixl.demo.fleet ...``, its output copied here
with a prefix), ``said`` (has it printed a line starting with some text), ``wait``
and ``term`` (its exit status), ``read`` (a file this host
wrote, such as a worker's result), ``engine`` (a named engine in this process with one
region ``data``), ``sha`` (of that region), ``set_capacity``, ``restart`` (close the engine
and open a new one with the same name and address: a new process, as peers see it),
``close_engine``, ``vanish`` (freeze a spawned worker at once, answer, then have this
host cut off the wire), ``bye``. Engines and workers use the run's shared token
(``$HIXL_FLEET_TOKEN``).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from hixl import Access, Engine, HixlError
from hixl.demo.fleet import fleet_token
from hixl.errors import RegistryUnavailable
from hixl.testbed.hosts import Control, HostEnv, vanish

CONTROL_PORT = 7200
IDLE_S = 600.0
ACCEPT_S = 600.0


def pattern(seed: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The seeded bytes every host can compute (same numpy on all: shared root fs)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha(buf: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


def _copy(tag: str, stream: IO[bytes], seen: dict[str, list[str]]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        print(f"[{tag}] {line}", flush=True)
        if len(seen[tag]) < 10_000:
            seen[tag].append(line)


class Agent:
    def __init__(self, host: HostEnv) -> None:
        self.host = host
        self.token = fleet_token()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lines: dict[str, list[str]] = {}
        self.engine: Engine | None = None
        self.engine_args: dict[str, Any] = {}
        self.buf: npt.NDArray[np.uint8] | None = None

    def open_engine(self) -> dict[str, Any]:
        a = self.engine_args
        eng = Engine(
            a["listen"],
            name=a["name"],
            role=a.get("role", "store"),
            capacity=int(a.get("capacity", 1)),
            registry=a["url"],
            token=self.token,
        )
        self.buf = np.zeros(int(a["nbytes"]), np.uint8)
        eng.register(self.buf, access=Access.REMOTE_WRITE | Access.REMOTE_READ, name="data")
        self.engine = eng
        assert eng.registry is not None
        return {"id": eng.id, "instance": eng.registry.instance}

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def handle(self, req: dict[str, Any], ctl: Control) -> dict[str, Any]:
        op = req["op"]
        if op == "spawn":
            tag = str(req["tag"])
            if tag in self.procs and self.procs[tag].poll() is None:
                raise HixlError(f"{tag} is already running")
            proc = subprocess.Popen(
                [str(x) for x in req["argv"]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),
            )
            assert proc.stdout is not None
            self.lines[tag] = []
            threading.Thread(target=_copy, args=(tag, proc.stdout, self.lines), daemon=True).start()
            self.procs[tag] = proc
            return {"pid": proc.pid}
        if op in ("wait", "term"):
            proc = self.procs[str(req["tag"])]
            if op == "term" and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                return {"rc": proc.wait(timeout=float(req.get("seconds", 30.0)))}
            except subprocess.TimeoutExpired:
                raise HixlError(
                    f"{req['tag']} still running after {req.get('seconds')} s"
                ) from None
        if op == "said":  # has the worker printed a line starting with this yet?
            lines = list(self.lines.get(str(req["tag"]), []))
            return {"said": any(x.startswith(str(req["text"])) for x in lines)}
        if op == "read":
            return {"text": Path(str(req["path"])).read_text()}
        if op == "engine":
            self.close_engine()
            self.engine_args = dict(req)
            return self.open_engine()
        if op == "restart":
            self.close_engine()
            return self.open_engine()
        if op == "close_engine":
            self.close_engine()
            return {}
        if op == "sha":
            assert self.buf is not None
            return {"sha": sha(self.buf)}
        if op == "set_capacity":
            if self.engine is None:
                raise HixlError("no engine: send 'engine' first")
            try:
                self.engine.set_capacity(int(req["capacity"]))
            except RegistryUnavailable as exc:
                return {"kept": True, "reason": str(exc)}
            return {"kept": False}
        if op == "vanish":
            victim = req.get("tag")
            if victim is not None:  # frozen first: it answers nothing, refreshes nothing
                self.procs[str(victim)].send_signal(signal.SIGSTOP)
            ctl.send({"ok": True})
            print(f"agent: {victim or 'nothing'} frozen; cutting this host off", flush=True)
            vanish(f"the fleet test cut host{self.host.index} off with {victim} on it")
        raise HixlError(f"unknown op {op!r}")

    def close(self) -> None:
        self.close_engine()
        for tag, proc in self.procs.items():
            if proc.poll() is None:
                print(f"agent: stopping {tag}", flush=True)
                proc.kill()
                proc.wait(10)


def main() -> int:
    host = HostEnv.from_environ()
    agent = Agent(host)
    print(f"agent: host{host.index} {host.address}, control on :{CONTROL_PORT}", flush=True)
    try:
        with Control.serve(host.address, CONTROL_PORT, timeout=ACCEPT_S) as ctl:
            print(f"agent: driver {ctl.peer} connected", flush=True)
            ctl.answer(agent.handle, IDLE_S)
    finally:
        agent.close()
    print("agent: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
