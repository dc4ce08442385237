"""The far end of the two-host tests: a hixl engine on host1, driven from host0.

Run on host1 of a two-host run (``make test-hosts`` starts it). It serves one control
channel (JSON lines, :class:`hixl.testbed.hosts.Control`) on ``HIXL_HOST_ADDR:CONTROL_PORT``
and answers requests ``{"op": ..., ...}`` with ``{"ok": true, ...}`` or
``{"error": "..."}``. Every wait has a deadline; an agent nobody talks to for
``IDLE_S`` seconds exits 1, so a driver that dies never leaves it hanging.

Ops: ``engine`` (open a listening engine), ``register`` (a buffer, zeros or seeded
random bytes), ``sha`` (of a buffer), ``wait_note``, ``notify``, ``conn`` (state and MTU
of the connection to a peer), ``port`` (this host's rxe port), ``link_flap`` (NIC down
for a while, then up, in the background), ``wait_active``, ``vanish_when_written``
(power the host off as soon as a transfer starts landing), ``put_loop_start`` /
``put_loop_stop`` (4 KiB puts to a peer's region in a loop, with their latencies), ``bye``.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from hixl import Access, Engine, HixlError
from hixl.testbed.hosts import Control, HostEnv, set_link, vanish
from hixl.verbs.devices import select_device

CONTROL_PORT = 7100
ENGINE_PORT = 5000
IDLE_S = 400.0
ACCEPT_S = 400.0


def pattern(seed: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The seeded bytes both hosts can compute (same numpy on both: shared root fs)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha(buf: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(buf.tobytes()).hexdigest()


def port_state() -> dict[str, Any]:
    """This host's rxe port as hixl would pick it (raises DeviceError if none)."""
    sel = select_device()
    return {
        "device": sel.device.name,
        "state": sel.port.state,
        "active_mtu": sel.port.active_mtu,
        "gid_index": sel.gid.index,
        "ipv4": sel.gid.ipv4,
    }


