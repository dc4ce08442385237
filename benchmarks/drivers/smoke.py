"""CI's guard against benchmark rot: every entry point starts, and every path that needs
no RDMA device runs, natively (no VM), in well under a minute.

* every ``benchmarks/bench_*.py`` and ``run_all.py``: ``--help`` run by path and as
  ``python -m benchmarks.<name>``;
* ``bench_plan`` on a small workload and ``bench_overhead --no-device`` (pure planning),
  ``bench_kv --quick`` (a request's KV blocks: checks, plan and chain, natively),
  then ``run_all --report`` on that JSON (tables and plot, into a temporary directory);
* ``bench_transfer``, ``bench_layer``, ``bench_fair`` and ``bench_kv --device``: without
  a device each must stop at once with one clear line naming the missing device (exit 2);
  with one, a tiny run;
* ``bench_cold`` on its null device (two fresh processes);
* ``bench_peers --list``: the peers' install plan, without installing anything.

    python -m benchmarks.drivers.smoke         # from the repository root (make bench-smoke)
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .. import ENTRY_DIR
from ..common import REPO


def _run(cmd: Sequence[str], timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            list(cmd),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f} s", time.monotonic() - t0
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def _have_device() -> bool:
    try:
        from hixl.verbs.devices import select_device

        select_device(None)
    except Exception:  # noqa: BLE001 - any failure means: no device to use here
        return False
    return True


def checks(tmp: Path) -> list[tuple[str, list[str], float, Sequence[int], str]]:
    """(label, command, timeout, accepted exit codes, text the output must contain)."""
    py = sys.executable
    out: list[tuple[str, list[str], float, Sequence[int], str]] = []
    for path in sorted(ENTRY_DIR.glob("bench_*.py")) + [ENTRY_DIR / "run_all.py"]:
        out.append((f"{path.name} --help", [py, str(path), "--help"], 60, (0,), "usage:"))
        out.append(
            (
                f"-m benchmarks.{path.stem} --help",
                [py, "-m", f"benchmarks.{path.stem}", "--help"],
                60,
                (0,),
                "usage:",
            )
        )
    plan = ["--layers", "1", "--heads", "4", "--blocks", "8", "--repeat", "1"]
    out.append(
        (
            "bench_plan (small)",
            [py, str(ENTRY_DIR / "bench_plan.py"), *plan, "--baseline-repeat", "1"],
            60,
            (0,),
            "ratio",
        )
    )
    run_dir = tmp / "run"
    run_dir.mkdir()
    out.append(
        (
            "bench_overhead --no-device",
            [
                py,
                str(ENTRY_DIR / "bench_overhead.py"),
                "--no-device",
                "--repeat",
                "3",
                "--json",
                str(run_dir / "overhead.json"),
            ],
            120,
            (0,),
            "planning",
        )
    )
    out.append(
        (
            "run_all --report (from that JSON)",
            [
                py,
                str(ENTRY_DIR / "run_all.py"),
                "--run-dir",
                str(run_dir),
                "--report",
                "--no-docs",
            ],
            120,
            (0,),
            "results.md",
        )
    )
    kv = [py, str(ENTRY_DIR / "bench_kv.py"), "--quick", "--layers", "4", "--num-blocks", "256"]
    out.append(("bench_kv --quick (native)", kv, 120, (0,), "100G target"))
    device = _have_device()
    kvdev = [*kv, "--device", "--device-only", "--device-layers", "1", "--device-blocks", "4"]
    if device:
        out.append(("bench_kv --device, one round (device present)", kvdev, 600, (0,), "C"))
    else:
        out.append(("bench_kv --device without a device", kvdev, 60, (2,), "no usable RDMA"))
    for name in ("bench_transfer", "bench_layer"):
        cmd = [py, str(ENTRY_DIR / f"{name}.py"), "--quick"]
        if device:
            out.append((f"{name} --quick (device present)", cmd, 600, (0,), ""))
        else:
            out.append((f"{name} without a device", cmd, 60, (2,), "no usable RDMA device"))
    fair = [py, str(ENTRY_DIR / "bench_fair.py"), "--cases", "put", "--sizes", "64K"]
    fair += ["--bytes", "1M", "--repeat", "1"]
    if device:
        out.append(("bench_fair, one round (device present)", fair, 600, (0,), "yardstick"))
    else:
        out.append(("bench_fair without a device", fair, 60, (2,), "no usable RDMA device"))
    cold = [py, str(ENTRY_DIR / "bench_cold.py"), "--samples", "2"]
    out.append(("bench_cold, two fresh processes (null device)", cold, 120, (0,), "cold layer"))
    ceiling = [py, str(ENTRY_DIR / "bench_ceiling.py"), "--rounds", "1", "--iters", "256"]
    if device:
        out.append(("bench_ceiling, one round (device present)", ceiling, 600, (0,), "ring"))
        # A/A: this checkout against itself, through the child process of --against
        against = [*ceiling, "--against", str(REPO)]
        out.append(("bench_ceiling --against (device present)", against, 600, (0,), "Paired"))
    else:
        out.append(("bench_ceiling without a device", ceiling, 60, (2,), "no usable RDMA device"))
    peers = ENTRY_DIR / "bench_peers.py"
    if peers.is_file():
        out.append(("bench_peers --list", [py, str(peers), "--list"], 60, (0,), "mooncake"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.parse_args(argv)
    failed = 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hixl-bench-smoke-") as tmp:
        todo = checks(Path(tmp))
        for label, cmd, timeout, codes, needle in todo:
            rc, text, took = _run(cmd, timeout)
            ok = rc in codes and needle.lower() in text.lower()
            print(f"{'ok  ' if ok else 'FAIL'} {took:5.1f} s  {label}", flush=True)
            if not ok:
                failed += 1
                tail = "\n".join(text.strip().splitlines()[-15:])
                print(
                    f"     $ {shlex.join(cmd)}\n     exit {rc} (want {list(codes)}), "
                    f"want {needle!r} in the output:\n{tail}",
                    flush=True,
                )
    print(
        f"bench-smoke: {len(todo) - failed}/{len(todo)} passed in {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
