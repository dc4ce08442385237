"""Finding verbs devices by reading sysfs, and choosing the GID hixl uses.

Listing reads ``<sysfs>/class/infiniband`` only, never pyverbs, so it keeps working
when pyverbs is missing or broken (``hixl doctor`` relies on that).  Every function
takes the sysfs root as a parameter; unit tests point it at a fake tree.

Theory of the GID choice: hixl connects over RoCEv2 and exchanges IPv4 addresses out of
band, so it uses an IPv4-mapped RoCEv2 GID (``::ffff:a.b.c.d``) that is bound to a
netdev.  Such a GID exists exactly while that netdev holds the IPv4 address, because
the kernel fills the GID table from the netdev's addresses.  Among several, the lowest
index wins.  That is the GID perftest's ``get_best_gid_index`` picks when no ``-x`` is
given (IPv4-mapped beats non-mapped, RoCE v2 beats v1, first index wins a tie).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hixl.errors import DeviceError

__all__ = [
    "SYSFS_ROOT",
    "Device",
    "Gid",
    "Port",
    "Selection",
    "choose_gid",
    "devices_to_json",
    "format_devices",
    "gid_ipv4",
    "list_devices",
    "rdma_class_present",
    "roce_active_mtu",
    "select_device",
    "select_from",
]

SYSFS_ROOT = Path("/sys")

ROCE_V2 = "RoCE v2"

# Overheads the kernel subtracts from the netdev MTU before rounding down to an IB MTU:
# rxe uses RXE_MAX_HDR_LENGTH (80 bytes), the RoCE core's iboe_get_mtu() uses
# GRH 40 + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 + ICRC 4 = 96 bytes.
_RXE_OVERHEAD = 80
_IBOE_OVERHEAD = 96
_IB_MTUS = (4096, 2048, 1024, 512, 256)


def gid_ipv4(gid: str) -> str | None:
    """Return the IPv4 address inside an IPv4-mapped GID, or None.

    ``gid`` is in sysfs form, eight groups of four hex digits
    (``0000:0000:0000:0000:0000:ffff:c0a8:4d01`` gives ``"192.168.77.1"``).
    Raises ValueError if ``gid`` is not 32 hex digits.
    """
    mapped = _parse_gid(gid).ipv4_mapped
    return None if mapped is None else str(mapped)


def _parse_gid(gid: str) -> ipaddress.IPv6Address:
    digits = gid.replace(":", "")
    if len(digits) != 32:
        raise ValueError(f"GID {gid!r} has {len(digits)} hex digits, expected 32")
    return ipaddress.IPv6Address(int(digits, 16))


def roce_active_mtu(netdev_mtu: int, *, rxe: bool) -> int:
    """Return the active IB MTU (256..4096 bytes) a RoCE port gets on a netdev MTU.

    sysfs does not publish a port's active MTU, so it is derived the way the kernel
    computes it: rxe subtracts 80 header bytes, other RoCE drivers 96, then the result is
    rounded down to an IB MTU (a 1500-byte Ethernet MTU gives 1024).
    """
    payload = netdev_mtu - (_RXE_OVERHEAD if rxe else _IBOE_OVERHEAD)
    for mtu in _IB_MTUS:
        if payload >= mtu:
            return mtu
    return 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Gid:
    """One populated entry of a port's GID table."""

    index: int
    gid: str
    """The GID in sysfs form: eight colon-separated groups of four hex digits."""
    type: str
    """``"RoCE v2"``, ``"IB/RoCE v1"``, or ``""`` when the kernel reports no type."""
    netdev: str | None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"GID index must be >= 0, got {self.index}")
        _parse_gid(self.gid)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID, else None."""
        return gid_ipv4(self.gid)

    @property
    def usable(self) -> bool:
        """True if hixl can use this GID: IPv4-mapped, RoCE v2, bound to a netdev."""
        return self.type == ROCE_V2 and self.ipv4 is not None and bool(self.netdev)


@dataclass(frozen=True, slots=True, kw_only=True)
class Port:
    """One port of a verbs device, as sysfs shows it."""

    number: int
    state: str
    """``"ACTIVE"``, ``"DOWN"``, ``"INIT"``... (sysfs ``4: ACTIVE`` gives ``"ACTIVE"``)."""
    phys_state: str
    link_layer: str
    """``"Ethernet"`` for RoCE, ``"InfiniBand"`` for IB."""
    active_mtu: int | None
    """Derived from the netdev MTU for RoCE ports; None when it cannot be derived."""
    mtu_source: str
    gid_table_len: int
    gids: tuple[Gid, ...]
    """Populated (non-zero) GIDs only, by index."""

    @property
    def active(self) -> bool:
        """True if the port state is ACTIVE."""
        return self.state == "ACTIVE"

    @property
    def chosen_gid(self) -> Gid | None:
        """The GID hixl would use on this port (see :func:`choose_gid`)."""
        return choose_gid(self.gids)


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """A verbs device: its name, kind, parent netdevs and ports."""

    name: str
    kind: str
    """``"rxe"`` for soft-RoCE, ``"siw"``, or the kernel driver name of a hardware device."""
    node_type: str
    netdevs: tuple[str, ...]
    ports: tuple[Port, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """The device, port and GID hixl would use."""

    device: Device
    port: Port
    gid: Gid

    def __str__(self) -> str:
        return (
            f"{self.device.name} port {self.port.number} gid {self.gid.index} "
            f"({self.gid.ipv4} on {self.gid.netdev})"
        )


def choose_gid(gids: tuple[Gid, ...] | list[Gid]) -> Gid | None:
    """Return the usable GID with the lowest index, or None if there is none.

    Usable means IPv4-mapped, type RoCE v2 and bound to a netdev (:attr:`Gid.usable`).
    """
    usable = [g for g in gids if g.usable]
    return min(usable, key=lambda g: g.index) if usable else None


def rdma_class_present(sysfs: Path | str = SYSFS_ROOT) -> bool:
    """True if the kernel has RDMA core loaded (``<sysfs>/class/infiniband`` exists)."""
    return (Path(sysfs) / "class" / "infiniband").is_dir()


def _read(path: Path) -> str | None:
    # sysfs answers EINVAL for the attributes of an empty GID slot, ENOENT for
    # attributes the kernel does not have: both mean "no value".
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _state_name(raw: str | None) -> str:
    # "4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp"
    if not raw:
        return "UNKNOWN"
    return raw.split(":", 1)[1].strip() if ":" in raw else raw


def _numbered(directory: Path) -> list[int]:
    try:
        return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    except OSError:
        return []


def _kind(devdir: Path, node_type: str) -> str:
    driver = devdir / "device" / "driver"
    if driver.exists():
        return os.path.basename(os.path.realpath(driver))
    if (devdir / "device").exists():
        return "hardware"
    if "RNIC" in node_type:
        return "siw"
    if (devdir / "parent").exists():
        return "rxe"
    return "virtual"


def _read_gids(portdir: Path) -> tuple[int, tuple[Gid, ...]]:
    indices = _numbered(portdir / "gids")
    gids = []
    for i in indices:
        raw = _read(portdir / "gids" / str(i))
        if raw is None:
            continue
        try:
            if _parse_gid(raw).packed == bytes(16):
                continue
        except ValueError:
            continue
        gids.append(
            Gid(
                index=i,
                gid=raw,
                type=_read(portdir / "gid_attrs" / "types" / str(i)) or "",
                netdev=_read(portdir / "gid_attrs" / "ndevs" / str(i)) or None,
            )
        )
    return len(indices), tuple(gids)


def _read_port(sysfs: Path, portdir: Path, kind: str, netdevs: tuple[str, ...]) -> Port:
    table_len, gids = _read_gids(portdir)
    link_layer = _read(portdir / "link_layer") or "unknown"
    mtu: int | None = None
    source = "unknown"
    if link_layer == "Ethernet":
        candidates = [g.netdev for g in gids if g.netdev] + list(netdevs)
        for nd in candidates:
            raw = _read(sysfs / "class" / "net" / nd / "mtu")
            if raw and raw.isdigit():
                mtu = roce_active_mtu(int(raw), rxe=kind == "rxe")
                source = f"netdev {nd} mtu {raw}"
                break
    return Port(
        number=int(portdir.name),
        state=_state_name(_read(portdir / "state")),
        phys_state=_state_name(_read(portdir / "phys_state")),
        link_layer=link_layer,
        active_mtu=mtu,
        mtu_source=source,
        gid_table_len=table_len,
        gids=gids,
    )


def _read_device(sysfs: Path, devdir: Path) -> Device:
    node_type = _state_name(_read(devdir / "node_type"))
    kind = _kind(devdir, node_type)
    netdevs: list[str] = []
    parent = _read(devdir / "parent")
    if parent:
        netdevs.append(parent)
    with contextlib.suppress(OSError):
        netdevs.extend(sorted(p.name for p in (devdir / "device" / "net").iterdir()))
    ports = tuple(
        _read_port(sysfs, devdir / "ports" / str(n), kind, tuple(netdevs))
        for n in _numbered(devdir / "ports")
    )
    for port in ports:
        netdevs.extend(g.netdev for g in port.gids if g.netdev)
    return Device(
        name=devdir.name,
        kind=kind,
        node_type=node_type,
        netdevs=tuple(dict.fromkeys(netdevs)),
        ports=ports,
    )


def list_devices(sysfs: Path | str = SYSFS_ROOT) -> list[Device]:
    """Return the verbs devices under ``<sysfs>/class/infiniband``, sorted by name.

    Raises DeviceError if the kernel has no RDMA support loaded (the class directory is
    missing); returns an empty list if RDMA is there but no device exists.
    """
    root = Path(sysfs)
    cls = root / "class" / "infiniband"
    if not cls.is_dir():
        raise DeviceError(
            f"this kernel has no RDMA support loaded: {cls} does not exist "
            f"(run `hixl doctor` to see why and what to do)"
        )
    return [_read_device(root, d) for d in sorted(cls.iterdir(), key=lambda p: p.name)]


def select_device(name: str | None = None, *, sysfs: Path | str = SYSFS_ROOT) -> Selection:
    """Return the device, port and GID hixl would use.

    With ``name``, only that device is considered.  The first ACTIVE port (devices by
    name, ports by number) with a usable GID wins.  Raises DeviceError naming what was
    found and what is missing: no RDMA, no devices, no such device, no ACTIVE port, no
    IPv4 RoCEv2 GID.
    """
    return select_from(list_devices(sysfs), name)


def select_from(devices: list[Device], name: str | None = None) -> Selection:
    """Like :func:`select_device`, over devices already listed.  Pure: no I/O."""
    if name is not None:
        named = [d for d in devices if d.name == name]
        if not named:
            have = ", ".join(d.name for d in devices) or "none"
            raise DeviceError(f"no RDMA device named {name!r} (devices: {have})")
        devices = named
    if not devices:
        raise DeviceError("no RDMA devices; create a soft-RoCE one with: sudo hixl rxe up")
    problems = []
    for dev in devices:
        for port in dev.ports:
            gid = port.chosen_gid
            if port.active and gid is not None:
                return Selection(device=dev, port=port, gid=gid)
            if not port.active:
                problems.append(f"{dev.name} port {port.number} is {port.state}")
            else:
                problems.append(
                    f"{dev.name} port {port.number} has no IPv4 RoCEv2 GID "
                    f"({len(port.gids)} GIDs; does its netdev have an IPv4 "
                    f"address?)"
                )
        if not dev.ports:
            problems.append(f"{dev.name} has no ports")
    raise DeviceError("no usable RDMA port: " + "; ".join(problems))


def _gid_row(dev: Device, port: Port, gid: Gid, chosen: Gid | None) -> str:
    mark = "*" if chosen is not None and gid.index == chosen.index else " "
    ver = {"RoCE v2": "v2", "IB/RoCE v1": "v1"}.get(gid.type, gid.type or "-")
    return (
        f"  {mark} {dev.name:<8} {port.number:>4} {gid.index:>5}  {gid.gid}  "
        f"{gid.ipv4 or '-':<15} {ver:<3} {gid.netdev or '-'}"
    )


def format_devices(devices: list[Device]) -> str:
    """Render devices as text: one block per port, then its GID table.

    The GID hixl would use on a port is marked with ``*``; a last line names the device,
    port and GID hixl would use overall, or says why there is none.
    """
    if not devices:
        return "no RDMA devices (create a soft-RoCE one with: sudo hixl rxe up)"
    lines = []
    for dev in devices:
        nds = ", ".join(dev.netdevs) or "-"
        lines.append(f"{dev.name}: {dev.kind}, node type {dev.node_type}, netdev {nds}")
        for port in dev.ports:
            mtu = (
                f"active_mtu {port.active_mtu} ({port.mtu_source})"
                if port.active_mtu is not None
                else "active_mtu unknown"
            )
            lines.append(
                f"  port {port.number}: {port.state} ({port.phys_state}), "
                f"{port.link_layer}, {mtu}, "
                f"{len(port.gids)} of {port.gid_table_len} GIDs set"
            )
            if port.gids:
                lines.append(
                    f"    {'DEV':<8} {'PORT':>4} {'INDEX':>5}  {'GID':<39}  "
                    f"{'IPv4':<15} {'VER':<3} NETDEV"
                )
            chosen = port.chosen_gid
            lines.extend(_gid_row(dev, port, g, chosen) for g in port.gids)
    lines.append("")
    lines.append(_verdict(devices))
    return "\n".join(lines)


def _verdict(devices: list[Device]) -> str:
    try:
        return f"hixl uses: {select_from(devices)}  (* marks it)"
    except DeviceError as exc:
        return f"hixl uses: none: {exc}"


def devices_to_json(devices: list[Device]) -> dict[str, Any]:
    """Return devices as JSON-ready data: ``{"devices": [...], "selected": {...} | None}``."""
    selected: dict[str, Any] | None = None
    out = []
    for dev in devices:
        ports = []
        for port in dev.ports:
            chosen = port.chosen_gid
            if selected is None and port.active and chosen is not None:
                selected = {
                    "device": dev.name,
                    "port": port.number,
                    "gid_index": chosen.index,
                    "gid": chosen.gid,
                    "ipv4": chosen.ipv4,
                    "netdev": chosen.netdev,
                }
            ports.append(
                {
                    "port": port.number,
                    "state": port.state,
                    "phys_state": port.phys_state,
                    "link_layer": port.link_layer,
                    "active_mtu": port.active_mtu,
                    "mtu_source": port.mtu_source,
                    "gid_table_len": port.gid_table_len,
                    "chosen_gid_index": None if chosen is None else chosen.index,
                    "gids": [
                        {
                            "index": g.index,
                            "gid": g.gid,
                            "type": g.type,
                            "netdev": g.netdev,
                            "ipv4": g.ipv4,
                        }
                        for g in port.gids
                    ],
                }
            )
        out.append(
            {
                "name": dev.name,
                "kind": dev.kind,
                "node_type": dev.node_type,
                "netdevs": list(dev.netdevs),
                "ports": ports,
            }
        )
    return {"devices": out, "selected": selected}
