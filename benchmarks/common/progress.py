"""A one-line progress display for long benchmark runs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
