"""The one-clock C yardstick of ``bench_kv --device``: ``benchmarks/c/kv_wr.c``.

perftest cannot post a work request of several SGEs, and its "one pair per lane" form adds
up the averages of separate processes, each timed by its own clock over its own share.
``kv_wr`` moves a request's bytes in the request's number of work requests from one
process, timed by one clock from the first post to the last completion, on as many queue
pairs as the engine has lanes, in every configuration worth trying (one SGE per work
request or the request's own SGE shape; one posting thread or one per queue pair; a
spinning or a sleeping wait: see the source).  The yardstick is the configuration that
moved the request fastest, named beside the ratio.

The program is compiled on first use with ``gcc ... -libverbs`` into a cache directory
outside the source tree (``$XDG_CACHE_HOME/hixl/bench-c``, else ``~/.cache/hixl/bench-c``,
else the temporary directory), keyed by a hash of its source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..common import REPO, BenchError
from ..common.yardstick import Yardstick, against_best

SOURCE = REPO / "benchmarks" / "c" / "kv_wr.c"
PREFIX = "kv_wr: "  # the label of every configuration of this program in a round


@dataclass(frozen=True, slots=True)
class KVShape:
    """A request's work requests: ``wrs`` of ``sges`` SGEs of ``sge_len`` bytes, the
    SGEs ``stride`` apart on the source, over ``lanes`` queue pairs."""

    wrs: int
    sges: int
    sge_len: int
    stride: int
    lanes: int

    def __post_init__(self) -> None:
        if min(self.wrs, self.sges, self.sge_len, self.lanes) < 1 or self.stride < self.sge_len:
            raise ValueError(f"not a request shape: {self}")

    @property
    def nbytes(self) -> int:
        return self.wrs * self.sges * self.sge_len

    def args(self, device: str, gid_index: int, reps: int) -> list[str]:
        return [
            device,
            str(gid_index),
            str(self.wrs),
            str(self.sges),
            str(self.sge_len),
            str(self.stride),
            str(self.lanes),
            str(reps),
        ]


def config_names(shape: KVShape) -> list[str]:
    """The configurations ``kv_wr`` measures for ``shape``, as it names them: one SGE
    per work request and (with several) the request's own SGEs; one posting thread and
    (with several queue pairs) one per queue pair; a spinning and a sleeping wait."""
    qps = min(shape.lanes, shape.wrs)
    out = []
    for sges in (1, shape.sges) if shape.sges > 1 else (1,):
        for threads in ("one thread", "thread per QP") if qps > 1 else ("one thread",):
            for wait in ("poll", "event"):
                out.append(
                    f"{shape.wrs} WRs x {sges} SGE{'s' if sges > 1 else ''}, "
                    f"{qps} QP{'s' if qps > 1 else ''}, {threads}, {wait}"
                )
    return out


def parse_output(text: str, shape: KVShape) -> dict[str, float]:
    """``kv_wr``'s lines as ``{PREFIX + configuration: bytes per second}`` (its median
    time per request).  Every configuration of :func:`config_names` must be there, with
    the request's byte count and a positive time; otherwise :class:`BenchError`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("kv_wr\t"):
            continue
        fields = line.split("\t")
        try:
            _, name, seconds, nbytes = fields
            s, n = float(seconds), int(nbytes)
        except ValueError as exc:
            raise BenchError(f"kv_wr: cannot read the line {line!r}") from exc
        if n != shape.nbytes:
            raise BenchError(f"kv_wr: moved {n} B per request, the request has {shape.nbytes}")
        if not s > 0:
            raise BenchError(f"kv_wr: a non-positive time in {line!r}")
        out[PREFIX + name] = n / s
    missing = [n for n in config_names(shape) if PREFIX + n not in out]
    if missing:
        raise BenchError(f"kv_wr printed no figure for {missing[0]!r}:\n{text[-2000:]}")
    return out


def split_round(rnd: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """A round's C figures as (one-clock ``kv_wr`` configurations, perftest's)."""
    one = {k: v for k, v in rnd.items() if k.startswith(PREFIX)}
    return one, {k: v for k, v in rnd.items() if not k.startswith(PREFIX)}


def yardsticks(
    hixl_bps: Sequence[float | None], c_rounds: Sequence[Mapping[str, float]]
) -> tuple[Yardstick, Yardstick | None]:
    """The contender against the best one-clock C configuration (the yardstick), and
    against the best perftest configuration (kept beside it; None when a round had no
    perftest figure at all), each paired by round."""
    split = [split_round(r) for r in c_rounds]
    if not any(one for one, _ in split):
        raise BenchError("no round has a figure of kv_wr")
    best = against_best(hixl_bps, [one for one, _ in split])
    perf = [p for _, p in split]
    return best, against_best(hixl_bps, perf) if any(perf) else None


def cache_dirs() -> list[Path]:
    """Where the compiled program may live, in order of preference."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [
        Path(base) / "hixl" / "bench-c",
        Path(tempfile.gettempdir()) / f"hixl-bench-c-{os.getuid()}",
    ]


def build(source: Path = SOURCE, compiler: str = "gcc") -> Path:
    """The compiled ``kv_wr``: from the cache, else compiled now.  A missing compiler,
    a missing ``infiniband/verbs.h`` or ``libibverbs`` is a :class:`BenchError`
    naming what to install."""
    try:
        text = source.read_bytes()
    except OSError as exc:
        raise BenchError(f"the C yardstick's source is missing: {exc}") from exc
    digest = hashlib.sha256(text + compiler.encode()).hexdigest()[:16]
    name = f"{source.stem}-{digest}"
    for d in cache_dirs():
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    cc = shutil.which(compiler)
    if cc is None:
        raise BenchError(
            f"bench_kv --device compiles its C yardstick ({source.name}) and needs {compiler} "
            "and libibverbs-dev (scripts/setup.sh installs both); no "
            f"{compiler} on PATH"
        )
    last = ""
    for d in cache_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{name}.{os.getpid()}"
            out = subprocess.run(
                [cc, "-O2", "-Wall", "-o", str(tmp), str(source), "-libverbs", "-lpthread"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if out.returncode != 0:
                raise BenchError(
                    f"compiling {source.name} failed (is libibverbs-dev installed? "
                    f"scripts/setup.sh installs it):\n{out.stderr[-2000:]}"
                )
            tmp.replace(d / name)
            return d / name
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"compiling {source.name} took over 300 s") from exc
        except OSError as exc:  # a read-only cache: try the next place
            last = str(exc)
    raise BenchError(f"no writable directory for the compiled C yardstick: {last}")


def run(binary: Path, shape: KVShape, device: str, gid_index: int, reps: int) -> dict[str, float]:
    """One run of every configuration, ``reps`` requests each (their median): see
    :func:`parse_output`."""
    cmd = [str(binary), *shape.args(device, gid_index, reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"kv_wr did not finish in 300 s: {' '.join(cmd)}") from exc
    if out.returncode != 0:
        raise BenchError(f"kv_wr failed ({' '.join(cmd)}):\n{(out.stderr or out.stdout)[-2000:]}")
    return parse_output(out.stdout, shape)
