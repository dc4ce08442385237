"""The C yardstick: configurations measured, the best one picked, pairs added up."""

from __future__ import annotations

import argparse
import time

import pytest

from benchmarks.backends import perftest
from benchmarks.common import BenchError
from benchmarks.common.yardstick import CConfig, against_best, bw_configs, pick_best
from benchmarks.drivers.fair import out_of_budget, rows_from_log

ROW = """\
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4096       2048             30.00              {avg}  \t\t   0.004
---------------------------------------------------------------------------------------
"""


def test_writes_are_measured_plain_with_a_post_list_and_as_many_pairs_as_lanes() -> None:
    cfgs = bw_configs("ib_write_bw", 4096, 2048, 32, 2)
    assert [c.name for c in cfgs] == [
        "ib_write_bw -t 32",
        "ib_write_bw -l 32",
        "2 x ib_write_bw -t 32",
    ]
    assert cfgs[1].args == ("-s", "4096", "-n", "2048", "-t", "32", "-l", "32")
    assert [c.pairs for c in cfgs] == [1, 1, 2]
    assert cfgs[2].command == "2 x (ib_write_bw -s 4096 -n 2048 -t 32) at once"


def test_reads_keep_as_many_reads_outstanding_in_all_as_hixl() -> None:
    cfgs = bw_configs("ib_read_bw", 65536, 128, 32, 2, outstanding=32)
    assert cfgs[0].args[-2:] == ("-o", "32") and cfgs[1].args[-2:] == ("-o", "32")
    assert cfgs[2].args[-2:] == ("-o", "16") and cfgs[2].pairs == 2  # 2 x 16 in all


def test_one_lane_has_no_pairs_row_and_depth_is_capped_by_the_messages() -> None:
    cfgs = bw_configs("ib_write_bw", 65536, 16, 32, 1)
    assert len(cfgs) == 2 and cfgs[1].args[-2:] == ("-l", "16")
    with pytest.raises(ValueError, match="pairs"):
        CConfig(name="x", tool="ib_write_bw", args=(), pairs=0)


def test_the_best_median_wins_not_the_best_single_round() -> None:
    rounds = [{"plain": 10.0, "list": 30.0}, {"plain": 11.0, "list": 12.0}, {"plain": 12.0}]
    assert pick_best(rounds) == ("list", 21.0)  # median of 30 and 12
    lat = [{"a": 5.0, "b": 4.0}, {"a": 5.0, "b": 6.0}, {"a": 5.0, "b": 4.5}]
    assert pick_best(lat, higher_is_better=False) == ("b", 4.5)
    with pytest.raises(ValueError):
        pick_best([{}, {}])


def test_the_ratio_pairs_each_round_with_the_winner_of_that_round() -> None:
    c = [{"plain": 10.0, "pairs": 20.0}, {"plain": 10.0, "pairs": 10.0}, {"plain": 10.0}]
    y = against_best([10.0, 10.0, 10.0], c)
    assert y.winner == "pairs" and y.winner_median == 15.0
    assert y.ratio == pytest.approx(0.75)  # rounds 1 and 2: 0.5 and 1.0; round 3 has none
    assert y.rounds == 2 and y.medians == {"plain": 10.0, "pairs": 15.0}
    missing = against_best([None, 5.0, 5.0], c)
    assert missing.ratio == pytest.approx(0.5) and missing.rounds == 1
    with pytest.raises(ValueError, match="rounds"):
        against_best([1.0], c)


def test_latency_is_set_against_the_fastest_and_reads_as_a_time_ratio() -> None:
    y = against_best([30.0, 36.0], [{"lat": 20.0}, {"lat": 24.0}], higher_is_better=False)
    assert y.winner == "lat" and y.ratio == pytest.approx(1.5)


def test_pairs_that_ran_at_once_add_up_in_bytes_per_second() -> None:
    total = perftest.sum_bw([ROW.format(avg="10.00"), ROW.format(avg="12.50")])
    assert total == pytest.approx(22.5 * 2**20)
    with pytest.raises(BenchError):
        perftest.sum_bw([])
    with pytest.raises(BenchError, match="no perftest result table"):
        perftest.sum_bw([ROW.format(avg="10.00"), "Couldn't connect to 127.0.0.1:18600"])


CUT_SHORT = """\
# date 2026-12-06T10:44:00+00:00  commit abc
# cases lat,layer,get; sizes 4K,64K; 2 rounds; depth 32; lanes 2; 8 MiB per stream; load 1.18
# command: python benchmarks/bench_fair.py --cases lat,layer,get --repeat 2 --json -
[lat]
  ib_write_lat -s 4096 -n 200 -C: 200 µs
  hixl put ping-pong, new offset each: 300 µs
  hixl put ping-pong, new offset each: 500 µs
  ib_write_lat -s 4096 -n 200 -C: 250 µs
[layer]
  ib_write_bw -s 256 -n 8192 -t 128 -l 64: 6.0 MB/s
  ib_write_bw -s 256 -n 8192 -t 128: 3.0 MB/s
  hixl layer put: first 1000.0 ms, second 500.0 ms
  hixl layer put: first 2000.0 ms, second 1000.0 ms
  ib_write_bw -s 256 -n 8192 -t 128: 2.0 MB/s
  ib_write_bw -s 256 -n 8192 -t 128 -l 64: 4.0 MB/s
[get]
  ib_read_bw -t 32 -o 32 4 KiB: 3.7 MB/s
hixl: error: VM run exceeded its timeout of 900 s; killed vm
"""


