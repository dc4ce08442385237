"""Several hosts: one VM per host, each with its own kernel, NIC and rxe, on one wire.

Theory of operation
-------------------
:func:`plan_hosts` turns N commands into N :class:`~hixl.testbed.vm.GuestSpec` values (pure: no
I/O). Host ``i`` is named ``host<i>``, gets the NIC ``52:54:00:88:00:<i+1>`` with
``10.88.0.<i+1>/24`` and the MTU asked for, and its command sees

* ``HIXL_HOST_INDEX`` (``i``), ``HIXL_HOSTS`` (N), ``HIXL_HOST_ADDR`` (its IPv4),
* ``HIXL_PEER_ADDRS`` (the other hosts' IPv4s, comma separated, in index order),
* ``HIXL_HOST_NETDEV`` (the guest's interface name, set by the guest agent).

Every host's QEMU has a UDP socket netdev on its own 127.0.0.1 port. Two hosts send
their frames to each other's port; three or more send them to their own port of a
:class:`FrameHub`, a thread in the runner that passes every datagram on to all the
other hosts (an Ethernet hub). Each frame one guest sends arrives at the others as is,
so the RoCEv2 packets cross a real (virtual) Ethernet between kernels: MTU, ARP, GIDs
and routing are the real ones, and a guest whose VM is cut off (:func:`vanish`) is gone
without a TCP FIN, as a crashed machine would be. Datagrams never block a QEMU or the
hub (see :class:`~hixl.testbed.vm.GuestNet`); one that finds no room is dropped, as on a
congested wire.

:func:`run_hosts` boots them all with :func:`hixl.testbed.vm.run_guests` (same deadlines,
output prefixed per host, all VMs killed at the end); the run fails when any host's
command fails. A host that is *meant* to disappear calls :func:`vanish`, which leaves a
note for the runner; the runner kills that guest's VM at once and reports it as exit 0.

Inside a host, :class:`HostEnv` reads the variables above and :class:`Control` is a
small JSON-lines channel over TCP for one host to drive another (tests, benchmarks),
with a deadline on every wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hixl.errors import ArgumentError, HixlError, TransferTimeout
from hixl.testbed.net import free_udp_port
from hixl.testbed.vm import VANISHED, GuestNet, GuestSpec, VMConfig, run_guests

__all__ = [
    "SUBNET",
    "Control",
    "FrameHub",
    "HostEnv",
    "host_address",
    "host_mac",
    "plan_hosts",
    "run_hosts",
    "set_link",
    "vanish",
]

SUBNET = "10.88.0"
PREFIX_LEN = 24
MAX_HOSTS = 8


def host_address(index: int) -> str:
    """The IPv4 address of host ``index`` (0-based): ``10.88.0.<index+1>``."""
    if not 0 <= index < 254:
        raise ArgumentError(f"host index out of range: {index} (0..253)")
    return f"{SUBNET}.{index + 1}"


def host_mac(index: int) -> str:
    """The MAC of host ``index``'s NIC (locally administered QEMU range)."""
    if not 0 <= index < 254:
        raise ArgumentError(f"host index out of range: {index} (0..253)")
    return f"52:54:00:88:00:{index + 1:02x}"


def host_mtus(count: int, mtus: Sequence[int]) -> list[int]:
    if not mtus:
        return [1500] * count
    if len(mtus) == 1:
        return [mtus[0]] * count
    if len(mtus) != count:
        raise ArgumentError(
            f"give one MTU for all hosts or one per host: {count} hosts, "
            f"{len(mtus)} MTUs {list(mtus)}"
        )
    return list(mtus)


