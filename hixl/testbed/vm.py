"""Run commands on a real soft-RoCE device inside a small VM.

Where the host kernel cannot run ``rdma_rxe`` (many cloud and CI kernels),
hixl boots a distribution kernel that ships the module with virtme-ng, over
the host's own root filesystem, brings up ``rxe0`` inside and runs the
command there.  The guest sees the host's files read-only; hixl gives it one
writable exchange directory (and any directories the caller names) through
which the command's output, its exit status and the guest's progress come
back.  Nothing is parsed from the guest console, which can lose lines.

Acceleration: KVM where a guest really boots with it, TCG otherwise.  The
choice comes from a short, time-limited probe boot whose answer is cached per
kernel (``~/.cache/hixl/kvm-probe.json``); ``HIXL_VM_ACCEL=kvm|tcg`` forces it.

Every run has a boot deadline and an overall deadline; when either passes the
whole process group of the VM is killed and :class:`hixl.VMError` is raised.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from hixl.errors import VMError
from hixl.testbed.guest import CACHED_ROOT_TAG

log = logging.getLogger("hixl.vm")

#: Environment variables the guest command inherits from the caller.
PASSED_ENV = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TERM", "CI")
PASSED_ENV_PREFIXES = ("HIXL_", "PYTEST_", "HYPOTHESIS_")

_RXE_MODULE = re.compile(r"rdma_rxe\.ko(\.[xg]z|\.zst)?$")


@dataclass(frozen=True, slots=True)
class VMConfig:
    """How to boot the guest.  Times in seconds, memory as QEMU accepts it."""

    kernel: Path | None = None
    memory: str = "4G"
    cpus: int = 2
    accel: str = "auto"  # auto | kvm | tcg
    boot_timeout: float = 240.0
    timeout: float = 3600.0
    rw_dirs: tuple[Path, ...] = ()
    extra_qemu_opts: tuple[str, ...] = ()
    log_dir: Path | None = None
    """If set, each guest's stdout, stderr and console are copied to ``log_dir/<name>/``."""
    failure_grace: float = 20.0
    """After one guest fails, how long the others may still run before they are stopped."""

    def __post_init__(self) -> None:
        if self.accel not in ("auto", "kvm", "tcg"):
            raise VMError(f"accel must be auto, kvm or tcg, not {self.accel!r}")
        if self.cpus < 1:
            raise VMError(f"cpus must be >= 1, got {self.cpus}")
        if self.boot_timeout <= 0 or self.timeout <= 0:
            raise VMError(
                f"timeouts must be > 0: boot_timeout={self.boot_timeout} timeout={self.timeout}"
            )


@dataclass(frozen=True, slots=True)
class GuestNet:
    """A virtual NIC on a UDP socket netdev on loopback: the guest's link to the others.

    QEMU receives the guest's frames on 127.0.0.1:``port`` and sends each frame the guest
    transmits as one datagram to 127.0.0.1:``peer_port`` (the other host's port, or a
    :class:`hixl.testbed.hosts.FrameHub` port). ``address`` is the guest's IPv4/prefix.

    Why datagrams: no QEMU can ever block on another. Over a TCP socket pair the
    accepting QEMU's socket is a blocking one, so a peer guest that stopped draining its
    NIC (link down, shutting down) stalled that QEMU's main loop and froze its guest. A
    datagram that finds no room is dropped instead, as a frame on a congested wire
    would be, and RC retransmits it.
    """

    port: int
    peer_port: int
    mac: str
    address: str
    mtu: int = 1500

    def __post_init__(self) -> None:
        for name, port in (("port", self.port), ("peer_port", self.peer_port)):
            if not 0 < port < 65536:
                raise VMError(f"GuestNet {name} out of range: {port}")
        if not 68 <= self.mtu <= 65535:
            raise VMError(f"GuestNet mtu out of range: {self.mtu} (68..65535)")
        if not re.fullmatch(r"([0-9a-f]{2}:){5}[0-9a-f]{2}", self.mac):
            raise VMError(f"GuestNet mac must be lower-case aa:bb:cc:dd:ee:ff, not {self.mac!r}")

    def qemu_opts(self) -> str:
        return (
            f"-netdev socket,id=hx0,udp=127.0.0.1:{self.peer_port},"
            f"localaddr=127.0.0.1:{self.port} "
            f"-device virtio-net-pci,netdev=hx0,mac={self.mac}"
        )


@dataclass(frozen=True, slots=True)
class GuestSpec:
    """One guest: the command it runs and, for multi-host runs, its NIC."""

    command: tuple[str, ...]
    name: str = "vm"
    net: GuestNet | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise VMError(f"guest {self.name!r} has no command")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", self.name):
            raise VMError(f"guest name must be 1-32 of [A-Za-z0-9_.-], not {self.name!r}")


