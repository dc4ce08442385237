"""The C yardstick: the strongest perftest configuration at the same depth (pure).

On rxe the sending happens inside ``ibv_post_send``, so a post list (``-l``) or several
processes at once move more than one plain ``ib_write_bw``.  A ratio against the plain
tool alone flatters whatever posts in batches or from several threads; these helpers
name every configuration worth measuring and pick the one that moved the most.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class CConfig:
    """One perftest configuration: ``pairs`` processes pairs of ``tool`` with ``args``."""

    name: str
    tool: str
    args: tuple[str, ...]
    pairs: int = 1

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"a configuration needs >= 1 pair, got pairs={self.pairs}")

    @property
    def command(self) -> str:
        line = " ".join((self.tool, *self.args))
        return line if self.pairs == 1 else f"{self.pairs} x ({line}) at once"


def bw_configs(
    tool: str, size: int, iters: int, depth: int, lanes: int, outstanding: int | None = None
) -> list[CConfig]:
    """The configurations a stream of ``depth`` messages in flight over ``lanes`` queue
    pairs is measured against: plain, with a post list of the same depth, and ``lanes``
    pairs at once.  ``outstanding`` (reads): the reads in flight in all, ``-o`` of the
    one-queue-pair forms; each of the ``lanes`` pairs gets its share."""
    if min(size, iters, depth, lanes) < 1:
        raise ValueError(f"size, iters, depth, lanes must be >= 1: {size} {iters} {depth} {lanes}")
    depth = min(depth, iters)
    base = ("-s", str(size), "-n", str(iters), "-t", str(depth))
    one: tuple[str, ...] = ()
    per_pair: tuple[str, ...] = ()
    if outstanding is not None:
        one = ("-o", str(outstanding))
        per_pair = ("-o", str(max(1, outstanding // lanes)))
    out = [
        CConfig(name=f"{tool} -t {depth}{_o(one)}", tool=tool, args=(*base, *one)),
        CConfig(
            name=f"{tool} -l {depth}{_o(one)}",
            tool=tool,
            args=(*base, "-l", str(depth), *one),
        ),
    ]
    if lanes > 1:
        out.append(
            CConfig(
                name=f"{lanes} x {tool} -t {depth}{_o(per_pair)}",
                tool=tool,
                args=(*base, *per_pair),
                pairs=lanes,
            )
        )
    return out


def _o(args: tuple[str, ...]) -> str:
    return f" {' '.join(args)}" if args else ""


@dataclass(frozen=True, slots=True)
class Yardstick:
    """The winning configuration and the ratio of a contender against it.

    ``ratio`` is the median over rounds of the contender's value divided by the
    winner's value in the same round (rounds where either is missing are left out);
    ``medians`` holds every configuration's median, for the record.
    """

    winner: str
    winner_median: float
    ratio: float | None
    rounds: int
    medians: Mapping[str, float]


def pick_best(
    by_round: Sequence[Mapping[str, float]], higher_is_better: bool = True
) -> tuple[str, float]:
    """The configuration with the best median over the rounds it has a value in.

    ``by_round``: one mapping per round of configuration name to its figure (bandwidth:
    higher is better; latency: lower).  Ties go to the name first seen.  Raises
    :class:`ValueError` when no round has any figure.
    """
    values: dict[str, list[float]] = {}
    for rnd in by_round:
        for name, v in rnd.items():
            values.setdefault(name, []).append(v)
    if not values:
        raise ValueError("no configuration has a figure")
    best_name, best = "", 0.0
    for name, vs in values.items():
        m = float(statistics.median(vs))
        if not best_name or (m > best if higher_is_better else m < best):
            best_name, best = name, m
    return best_name, best


def against_best(
    contender: Sequence[float | None],
    c_by_round: Sequence[Mapping[str, float]],
    higher_is_better: bool = True,
) -> Yardstick:
    """Pick the best C configuration and the contender's paired ratio against it.

    ``contender[i]`` and ``c_by_round[i]`` were measured in the same round.  The ratio
    is contender / winner for both kinds: for bandwidth > 1 is faster, for latency > 1
    is slower.
    """
    if len(contender) != len(c_by_round):
        raise ValueError(f"{len(contender)} contender rounds but {len(c_by_round)} C rounds")
    winner, best = pick_best(c_by_round, higher_is_better)
    ratios = [
        x / rnd[winner]
        for x, rnd in zip(contender, c_by_round, strict=True)
        if x is not None and rnd.get(winner)
    ]
    medians: dict[str, float] = {}
    for rnd in c_by_round:
        for name in rnd:
            if name not in medians:
                medians[name] = float(statistics.median([r[name] for r in c_by_round if name in r]))
    return Yardstick(
        winner=winner,
        winner_median=best,
        ratio=float(statistics.median(ratios)) if ratios else None,
        rounds=len(ratios),
        medians=medians,
    )