def plan_hosts(
    commands: Sequence[Sequence[str]],
    *,
    ports: int | Sequence[int],
    hub_ports: Sequence[int] = (),
    mtus: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
) -> list[GuestSpec]:
    """The guests for a multi-host run: ``commands[i]`` runs on host ``i``.

    ``ports`` are the hosts' own 127.0.0.1 UDP ports (one per host, or the first of
    consecutive ones). Two hosts send to each other's port; more hosts need
    ``hub_ports`` (a :class:`FrameHub`'s, one per host) and send there. ``mtus`` is
    empty (1500), one MTU for all hosts, or one per host; ``env`` is added to every
    command's environment. Raises :class:`ArgumentError` for a bad count, command, MTU
    or port list.
    """
    count = len(commands)
    if not 2 <= count <= MAX_HOSTS:
        raise ArgumentError(f"a multi-host run needs 2..{MAX_HOSTS} hosts, got {count}")
    for i, cmd in enumerate(commands):
        if not cmd:
            raise ArgumentError(f"host {i} has an empty command")
    mtu = host_mtus(count, mtus)
    for i, m in enumerate(mtu):
        if not 576 <= m <= 9000:
            raise ArgumentError(f"host {i} MTU {m} out of range (576..9000)")
    own = [ports + i for i in range(count)] if isinstance(ports, int) else list(ports)
    if len(own) != count:
        raise ArgumentError(f"give one port per host: {count} hosts, ports {list(own)}")
    if count == 2 and not hub_ports:
        peer = [own[1], own[0]]
    elif len(hub_ports) == count:
        peer = list(hub_ports)
    else:
        raise ArgumentError(
            f"{count} hosts need a hub with one port per host, got hub ports {list(hub_ports)}"
        )
    specs = []
    addrs = [host_address(i) for i in range(count)]
    for i, cmd in enumerate(commands):
        host_env = dict(env or {})
        host_env.update(
            HIXL_HOST_INDEX=str(i),
            HIXL_HOSTS=str(count),
            HIXL_HOST_ADDR=addrs[i],
            HIXL_PEER_ADDRS=",".join(a for j, a in enumerate(addrs) if j != i),
        )
        net = GuestNet(
            port=own[i],
            peer_port=peer[i],
            mac=host_mac(i),
            address=f"{addrs[i]}/{PREFIX_LEN}",
            mtu=mtu[i],
        )
        specs.append(GuestSpec(command=tuple(cmd), name=f"host{i}", net=net, env=host_env))
    return specs


class FrameHub:
    """An Ethernet hub for QEMU UDP socket netdevs on 127.0.0.1.

    Host ``i``'s QEMU sends its frames to ``ports[i]``; the hub passes each datagram on
    to every other host's own port (``host_ports``). It never blocks: a datagram that
    finds a full socket buffer is dropped (counted in :attr:`dropped`), as a frame on a
    congested switch port would be, so no host can stall the others. Runs in a daemon
    thread until :meth:`close`.
    """

    def __init__(self, host_ports: Sequence[int]) -> None:
        import selectors
        import threading

        self._sel = selectors.DefaultSelector()
        self._socks: list[socket.socket] = []
        for _ in host_ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, len(self._socks))
            self._socks.append(sock)
        self.ports = [int(s.getsockname()[1]) for s in self._socks]
        self._dest = [("127.0.0.1", int(p)) for p in host_ports]
        self.frames = 0
        """Frames received from hosts so far (each goes to every other host)."""
        self.dropped = 0
        """Copies dropped because a host's socket had no room (or was gone)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hixl-frame-hub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.2):
                self._relay(key.data)

    def _relay(self, src: int) -> None:
        while True:
            try:
                frame = self._socks[src].recv(65536)
            except OSError:  # drained (BlockingIOError), or an ICMP error to ignore
                return
            self.frames += 1
            for dst, sock in enumerate(self._socks):
                if dst == src:
                    continue
                try:
                    sock.sendto(frame, self._dest[dst])
                except OSError:
                    self.dropped += 1

    def close(self) -> None:
        """Stop the hub and close its sockets; safe to call twice."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self._socks.clear()
        with contextlib.suppress(Exception):
            self._sel.close()


