"""Guest side of the hixl VM (``python -m hixl.testbed.guest XDIR``).

Runs inside the VM that :mod:`hixl.testbed.vm` boots.  It reads ``XDIR/request.json``
(written by the host), marks ``XDIR/booted``, brings up a soft-RoCE device,
runs the requested command with its output in ``XDIR/stdout`` and
``XDIR/stderr``, and finally writes the exit status to ``XDIR/rc``.  The host
never parses the guest console.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import traceback
from pathlib import Path
from typing import Any

#: Where the cached second view of the guest's 9p root is mounted (/tmp is writable there).
CACHED_ROOT = "/tmp/.hixl-root"
CACHED_ROOT_TAG = "hixl-root"  # the 9p tag hixl.testbed.vm exports the root under again


def _sh(*args: str) -> None:
    subprocess.run(
        list(args),
        check=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _nic_by_mac(mac: str, wait: float = 10.0) -> str:
    deadline = time.monotonic() + wait  # the driver may still be probing the device
    while True:
        for dev in Path("/sys/class/net").iterdir():
            try:
                if (dev / "address").read_text().strip().lower() == mac.lower():
                    return dev.name
            except OSError:
                continue
        if time.monotonic() > deadline:
            seen = sorted(d.name for d in Path("/sys/class/net").iterdir())
            raise RuntimeError(f"no network interface with MAC {mac} in the guest: {seen}")
        time.sleep(0.1)


def _bring_up_network(net: dict[str, Any] | None) -> list[str]:
    """Configure the guest's NIC (multi-host) and return ``hixl rxe up`` arguments."""
    if net is None:
        return []  # hixl rxe up makes a dummy netdev with an address
    _sh("modprobe", "virtio_net")
    ifname = _nic_by_mac(str(net["mac"]))
    _sh("ip", "link", "set", ifname, "mtu", str(int(net["mtu"])))
    _sh("ip", "addr", "add", str(net["address"]), "dev", ifname)
    _sh("ip", "link", "set", ifname, "up")
    return ["--netdev", ifname]


def _mounts() -> list[tuple[str, str, str]]:
    """``(source, mount point, type)`` of every mount in the guest."""
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        src, point, fstype = line.split()[:3]
        out.append((src, point.replace("\\040", " "), fstype))
    return out


def dirs_to_cache(dirs: list[str], mounts: list[tuple[str, str, str]]) -> list[str]:
    """Which of ``dirs`` to bind from the cached view (see :func:`_cache_python_dirs`).

    None unless the root is 9p; never ``/``, a directory inside one already chosen, or a
    directory with another mount below it."""
    root = next((m for m in mounts if m[1] == "/"), None)
    if root is None or root[2] != "9p":
        return []
    chosen: list[str] = []
    for d in sorted({d.rstrip("/") for d in dirs if d.startswith("/")}, key=len):
        if not d or any(d == c or d.startswith(c + "/") for c in chosen):
            continue
        if any(point != d and point.startswith(d + "/") for _, point, _ in mounts):
            continue
        chosen.append(d)
    return chosen


def _cache_python_dirs(dirs: list[str]) -> list[str]:
    """Give the directories Python reads from the 9p page cache; return those done.

    The guest's root is the host's filesystem over 9p without a cache, so every
    ``stat`` and ``open`` of an import is a round trip to QEMU: under emulation that made
    ``import numpy`` take 20-40 s in every process.  The runner exports the same root a
    second time (tag ``hixl-root``), mounted here read-only with ``cache=loose``, and
    each of ``dirs`` (the standard library,
    the virtual environment, the checkout) is bound from there over itself, so a file
    read once in this boot is read from the guest's memory after that.  A directory
    with another mount below it (a read-write directory the run shares with the host)
    is left alone, as is everything when the root is not 9p.  Files the host changes
    during the run may be seen late in these directories: they are the code being run.
    """
    mounts = _mounts()
    chosen = dirs_to_cache([os.path.realpath(d) for d in dirs if os.path.isdir(d)], mounts)
    if not chosen:
        return []
    os.makedirs(CACHED_ROOT, exist_ok=True)
    opts = "trans=virtio,version=9p2000.L,access=any,msize=524288,cache=loose,ro"
    if not _mount("-t", "9p", "-o", opts, CACHED_ROOT_TAG, CACHED_ROOT):
        return []
    return [d for d in chosen if _mount("--bind", CACHED_ROOT + d, d)]


def _mount(*args: str) -> bool:
    proc = subprocess.run(["mount", *args], capture_output=True, timeout=60, check=False)
    return proc.returncode == 0


def _blas_kernel(env: dict[str, str]) -> None:
    """Name OpenBLAS's CPU kernel when the emulated CPU can run Haswell's.

    OpenBLAS does not recognise QEMU's emulated CPU and falls back to its generic
    kernel, whose start-up alone made ``import numpy`` take 19-20 s instead of 11 s in a
    TCG guest (and whose math ran about half as fast).  Every process of the command
    inherits the choice; a value the caller set is kept."""
    if "OPENBLAS_CORETYPE" in env:
        return
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    flags = next(
        (ln.partition(":")[2].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    if {"avx2", "fma"} <= set(flags):
        env["OPENBLAS_CORETYPE"] = "Haswell"


def main(argv: list[str]) -> int:
    xdir = Path(argv[0])
    (xdir / "booted").write_text("1")
    request = json.loads((xdir / "request.json").read_text())
    env = {str(k): str(v) for k, v in request["env"].items()}
    env["HIXL_VM_XDIR"] = str(xdir)  # where a command may leave a VANISHED note
    _blas_kernel(env)
    rc = 1
    with (xdir / "stdout").open("wb") as out, (xdir / "stderr").open("wb") as err:
        try:
            if env.get("HIXL_VM_9P_CACHE", "1") != "0":
                stdlib = sysconfig.get_paths()["stdlib"]
                _cache_python_dirs([stdlib, sys.prefix, str(request["cwd"])])
            subprocess.run(["ip", "link", "set", "lo", "up"], check=False, timeout=30)
            netdev = _bring_up_network(request["net"])
            if netdev:
                env["HIXL_HOST_NETDEV"] = netdev[-1]
            up = [sys.executable, "-m", "hixl", "rxe", "up", *netdev]
            setup = subprocess.run(
                up,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=120,
                check=False,
            )
            if setup.returncode != 0:
                err.write(b"hixl vm: could not bring up a soft-RoCE device in the guest:\n")
                err.write(setup.stdout)
                rc = 125
            else:
                out.flush()
                rc = subprocess.run(
                    request["command"],
                    cwd=request["cwd"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    check=False,
                ).returncode
                if rc < 0:  # killed by a signal: report it the way a shell does
                    rc = 128 - rc
        except FileNotFoundError as exc:
            what = (
                "working directory does not exist in the guest (it has its own /tmp and "
                "/var/tmp; run from another directory)"
                if exc.filename == request["cwd"]
                else "command not found in the guest"
            )
            err.write(f"hixl vm: {what}: {exc.filename}\n".encode())
            rc = 127
        except Exception:  # noqa: BLE001 - report anything to the host, then exit
            err.write(traceback.format_exc().encode())
            rc = 125
    tmp = xdir / "rc.tmp"
    tmp.write_text(str(rc))
    os.replace(tmp, xdir / "rc")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
