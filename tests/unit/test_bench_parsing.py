"""The benchmarks' pure helpers: perftest output parsing, statistics, tables, targets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.backends import perftest
from benchmarks.drivers import suite, transfer_diagnose
from benchmarks.drivers import transfer as bt
from hixl.testbed import net

# Output of perftest 6.06 on rxe0 in the hixl VM (kernel 6.1, TCG), trimmed of addresses.
WRITE_BW = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : rxe0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 TX depth        : 128
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 1
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      200              42.35              14.64  \t\t   0.000234
---------------------------------------------------------------------------------------
"""

WRITE_BW_GBITS = """\
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 8388608    5           0.089634            0.089634            0.000001
---------------------------------------------------------------------------------------
"""

READ_BW = """\
Device not recognized to implement inline feature. Disabling it
---------------------------------------------------------------------------------------
                    RDMA_Read BW Test
 Outstand reads  : 16
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      200              31.30              15.25  \t\t   0.000244
---------------------------------------------------------------------------------------
"""

WRITE_LAT = """\
---------------------------------------------------------------------------------------
                    RDMA_Write Latency Test
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]\x20
 4096    200          94.18          75691.22      323.29   \t       2483.74     \t3233.41\
\t\t20711.80 \t\t75691.22
---------------------------------------------------------------------------------------
"""


def test_parse_bw_reads_mib_per_second() -> None:
    r = perftest.parse_bw(WRITE_BW)
    assert (r.size, r.iterations) == (65536, 200)
    assert r.avg_Bps == pytest.approx(14.64 * 2**20)
    assert r.peak_Bps == pytest.approx(42.35 * 2**20)
    assert r.msg_rate_mpps == pytest.approx(0.000234)


def test_parse_bw_reads_gbits_as_decimal_bits() -> None:
    r = perftest.parse_bw(WRITE_BW_GBITS)
    assert r.size == 8388608 and r.iterations == 5
    assert r.avg_Bps == pytest.approx(0.089634e9 / 8)


def test_parse_bw_skips_warnings_before_the_table() -> None:
    assert perftest.parse_bw(READ_BW).avg_Bps == pytest.approx(15.25 * 2**20)


def test_parse_lat_takes_t_typical_and_percentiles() -> None:
    r = perftest.parse_lat(WRITE_LAT)
    assert (r.size, r.iterations) == (4096, 200)
    assert r.t_typical_us == pytest.approx(323.29)
    assert r.t_min_us == pytest.approx(94.18)
    assert r.p99_us == pytest.approx(20711.80)
    assert r.p999_us == pytest.approx(75691.22)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Couldn't connect to 127.0.0.1:18515\nUnable to open file descriptor for socket",
        " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n---\n",
    ],
)
def test_parse_bw_without_a_result_row_says_so(text: str) -> None:
    with pytest.raises(common.BenchError, match="perftest"):
        perftest.parse_bw(text)


def test_parse_lat_refuses_bw_output() -> None:
    with pytest.raises(common.BenchError):
        perftest.parse_lat(WRITE_BW)


def test_parse_version() -> None:
    assert common.parse_perftest_version("Version: 6.06\n") == "6.06"
    assert common.parse_perftest_version("nothing") is None


def test_listening_ports_reads_proc_net_tcp() -> None:
    tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 00000000:4894 00000000:0000 0A 00000000:00000000 00:00000000 00000000\n"
        "   1: 0100007F:48AB 0100007F:8480 06 00000000:00000000 03:0000109A 00000000\n"
    )
    tcp6 = (
        "  sl  local_address                         remote_address  st\n"
        "   0: 00000000000000000000000000000000:48A8 00000000000000000000000000000000:0000 0A\n"
    )
    assert net.listening_ports([tcp, tcp6]) == {0x4894, 0x48A8}


def test_sizes_parse_and_format() -> None:
    assert common.parse_sizes("4K,64KiB,1M, 8M,100") == [4096, 65536, 1 << 20, 8 << 20, 100]
    assert [common.fmt_size(n) for n in (4096, 8 << 20, 100, 1536)] == [
        "4 KiB",
        "8 MiB",
        "100 B",
        "1.5 KiB",
    ]
    with pytest.raises(ValueError, match="not a size"):
        common.parse_size("lots")
    with pytest.raises(ValueError):
        common.parse_size("0")


def test_iterations_are_clamped() -> None:
    assert common.iterations_for(4096, 8 << 20, 5, 4096) == 2048
    assert common.iterations_for(8 << 20, 8 << 20, 5, 4096) == 5
    assert common.iterations_for(64, 8 << 20, 5, 4096) == 4096