def test_a_run_cut_short_keeps_its_finished_cases_paired_by_round() -> None:
    from benchmarks.drivers import fair

    rows = {r["row"]: r for r in fair.rows_from_log(CUT_SHORT)}
    lat = rows[fair.LAT_ROW]
    assert lat["ratio"] == pytest.approx(1.75)  # median of 300/200 and 500/250
    assert lat["yardstick"] == "ib_write_lat -s 4096 -n 200 -C"
    first = rows[fair.FIRST_LAYER]
    assert first["yardstick"] == "ib_write_bw -s 256 -n 8192 -t 128 -l 64"
    # 2 MiB in 1 s and in 2 s against 6 and 4 MB/s of the winning -l 64
    assert first["ratio"] == pytest.approx((2097152 / 6e6 + 1048576 / 4e6) / 2)
    assert first["rounds"] == 2


def test_a_budget_stops_between_rounds_when_the_next_would_end_past_it() -> None:
    """The first round always runs; later ones only when the mean round so far still
    fits; no budget, no limit."""
    said: list[str] = []
    now = time.monotonic()
    budget = argparse.Namespace(budget=25.0)
    assert not out_of_budget(budget, now - 100.0, 0, said.append)
    assert not out_of_budget(budget, now - 10.0, 2, said.append)  # 10 + 5 <= 25
    assert out_of_budget(budget, now - 20.0, 2, said.append)  # 20 + 10 > 25
    assert said == ["  (stopped after 2 rounds: another would end past the 25 s budget)"]
    assert not out_of_budget(argparse.Namespace(budget=None), now - 1e6, 9, said.append)


PUT_LOG = """\
# cases put; sizes 4K; 5 rounds; depth 32; lanes 2; 4 MiB per stream; load 1.25
[put]
  ib_write_bw -t 32 4 KiB: 10.0 MB/s
  ib_write_bw -l 32 4 KiB: 12.0 MB/s
  2 x ib_write_bw -t 32 4 KiB: 20.0 MB/s
  hixl (GIL interval as the process has it) 4 KiB: 5.0 MB/s
  hixl, GIL switch interval 0.5 ms 4 KiB: 4.0 MB/s
  hixl, the same arguments repeated 4 KiB: 6.0 MB/s
  hixl lanes=1 4 KiB: 6.0 MB/s
  hixl lanes=1 4 KiB: 9.0 MB/s
  hixl, the same arguments repeated 4 KiB: 7.0 MB/s
  hixl, GIL switch interval 0.5 ms 4 KiB: 4.0 MB/s
  hixl (GIL interval as the process has it) 4 KiB: 8.0 MB/s
  2 x ib_write_bw -t 32 4 KiB: 16.0 MB/s
  ib_write_bw -l 32 4 KiB: 18.0 MB/s
  ib_write_bw -t 32 4 KiB: failed after 3 tries
  (stopped after 2 rounds: another would end past the 80 s budget)
  ib_write_bw -t 32 4 KiB: 99.0 MB/s
"""


def test_stream_rows_are_read_back_from_a_log_cut_short() -> None:
    """Two whole rounds (in either order, one with a C configuration that failed) and
    the start of a third, which is left out: the best C configuration by median,
    per-round ratios, and lanes=1 against the post list alone."""
    rows = rows_from_log(PUT_LOG)
    by = {(r["row"], r["yardstick"]): r for r in rows}
    main = by[("hixl (GIL interval as the process has it)", "2 x ib_write_bw -t 32")]
    assert main["rounds"] == 2
    assert main["ratio"] == pytest.approx((5 / 20 + 8 / 16) / 2)
    assert main["hixl_median"] == pytest.approx(6.5e6)
    one = by[("hixl lanes=1", "ib_write_bw -l 32")]
    assert one["ratio"] == pytest.approx((6 / 12 + 9 / 18) / 2)
    assert ("hixl lanes=1", "2 x ib_write_bw -t 32") in by
    assert len(rows) == 5


def test_a_get_log_keeps_the_one_queue_pair_post_list_apart() -> None:
    """Reads have a fourth C line per round (``-l`` with one queue pair's reads in
    flight), which only lanes=1 is set against."""
    log = """\
# cases get; sizes 64K; 5 rounds; depth 32; lanes 2; 4 MiB per stream; load 1.48
[get]
  ib_read_bw -t 32 -o 32 64 KiB: 16.0 MB/s
  ib_read_bw -l 32 -o 32 64 KiB: 20.0 MB/s
  2 x ib_read_bw -t 32 -o 16 64 KiB: 32.0 MB/s
  ib_read_bw -l 32 -o 16 64 KiB: 40.0 MB/s
  hixl (GIL interval as the process has it) 64 KiB: 16.0 MB/s
  hixl, GIL switch interval 0.5 ms 64 KiB: 16.0 MB/s
  hixl, the same arguments repeated 64 KiB: 16.0 MB/s
  hixl lanes=1 64 KiB: 10.0 MB/s
"""
    by = {(r["row"], r["yardstick"]): r for r in rows_from_log(log)}
    default = ("hixl (GIL interval as the process has it)", "2 x ib_read_bw -t 32 -o 16")
    assert by[default]["ratio"] == pytest.approx(0.5)
    assert by[("hixl lanes=1", "ib_read_bw -l 32 -o 16")]["ratio"] == pytest.approx(0.25)
