"""Creating and removing a soft-RoCE (rxe) device.

``rxe_up`` does what the project's VM recipe does by hand: ``modprobe rdma_rxe``, pick
(or make) a netdev with an IPv4 address, ``rdma link add rxeN type rxe netdev IF``, then
wait, with a deadline, until the port is ACTIVE and its IPv4 RoCEv2 GID exists.  A
dummy netdev that hixl creates carries the alias :data:`HIXL_ALIAS`, which is how
``rxe_down`` knows it may delete it.

All external commands run through :func:`_run`: explicit argument lists, a timeout,
failures turned into DeviceError with the command, its exit status and its stderr.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hixl.errors import DeviceError
from hixl.verbs.devices import (
    SYSFS_ROOT,
    Device,
    Selection,
    list_devices,
    select_device,
    select_from,
)

__all__ = [
    "DUMMY_ADDRESS",
    "DUMMY_NETDEV",
    "HIXL_ALIAS",
    "Netdev",
    "RxeDown",
    "RxeUp",
    "list_netdevs",
    "parse_ip_addr_json",
    "pick_netdev",
    "rxe_down",
    "rxe_up",
]

log = logging.getLogger("hixl.rxe")

DUMMY_NETDEV = "hixl0"
DUMMY_ADDRESS = "192.168.77.1/24"
HIXL_ALIAS = "created by hixl rxe up"

_TOOL_PACKAGES = {"ip": "iproute2", "rdma": "iproute2", "modprobe": "kmod"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Netdev:
    """A network interface as ``ip -j addr`` reports it."""

    name: str
    up: bool
    """Administratively UP and with carrier (flags UP and LOWER_UP)."""
    loopback: bool
    ipv4: tuple[str, ...]
    """IPv4 addresses in ``a.b.c.d/len`` form."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RxeUp:
    """What :func:`rxe_up` did and the device, port and GID that are now usable."""

    selection: Selection
    created_device: bool
    created_netdev: bool

    @property
    def message(self) -> str:
        """A one-paragraph human summary."""
        sel = self.selection
        netdev = sel.gid.netdev or "?"
        head = (
            f"created {sel.device.name} on {netdev}"
            if self.created_device
            else f"{sel.device.name} already exists on {netdev}; nothing to do"
        )
        if self.created_netdev:
            head = f"created dummy netdev {netdev} ({DUMMY_ADDRESS}); " + head
        return (
            f"{head}\n{sel.device.name} port {sel.port.number} {sel.port.state}, "
            f"GID index {sel.gid.index} {sel.gid.gid} ({sel.gid.ipv4})"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RxeDown:
    """What :func:`rxe_down` removed."""

    removed_devices: tuple[str, ...]
    removed_netdev: str | None

    @property
    def message(self) -> str:
        """A one-line human summary."""
        parts = [f"removed {d}" for d in self.removed_devices]
        if self.removed_netdev:
            parts.append(f"removed dummy netdev {self.removed_netdev}")
        return "; ".join(parts) if parts else "no soft-RoCE device; nothing to do"


def _run(
    argv: Sequence[str], *, timeout: float = 20.0, hint: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run a command; raise DeviceError with its stderr unless it exits 0."""
    cmd = " ".join(argv)
    log.debug("run %s", cmd)
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as exc:
        pkg = _TOOL_PACKAGES.get(argv[0], argv[0])
        raise DeviceError(
            f"`{argv[0]}` is not installed or not on PATH; install it: sudo apt-get install {pkg}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise DeviceError(f"`{cmd}` did not finish within {timeout:g} s") from exc
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip() or "no output"
        msg = f"`{cmd}` failed (exit {proc.returncode}): {err}"
        raise DeviceError(f"{msg}; {hint}" if hint else msg)
    return proc


def parse_ip_addr_json(text: str) -> list[Netdev]:
    """Parse the output of ``ip -j addr show`` into netdevs.

    Raises DeviceError if the text is not the JSON list iproute2 prints.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DeviceError(f"cannot parse `ip -j addr show` output: {exc}") from exc
    if not isinstance(data, list):
        raise DeviceError(f"`ip -j addr show` printed a {type(data).__name__}, not a list")
    out = []
    for entry in data:
        if not isinstance(entry, dict) or "ifname" not in entry:
            continue
        flags = set(entry.get("flags", []))
        ipv4 = tuple(
            f"{a['local']}/{a.get('prefixlen', 32)}"
            for a in entry.get("addr_info", [])
            if isinstance(a, dict) and a.get("family") == "inet" and "local" in a
        )
        out.append(
            Netdev(
                name=str(entry["ifname"]),
                up={"UP", "LOWER_UP"} <= flags,
                loopback="LOOPBACK" in flags,
                ipv4=ipv4,
            )
        )
    return out


def list_netdevs() -> list[Netdev]:
    """Return the host's network interfaces (runs ``ip -j addr show``)."""
    return parse_ip_addr_json(_run(["ip", "-j", "addr", "show"], timeout=10).stdout)


def pick_netdev(netdevs: Sequence[Netdev]) -> Netdev | None:
    """Return the first UP, non-loopback netdev with an IPv4 address, or None."""
    for nd in netdevs:
        if nd.up and not nd.loopback and nd.ipv4:
            return nd
    return None


def _check_root(action: str) -> None:
    euid = os.geteuid()
    if euid != 0:
        raise DeviceError(
            f"`hixl rxe {action}` needs root (it runs modprobe, ip link and "
            f"rdma link; running as uid {euid}); run: sudo hixl rxe {action}"
        )


def _check_tools() -> None:
    missing = [t for t in ("modprobe", "ip", "rdma") if shutil.which(t) is None]
    if missing:
        pkgs = " ".join(sorted({_TOOL_PACKAGES[t] for t in missing}))
        raise DeviceError(
            f"missing tools: {', '.join(missing)}; install them: sudo apt-get install {pkgs}"
        )


def _rxe_on(devices: list[Device], netdev: str) -> Device | None:
    for dev in devices:
        if dev.kind == "rxe" and netdev in dev.netdevs:
            return dev
    return None


def _free_name(devices: list[Device]) -> str:
    taken = {d.name for d in devices}
    n = 0
    while f"rxe{n}" in taken:
        n += 1
    return f"rxe{n}"


def _make_dummy() -> None:
    # rxe needs a netdev with an IPv4 address for its RoCEv2 GID; a dummy netdev is the
    # smallest one and loops packets back inside the kernel, enough for one host.
    _run(
        ["ip", "link", "add", DUMMY_NETDEV, "type", "dummy"],
        hint="the kernel needs the `dummy` module (CONFIG_DUMMY)",
    )
    _run(["ip", "link", "set", "dev", DUMMY_NETDEV, "alias", HIXL_ALIAS])
    _run(["ip", "link", "set", "dev", DUMMY_NETDEV, "up"])
    _run(["ip", "addr", "add", DUMMY_ADDRESS, "dev", DUMMY_NETDEV])


def _wait_ready(
    name: str, deadline_s: float, sysfs: Path, clock: Callable[[], float] = time.monotonic
) -> Selection:
    end = clock() + deadline_s
    while True:
        try:
            return select_device(name, sysfs=sysfs)
        except DeviceError as exc:
            if clock() >= end:
                raise DeviceError(f"{name} is not ready after {deadline_s:g} s: {exc}") from exc
        time.sleep(0.1)


def rxe_up(
    netdev: str | None = None,
    *,
    name: str | None = None,
    timeout: float = 15.0,
    sysfs: Path | str = SYSFS_ROOT,
) -> RxeUp:
    """Create a soft-RoCE device and wait until it is usable.

    ``netdev`` defaults to the first UP non-loopback interface with an IPv4 address; if
    there is none, a dummy netdev ``hixl0`` with 192.168.77.1/24 is created.  ``name``
    defaults to the first free ``rxeN``.  If an rxe device already exists on the netdev
    (or, when neither ``netdev`` nor ``name`` is given, any usable rxe device exists),
    nothing is created.  Waits up to ``timeout`` seconds for the port to be ACTIVE with an
    IPv4 RoCEv2 GID.  Needs root.  Raises DeviceError naming what failed and how to fix it
    (not root, unknown netdev, netdev down or without IPv4, module not loadable,
    ``rdma link add`` failure, deadline passed).
    """
    root = Path(sysfs)
    if netdev is not None and not (root / "class" / "net" / netdev).exists():
        try:
            have = ", ".join(sorted(p.name for p in (root / "class" / "net").iterdir()))
        except OSError:
            have = "none"
        raise DeviceError(f"unknown netdev {netdev!r}: not in {root}/class/net (netdevs: {have})")
    _check_root("up")
    _check_tools()
    if not (root / "module" / "rdma_rxe").exists():
        _run(
            ["modprobe", "rdma_rxe"],
            timeout=30,
            hint="this kernel cannot load soft-RoCE; run `hixl doctor`, "
            "or use the VM: hixl vm run -- CMD",
        )

    created_netdev = False
    if netdev is None and name is None:
        # Without a netdev to honour, any usable soft-RoCE device already satisfies us.
        ready = [d for d in list_devices(root) if d.kind == "rxe"]
        try:
            sel = select_from(ready)
        except DeviceError:
            pass
        else:
            log.debug("%s is already usable", sel.device.name)
            return RxeUp(selection=sel, created_device=False, created_netdev=False)
    if netdev is None:
        chosen = pick_netdev(list_netdevs())
        if chosen is None:
            if not (root / "class" / "net" / DUMMY_NETDEV).exists():
                _make_dummy()
                created_netdev = True
            netdev = DUMMY_NETDEV
        else:
            netdev = chosen.name
    else:
        nd = next((n for n in list_netdevs() if n.name == netdev), None)
        if nd is not None and not nd.up:
            raise DeviceError(
                f"netdev {netdev!r} is not up (needs flags UP and LOWER_UP); "
                f"run: sudo ip link set dev {netdev} up"
            )
        if nd is not None and not nd.ipv4:
            raise DeviceError(
                f"netdev {netdev!r} has no IPv4 address, so rxe would get no "
                f"IPv4 RoCEv2 GID; add one, e.g.: "
                f"sudo ip addr add {DUMMY_ADDRESS} dev {netdev}"
            )

    devices = list_devices(root)
    existing = _rxe_on(devices, netdev)
    if existing is not None:
        if name is not None and name != existing.name:
            raise DeviceError(
                f"netdev {netdev!r} already has soft-RoCE device "
                f"{existing.name!r}; a netdev takes one rxe device "
                f"(remove it first: sudo hixl rxe down {existing.name})"
            )
        log.debug("%s already exists on %s", existing.name, netdev)
        sel = _wait_ready(existing.name, timeout, root)
        return RxeUp(selection=sel, created_device=False, created_netdev=created_netdev)

    if name is None:
        name = _free_name(devices)
    elif any(d.name == name for d in devices):
        other = next(d for d in devices if d.name == name)
        raise DeviceError(
            f"an RDMA device named {name!r} already exists "
            f"(on {', '.join(other.netdevs) or 'no netdev'}); pick another "
            f"--name"
        )
    _run(
        ["rdma", "link", "add", name, "type", "rxe", "netdev", netdev],
        hint=f"check `rdma link` and `ip addr show dev {netdev}`",
    )
    sel = _wait_ready(name, timeout, root)
    return RxeUp(selection=sel, created_device=True, created_netdev=created_netdev)


def _hixl_dummy(root: Path, netdev: str) -> bool:
    alias = root / "class" / "net" / netdev / "ifalias"
    try:
        return alias.read_text().strip() == HIXL_ALIAS
    except OSError:
        return False


def rxe_down(name: str | None = None, *, sysfs: Path | str = SYSFS_ROOT) -> RxeDown:
    """Remove a soft-RoCE device, and the dummy netdev if ``rxe_up`` made it.

    Without ``name``: removes the only rxe device, or does nothing if there is none, or
    raises DeviceError listing them if there are several.  With ``name``: raises
    DeviceError if no such device exists or it is not a soft-RoCE device.  Needs root.
    """
    root = Path(sysfs)
    _check_root("down")
    _check_tools()
    devices = list_devices(root) if (root / "class" / "infiniband").is_dir() else []
    rxes = [d for d in devices if d.kind == "rxe"]
    if name is not None:
        dev = next((d for d in devices if d.name == name), None)
        if dev is None:
            have = ", ".join(d.name for d in devices) or "none"
            raise DeviceError(f"no RDMA device named {name!r} (devices: {have})")
        if dev.kind != "rxe":
            raise DeviceError(
                f"{name!r} is a {dev.kind} device, not soft-RoCE (rxe); "
                f"hixl only removes rxe devices"
            )
        targets = [dev]
    elif len(rxes) > 1:
        raise DeviceError(
            f"{len(rxes)} soft-RoCE devices exist "
            f"({', '.join(d.name for d in rxes)}); name one: "
            f"sudo hixl rxe down NAME"
        )
    else:
        targets = rxes
    for dev in targets:
        _run(["rdma", "link", "delete", dev.name])
    removed_netdev = None
    remaining = [d for d in rxes if d not in targets]
    in_use = {n for d in remaining for n in d.netdevs}
    # The dummy goes when hixl made it, no remaining rxe uses it, and either no device
    # was named or the named one sat on it.
    if (
        _hixl_dummy(root, DUMMY_NETDEV)
        and DUMMY_NETDEV not in in_use
        and (name is None or any(DUMMY_NETDEV in d.netdevs for d in targets))
    ):
        _run(["ip", "link", "delete", DUMMY_NETDEV])
        removed_netdev = DUMMY_NETDEV
    return RxeDown(removed_devices=tuple(d.name for d in targets), removed_netdev=removed_netdev)
