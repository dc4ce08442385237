"""Sizes and the way figures are printed.

Units: sizes in bytes, bandwidth in bytes per second, times in seconds unless a name says
``_us``. Printed rates are decimal MB/s (10**6 bytes), sizes binary (KiB, MiB).
"""

from __future__ import annotations

import re

MIB = 1 << 20
KIB = 1 << 10


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
