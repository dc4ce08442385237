"""The VM runner's pure parts: multi-host plans, NIC options, exit-status rules, control."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hixl.demo.hosts import align_clocks
from hixl.errors import ArgumentError, HixlError, TransferTimeout, VMError
from hixl.testbed.hosts import (
    Control,
    FrameHub,
    HostEnv,
    host_address,
    host_mac,
    plan_hosts,
    vanish,
)
from hixl.testbed.vm import (
    STOPPED,
    VANISHED,
    GuestNet,
    GuestSpec,
    VMConfig,
    _exit_status,
    _Running,
    _Tail,
)


def test_two_hosts_get_addresses_macs_ports_and_env() -> None:
    specs = plan_hosts([["a", "1"], ["b"]], ports=4321, mtus=[1500, 9000], env={"X": "y"})
    assert [s.name for s in specs] == ["host0", "host1"]
    assert [s.command for s in specs] == [("a", "1"), ("b",)]
    nets = [s.net for s in specs]
    assert all(n is not None for n in nets)
    n0, n1 = (n for n in nets if n is not None)
    assert (n0.address, n0.mac, n0.mtu) == (
        "10.88.0.1/24",
        "52:54:00:88:00:01",
        1500,
    )
    assert (n1.address, n1.mac, n1.mtu) == (
        "10.88.0.2/24",
        "52:54:00:88:00:02",
        9000,
    )
    # Each receives on its own port and sends to the other's.
    assert (n0.port, n0.peer_port, n1.port, n1.peer_port) == (4321, 4322, 4322, 4321)
    pair = plan_hosts([["a"], ["b"]], ports=[7, 3])
    assert [(n.port, n.peer_port) for n in (s.net for s in pair) if n] == [(7, 3), (3, 7)]
    assert specs[0].env == {
        "X": "y",
        "HIXL_HOST_INDEX": "0",
        "HIXL_HOSTS": "2",
        "HIXL_HOST_ADDR": "10.88.0.1",
        "HIXL_PEER_ADDRS": "10.88.0.2",
    }
    assert specs[1].env["HIXL_PEER_ADDRS"] == "10.88.0.1"


def test_one_mtu_applies_to_every_host_and_default_is_1500() -> None:
    assert [s.net.mtu for s in plan_hosts([["a"], ["b"]], ports=1, mtus=[9000]) if s.net] == [
        9000,
        9000,
    ]
    assert [s.net.mtu for s in plan_hosts([["a"], ["b"]], ports=1) if s.net] == [1500, 1500]


@pytest.mark.parametrize(
    ("commands", "mtus", "match"),
    [
        ([["a"]], [], "2..8 hosts, got 1"),
        ([["a"]] * 9, [], "got 9"),
        ([["a"], []], [], "host 1 has an empty command"),
        ([["a"], ["b"]], [1500, 1500, 1500], "2 hosts, 3 MTUs"),
        ([["a"], ["b"]], [1500, 100], "host 1 MTU 100 out of range"),
    ],
)
def test_bad_plans_say_what_is_wrong(
    commands: list[list[str]], mtus: list[int], match: str
) -> None:
    with pytest.raises(ArgumentError, match=match):
        plan_hosts(commands, ports=1, mtus=mtus)


def test_addresses_and_macs() -> None:
    assert host_address(0) == "10.88.0.1"
    assert host_mac(15) == "52:54:00:88:00:10"
    with pytest.raises(ArgumentError, match="out of range: -1"):
        host_address(-1)


def test_qemu_options_of_a_nic() -> None:
    net = GuestNet(port=5001, peer_port=5000, mac="52:54:00:88:00:02", address="10.88.0.2/24")
    assert net.qemu_opts() == (
        "-netdev socket,id=hx0,udp=127.0.0.1:5000,localaddr=127.0.0.1:5001 "
        "-device virtio-net-pci,netdev=hx0,mac=52:54:00:88:00:02"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"port": 0}, "GuestNet port out of range: 0"),
        ({"peer_port": 70000}, "peer_port out of range: 70000"),
        ({"mtu": 70000}, "mtu out of range: 70000"),
        ({"mac": "52:54:00:88:00:0G"}, "mac must be"),
    ],
)
def test_bad_nics_are_refused(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "port": 1,
        "peer_port": 2,
        "mac": "52:54:00:88:00:01",
        "address": "10.88.0.1/24",
    }
    with pytest.raises(VMError, match=match):
        GuestNet(**{**base, **kwargs})


def test_guest_spec_validation() -> None:
    with pytest.raises(VMError, match="has no command"):
        GuestSpec(command=())
    with pytest.raises(VMError, match="guest name"):
        GuestSpec(command=("x",), name="a b")


class _Proc:
    def __init__(self, rc: int | None) -> None:
        self.returncode = rc
        self.pid = 0

    def poll(self) -> int | None:
        return self.returncode


def _running(tmp_path: Path, rc: int | None) -> _Running:
    sink = io.StringIO()
    tails = (_Tail(tmp_path / "stdout", sink), _Tail(tmp_path / "stderr", sink))
    proc: Any = _Proc(rc)
    return _Running(GuestSpec(command=("x",), name="h"), proc, tmp_path, tails, tmp_path, 0.0)


def test_exit_status_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_status(_running(tmp_path, None)) is None  # still running
    (tmp_path / VANISHED).write_text("asked to\n")
    assert _exit_status(_running(tmp_path, 0)) == 0  # powered off on purpose
    assert "h powered off on purpose: asked to" in capsys.readouterr().out
    (tmp_path / "rc").write_text("3")
    assert _exit_status(_running(tmp_path, 0)) == 3  # a reported status wins


def test_vanished_guest_is_cut_off_at_once(tmp_path: Path) -> None:
    # A guest that asks to vanish is still running: the runner kills its whole VM.
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        r = _running(tmp_path, None)
        r.proc = proc
        assert _exit_status(r) is None
        (tmp_path / VANISHED).write_text("power cut\n")
        assert _exit_status(r) == 0
        assert proc.poll() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_vm_that_ends_without_status_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "console.log").write_text("Kernel panic\n")
    r = _running(tmp_path, 1)
    r.console = tmp_path / "console.log"
    with pytest.raises(VMError, match="without reporting an exit status"):
        _exit_status(r)


def test_config_defaults_for_several_hosts() -> None:
    cfg = VMConfig()
    assert cfg.log_dir is None and cfg.failure_grace > 0
    assert STOPPED == 143


def test_host_env_reads_the_runner_variables() -> None:
    env = {
        "HIXL_HOST_INDEX": "1",
        "HIXL_HOSTS": "2",
        "HIXL_HOST_ADDR": "10.88.0.2",
        "HIXL_PEER_ADDRS": "10.88.0.1",
        "HIXL_HOST_NETDEV": "enp0s3",
    }
    h = HostEnv.from_environ(env)
    assert (h.index, h.count, h.address, h.peers, h.netdev) == (
        1,
        2,
        "10.88.0.2",
        ("10.88.0.1",),
        "enp0s3",
    )
    with pytest.raises(HixlError, match="HIXL_HOST_INDEX"):
        HostEnv.from_environ({})


def test_vanish_refuses_outside_a_vm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_IN_VM", raising=False)
    with pytest.raises(HixlError, match="only powers off a hixl VM"):
        vanish("test")


_VANISHING_CHILD = """
import sys, threading, time
from hixl.testbed.hosts import vanish

