"""bench_kv's one-clock C yardstick: its configurations, its output, the best one picked,
and the program compiled on demand (natively: without a device it must fail clearly)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.common import BenchError
from benchmarks.drivers import kv_c

TP4 = kv_c.KVShape(wrs=128, sges=16, sge_len=512, stride=2048, lanes=2)
FULL = kv_c.KVShape(wrs=128, sges=1, sge_len=32768, stride=32768, lanes=2)


def _output(shape: kv_c.KVShape, seconds: float = 0.05) -> str:
    return "".join(
        f"kv_wr\t{n}\t{seconds + i * 1e-3:.9f}\t{shape.nbytes}\n"
        for i, n in enumerate(kv_c.config_names(shape))
    )


def test_both_sge_shapes_both_posting_forms_and_both_waits_are_measured() -> None:
    names = kv_c.config_names(TP4)
    assert len(names) == 8
    assert names[0] == "128 WRs x 1 SGE, 2 QPs, one thread, poll"
    assert "128 WRs x 16 SGEs, 2 QPs, thread per QP, event" in names
    # one SGE per WR already is a whole block's shape: no second shape
    assert kv_c.config_names(FULL) == [
        "128 WRs x 1 SGE, 2 QPs, one thread, poll",
        "128 WRs x 1 SGE, 2 QPs, one thread, event",
        "128 WRs x 1 SGE, 2 QPs, thread per QP, poll",
        "128 WRs x 1 SGE, 2 QPs, thread per QP, event",
    ]
    one_lane = kv_c.KVShape(wrs=8, sges=2, sge_len=64, stride=64, lanes=1)
    assert [n for n in kv_c.config_names(one_lane) if "thread per QP" in n] == []
    assert TP4.nbytes == 128 * 8192
    with pytest.raises(ValueError):
        kv_c.KVShape(wrs=8, sges=2, sge_len=64, stride=32, lanes=1)  # SGEs overlap


def test_the_output_is_read_as_bandwidth_per_configuration() -> None:
    got = kv_c.parse_output("noise\n" + _output(TP4), TP4)
    assert len(got) == 8
    assert all(k.startswith(kv_c.PREFIX) for k in got)
    first = kv_c.PREFIX + "128 WRs x 1 SGE, 2 QPs, one thread, poll"
    assert got[first] == pytest.approx(TP4.nbytes / 0.05)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "no figure"),
        ("kv_wr\tx\t0.1\n", "cannot read"),
        (_output(TP4).replace(str(TP4.nbytes), "4096"), "moved 4096 B"),
        (_output(TP4, seconds=0.0).replace("0.000000000", "0"), "non-positive"),
        ("".join(_output(TP4).splitlines(keepends=True)[:-1]), "no figure"),
    ],
)
def test_output_that_is_incomplete_or_wrong_is_an_error(text: str, needle: str) -> None:
    with pytest.raises(BenchError, match=needle):
        kv_c.parse_output(text, TP4)


def test_the_yardstick_is_the_best_one_clock_configuration_perftest_kept_beside_it() -> None:
    one, thr = kv_c.PREFIX + "1 SGE, one thread", kv_c.PREFIX + "16 SGEs, thread per QP"
    # the summed perftest pairs read highest, but they are not one clock: not the yardstick
    rounds = [
        {one: 100.0, thr: 80.0, "2 x ib_write_bw -t 128": 200.0, "ib_write_bw -l 128": 90.0},
        {one: 110.0, thr: 120.0, "2 x ib_write_bw -t 128": 190.0, "ib_write_bw -l 128": 95.0},
        {one: 90.0, thr: 70.0, "2 x ib_write_bw -t 128": 210.0, "ib_write_bw -l 128": 80.0},
    ]
    hixl = [50.0, 99.0, 45.0]
    best, perf = kv_c.yardsticks(hixl, rounds)
    assert best.winner == one
    assert best.ratio == pytest.approx(0.5)  # median of 0.5, 0.9, 0.5: paired by round
    assert set(best.medians) == {one, thr}
    assert perf is not None and perf.winner == "2 x ib_write_bw -t 128"
    assert perf.ratio == pytest.approx(0.25)
    # without perftest figures the one-clock yardstick still stands
    best2, perf2 = kv_c.yardsticks(hixl, [kv_c.split_round(r)[0] for r in rounds])
    assert best2 == best and perf2 is None
    with pytest.raises(BenchError, match="kv_wr"):
        kv_c.yardsticks(hixl, [kv_c.split_round(r)[1] for r in rounds])


def test_a_missing_compiler_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(BenchError, match="needs no-such-cc-here and libibverbs-dev"):
        kv_c.build(compiler="no-such-cc-here")
    with pytest.raises(BenchError, match="source is missing"):
        kv_c.build(source=tmp_path / "gone.c")


@pytest.mark.skipif(
    shutil.which("gcc") is None or not Path("/usr/include/infiniband/verbs.h").exists(),
    reason="needs gcc and libibverbs-dev (scripts/setup.sh)",
)
def test_the_program_compiles_once_outside_the_source_tree_and_fails_clearly_without_a_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    binary = kv_c.build()
    assert binary.parent == tmp_path / "hixl" / "bench-c"
    mtime = binary.stat().st_mtime_ns
    assert kv_c.build() == binary and binary.stat().st_mtime_ns == mtime  # from the cache
    with pytest.raises(BenchError, match="(?s)kv_wr failed.*kv_wr: (no RDMA devices|cannot open)"):
        kv_c.run(binary, TP4, "no-such-device", 0, 1)
