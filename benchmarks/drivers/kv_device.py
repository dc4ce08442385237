"""The wire part of ``bench_kv --device``: put_blocks vs ib_write_bw, alternating pairs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..common import BenchError, fmt_ratio, gather_setup, median, quiet_logs, ratio

TOKENS, HEADS, HEAD_DIM = 16, 8, 128
POST_LIST = 16


def device_section(layers: int, blocks: int, repeat: int) -> list[dict[str, Any]]:
    """Both forms (all heads; a quarter of them into a 2-head cache) moved by
    ``put_blocks`` with a new scattered block list per request, alternating with
    ``ib_write_bw`` moving the same bytes in as many WRs of the same size, plain and with
    a post list of :data:`POST_LIST`; ratios of the medians."""
    from hixl.engine import Engine
    from hixl.testbed.net import free_tcp_port

    from ..backends.perftest import Perftest, bw_wall_check, parse_bw

    quiet_logs()
    setup = gather_setup(need_device=True)
    perftest = Perftest(setup["device"], setup["gid_index"])
    num_blocks = 4 * blocks
    out: list[dict[str, Any]] = []
    server = Engine(f"127.0.0.1:{free_tcp_port()}")
    client = Engine("127.0.0.1:0")
    try:
        shape = (2, num_blocks, TOKENS, HEADS, HEAD_DIM)
        rng = np.random.default_rng(7)
        src = [
            rng.integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16).view(np.float16)
            for _ in range(layers)
        ]
        src = [s.reshape(shape) for s in src]
        full = [np.zeros(shape, np.float16) for _ in range(layers)]
        quarter = [
            np.zeros((2, num_blocks, TOKENS, 2, HEAD_DIM), np.float16) for _ in range(layers)
        ]
        kv = client.register_kv("src", src, block_axis=1, heads_axis=3)
        server.register_kv("full", full, block_axis=1, heads_axis=3)
        server.register_kv("quarter", quarter, block_axis=1, heads_axis=3)
        client.connect(server.id, timeout=30.0)
        forms = [
            ("full", "full", None, full, TOKENS * HEADS * HEAD_DIM * 2),
            ("tp4", "quarter", (2, 4), quarter, TOKENS * 2 * HEAD_DIM * 2),
        ]
        for name, remote, heads, dst, wr_bytes in forms:
            wrs = layers * 2 * blocks
            nbytes = wrs * wr_bytes
            last: tuple[Any, Any] = (None, None)

            def put(remote: str = remote, heads: tuple[int, int] | None = heads) -> float:
                nonlocal last
                lids = rng.choice(num_blocks, blocks, replace=False)
                rids = rng.choice(num_blocks, blocks, replace=False)
                t0 = time.perf_counter()
                client.put_blocks(server.id, kv, remote, lids, rids, heads=heads, timeout=300)
                dt = time.perf_counter() - t0
                last = (lids, rids)
                return dt

            put()  # the first request's plan and chain
            hixl_bps: list[float] = []
            plain_bps: list[float] = []
            listed_bps: list[float] = []
            for i in range(repeat):
                order = (0, 1, 2) if i % 2 == 0 else (2, 1, 0)
                for turn in order:
                    if turn == 1:
                        hixl_bps.append(nbytes / put())
                        continue
                    args = ["-s", str(wr_bytes), "-n", str(wrs), "-t", "128"]
                    if turn == 2:
                        args += ["-l", str(POST_LIST)]
                    run = perftest.run("ib_write_bw", args, check=bw_wall_check(wr_bytes, wrs))
                    (plain_bps if turn == 0 else listed_bps).append(parse_bw(run.output).avg_Bps)
            lids, rids = last
            hs = slice(None) if heads is None else slice(*heads)
            for s, d in zip(src, dst, strict=True):
                if d[:, rids].tobytes() != np.ascontiguousarray(s[:, lids, :, hs]).tobytes():
                    raise BenchError(f"{name}: destination blocks differ from the source")
            h = median(hixl_bps) or 0.0
            pl = median(plain_bps) or 0.0
            ls = median(listed_bps) or 0.0
            best = max(pl, ls)
            row = {
                "form": name,
                "layers": layers,
                "blocks": blocks,
                "wrs": wrs,
                "wr_bytes": wr_bytes,
                "nbytes": nbytes,
                "hixl_Bps": h,
                "ib_write_bw_Bps": pl,
                "ib_write_bw_post_list_Bps": ls,
                "ratio_best": ratio(h, best),
                "ratio_plain": ratio(h, pl),
                "ratio_post_list": ratio(h, ls),
                "pairs": repeat,
            }
            out.append(row)
            print(
                f"{name}: put_blocks {layers} layers x (K,V) x {blocks} scattered blocks = "
                f"{nbytes} B in {wrs} WRs of {wr_bytes} B: {h / 1e6:.1f} MB/s; ib_write_bw -s "
                f"{wr_bytes} -n {wrs}: {pl / 1e6:.1f} MB/s (ratio {fmt_ratio(ratio(h, pl))}), "
                f"with -l {POST_LIST}: {ls / 1e6:.1f} MB/s (ratio {fmt_ratio(ratio(h, ls))}); "
                f"vs the best: {fmt_ratio(ratio(h, best))} ({repeat} alternating triples)"
            )
    finally:
        client.close()
        server.close()
    return out
