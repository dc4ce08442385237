"""The ``hixl`` command line: exit codes and error messages, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hixl import cli as _cli
from hixl.errors import HixlError

MAPPED = "0000:0000:0000:0000:0000:ffff:c0a8:4d01"


def fake_rxe0(sysfs: Path, state: str = "4: ACTIVE") -> None:
    """rxe0 on d0 as kernel 6.1 shows it, reduced to the files hixl reads."""
    port = sysfs / "class" / "infiniband" / "rxe0" / "ports" / "1"
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True)
    (port.parents[1] / "node_type").write_text("1: CA\n")
    (port.parents[1] / "parent").write_text("d0\n")
    (port / "state").write_text(state + "\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "gids" / "0").write_text(MAPPED + "\n")
    (port / "gid_attrs" / "types" / "0").write_text("RoCE v2\n")
    (port / "gid_attrs" / "ndevs" / "0").write_text("d0\n")


def test_devices_lists_and_marks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_rxe0(tmp_path)
    assert _cli.main(["devices", "--sysfs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rxe0: rxe, node type CA, netdev d0" in out
    assert f"* rxe0        1     0  {MAPPED}  192.168.77.1" in out


def test_devices_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_rxe0(tmp_path)
    assert _cli.main(["devices", "--json", "--sysfs", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selected"]["device"] == "rxe0" and data["selected"]["gid_index"] == 0


def test_devices_exit_1_when_nothing_is_usable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_rxe0(tmp_path, state="1: DOWN")
    assert _cli.main(["devices", "--sysfs", str(tmp_path)]) == 1
    assert "hixl uses: none: no usable RDMA port: rxe0 port 1 is DOWN" in capsys.readouterr().out


def test_devices_without_kernel_rdma_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli.main(["devices", "--sysfs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hixl: error: this kernel has no RDMA support loaded")
    assert "Traceback" not in err


def test_rxe_up_unknown_netdev(capsys: pytest.CaptureFixture[str]) -> None:
    # Checked before anything runs, so this is safe on any machine.
    assert _cli.main(["rxe", "up", "--netdev", "hixl-no-such0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hixl: error: unknown netdev 'hixl-no-such0': not in /sys/class/net")


@pytest.mark.parametrize("argv", [["rxe", "up"], ["rxe", "down"], ["rxe", "down", "rxe0"]])
def test_rxe_needs_root(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"`hixl rxe {argv[1]}` needs root" in err and "uid 1000" in err
    assert f"run: sudo hixl rxe {argv[1]}" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["rxe"], ["rxe", "sideways"], ["no-such-command"]):
        with pytest.raises(SystemExit) as info:
            _cli.main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_python_dash_m_hixl_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl", "rxe", "up", "--netdev", "hixl-no-such0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("hixl: error: unknown netdev")
    assert "Traceback" not in proc.stderr


def test_doctor_json_runs_here(capsys: pytest.CaptureFixture[str]) -> None:
    code = _cli.main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == data["exit_code"] and data["mode"] in ("direct", "vm", "none")
    assert {c["status"] for c in data["checks"]} <= {"ok", "warn", "fail"}


# --------------------------------------------------------------------------- bench


def test_bench_from_an_installed_package_says_where_the_benchmarks_are(tmp_path: Path) -> None:
    # A wheel puts hixl/ into site-packages with no checkout around it: copy the package
    # alone into a directory and run `hixl bench` from there (no VM is booted: the
    # checkout is looked up first).
    import shutil

    site = tmp_path / "site-packages"
    shutil.copytree(
        Path(_cli.__file__).resolve().parent,
        site / "hixl",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "hixl", "bench", "--quick", "--out", str(tmp_path / "r")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "not part of the installed hixl package" in out.stderr
    assert "--source DIR" in out.stderr and "make bench" in out.stderr


def test_bench_finds_this_checkout_and_refuses_a_directory_without_benchmarks(
    tmp_path: Path,
) -> None:
    root = Path(__file__).resolve().parents[2]
    assert _cli.bench_checkout() == root
    assert _cli.bench_checkout(str(root)) == root
    with pytest.raises(HixlError, match=f"{tmp_path} has no benchmarks/run_all.py"):
        _cli.bench_checkout(str(tmp_path))


def test_fleet_needs_one_host_per_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--prefill", "2", "--decode", "2", "--hosts", "3"]) == 2
    err = capsys.readouterr().err
    assert "--hosts 3: the fleet needs one host per worker (2 + 2)" in err


def test_token_prints_a_fresh_256_bit_token(capsys: pytest.CaptureFixture[str]) -> None:
    tokens = []
    for _ in range(3):
        assert _cli.main(["token"]) == 0
        out = capsys.readouterr().out
        assert out.endswith("\n") and out.count("\n") == 1
        tokens.append(out.strip())
    assert all(len(t) == 64 and int(t, 16) >= 0 and t == t.lower() for t in tokens)
    assert len(set(tokens)) == 3


def test_bench_runs_the_suites_own_default_sections() -> None:
    """``hixl bench`` decides from its default list whether to measure the build costs on
    the host before the VM boots; that list is the one the suite runs in the VM."""
    from benchmarks.drivers.suite import DEFAULT_SECTIONS, SECTIONS

    assert _cli.BENCH_DEFAULT_SECTIONS.split(",") == list(DEFAULT_SECTIONS)
    assert set(DEFAULT_SECTIONS) <= set(SECTIONS) and "build" in DEFAULT_SECTIONS
