"""Device listing from a fake sysfs tree, the GID choice rule, netdev picking.

These test parsing and rules only; the real sysfs of an rxe device is checked in the VM
(``hixl vm run -- hixl devices``).  The fake tree copies what kernel 6.1 shows for rxe0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl.errors import DeviceError
from hixl.testbed.rxe import Netdev, parse_ip_addr_json, pick_netdev
from hixl.verbs.devices import (
    Gid,
    choose_gid,
    devices_to_json,
    format_devices,
    gid_ipv4,
    list_devices,
    rdma_class_present,
    roce_active_mtu,
    select_device,
)

LINK_LOCAL = "fe80:0000:0000:0000:001a:feff:fe39:e25a"
MAPPED_77_1 = "0000:0000:0000:0000:0000:ffff:c0a8:4d01"  # ::ffff:192.168.77.1
MAPPED_10_1 = "0000:0000:0000:0000:0000:ffff:0a00:0001"  # ::ffff:10.0.0.1
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def make_device(
    sysfs: Path,
    name: str = "rxe0",
    *,
    netdev: str = "d0",
    state: str = "4: ACTIVE",
    table_len: int = 8,
    netdev_mtu: int = 1500,
    gids: list[tuple[int, str, str, str | None]] | None = None,
    driver: str | None = None,
) -> Path:
    """Write a device like kernel 6.1's sysfs: rxe has ``parent``, hardware ``device/``."""
    if gids is None:
        gids = [(0, LINK_LOCAL, "RoCE v2", netdev), (1, MAPPED_77_1, "RoCE v2", netdev)]
    dev = sysfs / "class" / "infiniband" / name
    port = dev / "ports" / "1"
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True, exist_ok=True)
    (dev / "node_type").write_text("1: CA\n")
    if driver is None:
        (dev / "parent").write_text(f"{netdev}\n")
    else:
        drv = sysfs / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        (dev / "device" / "net" / netdev).mkdir(parents=True)
        (dev / "device" / "driver").symlink_to(drv)
    (port / "state").write_text(f"{state}\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("Ethernet\n")
    by_index = {i: (g, t, n) for i, g, t, n in gids}
    for i in range(table_len):
        gid, typ, nd = by_index.get(i, (ZERO, None, None))
        (port / "gids" / str(i)).write_text(gid + "\n")
        # Empty slots: the kernel answers EINVAL on read; a directory gives an OSError too.
        for sub, value in (("types", typ), ("ndevs", nd)):
            attr = port / "gid_attrs" / sub / str(i)
            if value is None:
                attr.mkdir()
            else:
                attr.write_text(value + "\n")
    net = sysfs / "class" / "net" / netdev
    net.mkdir(parents=True, exist_ok=True)
    (net / "mtu").write_text(f"{netdev_mtu}\n")
    return dev


# --- parsing ---------------------------------------------------------------------------


def test_rxe_device_is_parsed_like_the_kernel_shows_it(tmp_path: Path) -> None:
    make_device(tmp_path)
    [dev] = list_devices(tmp_path)
    assert (dev.name, dev.kind, dev.node_type, dev.netdevs) == ("rxe0", "rxe", "CA", ("d0",))
    [port] = dev.ports
    assert port.number == 1 and port.active and port.phys_state == "LinkUp"
    assert port.link_layer == "Ethernet"
    assert port.gid_table_len == 8
    assert [g.index for g in port.gids] == [0, 1]  # zero GIDs are left out
    assert port.gids[1] == Gid(index=1, gid=MAPPED_77_1, type="RoCE v2", netdev="d0")
    assert port.active_mtu == 1024 and port.mtu_source == "netdev d0 mtu 1500"
    assert port.chosen_gid is not None and port.chosen_gid.index == 1


def test_hardware_device_kind_and_netdev_come_from_device_link(tmp_path: Path) -> None:
    make_device(tmp_path, "mlx5_0", netdev="ens1f0", driver="mlx5_core", netdev_mtu=9000)
    [dev] = list_devices(tmp_path)
    assert dev.kind == "mlx5_core"
    assert dev.netdevs == ("ens1f0",)
    assert dev.ports[0].active_mtu == 4096


def test_devices_are_sorted_and_missing_class_raises(tmp_path: Path) -> None:
    assert not rdma_class_present(tmp_path)
    with pytest.raises(DeviceError, match="has no RDMA support loaded"):
        list_devices(tmp_path)
    make_device(tmp_path, "rxe1", netdev="d1")
    make_device(tmp_path, "rxe0", netdev="d0")
    assert rdma_class_present(tmp_path)
    assert [d.name for d in list_devices(tmp_path)] == ["rxe0", "rxe1"]


def test_empty_class_lists_nothing(tmp_path: Path) -> None:
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    assert list_devices(tmp_path) == []
    assert "no RDMA devices" in format_devices([])


# --- GID choice ------------------------------------------------------------------------


def test_gid_ipv4() -> None:
    assert gid_ipv4(MAPPED_77_1) == "192.168.77.1"
    assert gid_ipv4(LINK_LOCAL) is None
    with pytest.raises(ValueError, match="has 28 hex digits, expected 32"):
        gid_ipv4("fe80:0000:0000:0000:0000:0000:0000")


def test_choice_prefers_ipv4_roce_v2_with_a_netdev() -> None:
    gids = [
        Gid(index=0, gid=LINK_LOCAL, type="RoCE v2", netdev="d0"),
        Gid(index=1, gid=MAPPED_10_1, type="IB/RoCE v1", netdev="d0"),
        Gid(index=2, gid=MAPPED_10_1, type="RoCE v2", netdev=None),
        Gid(index=3, gid=MAPPED_77_1, type="RoCE v2", netdev="d0"),
        Gid(index=4, gid=MAPPED_10_1, type="RoCE v2", netdev="d0"),
    ]
    chosen = choose_gid(gids)
    assert chosen is not None and chosen.index == 3
    assert choose_gid(gids[:3]) is None


def _perftest_choice(gids: list[Gid]) -> Gid:
    """perftest's get_best_gid_index over populated GIDs (index order, no -x, IPv4)."""
    rank = {"IB/RoCE v1": 1, "RoCE v2": 2}
    best = gids[0]
    for rival in gids[1:]:
        gains_ipv4 = rival.ipv4 is not None and best.ipv4 is None
        same_family = (rival.ipv4 is None) == (best.ipv4 is None)
        if gains_ipv4 or (same_family and rank[rival.type] > rank[best.type]):
            best = rival
    return best


_gid_values = st.sampled_from(
    [LINK_LOCAL, MAPPED_77_1, MAPPED_10_1, "fe80:0000:0000:0000:0000:0000:0000:0002"]
)
_types = st.sampled_from(["RoCE v2", "IB/RoCE v1"])


@given(st.lists(st.tuples(_gid_values, _types), min_size=1, max_size=12))
def test_choice_matches_perftest_when_an_ipv4_roce_v2_gid_exists(
    entries: list[tuple[str, str]],
) -> None:
    gids = [Gid(index=i, gid=g, type=t, netdev="d0") for i, (g, t) in enumerate(entries)]
    chosen = choose_gid(gids)
    if any(g.usable for g in gids):
        assert chosen == _perftest_choice(gids)
    else:
        assert chosen is None


# --- selection and output --------------------------------------------------------------


def test_select_device_reports_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    with pytest.raises(DeviceError, match="no RDMA devices; create .* hixl rxe up"):
        select_device(sysfs=tmp_path)
    make_device(tmp_path, "rxe0", state="1: DOWN")
    with pytest.raises(DeviceError, match="rxe0 port 1 is DOWN"):
        select_device(sysfs=tmp_path)
    with pytest.raises(DeviceError, match=r"no RDMA device named 'rxe7' \(devices: rxe0\)"):
        select_device("rxe7", sysfs=tmp_path)
    make_device(tmp_path, "rxe1", netdev="d1", gids=[(0, LINK_LOCAL, "RoCE v2", "d1")])
    with pytest.raises(DeviceError, match="rxe1 port 1 has no IPv4 RoCEv2 GID"):
        select_device("rxe1", sysfs=tmp_path)
    make_device(tmp_path, "rxe2", netdev="d2")
    sel = select_device(sysfs=tmp_path)
    assert (sel.device.name, sel.port.number, sel.gid.index) == ("rxe2", 1, 1)
    assert str(sel) == "rxe2 port 1 gid 1 (192.168.77.1 on d2)"


def test_format_marks_the_chosen_gid(tmp_path: Path) -> None:
    make_device(tmp_path)
    text = format_devices(list_devices(tmp_path))
    marked = [line for line in text.splitlines() if line.lstrip().startswith("*")]
    assert len(marked) == 1 and MAPPED_77_1 in marked[0] and "192.168.77.1" in marked[0]
    assert "port 1: ACTIVE (LinkUp), Ethernet, active_mtu 1024" in text
    assert text.endswith("hixl uses: rxe0 port 1 gid 1 (192.168.77.1 on d0)  (* marks it)")


def test_json_names_the_selection(tmp_path: Path) -> None:
    make_device(tmp_path)
    data = json.loads(json.dumps(devices_to_json(list_devices(tmp_path))))
    assert data["selected"] == {
        "device": "rxe0",
        "port": 1,
        "gid_index": 1,
        "gid": MAPPED_77_1,
        "ipv4": "192.168.77.1",
        "netdev": "d0",
    }
    assert data["devices"][0]["ports"][0]["chosen_gid_index"] == 1


@pytest.mark.parametrize(
    ("netdev_mtu", "rxe", "expected"),
    [
        (1500, True, 1024),
        (1500, False, 1024),
        (9000, True, 4096),
        (4176, True, 4096),
        (4175, True, 2048),
        (4191, False, 2048),
        (4192, False, 4096),
        (576, True, 256),
        (100, True, 256),
    ],
)
def test_roce_active_mtu(netdev_mtu: int, rxe: bool, expected: int) -> None:
    assert roce_active_mtu(netdev_mtu, rxe=rxe) == expected


# --- netdev choice for `hixl rxe up` ---------------------------------------------------

IP_ADDR_JSON = json.dumps(
    [
        {
            "ifindex": 1,
            "ifname": "lo",
            "flags": ["LOOPBACK", "UP", "LOWER_UP"],
            "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}],
        },
        {
            "ifindex": 2,
            "ifname": "docker0",
            "flags": ["NO-CARRIER", "BROADCAST", "UP"],
            "addr_info": [{"family": "inet", "local": "172.17.0.1", "prefixlen": 16}],
        },
        {
            "ifindex": 3,
            "ifname": "eth1",
            "flags": ["BROADCAST", "UP", "LOWER_UP"],
            "addr_info": [{"family": "inet6", "local": "fe80::1", "prefixlen": 64}],
        },
        {
            "ifindex": 4,
            "ifname": "eth0",
            "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
            "addr_info": [{"family": "inet", "local": "192.0.2.2", "prefixlen": 24}],
        },
    ]
)


def test_parse_ip_addr_json_and_pick() -> None:
    nds = parse_ip_addr_json(IP_ADDR_JSON)
    assert nds[0] == Netdev(name="lo", up=True, loopback=True, ipv4=("127.0.0.1/8",))
    assert not nds[1].up  # no carrier
    assert nds[2].ipv4 == ()
    picked = pick_netdev(nds)
    assert picked is not None and picked.name == "eth0"
    assert pick_netdev(nds[:3]) is None


def test_parse_ip_addr_json_rejects_garbage() -> None:
    with pytest.raises(DeviceError, match="cannot parse"):
        parse_ip_addr_json('Object "addr" is unknown')
    with pytest.raises(DeviceError, match="printed a dict, not a list"):
        parse_ip_addr_json("{}")


def test_rxe_up_reuses_a_usable_device_without_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hixl.testbed.rxe as rxe

    def no_commands(argv: list[str], **_: object) -> None:
        raise AssertionError(f"rxe_up ran {argv}")

    monkeypatch.setattr(rxe, "_run", no_commands)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda tool: f"/usr/sbin/{tool}")
    make_device(tmp_path, "rxe0", netdev="d0")
    (tmp_path / "module" / "rdma_rxe").mkdir(parents=True)
    result = rxe.rxe_up(sysfs=tmp_path)
    assert not result.created_device and not result.created_netdev
    assert str(result.selection) == "rxe0 port 1 gid 1 (192.168.77.1 on d0)"
    assert result.message.startswith("rxe0 already exists on d0; nothing to do")
