"""The peers benchmark's pure parts: its cases, the counter check, the summary and report,
the worker's buffer and error replies, and a failed peer install reported, never raised."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.backends import peers as peer_env
from benchmarks.backends.worker import Buffer
from benchmarks.drivers import peers


def _covered(ranges: list[list[int]]) -> set[int]:
    return {b for off, n in ranges for b in range(off, off + n)}


def test_contiguous_stream_walks_the_span_and_checks_every_message() -> None:
    case = peers.contiguous_case(4096, 64 * 4096, 16 * 4096)
    assert case.messages == 64 and case.nbytes == 64 * 4096 and case.mode == "stream"
    assert [s[0] for s in case.segments[:17]] == [i * 4096 for i in range(16)] + [0]
    assert all(s[0] == s[1] for s in case.segments)
    assert case.src_ranges == case.dst_ranges == [[0, 16 * 4096]]
    # perftest refuses fewer than 5 iterations: a stream has at least 8 messages
    assert peers.contiguous_case(1 << 20, 2 << 20, 2 << 20).messages == 8


def test_a_stream_padded_to_eight_messages_writes_each_range_once() -> None:
    # 2 MiB of 1 MiB messages is padded to 8 messages: they must not wrap onto each other
    # (a batch of them is one block list, which may not write a range twice)
    case = peers.contiguous_case(1 << 20, 2 << 20, 2 << 20)
    dsts = [s[1] for s in case.segments]
    assert len(set(dsts)) == len(dsts) == 8
    assert case.dst_ranges == [[0, 8 << 20]] and peers.buffer_bytes([case]) == 8 << 20


def test_segment_layer_is_8192_separate_256_byte_pieces() -> None:
    case = peers.segments_case(8192, 256)
    assert case.messages == 8192 and case.nbytes == 8192 * 256 and case.mode == "request"
    starts = [s[0] for s in case.segments]
    assert all(b - a == 512 for a, b in zip(starts, starts[1:], strict=False))  # never adjacent
    assert len(_covered(case.dst_ranges)) == case.nbytes


def test_paged_gather_takes_distinct_pool_blocks_into_consecutive_target_blocks() -> None:
    case = peers.paged_case(blocks=16, block_tokens=16, heads=8, head_dim=128, seed=3)
    block = 16 * 8 * 128 * 2
    assert case.messages == 32 and all(s[2] == block for s in case.segments)
    srcs = [s[0] for s in case.segments]
    assert len(set(srcs)) == 32 and all(s % block == 0 for s in srcs)
    assert max(srcs) + block <= 2 * 4 * 16 * block  # K and V pools, 4x the request
    assert [s[1] for s in case.segments] == [j * block for j in range(32)]
    assert len(_covered(case.src_ranges)) == len(_covered(case.dst_ranges)) == case.nbytes
    assert peers.buffer_bytes([case]) == 2 * 4 * 16 * block


def test_counters_must_move_one_packet_per_mtu_of_payload() -> None:
    segs = [[0, 0, 4096], [0, 0, 1000], [0, 0, 1025]]
    assert peers.min_packets(segs, 1024) == 4 + 1 + 2
    assert peers.crossed((10, 20), (17, 27), 7) == {
        "checked": True,
        "ok": True,
        "sent": 7,
        "rcvd": 7,
    }
    assert peers.crossed((10, 20), (16, 40), 7)["ok"] is False
    assert peers.crossed(None, (1, 1), 1) == {"checked": False, "ok": None}


def _m(rep: int, impl: str, value: float, **kw: Any) -> dict[str, Any]:
    m = {
        "repeat": rep,
        "case": "segments",
        "impl": impl,
        "value": value,
        "cpu_initiator_s": 0.5,
        "cpu_target_s": 0.1,
        "bytes_ok": None if impl == "perftest" else True,
        "rxe": {"checked": True, "ok": True},
    }
    m.update(kw)
    return m


def _data(measurements: list[dict[str, Any]]) -> dict[str, Any]:
    case = peers.segments_case(8, 256)
    return {
        "setup": {"date_utc": "2026-11-30T00:00:00+00:00", "device": "rxe0", "where": "VM/TCG"},
        "params": {"repeat": 3, "depth": 128},
        "contenders": [
            {"name": "hixl", "version": "0.1.0", "ran": True, "env": {}, "where": "project venv"},
            {
                "name": "mooncake",
                "version": "0.3.13.post1",
                "ran": True,
                "env": {"MC_LOG_LEVEL": "WARNING"},
                "where": ".venv-peers",
            },
            {
                "name": "nixl",
                "version": None,
                "ran": False,
                "error": "install failed: pip said no",
                "env": {},
                "where": ".venv-peers",
            },
        ],
        "summary": peers.summarize(measurements, [case], ["perftest", "hixl", "mooncake"]),
        "latency": [{"size": 4096, "us": {"hixl": 100.0, "mooncake": 300.0}}],
    }


def test_summary_pairs_each_repeat_and_the_report_names_failures() -> None:
    ms = []
    for rep, (p, h, mc) in enumerate([(10.0, 5.0, 20.0), (20.0, 8.0, 10.0), (10.0, 2.0, 9.0)]):
        ms += [_m(rep, "perftest", p), _m(rep, "hixl", h), _m(rep, "mooncake", mc)]
    ms.append({"repeat": 3, "case": "segments", "impl": "mooncake", "error": "batch failed"})
    data = _data(ms)
    s = data["summary"][0]["impls"]
    assert s["hixl"]["vs_perftest"] == pytest.approx(0.4)  # median of 0.5, 0.4, 0.2
    assert s["mooncake"]["vs_perftest"] == pytest.approx(0.9)  # median of 2.0, 0.5, 0.9
    assert s["mooncake"]["vs_hixl"] == pytest.approx(4.0)  # median of 4.0, 1.25, 4.5
    assert s["mooncake"]["errors"] == ["batch failed"] and s["mooncake"]["runs"] == 3
    assert s["perftest"]["bytes_ok"] is None and s["hixl"]["bytes_ok"] is True
    md = peers.markdown(data)
    assert "| 8 x 256 B segments, 1 request | Mooncake TE | 0.90× | 4.00× |" in md
    assert "NOT run: install failed: pip said no" in md
    assert "| 4 KiB | 100 µs | 300 µs | 3.00× |" in md


def test_the_report_places_both_hixl_contenders_in_the_project_venv() -> None:
    data = _data([])
    data["contenders"].insert(
        1, {"name": "hixl-batches", "version": "0.1.0", "ran": True, "env": {}, "where": "?"}
    )
    md = peers.markdown(data)
    assert "| hixl (batches) | 0.1.0 | project venv |" in md
    assert "| Mooncake TE | 0.3.13.post1 | .venv-peers |" in md


def test_a_byte_mismatch_shows_in_the_report() -> None:
    ms = [_m(0, "perftest", 10.0), _m(0, "hixl", 5.0, bytes_ok=False), _m(0, "mooncake", 5.0)]
    md = peers.markdown(_data(ms))
    assert "✗ DIFFER" in md


def test_worker_buffer_digests_its_bytes_and_refuses_ranges_outside() -> None:
    a, b = Buffer(8192), Buffer(8192)
    a.fill(1)
    b.fill(1)
    assert a.digest([[0, 8192]]) == b.digest([[0, 8192]])
    b.view[4096] ^= 1
    assert a.digest([[0, 4096]]) == b.digest([[0, 4096]])
    assert a.digest([[0, 8192]]) != b.digest([[0, 8192]])
    with pytest.raises(ValueError, match="offset=8000 nbytes=200 buffer=8192"):
        a.digest([[8000, 200]])


def test_worker_answers_a_failure_with_its_error_and_keeps_serving() -> None:
    worker = Path(peers.WORKER)
    cmds = [
        {"op": "fill", "seed": 1},  # before init
        {"op": "init", "role": "target", "nbytes": 4096, "device": "no-such-device"},
        {"op": "bogus"},
        {"op": "quit"},
    ]
    out = subprocess.run(
        [sys.executable, str(worker), "hixl"],
        input="".join(json.dumps(c) + "\n" for c in cmds),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(replies) == 3 and not any(r["ok"] for r in replies)
    assert "'fill' before init" in replies[0]["error"]
    assert "no-such-device" in replies[1]["error"] or "RDMA" in replies[1]["error"]
    assert "unknown op 'bogus'" in replies[2]["error"]


def test_a_peer_that_cannot_be_installed_is_reported_not_raised(tmp_path: Path) -> None:
    statuses = peer_env.install_all(["no-such-peer"], tmp_path / "install.json", tmp_path)
    assert not statuses[0].ok and "unknown peer" in (statuses[0].error or "")
    assert peer_env.load_statuses(tmp_path / "install.json")[0].name == "no-such-peer"
    # A venv without the peer: the probe says why it cannot import it.
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").symlink_to(peer_env.SYSTEM_PYTHON)
    st = peer_env.probe(peer_env.PEERS["mooncake"], tmp_path / "v")
    assert not st.ok and "mooncake" in (st.error or "")
    bad = peer_env.ensure_venv(Path("/proc/no-such-dir/venv"))
    assert bad is not None and "venv" in bad


def test_nixl_runs_as_installed_and_tuned_with_its_environment_filled_in(tmp_path: Path) -> None:
    spec = peer_env.PEERS["nixl"]
    assert spec.opt_in and "torch" not in spec.packages
    runs = spec.contenders()
    assert list(runs) == ["nixl", "nixl-tuned"]
    assert "UCX_ZCOPY_THRESH" not in runs["nixl"] and runs["nixl-tuned"]["UCX_ZCOPY_THRESH"] == "0"
    env = peer_env.render_env(runs["nixl"], "rxe0", 1, tmp_path)
    assert env["UCX_NET_DEVICES"] == "rxe0:1"
    assert env["UCX_TLS"] == "rc_verbs,ud_verbs"
    assert env["LD_LIBRARY_PATH"] == str(tmp_path / "verbs-shim")


def test_the_verbs_shim_points_the_bundled_library_at_the_system_one(tmp_path: Path) -> None:
    assert peer_env.make_verbs_shim(tmp_path) is not None  # nothing bundled: says so
    libs = tmp_path / "lib" / "python3.11" / "site-packages" / "nixl_cu12.libs"
    libs.mkdir(parents=True)
    (libs / "libibverbs-1de1263b.so.1.14.48.0").write_bytes(b"")
    if not peer_env.SYSTEM_VERBS.exists():
        assert "missing" in (peer_env.make_verbs_shim(tmp_path) or "")
        return
    assert peer_env.make_verbs_shim(tmp_path) is None
    link = peer_env.shim_dir(tmp_path) / "libibverbs-1de1263b.so.1.14.48.0"
    assert link.is_symlink() and link.resolve() == peer_env.SYSTEM_VERBS.resolve()
    assert peer_env.make_verbs_shim(tmp_path) is None  # again: replaces the link