def beat():
    n = 0
    while True:
        n += 1
        with open(sys.argv[1], "w") as fh:
            fh.write(str(n))
        time.sleep(0.01)

threading.Thread(target=beat, daemon=True).start()
time.sleep(0.2)
vanish("test: cut off", wait=float(sys.argv[2]))
"""


def test_vanish_tells_the_runner_then_freezes_the_whole_process(tmp_path: Path) -> None:
    # A thread of the vanishing process writes a heartbeat (as a registry lease refresh
    # would go on): soon after the runner's note is there, it must not beat any more.
    # With no runner to cut the power, the process is killed after ``wait``.
    beat = tmp_path / "beat"
    env = {**os.environ, "HIXL_IN_VM": "1", "HIXL_VM_XDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _VANISHING_CHILD, str(beat), "3"], env=env, cwd=Path.cwd()
    )
    try:
        note = tmp_path / VANISHED
        deadline = time.monotonic() + 30
        while not note.exists():
            assert time.monotonic() < deadline, "no vanish note"
            assert proc.poll() is None, proc.returncode
            time.sleep(0.01)
        assert note.read_text() == "test: cut off\n"
        time.sleep(0.5)  # the helper freezes it meanwhile
        first = beat.read_text()
        time.sleep(0.5)
        assert beat.read_text() == first, "a thread kept running after the note"
        assert proc.wait(30) == -signal.SIGKILL  # the power stayed on: killed, not exit 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_align_clocks_puts_decode_on_prefills_clock() -> None:
    prefill = {"layers": [{"transfer": [1.0, 2.0]}, {"transfer": [3.0, 4.0]}]}
    decode = {"layers": [{"arrived": 102.5}, {"arrived": 104.2}]}
    assert align_clocks(prefill, decode) == pytest.approx(100.2)
    assert [d["arrived"] for d in decode["layers"]] == pytest.approx([2.3, 4.0])


def test_control_round_trip_and_deadlines() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served: list[Control] = []
    t = threading.Thread(target=lambda: served.append(Control.serve("127.0.0.1", port, 10.0)))
    t.start()
    with Control.connect("127.0.0.1", port, timeout=10.0) as client:
        t.join(10.0)
        with served[0] as server:
            client.send({"op": "ping", "n": 1})
            assert server.recv(5.0) == {"op": "ping", "n": 1}
            with pytest.raises(TransferTimeout, match="no message"):
                server.recv(0.2)

            def answer() -> None:
                req = server.recv(5.0)
                server.send({"error": f"cannot {req['op']}"})

            helper = threading.Thread(target=answer)
            helper.start()
            with pytest.raises(HixlError, match="failed 'fly': cannot fly"):
                client.call("fly", seconds=1)
            helper.join(5.0)
        with pytest.raises(HixlError, match="closed the channel"):
            client.recv(5.0)


def test_control_connect_gives_up_at_its_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferTimeout, match="could not connect"):
        Control.connect("127.0.0.1", port, timeout=0.5)


def test_three_hosts_each_send_to_their_own_hub_port() -> None:
    specs = plan_hosts([["a"], ["b"], ["c"]], ports=7000, hub_ports=[9, 4, 7])
    nets = [s.net for s in specs if s.net is not None]
    assert [(n.port, n.peer_port, n.address) for n in nets] == [
        (7000, 9, "10.88.0.1/24"),
        (7001, 4, "10.88.0.2/24"),
        (7002, 7, "10.88.0.3/24"),
    ]
    assert specs[1].env["HIXL_PEER_ADDRS"] == "10.88.0.1,10.88.0.3"
    with pytest.raises(ArgumentError, match="need a hub with one port per host"):
        plan_hosts([["a"], ["b"], ["c"]], ports=7000)
    with pytest.raises(ArgumentError, match="one port per host: 3 hosts"):
        plan_hosts([["a"], ["b"], ["c"]], ports=[1, 2], hub_ports=[9, 4, 7])


def _udp(rcvbuf: int = 0) -> socket.socket:
    """A UDP socket on 127.0.0.1, standing in for one QEMU's netdev."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    return sock


