"""``hixl doctor``: the diagnosis for each kind of machine, from facts built by hand.

``diagnose`` is pure, so each case below is the facts of a machine we are not on: no
RDMA in the kernel, module not loadable, libibverbs missing, pyverbs (a test
dependency) missing or mismatched, no active port, not root.  The probes that gather
facts are tested for not raising, and for how they report a child that fails or crashes.
"""

from __future__ import annotations

import dataclasses
import gzip
from pathlib import Path

from hixl.testbed.doctor import (
    Facts,
    PyverbsProbe,
    Report,
    Status,
    VerbsProbe,
    VmFacts,
    diagnose,
    format_report,
    gather_facts,
    parse_kernel_config,
    probe_pyverbs,
    probe_verbs,
    report_to_json,
)
from hixl.verbs.devices import Device, Gid, Port

MAPPED = "0000:0000:0000:0000:0000:ffff:c0a8:4d01"
LINK_LOCAL = "fe80:0000:0000:0000:001a:feff:fe39:e25a"

VM_READY = VmFacts(
    qemu="/usr/bin/qemu-system-x86_64",
    kernels=("6.1.0-56-amd64",),
    vng="/venv/bin/vng",
    busybox="/usr/bin/busybox",
)
PYVERBS_NO_KERNEL = PyverbsProbe(
    imported=True,
    device_count=None,
    error="PyverbsRDMAError: Failed to get devices list",
    location="/usr/lib/python3/dist-packages/pyverbs/__init__.py",
)
VERBS_NO_KERNEL = VerbsProbe(
    loaded=True,
    device_count=None,
    error="DeviceError: cannot list verbs devices (No such file or directory)",
)
NO_MODULES_CONFIG = {"CONFIG_INFINIBAND": "n", "CONFIG_MODULES": "n", "CONFIG_RDMA_RXE": "n"}

# This project's CI/dev host: a kernel without RDMA or modules, VM tools installed.
HOST = Facts(
    kernel_release="6.18.44-fc-v669",
    rdma_class=False,
    config=NO_MODULES_CONFIG,
    config_source="/proc/config.gz",
    modprobe=(
        False,
        "modprobe: FATAL: Module rdma_rxe not found in directory /lib/modules/6.18.44-fc-v669",
    ),
    euid=0,
    python="/tmp/tv/bin/python (3.11.2)",
    verbs=VERBS_NO_KERNEL,
    pyverbs=PYVERBS_NO_KERNEL,
    vm=VM_READY,
)


def rxe0(state: str = "ACTIVE", gids: tuple[Gid, ...] | None = None) -> Device:
    if gids is None:
        gids = (
            Gid(index=0, gid=LINK_LOCAL, type="RoCE v2", netdev="d0"),
            Gid(index=1, gid=MAPPED, type="RoCE v2", netdev="d0"),
        )
    port = Port(
        number=1,
        state=state,
        phys_state="LinkUp",
        link_layer="Ethernet",
        active_mtu=1024,
        mtu_source="netdev d0 mtu 1500",
        gid_table_len=1024,
        gids=gids,
    )
    return Device(name="rxe0", kind="rxe", node_type="CA", netdevs=("d0",), ports=(port,))


# A machine with rxe0 up: the guest of the hixl VM.
GUEST = dataclasses.replace(
    HOST,
    kernel_release="6.1.0-56-amd64",
    rdma_class=True,
    config={"CONFIG_INFINIBAND": "m", "CONFIG_MODULES": "y", "CONFIG_RDMA_RXE": "m"},
    config_source="/boot/config-6.1.0-56-amd64",
    rxe_loaded=True,
    modprobe=(True, ""),
    verbs=VerbsProbe(loaded=True, device_count=1),
    pyverbs=PyverbsProbe(imported=True, device_count=1),
    devices=(rxe0(),),
)


def check(report: Report, name: str) -> tuple[Status, str, str]:
    [c] = [c for c in report.checks if c.name == name]
    return c.status, c.finding, c.fix


def names(report: Report) -> list[str]:
    return [c.name for c in report.checks]


