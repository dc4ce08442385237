"""What every benchmark shares: units and formatting, statistics, the setup header,
progress display and output (markdown tables, JSON). Pure or host-only; nothing here
opens a device."""

from .child import expect_line, send_line
from .errors import BenchError, run_main
from .output import json_out, markdown_table, write_json
from .progress import Progress
from .setup import (
    REPO,
    command_line,
    cpu_mhz,
    device_info,
    gather_setup,
    git_commit,
    parse_perftest_version,
    perftest_version,
    print_header,
    quiet_logs,
    setup_lines,
    where,
)
from .stats import median, median_of, ratio, spread
from .units import (
    KIB,
    MIB,
    fmt_rate,
    fmt_ratio,
    fmt_size,
    fmt_us,
    iterations_for,
    parse_ints,
    parse_size,
    parse_sizes,
)

__all__ = [
    "KIB",
    "MIB",
    "REPO",
    "BenchError",
    "expect_line",
    "send_line",
    "Progress",
    "command_line",
    "cpu_mhz",
    "device_info",
    "fmt_rate",
    "fmt_ratio",
    "fmt_size",
    "fmt_us",
    "gather_setup",
    "git_commit",
    "iterations_for",
    "json_out",
    "markdown_table",
    "median",
    "median_of",
    "parse_ints",
    "parse_perftest_version",
    "parse_size",
    "parse_sizes",
    "perftest_version",
    "print_header",
    "quiet_logs",
    "ratio",
    "run_main",
    "setup_lines",
    "spread",
    "where",
    "write_json",
]
