"""Benchmark: vectorized transfer planning against a plain per-segment Python planner.

Workload (defaults): the K cache of 32 layers x 64 heads x 128 blocks of 16 tokens
(head_dim 128, fp16: 4 KiB per head-block), i.e. 262,144 segments. The local side is a
paged prefill cache (``[layers][pool_blocks][heads][block_tokens][head_dim]``, the
request's blocks are random ids of a pool ``--pool-factor`` times larger); the remote side
is a contiguous decode cache (``[layers][K|V][heads][tokens][head_dim]``). Both planners
get the same ``Segments`` and must return the same ``Plan``; the result is the ratio of
their median times, measured in the same run.

    python benchmarks/bench_plan.py                 # defaults, prints "ratio: ..."
    python benchmarks/bench_plan.py --repeat 7 --json results/plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from hixl.core.descriptors import Segments
from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
from hixl.errors import DescriptorError

from ..common import json_out

RATIO_TARGET = 20.0
RATE_TARGET = 1_000_000.0


# --------------------------------------------------------------------------- baseline


def reference_plan(local: Segments, remote: Segments, op: Op, limits: DeviceLimits) -> Plan:
    """The same plan as :func:`hixl.core.plan.plan_transfer`, one Python step per segment.

    Kept deliberately plain: it is both the speed baseline and an independent oracle for
    the tests (which load this file).
    """
    if local.nbytes != remote.nbytes:
        raise DescriptorError(f"totals differ: {local.nbytes} != {remote.nbytes}")
    sge_max = limits.max_sge_rd if op is Op.READ else limits.max_sge
    msg_max = limits.max_msg_sz

    def merge(pairs: list[tuple[int, int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for off, n in pairs:
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] += n
            else:
                out.append([off, n])
        return out

    loc = merge(local.pairs())
    rem = merge(remote.pairs())

    if op is Op.READ:
        reach = -1
        for off, n in sorted(loc):
            if off < reach:
                raise DescriptorError("local (the READ destination) overlaps itself")
            reach = max(reach, off + n)

    # Cut the stream where either side's segment ends.
    pieces: list[tuple[int, int, int]] = []
    i = j = used_l = used_r = 0
    while i < len(loc):
        n = min(loc[i][1] - used_l, rem[j][1] - used_r)
        pieces.append((loc[i][0] + used_l, rem[j][0] + used_r, n))
        used_l += n
        used_r += n
        if used_l == loc[i][1]:
            i, used_l = i + 1, 0
        if used_r == rem[j][1]:
            j, used_r = j + 1, 0

    by_remote = sorted(pieces, key=lambda p: p[1])
    reach, overlaps = -1, False
    for _, r, n in by_remote:
        overlaps = overlaps or r < reach
        reach = max(reach, r + n)
    if overlaps and op is Op.WRITE:
        raise DescriptorError("remote (the WRITE destination) overlaps itself")
    if not overlaps:  # a READ source that repeats bytes keeps stream order
        pieces = by_remote

    # Remote runs, each a list of fused local pieces [offset, length].
    runs: list[tuple[int, list[list[int]]]] = []
    run_end = -1
    for lo, r, n in pieces:
        if runs and r == run_end:
            last = runs[-1][1][-1]
            if last[0] + last[1] == lo:
                last[1] += n
            else:
                runs[-1][1].append([lo, n])
        else:
            runs.append((r, [[lo, n]]))
        run_end = r + n

    wr_remote: list[int] = []
    wr_length: list[int] = []
    indptr = [0]
    sge_local: list[int] = []
    sge_length: list[int] = []
    for r0, run in runs:
        k = used = pos = 0
        while k < len(run):
            wr_remote.append(r0 + pos)
            budget = msg_max
            n_sge = 0
            while k < len(run) and n_sge < sge_max and budget > 0:
                take = min(run[k][1] - used, budget)
                sge_local.append(run[k][0] + used)
                sge_length.append(take)
                n_sge += 1
                used += take
                budget -= take
                pos += take
                if used == run[k][1]:
                    k, used = k + 1, 0
            wr_length.append(msg_max - budget)
            indptr.append(len(sge_local))
    return Plan(
        op=op,
        limits=limits,
        wr_remote_offset=np.array(wr_remote, dtype=np.int64),
        wr_length=np.array(wr_length, dtype=np.int64),
        wr_sge_start=np.array(indptr, dtype=np.int64),
        sge_local_offset=np.array(sge_local, dtype=np.int64),
        sge_length=np.array(sge_length, dtype=np.int64),
    )


# --------------------------------------------------------------------------- workload


def workload(args: argparse.Namespace) -> tuple[Segments, Segments]:
    """Local (paged, random block ids) and remote (contiguous) K-cache segments."""
    rng = np.random.default_rng(args.seed)
    head_block = args.block_tokens * args.head_dim * args.itemsize
    pool = args.blocks * args.pool_factor
    ids = rng.choice(pool, size=args.blocks, replace=False).astype(np.int64)

    l_block = args.heads * head_block
    l_layer = pool * l_block
    layer = np.arange(args.layers, dtype=np.int64)[:, None, None]
    head = np.arange(args.heads, dtype=np.int64)[None, :, None]
    local = layer * l_layer + ids[None, None, :] * l_block + head * head_block

    r_head = args.blocks * head_block
    r_layer = 2 * args.heads * r_head  # K and V planes; only K moves
    blk = np.arange(args.blocks, dtype=np.int64)[None, None, :]
    remote = layer * r_layer + head * r_head + blk * head_block

    n = local.size
    lengths = np.full(n, head_block, dtype=np.int64)
    return Segments(local.ravel(), lengths), Segments(remote.ravel(), lengths)


def timed(fn: Callable[[], Plan], repeat: int, warmup: int) -> tuple[list[float], Plan]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeat`` times timed (seconds)."""
    result: Plan | None = None
    for _ in range(warmup):
        result = fn()
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    assert result is not None
    return times, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--blocks", type=int, default=128, help="blocks per request")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--itemsize", type=int, default=2, help="bytes per value (2 = fp16)")
    p.add_argument("--pool-factor", type=int, default=4, help="local pool size / blocks")
    p.add_argument("--op", choices=[o.value for o in Op], default="write")
    p.add_argument("--max-sge", type=int, default=32)
    p.add_argument("--max-sge-rd", type=int, default=32)
    p.add_argument("--max-msg-sz", type=int, default=8 << 20)
    p.add_argument("--repeat", type=int, default=5, help="timed runs per planner")
    p.add_argument("--baseline-repeat", type=int, default=3, help="timed runs, baseline")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=json_out, default=None, help="write results to this file")
    p.add_argument(
        "--check", action="store_true", help="exit 1 unless ratio >= 20 and rate >= 1M seg/s"
    )
    args = p.parse_args(argv)

    op = Op(args.op)
    limits = DeviceLimits(
        max_sge=args.max_sge, max_sge_rd=args.max_sge_rd, max_msg_sz=args.max_msg_sz
    )
    # READ uses the same mapping: the local pages are filled from the remote cache.
    local, remote = workload(args)
    n = local.count

    print("# hixl planner benchmark")
    print(
        f"# python {platform.python_version()} numpy {np.__version__} "
        f"{platform.machine()} cpus={os.cpu_count()} {platform.platform()}"
    )
    print(
        f"# workload: {args.layers} layers x {args.heads} heads x {args.blocks} blocks "
        f"of {args.block_tokens} tokens, head_dim={args.head_dim}, itemsize={args.itemsize}"
        f" -> {n} segments per side, {local.nbytes} bytes"
    )
    print(f"# op={op.value} limits={limits}")
    print(
        f"# repeat={args.repeat} (baseline {args.baseline_repeat}) warmup={args.warmup}; "
        f"times are medians"
    )

    vec_times, vec_plan = timed(
        lambda: plan_transfer(local, remote, op, limits), args.repeat, args.warmup
    )
    ref_times, ref_plan = timed(
        lambda: reference_plan(local, remote, op, limits), args.baseline_repeat, args.warmup
    )
    same = vec_plan == ref_plan
    vec_med = statistics.median(vec_times)
    ref_med = statistics.median(ref_times)
    ratio = ref_med / vec_med
    vec_rate = n / vec_med
    ref_rate = n / ref_med

    print(f"plan: {vec_plan.num_wrs} WRs, {vec_plan.num_sges} SGEs; same plan as baseline: {same}")
    print(f"vectorized   median {vec_med * 1e3:9.2f} ms  {vec_rate / 1e6:8.2f} M segments/s")
    print(f"per-segment  median {ref_med * 1e3:9.2f} ms  {ref_rate / 1e6:8.2f} M segments/s")
    print(f"ratio: {ratio:.1f}x vs the per-segment planner (target >= {RATIO_TARGET:.0f}x)")
    ok = same and ratio >= RATIO_TARGET and vec_rate >= RATE_TARGET

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "plan",
                    "segments": n,
                    "nbytes": local.nbytes,
                    "op": op.value,
                    "limits": {
                        "max_sge": limits.max_sge,
                        "max_sge_rd": limits.max_sge_rd,
                        "max_msg_sz": limits.max_msg_sz,
                    },
                    "num_wrs": vec_plan.num_wrs,
                    "num_sges": vec_plan.num_sges,
                    "same_plan": same,
                    "vectorized_s": vec_times,
                    "baseline_s": ref_times,
                    "ratio": ratio,
                    "segments_per_s": vec_rate,
                    "baseline_segments_per_s": ref_rate,
                    "targets_met": ok,
                    "argv": vars(args) | {"json": str(args.json)},
                },
                indent=2,
            )
            + "\n"
        )
    if not same:
        print("ERROR: the two planners disagree", file=sys.stderr)
        return 1
    if args.check and not ok:
        print("targets not met", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
