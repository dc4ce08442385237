"""Shared pieces of hixl's benchmark programs.

* perftest: run a server/client pair of ``ib_write_bw``/``ib_read_bw``/``ib_write_lat`` on
  one device and parse the result table they print (pure parsers, unit tested);
* statistics: medians over repeats and ratios of medians;
* the setup header every run states (kernel, device, MTU, VM or host, CPUs, date, commit);
* a progress display, and small formatting helpers for markdown tables.

Units: sizes in bytes, bandwidth in bytes per second, times in seconds unless a name says
``_us``. perftest's ``MB/sec`` is MiB/s (2**20 bytes); ``Gb/sec`` is 10**9 bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MIB = 1 << 20
KIB = 1 << 10


class BenchError(RuntimeError):
    """A benchmark step could not run or its output could not be read."""


# --------------------------------------------------------------------------- sizes


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": KIB, "m": MIB, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"4K"``, ``"64KiB"``, ``"8M"`` or ``"4096"`` to bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 8M)")
    value = int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"size must be >= 1 byte, got {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, e.g. ``"4K,64K,8M"``."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_ints(text: str) -> list[int]:
    """A comma-separated list of positive ints, e.g. ``"8,32,128"``."""
    out = [int(part) for part in text.split(",") if part.strip()]
    if not out or min(out) < 1:
        raise ValueError(f"want positive integers, got {text!r}")
    return out


def fmt_size(n: int) -> str:
    """Bytes as ``4 KiB``, ``8 MiB`` or ``100 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= KIB:
        return f"{n / KIB:.1f} KiB"
    return f"{n} B"


def fmt_rate(bytes_per_s: float | None) -> str:
    """Bandwidth in decimal MB/s (10**6 bytes), as context next to the ratios."""
    if bytes_per_s is None:
        return "n/a"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def fmt_us(us: float | None) -> str:
    if us is None:
        return "n/a"
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    return f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs"


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}×"


