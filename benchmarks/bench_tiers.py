"""Entry point: see :mod:`benchmarks.drivers.tiers` (``--help`` prints its description)."""

import sys
from pathlib import Path

if not __package__:  # run by path: import the package from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import run_main  # noqa: E402
from benchmarks.drivers.tiers import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_main(main, "bench_tiers"))
