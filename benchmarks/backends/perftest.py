"""perftest (``ib_write_bw``, ``ib_read_bw``, ``ib_write_lat``): the C baseline.

Runs a server/client pair on one device and parses the result table they print (pure
parsers, unit tested). perftest's ``MB/sec`` is MiB/s (2**20 bytes); ``Gb/sec`` is 10**9
bits.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hixl.testbed.net import read_listening_ports, tcp_port_is_free

from ..common.errors import BenchError
from ..common.units import MIB


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
    # CPU seconds (user + system) of each process, from the parent's reaped-children usage;
    # None where another child of this process may have been reaped in between.
    client_cpu_s: float | None = None
    server_cpu_s: float | None = None

    @property
    def output(self) -> str:
        """The output whose result table counts."""
        return self.server_output if self.side == "server" else self.client_output

    @property
    def command(self) -> str:
        """Both command lines, as one shell-readable string."""
        return f"{shlex.join(self.server_cmd)} &  {shlex.join(self.client_cmd)}"


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


#: perftest prints this when its cycles-per-microsecond regression is too noisy to use
#: (common under CPU emulation on a busy host); it then computes with a bad clock rate.
CALIBRATION_FAILED = "Correlation coefficient r^2"


def _grep(text: str, needle: str) -> str:
    return next((line.strip() for line in text.splitlines() if needle in line), "")


#: How many ports, from ``port_base`` on, a :class:`Perftest` cycles through.
PORT_SPAN = 2000


class Perftest:
    """Runs perftest pairs on one device, on fresh TCP ports.

    Each pair gets the next free port of ``port_base .. port_base + PORT_SPAN - 1``
    (perftest's out-of-band connection). The server is started first; the client only once
    the server's port is in LISTEN state (read from ``/proc/net/tcp``, so nothing connects
    to the server early).
    """

    def __init__(
        self,
        device: str,
        gid_index: int,
        server_addr: str = "127.0.0.1",
        port_base: int = 18600,
        timeout: float = 180.0,
    ) -> None:
        if not 1024 <= port_base <= 65535 - PORT_SPAN + 1:
            raise ValueError(
                f"port_base must be in 1024..{65535 - PORT_SPAN + 1} "
                f"(it starts {PORT_SPAN} ports), got {port_base}"
            )
        self.device = device
        self.gid_index = gid_index
        self.server_addr = server_addr
        self.timeout = timeout
        self.port_base = port_base
        self._offset = -1

    def next_port(self) -> int:
        """The next port of this runner's range that is free now (cycling through it)."""
        for _ in range(PORT_SPAN):
            self._offset = (self._offset + 1) % PORT_SPAN
            port = self.port_base + self._offset
            if tcp_port_is_free(port):
                return port
        raise BenchError(
            f"no free TCP port for perftest in {self.port_base}..{self.port_base + PORT_SPAN - 1}"
        )

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

    def run_pairs(
        self,
        tool: str,
        args: Sequence[str],
        pairs: int,
        check: Callable[[PerftestRun], None] | None = None,
        retries: int = 2,
    ) -> PairsRun:
        """Run ``pairs`` server/client pairs of ``tool`` with ``args`` at the same time
        (each on its own port and queue pair), as N processes of an application would.
        Every pair must finish within the runner's timeout and pass ``check``; a try
        where one fails or hangs is retried whole.  Raises :class:`BenchError` with the
        last reason when every try failed."""
        if pairs == 1:
            return PairsRun((self.run(tool, args, check=check, retries=retries),))
        last = ""
        for _ in range(retries + 1):
            try:
                runs = self._run_many(tool, list(args), pairs)
                for run in runs:
                    if CALIBRATION_FAILED in run.client_output:
                        raise BenchError(f"{tool}: perftest's CPU clock calibration failed")
                    if check is not None:
                        check(run)
                return PairsRun(tuple(runs))
            except BenchError as exc:
                last = str(exc)
        raise BenchError(f"{last} (after {retries + 1} tries)")

    def _run_many(self, tool: str, args: list[str], pairs: int) -> list[PerftestRun]:
        ports = []
        for _ in range(pairs):
            port = self.next_port()
            while port in ports:
                port = self.next_port()
            ports.append(port)
        commons = [
            [tool, "-d", self.device, "-x", str(self.gid_index), "-F", "-p", str(p), *args]
            for p in ports
        ]
        servers = [
            subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for c in commons
        ]
        clients: list[subprocess.Popen[str]] = []
        try:
            deadline = time.monotonic() + 20.0
            while not set(ports) <= read_listening_ports():
                for server in servers:
                    if server.poll() is not None:
                        raise BenchError(
                            f"{tool} server exited early:\n{_tail(server.communicate()[0])}"
                        )
                if time.monotonic() > deadline:
                    raise BenchError(f"{tool} servers did not listen on {ports} within 20 s")
                time.sleep(0.05)
            t0 = time.perf_counter()
            clients = [
                subprocess.Popen(
                    [*c, self.server_addr],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for c in commons
            ]
            outs = []
            walls = []
            end = time.monotonic() + self.timeout
            for c, cmd in zip(clients, commons, strict=True):
                try:
                    out = c.communicate(timeout=max(1.0, end - time.monotonic()))[0]
                except subprocess.TimeoutExpired as exc:
                    raise BenchError(
                        f"{shlex.join(cmd)} ({pairs} at once) timed out after {self.timeout} s"
                    ) from exc
                walls.append(time.perf_counter() - t0)
                if c.returncode != 0:
                    raise BenchError(f"{shlex.join(cmd)} exited {c.returncode}:\n{_tail(out)}")
                outs.append(out)
            server_outs = []
            for server in servers:
                try:
                    server_outs.append(server.communicate(timeout=30.0)[0])
                except subprocess.TimeoutExpired:
                    server.kill()
                    server_outs.append(server.communicate()[0])
            return [
                PerftestRun(tool, tuple(c), (*c, self.server_addr), out, sout, wall)
                for c, out, sout, wall in zip(commons, outs, server_outs, walls, strict=True)
            ]
        finally:
            for proc in (*clients, *servers):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    def _run_once(self, tool: str, args: list[str]) -> PerftestRun:
        port = self.next_port()
        common = [tool, "-d", self.device, "-x", str(self.gid_index), "-F", "-p", str(port), *args]
        server_cmd = tuple(common)
        client_cmd = (*common, self.server_addr)
        server = subprocess.Popen(
            server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            deadline = time.monotonic() + 20.0
            while port not in read_listening_ports():
                if server.poll() is not None:
                    out = server.communicate()[0]
                    raise BenchError(f"{tool} server exited early:\n{_tail(out)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{tool} server did not listen on port {port} within 20 s")
                time.sleep(0.05)
            t0 = time.perf_counter()
            cpu0 = _children_cpu()
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
            cpu1 = _children_cpu()
            try:
                server_out = server.communicate(timeout=30.0)[0]
            except subprocess.TimeoutExpired:
                server.kill()
                server_out = server.communicate()[0]
            cpu2 = _children_cpu()
            if client.returncode != 0:
                raise BenchError(
                    f"{shlex.join(client_cmd)} exited {client.returncode}:\n{_tail(client.stdout)}"
                )
            return PerftestRun(
                tool,
                server_cmd,
                client_cmd,
                client.stdout,
                server_out,
                wall,
                client_cpu_s=cpu1 - cpu0,
                server_cpu_s=cpu2 - cpu1,
            )
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


@dataclass(frozen=True, slots=True)
class PairsRun:
    """``pairs`` server/client pairs of one BW tool run at the same time."""

    runs: tuple[PerftestRun, ...]

    @property
    def command(self) -> str:
        first = self.runs[0].command
        return first if len(self.runs) == 1 else f"{len(self.runs)} at once: {first}"


def sum_bw(outputs: Sequence[str]) -> float:
    """The bandwidth of BW pairs that ran at the same time: the sum of their averages
    (bytes per second).  Raises :class:`BenchError` when one printed no result."""
    if not outputs:
        raise BenchError("no perftest output to add up")
    return sum(parse_bw(text).avg_Bps for text in outputs)


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