def run_hosts(
    commands: Sequence[Sequence[str]],
    cfg: VMConfig | None = None,
    *,
    mtus: Sequence[int] = (),
    env: Mapping[str, str] | None = None,
) -> int:
    """Boot one VM per command on a private network, run them, return the run's status.

    0 when every host's command exited 0 (a host that :func:`vanish`-ed counts as 0),
    otherwise the first non-zero status in host order. Prints one line per host at the
    end. Raises :class:`VMError` on a boot failure or when ``cfg.timeout`` passes (all
    VMs are killed either way).
    """
    own = [free_udp_port() for _ in commands]
    hub = FrameHub(own) if len(commands) > 2 else None
    specs = plan_hosts(
        commands, ports=own, hub_ports=hub.ports if hub is not None else (), mtus=mtus, env=env
    )
    t0 = time.monotonic()
    try:
        codes = run_guests(specs, cfg)
    finally:
        if hub is not None:
            hub.close()
            print(
                f"hixl vm hosts: the frame hub relayed {hub.frames} frames "
                f"({hub.dropped} copies dropped)",
                file=sys.stderr,
            )
    took = time.monotonic() - t0
    for spec, code in zip(specs, codes, strict=True):
        assert spec.net is not None
        print(
            f"hixl vm hosts: {spec.name} {spec.net.address} mtu {spec.net.mtu}: exit {code}",
            file=sys.stderr,
        )
    print(f"hixl vm hosts: {len(specs)} hosts ran in {took:.0f} s", file=sys.stderr, flush=True)
    return next((c for c in codes if c != 0), 0)


# --- inside a host ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HostEnv:
    """Where this process runs in a multi-host run (from the runner's variables)."""

    index: int
    count: int
    address: str
    peers: tuple[str, ...]
    netdev: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HostEnv:
        """Read ``HIXL_HOST_*``; raises :class:`HixlError` outside a multi-host run."""
        e = os.environ if environ is None else environ
        missing = [
            k
            for k in ("HIXL_HOST_INDEX", "HIXL_HOSTS", "HIXL_HOST_ADDR", "HIXL_PEER_ADDRS")
            if k not in e
        ]
        if missing:
            raise HixlError(
                f"not in a multi-host run ({', '.join(missing)} unset); "
                "start it with 'hixl vm hosts' or 'hixl vm run --hosts 2'"
            )
        return cls(
            index=int(e["HIXL_HOST_INDEX"]),
            count=int(e["HIXL_HOSTS"]),
            address=e["HIXL_HOST_ADDR"],
            peers=tuple(p for p in e["HIXL_PEER_ADDRS"].split(",") if p),
            netdev=e.get("HIXL_HOST_NETDEV", ""),
        )