#: A second, read-only 9p export of the host's root under its own tag: the guest mounts it
#: with a page cache and reads Python's directories from there (see
#: :func:`hixl.testbed.guest._cache_python_dirs`).  virtio-9p serves one mount per tag, so
#: the root's own tag cannot be mounted a second time.
CACHED_ROOT_OPTS = (
    "-fsdev local,id=hixlroot,path=/,security_model=none,readonly=on,multidevs=remap "
    f"-device virtio-9p-pci,fsdev=hixlroot,mount_tag={CACHED_ROOT_TAG}"
)

#: Exit status reported for a guest the runner stopped because another guest failed.
STOPPED = 143
#: The file a guest command writes (via ``HIXL_VM_XDIR``) to have its VM cut off on
#: purpose (:func:`hixl.testbed.hosts.vanish`): the runner kills the guest's QEMU at once and
#: reports the guest as having exited 0.
VANISHED = "vanished"


def rxe_capable_kernels(
    boot: Path = Path("/boot"), modules: Path = Path("/lib/modules")
) -> list[Path]:
    """Kernel images under ``boot`` whose module tree ships ``rdma_rxe``, newest first."""
    found: list[tuple[tuple[int, ...], Path]] = []
    for image in boot.glob("vmlinuz-*"):
        version = image.name[len("vmlinuz-") :]
        rxe_dir = modules / version / "kernel" / "drivers" / "infiniband" / "sw" / "rxe"
        if rxe_dir.is_dir() and any(_RXE_MODULE.search(p.name) for p in rxe_dir.iterdir()):
            key = tuple(int(x) for x in re.findall(r"\d+", version))
            found.append((key, image))
    return [p for _, p in sorted(found, reverse=True)]


def find_kernel() -> Path:
    """The kernel the VM boots: ``HIXL_VM_KERNEL`` or the newest rxe-capable one."""
    env = os.environ.get("HIXL_VM_KERNEL")
    if env:
        path = Path(env)
        if not path.is_file():
            raise VMError(f"HIXL_VM_KERNEL={env} is not a file")
        return path
    kernels = rxe_capable_kernels()
    if not kernels:
        raise VMError(
            "no kernel image in /boot has rdma_rxe in its modules; install one "
            "(Debian: apt-get install linux-image-amd64) or run 'make setup'"
        )
    return kernels[0]


def find_vng() -> str:
    """Path of virtme-ng's ``vng``, looked up beside this interpreter, then on PATH."""
    beside = Path(sys.executable).parent / "vng"
    if beside.exists():
        return str(beside)
    found = shutil.which("vng")
    if found:
        return found
    raise VMError(
        "virtme-ng ('vng') is not installed; run 'make setup' or "
        "'pip install virtme-ng' in hixl's virtual environment"
    )


def _missing_tools() -> list[str]:
    missing = []
    if shutil.which("qemu-system-x86_64") is None:
        missing.append("qemu-system-x86 (apt-get install qemu-system-x86)")
    if not Path("/bin/busybox").exists() and not Path("/usr/bin/busybox").exists():
        missing.append("busybox-static (apt-get install busybox-static)")
    return missing


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hixl" / "kvm-probe.json"


def _vng_base(vng: str, kernel: Path, cfg: VMConfig, kvm: bool) -> list[str]:
    cmd = [vng, "--run", str(kernel), "--force-9p", "--memory", cfg.memory, "--cpus", str(cfg.cpus)]
    if not kvm:
        cmd.append("--disable-kvm")
    return cmd


