"""The one exception the benchmark programs raise for their own failures."""

from __future__ import annotations

import sys
from collections.abc import Callable


class BenchError(RuntimeError):
    """A benchmark step could not run, its output could not be read, or bytes differed."""


def run_main(main: Callable[[], int], prog: str) -> int:
    """Run a benchmark's ``main``; a :class:`BenchError` becomes one line and status 2.

    A missing device or a tool that failed is an expected outcome of a benchmark run, so it
    is reported as ``prog: message`` rather than a traceback.
    """
    try:
        return main()
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
