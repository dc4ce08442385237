"""``hixl doctor``: can hixl run RDMA here, and if not, exactly what to do.

Two halves.  :func:`gather_facts` looks at the machine (sysfs, kernel config, modprobe,
libibverbs and pyverbs probed in child processes, the VM tools) and returns plain values.
:func:`diagnose` turns those values into checks, each ``ok``/``warn``/``fail`` with a
one-line finding and an exact fix command, plus a verdict.  ``diagnose`` does no I/O, so
tests feed it the facts of machines they are not running on.

The runtime needs ``libibverbs.so.1`` loadable by cffi, and a device or the VM path; that
is what the verdict rests on.  pyverbs serves only the tests (an independent second
binding), so it is reported as a test dependency and never decides the verdict.  Both are
probed in a child Python (``sys.executable``), so that a broken library (an ABI mismatch,
a crash) cannot take the doctor down with it.
"""

from __future__ import annotations

import enum
import gzip
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hixl.errors import DeviceError
from hixl.verbs.devices import SYSFS_ROOT, Device, Selection, list_devices, select_from

__all__ = [
    "Check",
    "Facts",
    "PyverbsProbe",
    "Report",
    "Status",
    "VerbsProbe",
    "VmFacts",
    "diagnose",
    "format_report",
    "gather_facts",
    "parse_kernel_config",
    "probe_pyverbs",
    "probe_verbs",
    "report_to_json",
]

VM_COMMAND = "hixl vm run -- CMD"
_MEMLOCK_MIN = 64 << 20
_SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")


class Status(enum.Enum):
    """Outcome of one check."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One doctor finding: what was checked, the outcome, and the command that fixes it."""

    name: str
    status: Status
    finding: str
    fix: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class VerbsProbe:
    """Result of loading ``libibverbs.so.1`` through cffi and listing devices, in a child."""

    loaded: bool
    device_count: int | None
    """None when listing the devices failed (or was not reached)."""
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PyverbsProbe:
    """Result of importing pyverbs and calling ``get_device_list()`` in a child Python."""

    imported: bool
    device_count: int | None
    """None when ``get_device_list()`` raised (or was not reached)."""
    error: str = ""
    location: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class VmFacts:
    """What the VM path (``hixl vm run``) needs on the host."""

    qemu: str | None
    kernels: tuple[str, ...]
    """Versions with a /boot/vmlinuz-<ver> we can read and a rdma_rxe module."""
    unreadable_kernels: tuple[str, ...] = ()
    """Versions with rdma_rxe whose vmlinuz this user cannot read (Ubuntu: mode 0600)."""
    vng: str | None = None
    busybox: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """Everything the doctor looked at, as plain values."""

    kernel_release: str
    rdma_class: bool
    config: Mapping[str, str] | None
    """Kernel config (``CONFIG_X`` -> ``y``/``m``/``n``/value), None if unreadable."""
    config_source: str = ""
    rxe_loaded: bool = False
    modprobe: tuple[bool, str] | None = None
    """(loadable, output) of ``modprobe -n -v rdma_rxe``; None if modprobe is missing."""
    euid: int = 0
    memlock: int | None = None
    """Soft RLIMIT_MEMLOCK in bytes; None means unlimited."""
    python: str = ""
    venv_without_system_site: bool = False
    system_pyverbs: bool = True
    verbs: VerbsProbe = field(default_factory=lambda: VerbsProbe(loaded=False, device_count=None))
    pyverbs: PyverbsProbe = field(
        default_factory=lambda: PyverbsProbe(imported=False, device_count=None)
    )
    devices: tuple[Device, ...] = ()
    vm: VmFacts = field(default_factory=lambda: VmFacts(qemu=None, kernels=()))


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The doctor's checks and verdict.  ``mode`` is ``direct``, ``vm`` or ``none``."""

    checks: tuple[Check, ...]
    mode: str
    verdict: str
    selection: Selection | None = None

    @property
    def exit_code(self) -> int:
        """0 if hixl can run RDMA here (directly or through the VM), else 1."""
        return 0 if self.mode in ("direct", "vm") else 1