def test_host_without_rdma_points_to_the_vm() -> None:
    report = diagnose(HOST)
    status, finding, fix = check(report, "kernel RDMA")
    assert status is Status.FAIL
    assert finding == (
        "kernel 6.18.44-fc-v669 has no RDMA: /sys/class/infiniband is missing; "
        "CONFIG_INFINIBAND is not set (/proc/config.gz)"
    )
    assert "hixl vm run -- CMD" in fix
    status, finding, _ = check(report, "rdma_rxe module")
    assert status is Status.FAIL and "cannot load modules" in finding
    assert check(report, "libibverbs")[0] is Status.OK  # it loads; the kernel is at fault
    assert check(report, "pyverbs (tests only)")[0] is Status.OK
    assert check(report, "vm path")[0] is Status.OK
    assert report.mode == "vm" and report.exit_code == 0
    assert report.verdict == (
        "hixl can run RDMA through the VM: hixl vm run -- CMD   (this kernel cannot run soft-RoCE)"
    )
    text = format_report(report)
    assert "[fail] kernel RDMA" in text and "use: hixl vm run -- CMD" in text


def test_host_without_rdma_or_vm_tools_fails_with_fixes() -> None:
    facts = dataclasses.replace(HOST, vm=VmFacts(qemu=None, kernels=(), vng=None, busybox=None))
    report = diagnose(facts)
    assert report.mode == "none" and report.exit_code == 1
    assert check(report, "vm: qemu")[2] == "sudo apt-get install qemu-system-x86"
    assert check(report, "vm: kernel")[2] == "sudo apt-get install linux-image-amd64"
    assert "virtme-ng" in check(report, "vm: virtme-ng")[2]
    assert check(report, "vm: busybox")[2] == "sudo apt-get install busybox-static"
    status, finding, _ = check(report, "vm path")
    assert status is Status.FAIL
    assert finding == "not ready: vm: qemu, vm: kernel, vm: virtme-ng, vm: busybox"


def test_unreadable_vm_kernel_gets_a_chmod_fix() -> None:
    facts = dataclasses.replace(
        HOST, vm=dataclasses.replace(VM_READY, kernels=(), unreadable_kernels=("6.8.0-45-generic",))
    )
    status, _, fix = check(diagnose(facts), "vm: kernel")
    assert status is Status.FAIL and fix == "sudo chmod 0644 /boot/vmlinuz-6.8.0-45-generic"


def test_module_missing_although_configured() -> None:
    facts = dataclasses.replace(
        HOST,
        config={"CONFIG_INFINIBAND": "m", "CONFIG_MODULES": "y", "CONFIG_RDMA_RXE": "m"},
        modprobe=(False, "modprobe: FATAL: Module rdma_rxe not found"),
    )
    report = diagnose(facts)
    assert check(report, "kernel RDMA")[0] is Status.WARN
    status, finding, fix = check(report, "rdma_rxe module")
    assert status is Status.FAIL
    assert finding == "rdma_rxe cannot be loaded: modprobe: FATAL: Module rdma_rxe not found"
    assert "linux-modules-extra-$(uname -r)" in fix


def test_module_not_in_kernel_config() -> None:
    facts = dataclasses.replace(
        HOST, config={"CONFIG_INFINIBAND": "m", "CONFIG_MODULES": "y", "CONFIG_RDMA_RXE": "n"}
    )
    _, _, fix = check(diagnose(facts), "rdma_rxe module")
    assert "CONFIG_RDMA_RXE is not set" in fix and "hixl vm run" in fix


def test_module_loadable_but_no_device_yet() -> None:
    facts = dataclasses.replace(
        GUEST,
        rxe_loaded=False,
        devices=(),
        verbs=VerbsProbe(loaded=True, device_count=0),
        pyverbs=PyverbsProbe(imported=True, device_count=0),
    )
    report = diagnose(facts)
    assert check(report, "rdma_rxe module")[0] is Status.OK
    status, finding, fix = check(report, "devices")
    assert (status, finding, fix) == (Status.FAIL, "no RDMA devices", "sudo hixl rxe up")
    assert report.mode == "vm"  # the VM path is still there
    assert "sudo hixl rxe up would make one" in report.verdict


