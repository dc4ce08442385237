"""The wire part of ``bench_kv --device``: put_blocks vs ib_write_bw, alternating pairs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..common import BenchError, fmt_ratio, gather_setup, median, median_of, quiet_logs

TOKENS, HEADS, HEAD_DIM = 16, 8, 128
DEPTH = 128  # WRs in flight of the C configurations (perftest -t, and -l for the post list)
LANES = 2  # the engine's queue pairs per connection (Engine(lanes=2), the default)
C_REPS = 3  # requests per round of hixl and of each one-clock C configuration (median)


def one_process_lanes(size: int, wrs: int, lanes: int) -> Any:
    """``ib_write_bw -q lanes``: one process moving the same bytes in the same WRs over
    ``lanes`` queue pairs (``-n`` counts per queue pair), timed by one clock from the
    first post to the last completion -- the engine's own shape (one process, a chain
    spread over its lanes), where the summed pairs of separate processes each time only
    their own share."""
    from ..common.yardstick import CConfig

    per = max(1, wrs // lanes)
    depth = min(DEPTH, per)
    args = ("-s", str(size), "-n", str(per), "-t", str(depth), "-q", str(lanes))
    return CConfig(name=f"ib_write_bw -q {lanes} -t {depth}", tool="ib_write_bw", args=args)


def device_section(
    layers: int, blocks: int, repeat: int, names: Sequence[str] = ("full", "tp4")
) -> list[dict[str, Any]]:
    """Both forms (all heads; a quarter of them into a 2-head cache) moved by
    ``put_blocks`` with a new scattered block list per request, alternating round by
    round with C moving the same bytes in the same number of work requests:

    * the yardstick, ``benchmarks/c/kv_wr.c`` (:mod:`.kv_c`): one process, one clock, on
      as many queue pairs as the engine has lanes, one SGE per work request and the
      request's own SGE shape, one posting thread and one per queue pair, a spinning and
      a sleeping wait; the best of them;
    * beside it, ``ib_write_bw`` in every configuration of
      :func:`~benchmarks.common.yardstick.bw_configs` (plain, a post list, one process
      pair per lane, their averages added up) and :func:`one_process_lanes`, with work
      requests of one SGE of the same size.

    Each round takes the median of 3 requests of hixl and of each ``kv_wr`` configuration.
    The ratios against the best of each, paired by round; ``names`` picks the forms and
    their order.  Each round also times the engine's own path (checks, plan, chain) for
    a request of the same shape."""
    from hixl.engine import Engine
    from hixl.testbed.net import free_tcp_port

    from ..backends.perftest import Perftest, bw_wall_check, sum_bw
    from ..common.yardstick import CConfig, bw_configs
    from . import kv_c
    from .kv_request import form as kvform
    from .kv_request import one_request, planner

    quiet_logs()
    setup = gather_setup(need_device=True)
    perftest = Perftest(setup["device"], setup["gid_index"])
    kv_wr = kv_c.build()
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
            ("full", "full", None, full, TOKENS * HEADS * HEAD_DIM * 2, 1),
            ("tp4", "quarter", (2, 4), quarter, TOKENS * 2 * HEAD_DIM * 2, TOKENS),
        ]
        for name, remote, heads, dst, wr_bytes, sges in sorted(
            (f for f in forms if f[0] in names), key=lambda f: list(names).index(f[0])
        ):
            wrs = layers * 2 * blocks
            nbytes = wrs * wr_bytes
            # the request's own WR shape: a block's rows of the head range, one SGE each
            # (a whole block: one SGE), the rows HEADS * HEAD_DIM * 2 B apart on the source
            row_stride = HEADS * HEAD_DIM * 2 if sges > 1 else wr_bytes
            wr_shape = kv_c.KVShape(wrs, sges, wr_bytes // sges, row_stride, LANES)
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

            put()  # the first request's geometry read
            configs = bw_configs("ib_write_bw", wr_bytes, wrs, min(DEPTH, wrs), LANES)
            configs.append(one_process_lanes(wr_bytes, wrs, LANES))
            hixl_bps: list[float | None] = []
            builds: list[float] = []
            c_rounds: list[dict[str, float]] = []
            f = kvform(name, layers, num_blocks)
            plan = planner()
            for i in range(repeat):
                items: list[CConfig | str | None] = [None, "kv_wr", *configs]
                if i % 2:
                    items.reverse()
                rnd: dict[str, float] = {}
                for cfg in items:
                    if cfg is None:  # as many requests as each C configuration makes
                        hixl_bps.append(nbytes / median_of([put() for _ in range(C_REPS)]))
                        # the engine's own path alone (checks, plan, chain), same shape
                        builds.append(one_request(f, rng, blocks, num_blocks, plan)[0] / 1e6)
                        continue
                    if isinstance(cfg, str):
                        rnd.update(
                            kv_c.run(kv_wr, wr_shape, setup["device"], setup["gid_index"], C_REPS)
                        )
                        continue
                    pr = perftest.run_pairs(
                        cfg.tool, cfg.args, cfg.pairs, check=bw_wall_check(wr_bytes, wrs)
                    )
                    rnd[cfg.name] = sum_bw([r.output for r in pr.runs])
                c_rounds.append(rnd)
            lids, rids = last
            hs = slice(None) if heads is None else slice(*heads)
            for s, d in zip(src, dst, strict=True):
                if d[:, rids].tobytes() != np.ascontiguousarray(s[:, lids, :, hs]).tobytes():
                    raise BenchError(f"{name}: destination blocks differ from the source")
            best, perf = kv_c.yardsticks(hixl_bps, c_rounds)
            h = median([x for x in hixl_bps if x is not None]) or 0.0
            row = {
                "form": name,
                "layers": layers,
                "blocks": blocks,
                "wrs": wrs,
                "wr_bytes": wr_bytes,
                "nbytes": nbytes,
                "hixl_Bps": h,
                "c_medians_Bps": dict(best.medians),
                "yardstick": best.winner,
                "ratio": best.ratio,
                "rounds": best.rounds,
                "perftest_yardstick": perf.winner if perf else None,
                "perftest_ratio": perf.ratio if perf else None,
                "perftest_medians_Bps": dict(perf.medians) if perf else {},
                "build_s": median_of(builds),
            }
            out.append(row)
            others = ", ".join(
                f"{k}: {v / 1e6:.1f} MB/s"
                for k, v in [*best.medians.items(), *(perf.medians.items() if perf else ())]
            )
            print(
                f"{name}: put_blocks of {layers} layers x (K,V) x {blocks} scattered blocks = "
                f"{nbytes} B in {wrs} WRs of {wr_bytes} B: {h / 1e6:.1f} MB/s "
                f"({nbytes / h * 1e3 if h else 0:.1f} ms per request, of which the engine's "
                f"own path (checks, plan, chain) {median_of(builds) * 1e3:.1f} ms); C ({others}); "
                f"against the best one-clock C ({best.winner}, same bytes and WR count): "
                f"{fmt_ratio(best.ratio)}; against the best perftest configuration "
                f"({perf.winner if perf else '-'}): "
                f"{fmt_ratio(perf.ratio) if perf else '-'} (medians of {best.rounds} paired "
                "rounds)",
                flush=True,
            )
    finally:
        client.close()
        server.close()
    return out