# --- facts -----------------------------------------------------------------------------


def parse_kernel_config(text: str) -> dict[str, str]:
    """Parse kernel ``.config`` text into ``{"CONFIG_X": value}``.

    ``CONFIG_X=m`` gives ``"m"``, ``# CONFIG_X is not set`` gives ``"n"``.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# CONFIG_") and line.endswith(" is not set"):
            out[line[2 : -len(" is not set")]] = "n"
        elif line.startswith("CONFIG_") and "=" in line:
            key, _, value = line.partition("=")
            out[key] = value.strip('"')
    return out


def _read_config(release: str, proc: Path, boot: Path) -> tuple[dict[str, str] | None, str]:
    try:
        with gzip.open(proc / "config.gz", "rt") as fh:
            return parse_kernel_config(fh.read()), str(proc / "config.gz")
    except OSError:
        pass
    path = boot / f"config-{release}"
    try:
        return parse_kernel_config(path.read_text()), str(path)
    except OSError:
        return None, ""


_PROBE = r"""
import json
out = {"imported": False, "device_count": None, "error": "", "location": ""}
try:
    import pyverbs
    import pyverbs.device as d
    out["imported"] = True
    out["location"] = str(getattr(pyverbs, "__file__", ""))
    out["device_count"] = len(d.get_device_list())
except BaseException as e:
    out["error"] = type(e).__name__ + ": " + " ".join(str(e).split())
print(json.dumps(out))
"""


_VERBS_PROBE = r"""
import json
out = {"loaded": False, "device_count": None, "error": ""}
try:
    from hixl.verbs import adapter
    ok, why = adapter.available()
    out["loaded"] = ok
    out["error"] = why
    if ok:
        out["device_count"] = len(adapter.device_names())
except BaseException as e:
    out["error"] = type(e).__name__ + ": " + " ".join(str(e).split())
