"""Medians over repeats and ratios of medians: the only statistics the reports use."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float | None:
    """Median, or None for no values."""
    return float(statistics.median(values)) if values else None


def median_of(values: Sequence[float]) -> float:
    """Median of a sample that cannot be empty; ValueError when it is."""
    if not values:
        raise ValueError("median of an empty sample")
    return float(statistics.median(values))


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
