"""hixl's benchmarks, as a typed package (not shipped in the wheel; run from a checkout).

Layout, after ucx-py's split:

* :mod:`benchmarks.common`: units, statistics, the setup header, progress, output;
* :mod:`benchmarks.backends`: the contenders (perftest, hixl, and the peers);
* :mod:`benchmarks.drivers`: the programs that measure and report.

The ``bench_*.py`` and ``run_all.py`` files next to this one are thin entry points: each
runs as ``python benchmarks/bench_x.py`` or as ``python -m benchmarks.bench_x`` from the
repository root.
"""

from __future__ import annotations

from pathlib import Path

#: The directory of the entry-point files (``bench_*.py``, ``run_all.py``).
ENTRY_DIR = Path(__file__).resolve().parent


def entry(name: str) -> Path:
    """The entry-point file ``benchmarks/<name>.py``, for running a driver in a new process."""
    path = ENTRY_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark entry point {path}")
    return path
