"""The setup every run states: date, commit, kernel, VM or host, CPUs, device, versions.

Also the command line recorded with every result, and the quieting of libraries' INFO logs.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import BenchError

#: The source checkout the benchmarks live in (benchmarks/ is its child).
REPO = Path(__file__).resolve().parents[2]


def _first(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _cpu_model() -> str | None:
    text = _first("/proc/cpuinfo") or ""
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else None


def cpu_mhz(cpuinfo: str | None = None) -> float | None:
    """The TSC rate perftest's cycle counts run at: ``cpu MHz`` of ``/proc/cpuinfo``.

    None when absent or when CPUs disagree by more than 2% (then no single rate holds).
    """
    text = _first("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    values = [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", text or "", re.M)]
    if not values or max(values) > 1.02 * min(values):
        return None
    return values[0]


def parse_perftest_version(text: str) -> str | None:
    """The version perftest prints for ``--version`` (``Version: 6.06``), or None."""
    m = re.search(r"Version:\s*(\S+)", text)
    return m.group(1) if m else None


def perftest_version() -> str | None:
    """The installed perftest's version, or None when it is missing or says nothing."""
    try:
        out = subprocess.run(
            ["ib_write_bw", "--version"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_perftest_version(out.stdout + out.stderr)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """Short commit of the checkout, with ``+dirty`` when tracked files changed.

    ``HIXL_BENCH_COMMIT`` (set by ``hixl bench`` on the host) wins: a guest may not be
    able to run git on the read-only checkout.
    """
    env = os.environ.get("HIXL_BENCH_COMMIT")
    if env:
        return env
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def where() -> str:
    """``host``, ``VM/KVM``, ``VM/TCG`` or ``VM/unknown``: where the numbers were made."""
    in_vm = os.environ.get("HIXL_IN_VM") == "1" or _first("/sys/class/dmi/id/sys_vendor") == "QEMU"
    if not in_vm:
        return "host"
    if _first("/sys/devices/system/clocksource/clocksource0/current_clocksource") == "kvm-clock":
        return "VM/KVM"
    if "TCG" in (_cpu_model() or ""):
        return "VM/TCG"
    return "VM/unknown"


def device_info(name: str | None = None) -> dict[str, Any]:
    """The device, port, GID and MTU hixl (and these benchmarks) use."""
    from hixl.verbs.devices import select_device

    sel = select_device(name)
    return {
        "device": sel.device.name,
        "port": sel.port.number,
        "gid_index": sel.gid.index,
        "gid": sel.gid.gid,
        "netdev": sel.gid.netdev or ",".join(sel.device.netdevs) or None,
        "active_mtu": sel.port.active_mtu,
        "kind": sel.device.kind,
    }


def gather_setup(device: str | None = None, need_device: bool = True) -> dict[str, Any]:
    """Everything the header states about this run."""
    import numpy as np

    setup: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "kernel": platform.release(),
        "where": where(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "cpu_mhz": cpu_mhz(),
        "host_cpu_model": os.environ.get("HIXL_BENCH_HOST_CPU"),
        "host_cpus": os.environ.get("HIXL_BENCH_HOST_CPUS"),
        "host_kernel": os.environ.get("HIXL_BENCH_HOST_KERNEL"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "perftest": perftest_version(),
    }
    try:
        setup.update(device_info(device))
    except Exception as exc:  # noqa: BLE001 - reported, and fatal only when a device is needed
        if need_device:
            raise BenchError(f"no usable RDMA device: {exc}") from exc
        setup["device"] = None
        setup["device_error"] = str(exc)
    return setup


def setup_lines(setup: dict[str, Any]) -> list[str]:
    """The setup as ``# key: value`` header lines for a terminal or a log."""
    dev = setup.get("device")
    dev_text = (
        f"{dev} port {setup.get('port')} GID index {setup.get('gid_index')} "
        f"({setup.get('gid')}) on {setup.get('netdev')}, active MTU {setup.get('active_mtu')}"
        if dev
        else f"none ({setup.get('device_error', 'not needed')})"
    )
    host = ""
    if setup.get("host_cpu_model"):
        host = f"; host: {setup['host_cpu_model']}, {setup.get('host_cpus')} CPUs"
        if setup.get("host_kernel"):
            host += f", kernel {setup['host_kernel']}"
    return [
        f"# date {setup['date_utc']}  commit {setup['commit']}",
        f"# {setup['where']}: kernel {setup['kernel']}, {setup['cpus']} CPUs "
        f"({setup.get('cpu_model')}){host}",
        f"# device: {dev_text}",
        f"# python {setup['python']}, numpy {setup['numpy']}, perftest {setup.get('perftest')}",
    ]


def print_header(title: str, setup: dict[str, Any], extra: Sequence[str] = ()) -> None:
    print(f"# {title}")
    for line in (*setup_lines(setup), *extra):
        print(line if line.startswith("#") else f"# {line}")
    sys.stdout.flush()


def command_line(argv: Sequence[str] | None = None) -> str:
    """This program's command line, relative to the repository, for the record."""
    args = list(sys.argv if argv is None else argv)
    with contextlib.suppress(ValueError):
        args[0] = str(Path(args[0]).resolve().relative_to(REPO))
    return shlex.join(["python", *args])


def quiet_logs() -> None:
    """Keep INFO chatter (engines closing, matplotlib's font cache) out of the output.

    pyverbs (rdma-core 44) calls ``logging.basicConfig`` at INFO level once it is loaded,
    which would print every INFO record of hixl and matplotlib; these programs only want
    warnings from them.
    """
    for name in ("hixl", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)