def set_link(netdev: str, up: bool) -> None:
    """``ip link set NETDEV up|down`` (needs root); raises :class:`HixlError` on failure."""
    proc = subprocess.run(
        ["ip", "link", "set", netdev, "up" if up else "down"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if proc.returncode != 0:
        raise HixlError(f"ip link set {netdev} {'up' if up else 'down'}: {proc.stderr.strip()}")


def vanish(reason: str, wait: float = 30.0) -> NoReturn:
    """Have this guest's VM cut off at once, as a host losing power would (no FIN, no goodbye).

    Leaves ``reason`` where the runner finds it (``$HIXL_VM_XDIR/vanished``); the runner
    then kills the guest's QEMU within a fraction of a second and reports the host as
    having exited 0. The cut comes from outside, like a power failure: a guest powering
    itself off runs its kernel's shutdown path, which can stall for minutes on one
    emulated CPU busy with incoming RDMA traffic. Only meaningful inside a hixl VM;
    raises :class:`HixlError` elsewhere rather than touching a real machine.

    Right after the runner is told, every thread of the calling process is frozen
    (SIGSTOP), so hardly anything of it runs in the moments until the power goes: no
    registry lease refresh, no answer to a peer.  (Without the freeze, a lease refresh
    made before the runner acted could keep a cut host's name up to one refresh interval
    longer.)  The runner is told first so that the cut comes as soon as before: starting
    the helper that freezes takes a while under emulation.  If no runner cuts the power
    within ``wait`` seconds, the helper kills the process, which fails the run rather
    than hanging it.
    """
    xdir = os.environ.get("HIXL_VM_XDIR")
    if os.environ.get("HIXL_IN_VM") != "1" or not xdir:
        raise HixlError("vanish() only powers off a hixl VM guest (HIXL_IN_VM/HIXL_VM_XDIR unset)")
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = Path(xdir) / f".{VANISHED}.{os.getpid()}.tmp"
    with tmp.open("w") as fh:  # written whole, then renamed: the runner never reads half
        fh.write(reason + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, Path(xdir) / VANISHED)
    # $0 pid, $1 seconds: freeze the process, and kill it if the power is still on then.
    script = 'kill -STOP "$0"; sleep "$1"; kill -KILL "$0"'
    subprocess.Popen(
        ["/bin/sh", "-c", script, str(os.getpid()), str(wait)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    while True:  # frozen here by the helper (any other thread that gets here waits too)
        time.sleep(1.0)


class Control:
    """A JSON-lines channel between two hosts; every wait has a deadline.

    One side :meth:`serve`\\ s, the other :meth:`connect`\\ s (retrying until its
    deadline, since the server may still be starting). Messages are JSON objects, one
    per line. :meth:`call` sends a request and returns the reply, raising
    :class:`HixlError` when the reply carries ``"error"``.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._buf = b""

    @classmethod
    def serve(cls, address: str, port: int, timeout: float) -> Control:
        """Accept one connection on ``address:port`` within ``timeout`` s."""
        with socket.create_server((address, port)) as srv:
            srv.settimeout(timeout)
            try:
                sock, (host, peer_port) = srv.accept()
            except TimeoutError:
                raise TransferTimeout(
                    f"control: nobody connected to {address}:{port} within {timeout:.0f} s"
                ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, f"{host}:{peer_port}")

    @classmethod
    def connect(cls, address: str, port: int, timeout: float) -> Control:
        """Connect to ``address:port``, retrying until ``timeout`` s have passed."""
        deadline = time.monotonic() + timeout
        last: OSError | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((address, port), timeout=2.0)
            except OSError as exc:
                last = exc
                time.sleep(0.2)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return cls(sock, f"{address}:{port}")
        raise TransferTimeout(
            f"control: could not connect to {address}:{port} within {timeout:.0f} s: {last}"
        )

    def send(self, message: Mapping[str, Any], timeout: float = 30.0) -> None:
        """Send one message; :class:`TransferTimeout` if it cannot go out in time."""
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except TimeoutError:
            raise TransferTimeout(f"control: send to {self.peer} blocked {timeout:.0f} s") from None

    def recv(self, timeout: float) -> dict[str, Any]:
        """The next message; :class:`TransferTimeout` after ``timeout`` s,
        :class:`HixlError` when the peer closed the channel."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"control: no message from {self.peer} in {timeout:.0f} s")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise HixlError(f"control: {self.peer} closed the channel")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise HixlError(f"control: {self.peer} sent {type(obj).__name__}, not an object")
        return obj

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, **args}`` and return the reply (raises on ``"error"``).

        The reply is awaited for 60 s plus ``args["seconds"]``, the time an op that
        waits on the far side is given there.
        """
        timeout = 60.0 + float(args.get("seconds", 0.0))
        self.send({"op": op, **args}, timeout)
        reply = self.recv(timeout)
        if "error" in reply:
            raise HixlError(f"control: {self.peer} failed {op!r}: {reply['error']}")
        return reply

    def answer(
        self, handle: Callable[[dict[str, Any], Control], Mapping[str, Any]], idle: float
    ) -> None:
        """Serve requests until ``{"op": "bye"}``: each reply is ``{"ok": True, **handle(...)}``,
        or ``{"error": ...}`` when ``handle`` raises (the traceback goes to stderr).
        :class:`TransferTimeout` when no request comes for ``idle`` s."""
        while True:
            req = self.recv(timeout=idle)
            if req.get("op") == "bye":
                self.send({"ok": True})
                return
            try:
                reply = {"ok": True, **handle(req, self)}
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
                traceback.print_exc()
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.send(reply)

    def close(self) -> None:
        """Close the channel; safe to call twice."""
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Environment for guest commands that compute with numpy: one BLAS thread each, so that
#: several guests on a small machine do not fight over its cores.
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