def kvm_usable(kernel: Path, probe_timeout: float = 25.0) -> bool:
    """Whether a guest boots under KVM here, from a cached, time-limited probe.

    Some hosts offer ``/dev/kvm`` but the guest hangs early in boot or QEMU
    aborts; the probe boots ``true`` once and remembers the answer.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    cache = _cache_file()
    key = f"{kernel}:{os.uname().release}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), bool):
        return bool(known[key])
    cmd = _vng_base(find_vng(), kernel, VMConfig(memory="1G", cpus=1), kvm=True)
    cmd += ["--exec", "true"]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=_host_env(),
    )
    try:
        ok = proc.wait(timeout=probe_timeout) == 0
    except subprocess.TimeoutExpired:
        ok = False
    finally:
        _kill_group(proc)
    log.debug("KVM probe for %s: %s", kernel, ok)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = ok
        cache.write_text(json.dumps(known))
    except OSError:
        pass
    return ok


def _host_env() -> dict[str, str]:
    env = dict(os.environ)
    # vng runs helper programs (virtme-run, virtme-init) from its own bin directory.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _guest_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith(PASSED_ENV_PREFIXES)
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["HIXL_IN_VM"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


class _Tail:
    """Copies what a guest appends to a file onto one of our streams."""

    def __init__(self, path: Path, sink: IO[str], prefix: str = "") -> None:
        self.path = path
        self.sink = sink
        self.prefix = prefix
        self.pos = 0
        self._partial = ""

    def pump(self) -> None:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return
        if not data:
            return
        self.pos += len(data)
        text = self._partial + data.decode("utf-8", "replace")
        if self.prefix:
            lines = text.split("\n")
            self._partial = lines.pop()
            text = "".join(f"{self.prefix}{line}\n" for line in lines)
        self.sink.write(text)
        self.sink.flush()

    def flush(self) -> None:
        self.pump()
        if self._partial:
            self.sink.write(f"{self.prefix}{self._partial}\n")
            self._partial = ""
            self.sink.flush()


@dataclass
class _Running:
    spec: GuestSpec
    proc: subprocess.Popen[bytes]
    xdir: Path
    tails: tuple[_Tail, _Tail]
    console: Path
    started: float


def _launch(
    spec: GuestSpec, cfg: VMConfig, kernel: Path, vng: str, kvm: bool, xdir: Path, prefix: str
) -> _Running:
    cwd = Path.cwd()
    request = {
        "command": list(spec.command),
        "cwd": str(cwd),
        "env": _guest_env(spec.env),
        "net": None
        if spec.net is None
        else {"address": spec.net.address, "mtu": spec.net.mtu, "mac": spec.net.mac},
    }
    (xdir / "request.json").write_text(json.dumps(request))
    guest = f"{shlex.quote(sys.executable)} -m hixl.testbed.guest {shlex.quote(str(xdir))}"
    cmd = _vng_base(vng, kernel, cfg, kvm)
    for d in (xdir, *cfg.rw_dirs):
        cmd += ["--rwdir", str(d)]
    qemu_opts = [CACHED_ROOT_OPTS, *cfg.extra_qemu_opts]
    if spec.net is not None:
        qemu_opts.append(spec.net.qemu_opts())
    if qemu_opts:
        cmd.append("--qemu-opts=" + " ".join(qemu_opts))  # "=": the value starts with "-"
    cmd += ["--exec", guest]
    console = xdir / "console.log"
    log.debug("launching %s: %s", spec.name, shlex.join(cmd))
    with console.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=_host_env(),
        )
    tails = (_Tail(xdir / "stdout", sys.stdout, prefix), _Tail(xdir / "stderr", sys.stderr, prefix))
    return _Running(spec, proc, xdir, tails, console, time.monotonic())


def _save_logs(r: _Running, log_dir: Path) -> None:
    dest = log_dir / r.spec.name
    with contextlib.suppress(OSError):
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("stdout", "stderr", "console.log", VANISHED):
            src = r.xdir / name
            if src.exists():
                shutil.copyfile(src, dest / name)


def _console_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no console output)"
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return "\n".join(text.strip().splitlines()[-lines:])


def run_guests(specs: Sequence[GuestSpec], cfg: VMConfig | None = None) -> list[int]:
    """Boot one VM per spec, run each command, and return their exit codes.

    Output of each guest command is streamed to this process's stdout and
    stderr (prefixed with the guest name when there are several).  Raises
    :class:`VMError` when a guest does not boot within ``boot_timeout``, when
    the whole run exceeds ``timeout``, or when a guest ends without reporting
    an exit status.  All VMs are killed before this returns or raises.
    """
    cfg = cfg or VMConfig()
    if not specs:
        raise VMError("no guest to run")
    missing = _missing_tools()
    if missing:
        raise VMError("the VM path needs: " + ", ".join(missing) + "; run 'make setup'")
    kernel = cfg.kernel or find_kernel()
    vng = find_vng()
    accel = os.environ.get("HIXL_VM_ACCEL", cfg.accel)
    if accel not in ("auto", "kvm", "tcg"):
        raise VMError(f"HIXL_VM_ACCEL must be auto, kvm or tcg, not {accel!r}")
    kvm = kvm_usable(kernel) if accel == "auto" else accel == "kvm"
    log.debug("kernel=%s accel=%s", kernel, "kvm" if kvm else "tcg")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise VMError(f"guest names must be unique: {names}")
    root = Path(tempfile.mkdtemp(prefix="hixl-vm-"))
    running: list[_Running] = []
    width = max(len(n) for n in names)
    start = time.monotonic()
    try:
        for i, spec in enumerate(specs):
            xdir = root / f"{i}-{spec.name}"
            xdir.mkdir()
            prefix = f"[{spec.name:<{width}}] " if len(specs) > 1 else ""
            running.append(_launch(spec, cfg, kernel, vng, kvm, xdir, prefix))
        return _supervise(running, cfg, start)
    finally:
        for r in running:
            _kill_group(r.proc)
        if cfg.log_dir is not None:
            for r in running:
                _save_logs(r, cfg.log_dir)
        if os.environ.get("HIXL_VM_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"hixl vm: kept exchange directories under {root}", file=sys.stderr)


def _supervise(running: list[_Running], cfg: VMConfig, start: float) -> list[int]:
    """Wait for every guest's exit status, enforcing the boot and overall deadlines.

    A guest that wrote :data:`VANISHED` is killed at once and counts as exit 0.
    Once one guest fails, the others get ``cfg.failure_grace`` seconds to finish and are
    then stopped and reported as :data:`STOPPED`.
    """
    codes: dict[int, int] = {}
    failed_at: float | None = None
    many = len(running) > 1
    while len(codes) < len(running):
        time.sleep(0.2)
        now = time.monotonic()
        for i, r in enumerate(running):
            for t in r.tails:
                t.pump()
            if i in codes:
                continue
            code = _exit_status(r)
            if code is not None:
                codes[i] = code
                if code != 0 and failed_at is None:
                    failed_at = now
                    if many and len(codes) < len(running):
                        print(
                            f"hixl vm: {r.spec.name} failed (exit {code}); stopping the "
                            f"others in {cfg.failure_grace:.0f} s unless they finish",
                            file=sys.stderr,
                            flush=True,
                        )
                continue
            if not (r.xdir / "booted").exists() and now - r.started > cfg.boot_timeout:
                raise VMError(
                    f"guest {r.spec.name} did not boot within {cfg.boot_timeout:.0f} s. "
                    f"Last console lines:\n{_console_tail(r.console)}"
                )
        if failed_at is not None and now - failed_at > cfg.failure_grace:
            for i, r in enumerate(running):
                if i not in codes:
                    _kill_group(r.proc)
                    for t in r.tails:
                        t.flush()
                    codes[i] = STOPPED
                    print(f"hixl vm: stopped {r.spec.name}", file=sys.stderr, flush=True)
        if now - start > cfg.timeout:
            late = [r.spec.name for i, r in enumerate(running) if i not in codes]
            raise VMError(
                f"VM run exceeded its timeout of {cfg.timeout:.0f} s; killed {', '.join(late)}"
            )
    return [codes[i] for i in range(len(running))]


def _exit_status(r: _Running) -> int | None:
    """The guest's exit status once it has one; raises if its VM ended without one."""
    rc_file = r.xdir / "rc"
    if rc_file.exists() or (r.proc.poll() is not None and _wait_for(rc_file, 2.0)):
        for t in r.tails:
            t.flush()
        try:
            return int(rc_file.read_text().strip() or "1")
        except ValueError:
            return 1
    marker = r.xdir / VANISHED
    if marker.exists():
        # A power cut asked for: the whole QEMU goes now, so the other hosts see this
        # one's frames stop mid-stream, and no guest shutdown path is involved.
        _kill_group(r.proc)
        for t in r.tails:
            t.flush()
        reason = marker.read_text(errors="replace").strip() or "no reason given"
        print(f"hixl vm: {r.spec.name} powered off on purpose: {reason}", flush=True)
        return 0
    if r.proc.poll() is None:
        return None
    for t in r.tails:
        t.flush()
    raise VMError(
        f"guest {r.spec.name} ended (qemu exit {r.proc.returncode}) without "
        f"reporting an exit status. Last console lines:\n{_console_tail(r.console)}"
    )


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return path.exists()


