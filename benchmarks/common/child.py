"""Line protocol with a benchmark's child process: one command per line on its stdin,
one answer per line on its stdout, the first word naming the answer."""

from __future__ import annotations

import select
import subprocess

from .errors import BenchError


def send_line(proc: subprocess.Popen[str], line: str) -> None:
    """Write one command line to ``proc``'s stdin."""
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def expect_line(
    proc: subprocess.Popen[str], word: str, timeout: float, who: str, fields: int = 1
) -> list[str]:
    """The next line of ``proc``'s stdout, split, which must start with ``word`` and
    have at least ``fields`` words; :class:`BenchError` (naming ``who``) otherwise, or
    when no line came within ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    got = line.split()
    if len(got) < max(fields, 1) or got[0] != word:
        raise BenchError(f"{who}: wanted {word}, got {line.strip()!r}")
    return got