class Agent:
    def __init__(self, host: HostEnv) -> None:
        self.host = host
        self.engine: Engine | None = None
        self.buffers: dict[str, npt.NDArray[np.uint8]] = {}
        self.flap: threading.Thread | None = None
        self.put_loop: tuple[threading.Thread, threading.Event, list[float]] | None = None

    def start_put_loop(self, peer: str, name: str) -> dict[str, Any]:
        """Put 4 KiB into ``peer``'s region ``name`` again and again, timing each put."""
        if self.put_loop is not None:
            raise HixlError("a put loop is already running")
        eng = self.eng()
        _wait_region(eng, peer, name, 20.0)
        stop, lat = threading.Event(), list[float]()
        thread = threading.Thread(target=_put_loop, args=(eng, peer, name, stop, lat))
        thread.start()
        self.put_loop = (thread, stop, lat)
        return {}

    def eng(self) -> Engine:
        if self.engine is None:
            raise HixlError("no engine yet: send 'engine' first")
        return self.engine

    def handle(self, req: dict[str, Any], ctl: Control) -> dict[str, Any]:
        op = req["op"]
        if op == "engine":
            if self.engine is not None:
                self.engine.close()
            self.buffers.clear()
            self.engine = Engine(
                f"{self.host.address}:{req.get('port', ENGINE_PORT)}",
                qp_timeout=int(req.get("qp_timeout", 14)),
                insecure=True,  # these tests are of the wire, not of authentication
            )
            return {"id": self.engine.id}
        if op == "register":
            n = int(req["nbytes"])
            seed = req.get("seed")
            buf = pattern(int(seed), n) if seed is not None else np.zeros(n, np.uint8)
            self.buffers[req["name"]] = buf
            self.eng().register(
                buf, access=Access.REMOTE_WRITE | Access.REMOTE_READ, name=req["name"]
            )
            return {"sha": sha(buf)}
        if op == "sha":
            return {"sha": sha(self.buffers[req["name"]])}
        if op == "wait_note":
            note = self.eng().wait_notification(req["name"], timeout=float(req["seconds"]))
            return {"peer": note.peer, "message": note.message.hex()}
        if op == "notify":
            self.eng().notify(req["peer"], req["name"], bytes.fromhex(req.get("message", "")))
            return {}
        if op == "conn":
            conn = self.eng().connection(req["peer"])
            return {"state": conn.state.name, "mtu": conn.mtu}
        if op == "port":
            return port_state()
        if op == "put_loop_start":
            return self.start_put_loop(str(req["peer"]), str(req["name"]))
        if op == "put_loop_stop":
            if self.put_loop is None:
                raise HixlError("no put loop running")
            thread, stop, lat = self.put_loop
            stop.set()
            thread.join(timeout=30)
            self.put_loop = None
            return {"count": len(lat), "max_s": max(lat, default=0.0), "alive": thread.is_alive()}
        if op == "link_flap":
            # The answer travels over the link being taken down, so it goes first: the
            # link drops ``after_s`` later and comes back ``down_s`` after that.
            after_s, down_s = float(req["after_s"]), float(req["down_s"])

            def flap() -> None:
                time.sleep(after_s)
                set_link(self.host.netdev, up=False)
                print(f"agent: {self.host.netdev} down for {down_s:.0f} s", flush=True)
                time.sleep(down_s)
                set_link(self.host.netdev, up=True)
                print(f"agent: {self.host.netdev} up", flush=True)

            self.flap = threading.Thread(target=flap, name="link-flap", daemon=True)
            self.flap.start()
            return {"netdev": self.host.netdev}
        if op == "wait_active":
            deadline = time.monotonic() + float(req["seconds"])
            if self.flap is not None:
                self.flap.join(timeout=float(req["seconds"]))
            last: Exception | None = None
            while time.monotonic() < deadline:
                try:
                    state = port_state()
                    if state["state"] == "ACTIVE":
                        return state
                except HixlError as exc:
                    last = exc
                time.sleep(0.2)
            raise HixlError(f"port not ACTIVE with a GID in {req['seconds']} s: {last}")
        if op == "vanish_when_written":
            buf = self.buffers[req["name"]]
            deadline = time.monotonic() + float(req["seconds"])
            ctl.send({"ok": True})
            while buf[0] == 0:  # the first bytes of the put landed
                if time.monotonic() > deadline:
                    print("agent: no data arrived before the vanish deadline", flush=True)
                    sys.exit(1)
                time.sleep(0.001)
            landed_all = bool(buf[-1] != 0)
            print(f"agent: data is landing (all landed: {landed_all}); powering off", flush=True)
            vanish(f"asked to vanish mid-transfer; the last byte had landed: {landed_all}")
        raise HixlError(f"unknown op {op!r}")


def _wait_region(eng: Engine, peer: str, name: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            eng.connection(peer).remote_region(name)
            return
        except HixlError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _put_loop(eng: Engine, peer: str, name: str, stop: threading.Event, lat: list[float]) -> None:
    src = eng.register(pattern(5, 4096), access=Access.NONE)
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            eng.put(peer, src, name, timeout=30)
        except HixlError as exc:
            print(f"agent: put loop: {exc}", flush=True)
            lat.append(float("inf"))
            return
        lat.append(time.monotonic() - t0)
        time.sleep(0.002)


def main() -> int:
    host = HostEnv.from_environ()
    agent = Agent(host)
    print(f"agent: host{host.index} {host.address}, control on :{CONTROL_PORT}", flush=True)
    with Control.serve(host.address, CONTROL_PORT, timeout=ACCEPT_S) as ctl:
        print(f"agent: driver {ctl.peer} connected", flush=True)
        ctl.answer(agent.handle, IDLE_S)
    if agent.engine is not None:
        agent.engine.close()
    print("agent: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