def test_median_ratio_and_spread() -> None:
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    assert common.median([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert common.median([]) is None
    assert common.ratio(9.0, 10.0) == pytest.approx(0.9)
    assert common.ratio(None, 1.0) is None and common.ratio(1.0, 0.0) is None
    assert common.spread([2.0, 1.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert common.spread([])["n"] == 0


def test_markdown_table_aligns_and_escapes() -> None:
    text = common.markdown_table(["size", "ratio"], [["4 KiB", "0.93×"], ["a|b", "1×"]], "lr")
    assert text.splitlines() == [
        "| size | ratio |",
        "|:--|--:|",
        "| 4 KiB | 0.93× |",
        "| a\\|b | 1× |",
    ]
    with pytest.raises(ValueError):
        common.markdown_table(["a", "b"], [["only one"]])


def test_formatters() -> None:
    assert common.fmt_ratio(0.9349) == "0.93×"
    assert common.fmt_ratio(None) == "n/a"
    assert common.fmt_rate(15.6e6) == "15.6 MB/s"
    assert common.fmt_us(34.25) == "34.2 µs"
    assert common.fmt_us(323.3) == "323 µs"
    assert common.fmt_us(25_000.0) == "25.0 ms"


def test_transfer_summary_ratios_and_target() -> None:
    ms = []
    for rep, (p, h) in enumerate([(10.0, 8.5), (12.0, 9.0), (11.0, 9.5)]):
        ms.append(
            {
                "repeat": rep,
                "size": 65536,
                "kind": "write",
                "impl": "perftest",
                "iters": 100,
                "value": p,
            }
        )
        ms.append(
            {
                "repeat": rep,
                "size": 65536,
                "kind": "write",
                "impl": "hixl",
                "iters": 100,
                "value": h,
            }
        )
    ms.append(
        {"repeat": 0, "size": 4096, "kind": "write", "impl": "hixl", "iters": 5, "error": "boom"}
    )
    rows = bt.summarize(ms, [4096, 65536])
    assert "write" not in rows[0]
    w = rows[1]["write"]
    assert w["perftest"]["median"] == 11.0 and w["hixl"]["median"] == 9.0
    # the median of the paired (same-repeat) ratios 0.85, 0.75, 0.86; not 9.0 / 11.0
    assert w["ratio"] == pytest.approx(0.85)
    assert w["ratio_of_medians"] == pytest.approx(9.0 / 11.0)
    t = bt.check_targets(rows)["put_vs_ib_write_bw"]
    assert not t["met"] and t["misses"][0]["size"] == 65536


def test_channel_ping_pong_is_paired_with_its_own_ib_write_lat_and_reported() -> None:
    ms = [
        {"repeat": r, "size": 4096, "kind": k, "impl": i, "iters": 100, "value": v}
        for r in range(3)
        for k, i, v in (
            ("lat", "perftest", 200.0 + r),
            ("lat", "hixl", 500.0),
            ("chan", "perftest", 210.0),
            ("chan", "hixl", 300.0 + 10 * r),
        )
    ]
    rows = bt.summarize(ms, [4096])
    assert rows[0]["lat"]["ratio"] == pytest.approx(500.0 / 201.0)
    assert rows[0]["chan"]["ratio"] == pytest.approx(310.0 / 210.0)
    data = {
        "params": {"repeat": 3, "depth": 128},
        "summary": rows,
    }
    md = bt.markdown(data)
    assert "channel latency / ib_write_lat" in md and "1.48×" in md and "2.49×" in md
    assert bt.check_targets(rows)["put_vs_ib_write_bw"]["checked"] == 0


def test_transfer_steps_alternate_the_order() -> None:
    steps = bt.build_steps([4096, 65536], ["write", "lat"], 2)
    assert len(steps) == 2 * 2 * 2 * 2
    firsts = [steps[i][3] for i in range(0, len(steps), 2)]
    assert firsts[:4] == ["perftest", "hixl", "perftest", "hixl"]
    assert all(
        {steps[i][3], steps[i + 1][3]} == {"perftest", "hixl"} for i in range(0, len(steps), 2)
    )
    # Each point's first stream alternates over the repeats too, even when a repeat has
    # an even number of points (here four).
    first: dict[tuple[int, str], list[str]] = {}
    for i in range(0, len(steps), 2):
        _, size, kind, impl = steps[i]
        first.setdefault((size, kind), []).append(impl)
    assert all(
        order == ["perftest", "hixl"] or order == ["hixl", "perftest"] for order in first.values()
    )


def _diagnosis_row(alt_key: str) -> dict[str, object]:
    row: dict[str, object] = {
        "size": 4096,
        "iters": 100,
        "hixl": {
            "vs_ib_write_bw": 0.9,
            "in_call_s": 0.01,
            "caller_user_s": 0.002,
            "caller_sys_s": 0.003,
            "other_threads_cpu_s": 0.004,
        },
        "pyverbs_loop": {"vs_ib_write_bw": 0.5, "user_s": 0.01, "sys_s": 0.02},
    }
    row[alt_key] = {"vs_ib_write_bw": 1.25}
    return row


def test_the_diagnosis_names_the_switch_interval_it_ran() -> None:
    md = transfer_diagnose.diagnosis_markdown([_diagnosis_row("hixl_switch_5ms")])
    assert "same, GIL switch 5 ms" in md and "1.25×" in md
    # a run from before the fix repeated the engine's 0.5 ms: it says so, not "5 ms"
    old = transfer_diagnose.diagnosis_markdown([_diagnosis_row("hixl_switch_0.5ms")])
    assert "same again" in old and "5 ms" not in old and "1.25×" in old


def test_small_sizes_get_their_own_repeat_count() -> None:
    steps = bt.build_steps([4096, 16384, 65536], ["write", "lat"], 3, 9)
    count: dict[tuple[int, str], int] = {}
    for _, size, kind, _ in steps:
        count[(size, kind)] = count.get((size, kind), 0) + 1
    assert count == {
        (4096, "write"): 18,
        (4096, "lat"): 18,
        (16384, "write"): 18,
        (16384, "lat"): 18,
        (65536, "write"): 6,
        (65536, "lat"): 6,
    }
    # every repeat of every point is still one back-to-back pair
    assert all(
        steps[i][:3] == steps[i + 1][:3] and {steps[i][3], steps[i + 1][3]} == {"hixl", "perftest"}
        for i in range(0, len(steps), 2)
    )


def _fake_runs(outputs: list[tuple[str, str]]) -> perftest.Perftest:
    pt = perftest.Perftest("rxe0", 1)
    runs = iter(outputs)

    def once(tool: str, args: list[str]) -> perftest.PerftestRun:
        client, server = next(runs)
        return perftest.PerftestRun(tool, (tool,), (tool, "127.0.0.1"), client, server, 1.0)

    pt._run_once = once  # type: ignore[method-assign]
    return pt


def test_perftest_retries_when_the_clock_calibration_failed() -> None:
    bad = "Correlation coefficient r^2: 0.5 < 0.9\n" + WRITE_LAT
    pt = _fake_runs([(bad, bad), (WRITE_LAT, bad)])
    run = pt.run("ib_write_lat", [])
    assert run.side == "client" and perftest.parse_lat(run.output).t_typical_us == 323.29
    pt = _fake_runs([(bad, bad)] * 3)
    with pytest.raises(common.BenchError, match="calibration failed.*3 tries"):
        pt.run("ib_write_lat", [])


def test_ping_pong_falls_back_to_the_server_side() -> None:
    bad = "Correlation coefficient r^2: 0.5 < 0.9\n" + WRITE_LAT
    server = WRITE_LAT.replace("323.29", "300.00")
    pt = _fake_runs([(bad, server)])
    run = pt.run("ib_write_lat", [], symmetric=True)
    assert run.side == "server"
    assert perftest.parse_lat(run.output).t_typical_us == 300.0


def test_bw_wall_clock_check_rejects_an_impossible_figure() -> None:
    run = perftest.PerftestRun("ib_write_bw", (), (), WRITE_BW, "", 0.5)
    # 200 x 64 KiB in 0.5 s of wall time is 26 MB/s at least; perftest claims 15.4 MB/s.
    with pytest.raises(common.BenchError, match="clock is off"):
        perftest.bw_wall_check(65536, 200)(run)
    perftest.bw_wall_check(65536, 200)(
        perftest.PerftestRun("ib_write_bw", (), (), WRITE_BW, "", 2.0)
    )


def test_cpu_mhz_needs_one_rate() -> None:
    two = "processor\t: 0\ncpu MHz\t\t: 2596.140\nprocessor\t: 1\ncpu MHz\t\t: 2596.140\n"
    assert common.cpu_mhz(two) == pytest.approx(2596.14)
    assert common.cpu_mhz("cpu MHz : 1000.0\ncpu MHz : 2000.0\n") is None
    assert common.cpu_mhz("no rate here") is None


WRITE_LAT_CYCLES = """\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]\x20
 4096    100          242060.00        2245373.00      247286.00  \t       408874.26     \t-nan\
   \t\t2245373.00 \t\t2245373.00
---------------------------------------------------------------------------------------
"""


def test_parse_lat_in_cycles_with_an_undefined_stdev() -> None:
    r = perftest.parse_lat(WRITE_LAT_CYCLES)
    assert r.t_typical_us == 247286.0  # cycles: ib_write_lat -C keeps the usec header
    assert r.t_stdev_us != r.t_stdev_us  # nan


def test_parse_lat_refuses_an_infinite_median() -> None:
    text = WRITE_LAT_CYCLES.replace("247286.00", "inf")
    with pytest.raises(common.BenchError, match="t_typical is inf"):
        perftest.parse_lat(text)


def test_perftest_ports_come_from_its_own_range() -> None:
    # Two runners with different bases must not share ports (the base was once ignored).
    a = perftest.Perftest("rxe0", 1, port_base=30000)
    b = perftest.Perftest("rxe0", 1, port_base=40000)
    ports_a = [a.next_port() for _ in range(5)]
    ports_b = [b.next_port() for _ in range(5)]
    assert all(30000 <= p < 30000 + perftest.PORT_SPAN for p in ports_a)
    assert all(40000 <= p < 40000 + perftest.PORT_SPAN for p in ports_b)
    assert len(set(ports_a)) == 5  # each pair gets a fresh port
    with pytest.raises(ValueError, match="port_base must be in 1024..63536.*got 64000"):
        perftest.Perftest("rxe0", 1, port_base=64000)


def test_perftest_skips_a_port_in_use() -> None:
    import socket

    base = next(p for p in range(21000, 23000) if net.tcp_port_is_free(p))
    with socket.socket() as held:
        held.bind(("127.0.0.1", base))
        assert not net.tcp_port_is_free(base)
        assert perftest.Perftest("rxe0", 1, port_base=base).next_port() != base


def _child(script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def test_child_line_protocol_answers_and_refusals() -> None:
    """send_line/expect_line: an echoing child's answer comes back split; a wrong first
    word, too few words, a child that exits and one that stays silent are errors."""
    echo = "import sys\nfor line in sys.stdin:\n    print('ANS', line.strip(), flush=True)\n"
    proc = _child(echo)
    try:
        common.send_line(proc, "RUN 3 4")
        assert common.expect_line(proc, "ANS", 30, "echo") == ["ANS", "RUN", "3", "4"]
        common.send_line(proc, "x")
        with pytest.raises(common.BenchError, match="echo: wanted OTHER, got 'ANS x'"):
            common.expect_line(proc, "OTHER", 30, "echo")
        common.send_line(proc, "")
        with pytest.raises(common.BenchError, match="wanted ANS"):
            common.expect_line(proc, "ANS", 30, "echo", fields=2)  # "ANS" alone
    finally:
        proc.kill()
        proc.wait()
    gone = _child("pass")
    gone.wait()
    with pytest.raises(common.BenchError, match="got ''"):
        common.expect_line(gone, "READY", 30, "gone")
    silent = _child("import time\ntime.sleep(30)")
    try:
        with pytest.raises(common.BenchError, match="got ''"):
            common.expect_line(silent, "READY", 0.2, "silent")
    finally:
        silent.kill()
        silent.wait()


def test_ceiling_probe_refuses_a_tree_that_is_not_a_checkout(tmp_path: Path) -> None:
    # Arguments are checked before any device is opened, so this runs without one.
    ceiling = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ceiling.py"
    out = subprocess.run(
        [sys.executable, str(ceiling), "--against", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2
    assert "not a hixl checkout" in out.stderr


def test_the_report_copied_into_the_docs_names_no_commit() -> None:
    setup = {
        "date_utc": "2026-01-01T00:00:00+00:00",
        "commit": "0123456789ab",
        "where": "host",
        "kernel": "6.1",
        "cpus": 2,
        "cpu_model": "x",
        "python": "3.11",
        "numpy": "2",
        "perftest": "6",
    }
    data = {"build": {"setup": setup, "rows": []}}
    own = suite.render(data, {}, "python x", None, Path("/tmp/r"))
    docs = suite.render(data, {}, "python x", None, Path("/tmp/r"), commit=False)
    assert "0123456789ab" in own
    assert "0123456789ab" not in docs and "commit" not in docs
    assert "Measured 2026-01-01 00:00:00 UTC on host" in docs


def test_json_destination_is_checked_before_anything_is_measured(tmp_path: Path) -> None:
    from benchmarks.drivers import kv

    out = common.json_out(str(tmp_path / "new" / "kv.json"))
    assert out == tmp_path / "new" / "kv.json" and (tmp_path / "new").is_dir()
    assert common.json_out("-") == "-"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:  # argparse's usage error, before any run
        kv.main(["--json", str(blocker / "kv.json"), "--quick"])
    assert exc.value.code == 2