def iterations_for(size: int, target_bytes: int, lo: int, hi: int) -> int:
    """Iterations that move about ``target_bytes`` of ``size``-byte messages, in [lo, hi]."""
    return max(lo, min(hi, target_bytes // size))


# --------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float | None:
    """Median, or None for no values."""
    return float(statistics.median(values)) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or ``den`` is zero."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, min, max and count of a sample (for JSON)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


# --------------------------------------------------------------------------- perftest parsing


@dataclass(frozen=True, slots=True)
class BwResult:
    """One row of an ``ib_*_bw`` result table; bandwidths in bytes per second."""

    size: int
    iterations: int
    peak_Bps: float  # noqa: N815 - units in the name
    avg_Bps: float  # noqa: N815
    msg_rate_mpps: float


@dataclass(frozen=True, slots=True)
class LatResult:
    """One row of an ``ib_*_lat`` result table; times in microseconds.

    ``t_typical_us`` is perftest's median of the per-iteration samples; for ``ib_write_lat``
    each sample is half a ping-pong round trip.
    """

    size: int
    iterations: int
    t_min_us: float
    t_max_us: float
    t_typical_us: float
    t_avg_us: float
    t_stdev_us: float
    p99_us: float | None
    p999_us: float | None


_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
# perftest prints these when a statistic is undefined (stdev with -C) or its clock failed.
_NONFINITE = re.compile(r"[-+]?(?:nan|inf)", re.I)


def _finite(value: str, what: str, text: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise BenchError(
            f"perftest's {what} is {value} (clock calibration failed?):\n{_tail(text)}"
        )
    return x


def _table_rows(text: str, header_key: str) -> tuple[str, list[list[str]]]:
    """The header line containing ``header_key`` and the numeric rows below it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if header_key in line and "#bytes" in line:
            rows = []
            for row in lines[i + 1 :]:
                fields = row.split()
                if not fields or not re.fullmatch(r"\d+", fields[0]):
                    break
                if all(re.fullmatch(_NUM, f) or _NONFINITE.fullmatch(f) for f in fields):
                    rows.append(fields)
            return line, rows
    raise BenchError(f"no perftest result table with {header_key!r} in output:\n{_tail(text)}")


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:]) or "(no output)"


def parse_bw(text: str) -> BwResult:
    """Parse the result line of ``ib_write_bw``/``ib_read_bw`` output.

    Handles both ``MB/sec`` (MiB/s) and ``--report_gbits`` (``Gb/sec``) tables. Raises
    :class:`BenchError` when there is no result row.
    """
    header, rows = _table_rows(text, "BW average")
    if not rows:
        raise BenchError(f"perftest printed a BW header but no result row:\n{_tail(text)}")
    fields = rows[-1]
    if len(fields) < 5:
        raise BenchError(f"perftest BW row has {len(fields)} fields, want 5: {fields}")
    if "Gb/sec" in header:
        scale = 1e9 / 8
    elif "MB/sec" in header:
        scale = float(MIB)
    else:
        raise BenchError(f"unknown perftest BW unit in header: {header.strip()!r}")
    return BwResult(
        size=int(fields[0]),
        iterations=int(fields[1]),
        peak_Bps=float(fields[2]) * scale,
        avg_Bps=_finite(fields[3], "average bandwidth", text) * scale,
        msg_rate_mpps=float(fields[4]),
    )


def parse_lat(text: str) -> LatResult:
    """Parse the result line of ``ib_write_lat``-style output.

    Times are in usec, or in cycles when perftest ran with ``-C`` (its header still says
    usec). Other statistics may be ``nan``/``inf``; ``t_typical`` must be finite.
    """
    _, rows = _table_rows(text, "t_typical")
    if not rows:
        raise BenchError(f"perftest printed a latency header but no result row:\n{_tail(text)}")
    f = rows[-1]
    if len(f) < 7:
        raise BenchError(f"perftest latency row has {len(f)} fields, want >= 7: {f}")
    return LatResult(
        size=int(f[0]),
        iterations=int(f[1]),
        t_min_us=float(f[2]),
        t_max_us=float(f[3]),
        t_typical_us=_finite(f[4], "t_typical", text),
        t_avg_us=float(f[5]),
        t_stdev_us=float(f[6]),
        p99_us=float(f[7]) if len(f) > 7 else None,
        p999_us=float(f[8]) if len(f) > 8 else None,
    )


def parse_perftest_version(text: str) -> str | None:
    m = re.search(r"Version:\s*(\S+)", text)
    return m.group(1) if m else None


def listening_ports(proc_net: Sequence[str]) -> set[int]:
    """TCP ports in LISTEN state (``0A``) in the text of ``/proc/net/tcp``/``tcp6``."""
    ports: set[int] = set()
    for text in proc_net:
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --------------------------------------------------------------------------- perftest runner


@dataclass(frozen=True, slots=True)
class PerftestRun:
    """What one server/client pair printed, and how it was started."""

    tool: str
    server_cmd: tuple[str, ...]
    client_cmd: tuple[str, ...]
    client_output: str
    server_output: str
    wall_s: float  # client process start to exit, connection set-up included
    side: str = "client"  # whose result table is used: "client", or "server" (see run())

    @property
    def output(self) -> str:
        """The output whose result table counts."""
        return self.server_output if self.side == "server" else self.client_output

    @property
    def command(self) -> str:
        """Both command lines, as one shell-readable string."""
        return f"{shlex.join(self.server_cmd)} &  {shlex.join(self.client_cmd)}"


def _read_proc_net() -> list[str]:
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            out.append(Path(name).read_text())
    return out


#: perftest prints this when its cycles-per-microsecond regression is too noisy to use
#: (common under CPU emulation on a busy host); it then computes with a bad clock rate.
CALIBRATION_FAILED = "Correlation coefficient r^2"


def _grep(text: str, needle: str) -> str:
    return next((line.strip() for line in text.splitlines() if needle in line), "")


class Perftest:
    """Runs perftest pairs on one device, on fresh TCP ports.

    The server is started first; the client only once the server's port is in LISTEN
    state (read from ``/proc/net/tcp``, so nothing connects to the server early).
    """

    def __init__(
        self,
        device: str,
        gid_index: int,
        server_addr: str = "127.0.0.1",
        port_base: int = 18600,
        timeout: float = 180.0,
    ) -> None:
        self.device = device
        self.gid_index = gid_index
        self.server_addr = server_addr
        self.timeout = timeout
        self._port = port_base

    def _next_port(self) -> int:
        for _ in range(200):
            self._port = 18600 + (self._port - 18600 + 1) % 2000
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", self._port))
                except OSError:
                    continue
            return self._port
        raise BenchError("no free TCP port for perftest in 18600..20599")

    def run(
        self,
        tool: str,
        args: Sequence[str],
        check: Callable[[PerftestRun], None] | None = None,
        retries: int = 2,
        symmetric: bool = False,
        in_cycles: bool = False,
    ) -> PerftestRun:
        """Run ``tool`` as server and client with ``args``; return their output.

        The client's result table counts. Where perftest says a side's CPU clock
        calibration failed, that side's figures are wrong (``inf`` or computed with a bad
        clock rate): with ``symmetric`` (ping-pong tests, where both sides time the same
        round trips) the server's table is used instead when its calibration held;
        otherwise the run is retried on a new port. It is also retried when the client
        fails or ``check`` raises :class:`BenchError`. Raises :class:`BenchError` with the
        last reason when every try failed. ``in_cycles``: the run reports raw cycle counts
        (``ib_*_lat -C``), so perftest's calibration does not matter.
        """
        last = ""
        for _ in range(retries + 1):
            try:
                run = self._run_once(tool, list(args))
                if CALIBRATION_FAILED in run.client_output and not in_cycles:
                    if symmetric and CALIBRATION_FAILED not in run.server_output:
                        run = dataclasses.replace(run, side="server")
                    else:
                        raise BenchError(
                            f"{tool}: perftest's CPU clock calibration failed "
                            f"({_grep(run.client_output, CALIBRATION_FAILED)})"
                        )
                if check is not None:
                    check(run)
                return run
            except BenchError as exc:
                last = str(exc)
        raise BenchError(f"{last} (after {retries + 1} tries)")

    def _run_once(self, tool: str, args: list[str]) -> PerftestRun:
        port = self._next_port()
        common = [tool, "-d", self.device, "-x", str(self.gid_index), "-F", "-p", str(port), *args]
        server_cmd = tuple(common)
        client_cmd = (*common, self.server_addr)
        server = subprocess.Popen(
            server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            deadline = time.monotonic() + 20.0
            while port not in listening_ports(_read_proc_net()):
                if server.poll() is not None:
                    out = server.communicate()[0]
                    raise BenchError(f"{tool} server exited early:\n{_tail(out)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{tool} server did not listen on port {port} within 20 s")
                time.sleep(0.05)
            t0 = time.perf_counter()
            try:
                client = subprocess.run(
                    client_cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=self.timeout,
                )
            except subprocess.TimeoutExpired as exc:
                raise BenchError(
                    f"{shlex.join(client_cmd)} timed out after {self.timeout} s"
                ) from exc
            wall = time.perf_counter() - t0
            try:
                server_out = server.communicate(timeout=30.0)[0]
            except subprocess.TimeoutExpired:
                server.kill()
                server_out = server.communicate()[0]
            if client.returncode != 0:
                raise BenchError(
                    f"{shlex.join(client_cmd)} exited {client.returncode}:\n{_tail(client.stdout)}"
                )
            return PerftestRun(tool, server_cmd, client_cmd, client.stdout, server_out, wall)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()

    @staticmethod
    def version() -> str | None:
        try:
            out = subprocess.run(
                ["ib_write_bw", "--version"], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return parse_perftest_version(out.stdout + out.stderr)


def bw_wall_check(size: int, iters: int) -> Callable[[PerftestRun], None]:
    """A ``check`` for :meth:`Perftest.run` of a BW test: its figure must not be below the
    wall-clock bound ``size * iters / wall`` (set-up included), else perftest's cycle
    clock rate is wrong (a risk under emulation)."""

    def check(run: PerftestRun) -> None:
        bound = size * iters / run.wall_s
        avg = parse_bw(run.output).avg_Bps
        if avg < bound / 1.05:
            raise BenchError(
                f"{run.tool} reported {avg / 1e6:.2f} MB/s, below the wall-clock bound "
                f"{bound / 1e6:.2f} MB/s: its clock is off"
            )

    return check


# --------------------------------------------------------------------------- setup header


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
        "perftest": Perftest.version(),
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


# --------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress display on stderr: step count, elapsed and estimated time left.

    On a terminal the line is redrawn in place; otherwise (a log, the VM's output relay)
    each step is printed on its own line.
    """

    def __init__(self, total: int, title: str, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.title = title
        self.done = 0
        self.stream = stream or sys.stderr
        self.start = time.monotonic()
        self.tty = self.stream.isatty()

    def step(self, label: str) -> None:
        """Announce the step about to run (``label``); call :meth:`advance` after it."""
        elapsed = time.monotonic() - self.start
        left = ""
        if self.done:
            left = f", ~{_clock(elapsed / self.done * (self.total - self.done))} left"
        pct = 100 * self.done // self.total
        line = (
            f"[{self.title} {self.done + 1}/{self.total} {pct:3d}% {_clock(elapsed)}{left}] {label}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(
            f"[{self.title}] done: {self.done} steps in {_clock(time.monotonic() - self.start)}\n"
        )
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


# --------------------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A GitHub markdown table. ``align`` has one of ``l``/``r``/``c`` per column."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row needs one cell per header")
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    align = align.ljust(len(headers), "l")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(marks[a] for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(obj: object) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[call-overload]
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
