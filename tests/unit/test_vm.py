"""The VM runner's pure parts: multi-host plans, NIC options, exit-status rules, control."""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hixl._errors import ArgumentError, HixlError, TransferTimeout, VMError
from hixl._hosts import (
    Control,
    FrameDecoder,
    FrameHub,
    HostEnv,
    align_clocks,
    host_address,
    host_mac,
    plan_hosts,
    vanish,
)
from hixl._vm import (
    STOPPED,
    VANISHED,
    GuestNet,
    GuestSpec,
    VMConfig,
    _exit_status,
    _Running,
    _Tail,
    listening_ports,
)


def test_two_hosts_get_addresses_macs_roles_and_env() -> None:
    specs = plan_hosts([["a", "1"], ["b"]], port=4321, mtus=[1500, 9000], env={"X": "y"})
    assert [s.name for s in specs] == ["host0", "host1"]
    assert [s.command for s in specs] == [("a", "1"), ("b",)]
    nets = [s.net for s in specs]
    assert all(n is not None for n in nets)
    n0, n1 = (n for n in nets if n is not None)
    assert (n0.role, n0.address, n0.mac, n0.mtu) == (
        "udp",
        "10.88.0.1/24",
        "52:54:00:88:00:01",
        1500,
    )
    assert (n1.role, n1.address, n1.mac, n1.mtu) == (
        "udp",
        "10.88.0.2/24",
        "52:54:00:88:00:02",
        9000,
    )
    # Each receives on its own port and sends to the other's.
    assert (n0.port, n0.peer_port, n1.port, n1.peer_port) == (4321, 4322, 4322, 4321)
    pair = plan_hosts([["a"], ["b"]], port=[7, 3])
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
    assert [s.net.mtu for s in plan_hosts([["a"], ["b"]], port=1, mtus=[9000]) if s.net] == [
        9000,
        9000,
    ]
    assert [s.net.mtu for s in plan_hosts([["a"], ["b"]], port=1) if s.net] == [1500, 1500]


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
        plan_hosts(commands, port=1, mtus=mtus)


def test_addresses_and_macs() -> None:
    assert host_address(0) == "10.88.0.1"
    assert host_mac(15) == "52:54:00:88:00:10"
    with pytest.raises(ArgumentError, match="out of range: -1"):
        host_address(-1)


def test_qemu_options_of_a_nic() -> None:
    net = GuestNet(role="connect", port=5555, mac="52:54:00:88:00:02", address="10.88.0.2/24")
    assert net.qemu_opts() == (
        "-netdev socket,id=hx0,connect=127.0.0.1:5555 "
        "-device virtio-net-pci,netdev=hx0,mac=52:54:00:88:00:02"
    )
    udp = GuestNet(
        role="udp", port=5001, peer_port=5000, mac="52:54:00:88:00:02", address="10.88.0.2/24"
    )
    assert udp.qemu_opts() == (
        "-netdev socket,id=hx0,udp=127.0.0.1:5000,localaddr=127.0.0.1:5001 "
        "-device virtio-net-pci,netdev=hx0,mac=52:54:00:88:00:02"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"role": "bind"}, "role must be udp, listen or connect"),
        ({"port": 0}, "port out of range: 0"),
        ({"role": "udp"}, "peer_port out of range: 0"),
        ({"mtu": 70000}, "mtu out of range: 70000"),
        ({"mac": "52:54:00:88:00:0G"}, "mac must be"),
    ],
)
def test_bad_nics_are_refused(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "role": "listen",
        "port": 1,
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


def test_listening_ports_reads_proc_net_tcp() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue ...\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000\n"
        "   1: 00000000:1BBC 00000000:0000 0A 00000000:00000000 00:00000000 00000000\n"
        "   2: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000\n"
        "   3: 0258580A:1388 00000000:0000 0A 00000000:00000000 00:00000000 00000000\n"
    )
    # LISTEN on loopback or any address only; established (01) and 10.88.0.2 are not ours.
    assert listening_ports(text) == {0x1F90, 0x1BBC}


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


def test_three_hosts_each_connect_to_their_own_hub_port() -> None:
    specs = plan_hosts([["a"], ["b"], ["c"]], port=7000)
    nets = [s.net for s in specs if s.net is not None]
    assert [(n.role, n.port, n.address) for n in nets] == [
        ("connect", 7000, "10.88.0.1/24"),
        ("connect", 7001, "10.88.0.2/24"),
        ("connect", 7002, "10.88.0.3/24"),
    ]
    assert specs[1].env["HIXL_PEER_ADDRS"] == "10.88.0.1,10.88.0.3"
    hub = plan_hosts([["a"], ["b"], ["c"]], port=[9, 4, 7])  # a hub's ports, one per host
    assert [s.net.port for s in hub if s.net is not None] == [9, 4, 7]
    with pytest.raises(ArgumentError, match="one port per host"):
        plan_hosts([["a"], ["b"], ["c"]], port=[9, 4])


def _record(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def test_frame_decoder_splits_and_joins_records() -> None:
    d = FrameDecoder()
    stream = _record(b"A" * 60) + _record(b"B" * 1500)
    assert d.feed(stream[:3]) == []
    assert d.feed(stream[3:70]) == [_record(b"A" * 60)]
    assert d.feed(stream[70:]) == [_record(b"B" * 1500)]
    with pytest.raises(HixlError, match="bad frame length 0"):
        FrameDecoder().feed(b"\0\0\0\0")


def test_frame_hub_copies_each_frame_to_every_other_host() -> None:
    hub = FrameHub(3)
    try:
        socks = [socket.create_connection(("127.0.0.1", p), timeout=5.0) for p in hub.ports]
        deadline = time.monotonic() + 5.0
        while hub.connected < 3:  # frames sent before a host is plugged in are lost
            assert time.monotonic() < deadline
            time.sleep(0.01)
        frame = _record(b"\xff" * 6 + b"x" * 100)
        socks[0].sendall(frame)
        for s in socks[1:]:
            got = b""
            while len(got) < len(frame):
                got += s.recv(4096)
            assert got == frame
        socks[0].close()  # a host that powers off is dropped; the others go on
        socks[1].sendall(frame)
        got = b""
        while len(got) < len(frame):
            got += socks[2].recv(4096)
        assert got == frame
    finally:
        hub.close()
        hub.close()
        for s in socks:
            s.close()