print(json.dumps(out))
"""


def _run_probe(code: str, python: str | None, timeout: float) -> dict[str, Any] | str:
    """Run ``code`` in a child interpreter; its last stdout line as JSON, or why not."""
    argv = [python or sys.executable, "-c", code]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"probe did not run: {exc}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        how = (
            f"killed by signal {-proc.returncode}"
            if proc.returncode < 0
            else f"exit {proc.returncode}"
        )
        tail = " ".join(proc.stderr.split())[-300:]
        return f"probe process failed ({how}): {tail}"
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError:
        return f"probe printed no result: {lines[-1][:200]}"
    return data if isinstance(data, dict) else f"probe printed no result: {lines[-1][:200]}"


def probe_verbs(python: str | None = None, timeout: float = 30.0) -> VerbsProbe:
    """Load ``libibverbs.so.1`` with hixl's cffi adapter and list devices, in a child.

    Never raises: a failure, timeout or crash of the child is reported in ``error``.
    """
    data = _run_probe(_VERBS_PROBE, python, timeout)
    if isinstance(data, str):
        return VerbsProbe(loaded=False, device_count=None, error=data)
    count = data.get("device_count")
    return VerbsProbe(
        loaded=bool(data.get("loaded")),
        device_count=count if isinstance(count, int) else None,
        error=str(data.get("error", "")),
    )


def probe_pyverbs(python: str | None = None, timeout: float = 30.0) -> PyverbsProbe:
    """Import pyverbs and call ``get_device_list()`` in a child interpreter.

    Never raises: a failure, timeout or crash of the child is reported in ``error``.
    """
    data = _run_probe(_PROBE, python, timeout)
    if isinstance(data, str):
        return PyverbsProbe(imported=False, device_count=None, error=data)
    count = data.get("device_count")
    return PyverbsProbe(
        imported=bool(data.get("imported")),
        device_count=count if isinstance(count, int) else None,
        error=str(data.get("error", "")),
        location=str(data.get("location", "")),
    )


def _modprobe_dry_run() -> tuple[bool, str] | None:
    exe = shutil.which("modprobe") or next(
        (p for p in ("/usr/sbin/modprobe", "/sbin/modprobe") if os.access(p, os.X_OK)), None
    )
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "-n", "-v", "rdma_rxe"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    text = " ".join((proc.stderr + " " + proc.stdout).split())
    return proc.returncode == 0, text


def _vm_facts(boot: Path, modules: Path) -> VmFacts:
    from hixl.errors import VMError
    from hixl.testbed.vm import find_vng, rxe_capable_kernels

    kernels: list[str] = []
    unreadable: list[str] = []
    for image in rxe_capable_kernels(boot, modules):
        version = image.name[len("vmlinuz-") :]
        (kernels if os.access(image, os.R_OK) else unreadable).append(version)
    try:
        vng: str | None = find_vng()
    except VMError:
        vng = None
    busybox = next(
        (p for p in ("/usr/bin/busybox", "/bin/busybox") if os.access(p, os.X_OK)), None
    ) or shutil.which("busybox")
    return VmFacts(
        qemu=shutil.which("qemu-system-x86_64"),
        kernels=tuple(kernels),
        unreadable_kernels=tuple(unreadable),
        vng=vng,
        busybox=busybox,
    )


def _venv_without_system_site() -> bool:
    if sys.prefix == sys.base_prefix:
        return False
    try:
        cfg = (Path(sys.prefix) / "pyvenv.cfg").read_text()
    except OSError:
        return False
    for line in cfg.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "include-system-site-packages":
            return value.strip().lower() != "true"
    return True


def gather_facts(
    *,
    sysfs: Path | str = SYSFS_ROOT,
    proc: Path | str = "/proc",
    boot: Path | str = "/boot",
    modules: Path | str = "/lib/modules",
    python: str | None = None,
) -> Facts:
    """Look at this machine and return what :func:`diagnose` needs.  Never raises."""
    root = Path(sysfs)
    release = platform.release()
    config, source = _read_config(release, Path(proc), Path(boot))
    rdma_class = (root / "class" / "infiniband").is_dir()
    devices: tuple[Device, ...] = ()
    if rdma_class:
        try:
            devices = tuple(list_devices(root))
        except DeviceError:
            devices = ()
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return Facts(
        kernel_release=release,
        rdma_class=rdma_class,
        config=config,
        config_source=source,
        rxe_loaded=(root / "module" / "rdma_rxe").exists(),
        modprobe=_modprobe_dry_run(),
        euid=os.geteuid(),
        memlock=None if soft == resource.RLIM_INFINITY else soft,
        python=f"{python or sys.executable} ({platform.python_version()})",
        venv_without_system_site=_venv_without_system_site(),
        system_pyverbs=_SYSTEM_PYVERBS.is_dir(),
        verbs=probe_verbs(python),
        pyverbs=probe_pyverbs(python),
        devices=devices,
        vm=_vm_facts(Path(boot), Path(modules)),
    )


# --- diagnosis (pure) ------------------------------------------------------------------


def _cfg(facts: Facts, key: str) -> str | None:
    return None if facts.config is None else facts.config.get(key, "n")


def _cfg_note(facts: Facts, key: str) -> str:
    value = _cfg(facts, key)
    if value is None:
        return "kernel config not readable"
    text = f"{key} is not set" if value == "n" else f"{key}={value}"
    return f"{text} ({facts.config_source})"


def _kernel_can_rxe(facts: Facts) -> bool:
    if facts.rxe_loaded or _cfg(facts, "CONFIG_RDMA_RXE") == "y":
        return True
    return facts.modprobe is not None and facts.modprobe[0]


def _check_kernel(facts: Facts) -> Check:
    name = "kernel RDMA"
    if facts.rdma_class:
        return Check(
            name=name,
            status=Status.OK,
            finding=f"kernel {facts.kernel_release} has RDMA (/sys/class/infiniband present)",
        )
    ib = _cfg(facts, "CONFIG_INFINIBAND")
    modules = _cfg(facts, "CONFIG_MODULES")
    if ib == "m" and modules != "n":
        return Check(
            name=name,
            status=Status.WARN,
            finding=f"kernel {facts.kernel_release} has RDMA as modules "
            f"({_cfg_note(facts, 'CONFIG_INFINIBAND')}), none loaded yet",
            fix="sudo hixl rxe up   # loads rdma_rxe and ib_core",
        )
    why = "/sys/class/infiniband is missing; " + (
        _cfg_note(facts, "CONFIG_INFINIBAND") if ib is not None else "kernel config not readable"
    )
    return Check(
        name=name,
        status=Status.FAIL,
        finding=f"kernel {facts.kernel_release} has no RDMA: {why}",
        fix=f"use the VM path: {VM_COMMAND}   (or boot a kernel with "
        f"CONFIG_INFINIBAND=m CONFIG_RDMA_RXE=m)",
    )


def _check_rxe_module(facts: Facts) -> Check:
    name = "rdma_rxe module"
    hardware = [d.name for d in facts.devices if d.kind not in ("rxe", "siw", "virtual")]
    if facts.rxe_loaded:
        return Check(name=name, status=Status.OK, finding="rdma_rxe is loaded")
    if _cfg(facts, "CONFIG_RDMA_RXE") == "y":
        return Check(name=name, status=Status.OK, finding="rdma_rxe is built into the kernel")
    if hardware:
        return Check(
            name=name,
            status=Status.OK,
            finding=f"not loaded, not needed: hardware device(s) {', '.join(hardware)}",
        )
    if facts.modprobe is not None and facts.modprobe[0]:
        return Check(
            name=name,
            status=Status.OK,
            finding=f"rdma_rxe can be loaded (modprobe -n: {facts.modprobe[1] or 'ok'})",
            fix="sudo hixl rxe up   # loads it and creates rxe0",
        )
    if _cfg(facts, "CONFIG_MODULES") == "n":
        return Check(
            name=name,
            status=Status.FAIL,
            finding=f"kernel {facts.kernel_release} cannot load modules, so no "
            f"rdma_rxe: {_cfg_note(facts, 'CONFIG_MODULES')}",
            fix=f"use the VM path: {VM_COMMAND}",
        )
    detail = facts.modprobe[1] if facts.modprobe is not None else "modprobe is not installed"
    rxe_cfg = _cfg(facts, "CONFIG_RDMA_RXE")
    if facts.modprobe is None:
        fix = "sudo apt-get install kmod"
    elif rxe_cfg == "m":
        fix = (
            "the module file is missing; install the kernel's extra modules: "
            "sudo apt-get install linux-modules-extra-$(uname -r)   # Ubuntu"
        )
    elif rxe_cfg == "n":
        fix = f"this kernel has no soft-RoCE (CONFIG_RDMA_RXE is not set); use: {VM_COMMAND}"
    else:
        fix = f"install a kernel with CONFIG_RDMA_RXE=m, or use: {VM_COMMAND}"
    return Check(
        name=name, status=Status.FAIL, finding=f"rdma_rxe cannot be loaded: {detail}", fix=fix
    )


def _select_from(devices: tuple[Device, ...]) -> tuple[Selection | None, str]:
    try:
        return select_from(list(devices)), ""
    except DeviceError as exc:
        return None, str(exc)


def _check_root(facts: Facts, selection: Selection | None) -> Check:
    name = "root"
    if facts.euid == 0:
        return Check(name=name, status=Status.OK, finding="running as root")
    if selection is not None:
        return Check(
            name=name,
            status=Status.OK,
            finding=f"not root (uid {facts.euid}); fine: {selection.device.name} is already up",
        )
    if not _kernel_can_rxe(facts):
        return Check(
            name=name,
            status=Status.OK,
            finding=f"not root (uid {facts.euid}); root would not help this kernel, "
            f"and the VM path does not need it",
        )
    return Check(
        name=name,
        status=Status.WARN,
        finding=f"not root (uid {facts.euid}): creating a soft-RoCE device needs root",
        fix="sudo hixl rxe up",
    )


def _check_memlock(facts: Facts) -> Check:
    name = "locked memory"
    if facts.euid == 0 or facts.memlock is None:
        return Check(
            name=name,
            status=Status.OK,
            finding="no limit" if facts.memlock is None else "root: limit does not apply",
        )
    if facts.memlock < _MEMLOCK_MIN:
        return Check(
            name=name,
            status=Status.WARN,
            finding=f"RLIMIT_MEMLOCK is {facts.memlock // 1024} KiB; registering "
            f"more than that fails for non-root users",
            fix="ulimit -l unlimited   (to keep it: '* - memlock unlimited' in "
            "/etc/security/limits.conf)",
        )
    return Check(
        name=name, status=Status.OK, finding=f"RLIMIT_MEMLOCK is {facts.memlock >> 20} MiB"
    )


def _pyverbs_fix(facts: Facts) -> str:
    if not facts.system_pyverbs:
        extra = (
            "; then recreate this venv with system packages: /usr/bin/python3 -m venv "
            "--system-site-packages .venv"
            if facts.venv_without_system_site
            else ""
        )
        return "sudo apt-get install python3-pyverbs" + extra
    if facts.venv_without_system_site:
        return (
            "this venv hides system packages; recreate it: /usr/bin/python3 -m venv "
            "--system-site-packages .venv && .venv/bin/pip install -e ."
        )
    return (
        "python3-pyverbs is built for /usr/bin/python3; run hixl with it, e.g. "
        "/usr/bin/python3 -m venv --system-site-packages .venv"
    )


def _check_verbs(facts: Facts) -> Check:
    name = "libibverbs"
    v = facts.verbs
    if not v.loaded:
        return Check(
            name=name,
            status=Status.FAIL,
            finding=f"libibverbs.so.1 cannot be loaded through cffi: {v.error}",
            fix="sudo apt-get install libibverbs1 ibverbs-providers   # rdma-core",
        )
    if v.device_count is None:
        if not facts.rdma_class:
            return Check(
                name=name,
                status=Status.OK,
                finding="libibverbs.so.1 loads; listing devices fails here only because "
                f"the kernel has no RDMA ({v.error})",
            )
        return Check(
            name=name,
            status=Status.FAIL,
            finding=f"libibverbs.so.1 loads but listing devices fails: {v.error}",
            fix="sudo apt-get install --reinstall rdma-core ibverbs-providers",
        )
    return Check(
        name=name,
        status=Status.OK,
        finding=f"libibverbs.so.1 loads; it sees {v.device_count} device(s)",
    )


def _check_pyverbs(facts: Facts) -> Check:
    """pyverbs is for the tests only, so it warns at worst and never decides the verdict."""
    name = "pyverbs (tests only)"
    pv = facts.pyverbs
    where = f"python {facts.python}" if facts.python else "this python"
    if not pv.imported:
        if "IBVERBS_PRIVATE" in pv.error:
            return Check(
                name=name,
                status=Status.WARN,
                finding=f"pyverbs does not match the system's libibverbs (a PyPI "
                f"build?): {pv.error}",
                fix="pip uninstall -y pyverbs && sudo apt-get install python3-pyverbs"
                " && use a venv made by /usr/bin/python3 -m venv "
                "--system-site-packages",
            )
        return Check(
            name=name,
            status=Status.WARN,
            finding=f"pyverbs cannot be imported by {where} (the runtime does not need it; "
            f"the tests do): {pv.error}",
            fix=_pyverbs_fix(facts),
        )
    if pv.device_count is None:
        if not facts.rdma_class:
            return Check(
                name=name,
                status=Status.OK,
                finding=f"pyverbs imports ({pv.location}); get_device_list() fails "
                f"here only because the kernel has no RDMA ({pv.error})",
            )
        return Check(
            name=name,
            status=Status.WARN,
            finding=f"pyverbs imports but get_device_list() fails: {pv.error}",
            fix="sudo apt-get install --reinstall rdma-core ibverbs-providers python3-pyverbs",
        )
    return Check(
        name=name,
        status=Status.OK,
        finding=f"pyverbs imports ({pv.location}); get_device_list() sees "
        f"{pv.device_count} device(s)",
    )


def _check_devices(facts: Facts) -> Check:
    name = "devices"
    if not facts.devices:
        fix = "sudo hixl rxe up" if _kernel_can_rxe(facts) else f"use the VM path: {VM_COMMAND}"
        return Check(name=name, status=Status.FAIL, finding="no RDMA devices", fix=fix)
    listed = ", ".join(
        f"{d.name} ({d.kind} on {', '.join(d.netdevs) or 'no netdev'})" for d in facts.devices
    )
    return Check(name=name, status=Status.OK, finding=listed)


def _check_port(facts: Facts, selection: Selection | None, why: str) -> Check:
    name = "active port + GID"
    if selection is not None:
        return Check(name=name, status=Status.OK, finding=f"{selection}, {selection.gid.type}")
    fix = "sudo hixl rxe down && sudo hixl rxe up"
    for dev in facts.devices:
        for port in dev.ports:
            nd = next(iter(dev.netdevs), "IF")
            if not port.active:
                fix = f"sudo ip link set dev {nd} up"
            elif port.chosen_gid is None:
                fix = f"sudo ip addr add 192.168.77.1/24 dev {nd}"
            break
    return Check(name=name, status=Status.FAIL, finding=why, fix=fix)


def _vm_checks(facts: Facts) -> tuple[list[Check], bool]:
    vm = facts.vm
    checks = [
        Check(name="vm: qemu", status=Status.OK, finding=vm.qemu)
        if vm.qemu
        else Check(
            name="vm: qemu",
            status=Status.FAIL,
            finding="qemu-system-x86_64 not found",
            fix="sudo apt-get install qemu-system-x86",
        ),
    ]
    if vm.kernels:
        checks.append(
            Check(
                name="vm: kernel",
                status=Status.OK,
                finding=f"/boot/vmlinuz-{vm.kernels[0]} with rdma_rxe",
            )
        )
    elif vm.unreadable_kernels:
        ver = vm.unreadable_kernels[0]
        checks.append(
            Check(
                name="vm: kernel",
                status=Status.FAIL,
                finding=f"/boot/vmlinuz-{ver} has rdma_rxe but this user cannot read it",
                fix=f"sudo chmod 0644 /boot/vmlinuz-{ver}",
            )
        )
    else:
        checks.append(
            Check(
                name="vm: kernel",
                status=Status.FAIL,
                finding="no /boot/vmlinuz-* whose /lib/modules/<version> has rdma_rxe.ko",
                fix="sudo apt-get install linux-image-amd64",
            )
        )
    checks.append(
        Check(name="vm: virtme-ng", status=Status.OK, finding=vm.vng)
        if vm.vng
        else Check(
            name="vm: virtme-ng",
            status=Status.FAIL,
            finding="vng (virtme-ng) not found",
            fix="pip install 'hixl[vm]'   # or: pip install virtme-ng",
        )
    )
    checks.append(
        Check(name="vm: busybox", status=Status.OK, finding=vm.busybox)
        if vm.busybox
        else Check(
            name="vm: busybox",
            status=Status.FAIL,
            finding="busybox not found (virtme-ng builds its initramfs with it)",
            fix="sudo apt-get install busybox-static",
        )
    )
    ready = all(c.status is Status.OK for c in checks) and facts.verbs.loaded
    if ready:
        checks.append(
            Check(
                name="vm path",
                status=Status.OK,
                finding=f"ready: runs CMD in a VM booting {vm.kernels[0]} with "
                f"rxe0 up (about 25 s to boot without KVM)",
                fix=VM_COMMAND,
            )
        )
    else:
        missing = [c.name for c in checks if c.status is not Status.OK]
        if not facts.verbs.loaded:
            missing.append("libibverbs (the VM uses this machine's libraries)")
        checks.append(
            Check(
                name="vm path",
                status=Status.FAIL,
                finding=f"not ready: {', '.join(missing)}",
                fix="apply the fixes above, then: " + VM_COMMAND,
            )
        )
    return checks, ready


def diagnose(facts: Facts) -> Report:
    """Turn facts into checks and a verdict.  Pure: no I/O.

    The mode is ``direct`` when libibverbs lists devices and an ACTIVE port has a usable
    GID, else
    ``vm`` when the VM path is complete, else ``none``.  VM checks appear only when the
    direct path is not ready.
    """
    selection, why = _select_from(facts.devices) if facts.rdma_class else (None, "")
    checks = [
        _check_kernel(facts),
        _check_rxe_module(facts),
        _check_root(facts, selection),
        _check_memlock(facts),
        _check_verbs(facts),
        _check_pyverbs(facts),
    ]
    if facts.rdma_class:
        checks.append(_check_devices(facts))
        if facts.devices:
            checks.append(_check_port(facts, selection, why))
    v = facts.verbs
    direct = selection is not None and v.loaded and bool(v.device_count)
    if direct:
        assert selection is not None
        return Report(
            checks=tuple(checks),
            mode="direct",
            selection=selection,
            verdict=f"hixl can run RDMA here directly: {selection}",
        )
    vm_checks, vm_ready = _vm_checks(facts)
    checks.extend(vm_checks)
    if vm_ready:
        where = (
            "this kernel cannot run soft-RoCE"
            if not _kernel_can_rxe(facts)
            else "no usable device here yet; sudo hixl rxe up would make one"
        )
        return Report(
            checks=tuple(checks),
            mode="vm",
            verdict=f"hixl can run RDMA through the VM: {VM_COMMAND}   ({where})",
        )
    return Report(
        checks=tuple(checks),
        mode="none",
        verdict="hixl cannot run RDMA here yet: apply the fixes of the [fail] lines above",
    )


def format_report(report: Report) -> str:
    """Render a report as text: one line per check, its fix indented below it."""
    width = max(len(c.name) for c in report.checks)
    lines = []
    for c in report.checks:
        lines.append(f"[{c.status.value:<4}] {c.name:<{width}}  {c.finding}")
        if c.fix:
            label = "use" if c.status is Status.OK else "fix"
            lines.append(f"       {'':<{width}}  {label}: {c.fix}")
    lines.append("")
    lines.append(report.verdict)
    return "\n".join(lines)


def report_to_json(report: Report) -> dict[str, Any]:
    """Return a report as JSON-ready data."""
    sel = report.selection
    return {
        "mode": report.mode,
        "exit_code": report.exit_code,
        "verdict": report.verdict,
        "selected": None
        if sel is None
        else {
            "device": sel.device.name,
            "port": sel.port.number,
            "gid_index": sel.gid.index,
            "gid": sel.gid.gid,
            "ipv4": sel.gid.ipv4,
            "netdev": sel.gid.netdev,
        },
        "checks": [
            {"name": c.name, "status": c.status.value, "finding": c.finding, "fix": c.fix}
            for c in report.checks
        ],
    }