def run(command: Sequence[str], cfg: VMConfig | None = None) -> int:
    """Run ``command`` in one VM with ``rxe0`` up; return its exit code."""
    if not command:
        raise VMError("no command given; usage: hixl vm run -- CMD [ARGS...]")
    return run_guests([GuestSpec(command=tuple(command))], cfg)[0]


def host_has_rdma() -> bool:
    """Whether this host has an ACTIVE verbs port with a usable GID right now."""
    from hixl.errors import DeviceError
    from hixl.verbs.devices import select_device

    try:
        select_device()
    except DeviceError:
        return False
    return True


def run_with_rdma(command: Sequence[str], cfg: VMConfig | None = None) -> int:
    """Run ``command`` where a soft-RoCE device is: on the host if it has one, else in a VM.

    On the host the command runs with ``HIXL_REQUIRE_RDMA=1`` added to its
    environment, so hixl's RDMA tests fail rather than skip.  Returns its exit code.
    """
    if not command:
        raise VMError("no command given; usage: hixl run -- CMD [ARGS...]")
    if host_has_rdma():
        log.debug("host has an RDMA device; running %s directly", command[0])
        env = dict(os.environ, HIXL_REQUIRE_RDMA="1")
        try:
            return subprocess.run(list(command), env=env, check=False).returncode
        except FileNotFoundError as exc:
            raise VMError(f"command not found: {exc.filename}") from exc
    return run(command, cfg)