def test_frame_hub_copies_each_frame_to_every_other_host() -> None:
    hosts = [_udp() for _ in range(3)]
    hub = FrameHub([h.getsockname()[1] for h in hosts])
    try:
        frame = b"\xff" * 6 + b"x" * 100
        hosts[0].sendto(frame, ("127.0.0.1", hub.ports[0]))
        assert hosts[1].recv(65536) == frame
        assert hosts[2].recv(65536) == frame
        hosts[0].close()  # a host that is gone: the others go on
        jumbo = b"\x01" * 9000
        hosts[1].sendto(jumbo, ("127.0.0.1", hub.ports[1]))
        assert hosts[2].recv(65536) == jumbo
        assert hub.frames == 2
    finally:
        hub.close()
        hub.close()
        for h in hosts:
            h.close()


def test_frame_hub_drops_rather_than_blocks_when_a_host_does_not_read() -> None:
    sender, slow, fast = _udp(), _udp(rcvbuf=4096), _udp()
    hub = FrameHub([s.getsockname()[1] for s in (sender, slow, fast)])
    try:
        for i in range(200):  # ``slow`` never reads, so its buffer is full at once
            frame = i.to_bytes(2, "big") * 500
            sender.sendto(frame, ("127.0.0.1", hub.ports[0]))
            assert fast.recv(65536) == frame  # ``fast`` still gets every frame, in order
        assert hub.frames == 200
    finally:
        hub.close()
        for sock in (sender, slow, fast):
            sock.close()


def test_the_guest_caches_only_python_dirs_with_nothing_mounted_below() -> None:
    from hixl.testbed.guest import dirs_to_cache

    mounts = [
        ("/dev/root", "/", "9p"),
        ("overlay", "/usr", "overlay"),
        ("virtme.initmount0", "/tmp/hixl-vm-x/0-vm", "9p"),
        ("share", "/work/ci/results", "9p"),
    ]
    stdlib, venv, checkout = "/usr/lib/python3.11", "/work/ci/.venv", "/work/ci"
    # The checkout holds a shared read-write directory: only its venv is bound.
    assert dirs_to_cache([stdlib, venv, checkout], mounts) == [venv, stdlib]
    # Without that, the checkout covers its venv.
    assert dirs_to_cache([stdlib, venv, checkout], mounts[:3]) == [checkout, stdlib]
    assert dirs_to_cache(["/", "relative"], mounts[:3]) == []
    assert dirs_to_cache([stdlib], [("/dev/vda", "/", "ext4")]) == []  # not a 9p root