def test_libibverbs_missing_stops_both_paths() -> None:
    facts = dataclasses.replace(
        HOST,
        verbs=VerbsProbe(
            loaded=False,
            device_count=None,
            error="libibverbs.so.1 cannot be loaded (cannot load library); install rdma-core",
        ),
    )
    report = diagnose(facts)
    status, finding, fix = check(report, "libibverbs")
    assert status is Status.FAIL and "cannot be loaded through cffi" in finding
    assert fix.startswith("sudo apt-get install libibverbs1")
    # The guest runs this machine's Python and libraries, so the VM path is not ready.
    assert report.mode == "none" and report.exit_code == 1
    assert "libibverbs" in check(report, "vm path")[1]


def test_pyverbs_missing_is_a_test_dependency_only() -> None:
    facts = dataclasses.replace(
        HOST,
        system_pyverbs=False,
        pyverbs=PyverbsProbe(
            imported=False,
            device_count=None,
            error="ModuleNotFoundError: No module named 'pyverbs'",
        ),
    )
    report = diagnose(facts)
    status, finding, fix = check(report, "pyverbs (tests only)")
    assert status is Status.WARN and "No module named 'pyverbs'" in finding
    assert "the runtime does not need it" in finding
    assert fix == "sudo apt-get install python3-pyverbs"
    # A wheel in a clean venv has no pyverbs, and the VM path is ready all the same.
    assert report.mode == "vm" and report.exit_code == 0
    assert check(report, "vm path")[0] is Status.OK


def test_pyverbs_hidden_by_a_venv() -> None:
    facts = dataclasses.replace(
        HOST,
        venv_without_system_site=True,
        system_pyverbs=True,
        pyverbs=PyverbsProbe(
            imported=False,
            device_count=None,
            error="ModuleNotFoundError: No module named 'pyverbs'",
        ),
    )
    fix = check(diagnose(facts), "pyverbs (tests only)")[2]
    assert "/usr/bin/python3 -m venv --system-site-packages .venv" in fix


def test_pyverbs_from_pypi_does_not_match_libibverbs() -> None:
    err = (
        "ImportError: /lib/x86_64-linux-gnu/libibverbs.so.1: version `IBVERBS_PRIVATE_59' "
        "not found (required by /venv/lib/python3.11/site-packages/pyverbs/device.so)"
    )
    facts = dataclasses.replace(
        HOST, pyverbs=PyverbsProbe(imported=False, device_count=None, error=err)
    )
    status, finding, fix = check(diagnose(facts), "pyverbs (tests only)")
    assert status is Status.WARN and "does not match the system's libibverbs" in finding
    assert fix.startswith("pip uninstall -y pyverbs && sudo apt-get install python3-pyverbs")
    assert "--system-site-packages" in fix


def test_pyverbs_broken_does_not_decide_the_direct_path() -> None:
    facts = dataclasses.replace(GUEST, pyverbs=PYVERBS_NO_KERNEL)
    report = diagnose(facts)
    assert check(report, "pyverbs (tests only)")[0] is Status.WARN
    assert report.mode == "direct"


def test_libibverbs_broken_although_kernel_has_rdma() -> None:
    facts = dataclasses.replace(GUEST, verbs=VERBS_NO_KERNEL)
    report = diagnose(facts)
    status, _, fix = check(report, "libibverbs")
    assert status is Status.FAIL and "--reinstall rdma-core" in fix
    assert report.mode != "direct"


def test_no_active_port() -> None:
    facts = dataclasses.replace(GUEST, devices=(rxe0(state="DOWN"),))
    report = diagnose(facts)
    status, finding, fix = check(report, "active port + GID")
    assert (status, fix) == (Status.FAIL, "sudo ip link set dev d0 up")
    assert "rxe0 port 1 is DOWN" in finding
    assert report.mode == "vm" and "vm path" in names(report)


def test_active_port_without_ipv4_gid() -> None:
    only_v6 = (Gid(index=0, gid=LINK_LOCAL, type="RoCE v2", netdev="d0"),)
    facts = dataclasses.replace(GUEST, devices=(rxe0(gids=only_v6),))
    status, finding, fix = check(diagnose(facts), "active port + GID")
    assert status is Status.FAIL and "no IPv4 RoCEv2 GID" in finding
    assert fix == "sudo ip addr add 192.168.77.1/24 dev d0"


def test_not_root_without_a_device_warns() -> None:
    facts = dataclasses.replace(GUEST, euid=1000, devices=(), memlock=8 << 20)
    report = diagnose(facts)
    assert check(report, "root") == (
        Status.WARN,
        "not root (uid 1000): creating a soft-RoCE device needs root",
        "sudo hixl rxe up",
    )
    status, finding, _ = check(report, "locked memory")
    assert status is Status.WARN and "8192 KiB" in finding


def test_not_root_does_not_matter_when_the_kernel_cannot_rxe() -> None:
    status, finding, fix = check(diagnose(dataclasses.replace(HOST, euid=1000)), "root")
    assert (status, fix) == (Status.OK, "")
    assert "the VM path does not need it" in finding


def test_not_root_with_a_device_is_fine() -> None:
    facts = dataclasses.replace(GUEST, euid=1000, memlock=None)
    report = diagnose(facts)
    assert check(report, "root")[0] is Status.OK
    assert check(report, "locked memory")[0] is Status.OK
    assert report.mode == "direct"


def test_direct_path_has_no_vm_checks() -> None:
    report = diagnose(GUEST)
    assert report.mode == "direct" and report.exit_code == 0
    assert all(c.status is Status.OK for c in report.checks)
    assert not [n for n in names(report) if n.startswith("vm")]
    assert (
        report.verdict == "hixl can run RDMA here directly: rxe0 port 1 gid 1 (192.168.77.1 on d0)"
    )
    data = report_to_json(report)
    assert data["selected"]["gid_index"] == 1 and data["exit_code"] == 0


def test_parse_kernel_config() -> None:
    text = '# comment\nCONFIG_RDMA_RXE=m\n# CONFIG_INFINIBAND is not set\nCONFIG_X="a b"\n'
    assert parse_kernel_config(text) == {
        "CONFIG_RDMA_RXE": "m",
        "CONFIG_INFINIBAND": "n",
        "CONFIG_X": "a b",
    }


def test_probe_reports_a_child_that_cannot_start() -> None:
    probe = probe_pyverbs("/nonexistent/python")
    assert not probe.imported and probe.error.startswith("probe did not run")


def test_probe_reports_a_crashing_child(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake.chmod(0o755)
    probe = probe_pyverbs(str(fake))
    assert not probe.imported and "killed by signal 11" in probe.error
    verbs = probe_verbs(str(fake))
    assert not verbs.loaded and "killed by signal 11" in verbs.error


def test_verbs_probe_reports_a_child_that_cannot_start() -> None:
    probe = probe_verbs("/nonexistent/python")
    assert not probe.loaded and probe.error.startswith("probe did not run")


def test_gather_facts_reads_fake_trees(tmp_path: Path) -> None:
    proc, boot, modules = tmp_path / "proc", tmp_path / "boot", tmp_path / "lib" / "modules"
    proc.mkdir()
    with gzip.open(proc / "config.gz", "wt") as fh:
        fh.write("# CONFIG_INFINIBAND is not set\n")
    boot.mkdir()
    (boot / "vmlinuz-9.9.9").write_text("kernel")
    rxe = modules / "9.9.9" / "kernel" / "drivers" / "infiniband" / "sw" / "rxe"
    rxe.mkdir(parents=True)
    (rxe / "rdma_rxe.ko.xz").write_text("module")
    (boot / "vmlinuz-1.0.0").write_text("kernel without rxe")
    facts = gather_facts(sysfs=tmp_path / "sys", proc=proc, boot=boot, modules=modules)
    assert facts.rdma_class is False and facts.devices == ()
    assert facts.config == {"CONFIG_INFINIBAND": "n"}
    assert facts.config_source == str(proc / "config.gz")
    assert facts.vm.kernels == ("9.9.9",)
