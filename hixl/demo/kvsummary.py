"""The KV-cache demo's summary: interval arithmetic over both roles' timelines (how
much of the transfer time the compute hid), the combined result and its text form.
Pure: no engine, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from hixl.core.plan import DeviceLimits
from hixl.demo.kvmodel import (
    DemoConfig,
    paged_layout,
    per_head_put_wrs,
    source_layout,
    strided_put_wrs,
)

Interval = tuple[float, float]


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``[start, end]`` intervals (empty ones dropped)."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Sequence[Interval]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


def overlap(xs: Sequence[Interval], ys: Sequence[Interval]) -> float:
    """Length of ``union(xs) ∩ union(ys)``."""
    total = 0.0
    uy = union(ys)
    for a, b in union(xs):
        for c, d in uy:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def summarize(cfg: DemoConfig, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """Combine both roles' results into the summary (all times in ms, sizes in bytes).

    Transfer ``i`` runs from the moment layer ``i``'s K/V are in the registered region
    until its put's completion is seen (data and notification acknowledged): hashing,
    planning, posting and the wire; MB/s counts from the start of posting. *Overlapped*
    is the part of the union of transfers that falls inside the union of compute
    intervals (layer math and writing K/V into the source region); *exposed* is the rest.
    """
    lim = prefill["limits"]
    limits = DeviceLimits(lim["max_sge"], lim["max_sge_rd"], lim["max_msg_sz"])
    ids = np.asarray(decode["block_ids"], dtype=np.int64)
    src = source_layout(cfg)
    dst = paged_layout(cfg, decode["pool_blocks"], decode["block_size"])
    ours = strided_put_wrs(src, dst, ids, limits)
    base = per_head_put_wrs(src, dst, ids, limits)

    pl, dl = prefill["layers"], decode["layers"]
    t0 = pl[0]["compute"][0]
    computes = [tuple(r["compute"]) for r in pl]
    transfers = [tuple(r["transfer"]) for r in pl]
    rows = []
    for r, d in zip(pl, dl, strict=True):
        x = tuple(r["transfer"])
        dur = x[1] - x[0]
        wire = x[1] - r["post"][0]
        rows.append(
            {
                "layer": r["layer"],
                "compute_ms": 1e3 * (r["compute"][1] - r["compute"][0]),
                "transfer_ms": 1e3 * dur,
                "post_ms": 1e3 * (r["post"][1] - r["post"][0]),
                "hidden_fraction": overlap([x], computes) / dur if dur > 0 else 1.0,
                "bytes": r["nbytes"],
                "wrs": r["num_wrs"],
                "mb_per_s": r["nbytes"] / wire / 1e6 if wire > 0 else 0.0,
                "arrived_ms": 1e3 * (d["arrived"] - t0),
                "bit_exact": bool(d["bit_exact"]),
            }
        )
    busy = length(transfers)
    hidden = overlap(transfers, computes)
    posted = sum(r["num_wrs"] for r in pl)
    exact = sum(1 for d in dl if d["bit_exact"])
    tokens_equal = decode["tokens_received"] == decode["tokens_local"]
    ok = exact == cfg.layers and tokens_equal and posted == ours.wrs
    return {
        "ok": ok,
        "config": asdict(cfg),
        "device": prefill["device"],
        "limits": lim,
        "layout": {
            "source_row_bytes": src.stride_token,
            "data_row_bytes": src.vector_bytes,
            "block_size": decode["block_size"],
            "pool_blocks": decode["pool_blocks"],
            "block_ids": decode["block_ids"],
        },
        "bytes_moved": sum(r["nbytes"] for r in pl),
        "puts": len(pl),
        "wrs_posted": posted,
        "wrs_planned": ours.wrs,
        "per_head": {"puts": base.puts, "wrs": base.wrs},
        "wrs_avoided": base.wrs - posted,
        "layers": rows,
        "compute_ms": 1e3 * length(computes),
        "transfer_busy_ms": 1e3 * busy,
        "overlapped_ms": 1e3 * hidden,
        "exposed_ms": 1e3 * (busy - hidden),
        "overlap_fraction": hidden / busy if busy > 0 else 1.0,
        "prefill_to_last_landed_ms": 1e3 * (transfers[-1][1] - t0),
        "tail_after_compute_ms": 1e3 * max(0.0, transfers[-1][1] - computes[-1][1]),
        "layers_bit_exact": exact,
        "received_equals_recompute": bool(decode["received_equals_recompute"]),
        "first_token": {"prefill": prefill["first_token"], "decode": decode["first_token"]},
        "tokens_received": decode["tokens_received"],
        "tokens_local": decode["tokens_local"],
        "tokens_equal": tokens_equal,
        "timings_s": {
            "prefill_model_build": prefill["build_s"],
            "decode_model_build": decode["build_s"],
            "decode_recompute": decode["recompute_s"],
            "decode_generate": decode["generate_s"],
        },
    }


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable summary of :func:`summarize`'s result."""
    cfg, lay, per_head = s["config"], s["layout"], s["per_head"]
    busy_s = s["transfer_busy_ms"] / 1e3
    pad = lay["source_row_bytes"] - lay["data_row_bytes"]
    avoided_pct = 100.0 * s["wrs_avoided"] / per_head["wrs"] if per_head["wrs"] else 0.0
    yes = {True: "yes", False: "NO"}
    lines = [
        f"hixl demo: {'VERIFIED' if s['ok'] else 'FAILED'}",
        f"  model         {cfg['layers']} layers, {cfg['heads']} heads x head_dim "
        f"{cfg['head_dim']}, fp16 KV; d_model {cfg['d_model']}, ffn {cfg['ffn']}, "
        f"seed {cfg['seed']}",
        f"  request       {cfg['tokens']} prompt tokens, then {cfg['gen_tokens']} generated",
        f"  device        {s['device']}",
        f"  prefill KV    [layer][K|V][head][token] rows of {lay['data_row_bytes']} B padded "
        f"by {pad} B to {lay['source_row_bytes']} B",
        f"  decode KV     paged: {len(lay['block_ids'])} blocks of {lay['block_size']} "
        f"tokens x heads x head_dim, ids {lay['block_ids']} of a pool of "
        f"{lay['pool_blocks']}",
        "",
        "  layer  compute  transfer  (posting)  hidden  WRs      bytes   MB/s  decode saw it"
        "  bit-exact",
    ]
    for r in s["layers"]:
        lines.append(
            f"  {r['layer']:>5}  {r['compute_ms']:>5.0f}ms  {r['transfer_ms']:>6.0f}ms  "
            f"({r['post_ms']:>5.0f}ms)  {100 * r['hidden_fraction']:>5.0f}%  {r['wrs']:>4}  "
            f"{r['bytes']:>9,}  {r['mb_per_s']:>5.1f}  {r['arrived_ms'] / 1e3:>11.2f} s  "
            f"{yes[r['bit_exact']]}"
        )
    lines += [
        "  (transfer: from the layer's K/V being ready to its completion; posting: the",
        "   put_async call; hidden: share of the transfer during later layers' compute;",
        "   decode saw it: seconds after prefill started computing)",
        "",
        f"  bytes moved   {s['bytes_moved']:,} B ({s['bytes_moved'] / (1 << 20):.2f} MiB) of "
        f"K/V data (no padding) in {s['puts']} strided puts, one per layer",
        f"  work requests {s['wrs_posted']:,} posted, each gathering up to "
        f"{s['limits']['max_sge']} head rows into one block run",
        f"                a put per (layer, K|V, head) = {per_head['puts']:,} puts would post "
        f"{per_head['wrs']:,} WRs",
        f"                (a head's rows are {cfg['heads'] * cfg['head_dim'] * 2} B apart in a "
        f"paged block): {s['wrs_avoided']:,} WRs avoided ({avoided_pct:.1f}%)",
        f"  transfer      {busy_s:.2f} s busy in all; {s['overlapped_ms'] / 1e3:.2f} s of it "
        f"overlapped prefill's compute ({100 * s['overlap_fraction']:.0f}%), "
        f"{s['exposed_ms'] / 1e3:.2f} s exposed",
        f"  pipeline      compute {s['compute_ms'] / 1e3:.2f} s; the last layer landed "
        f"{s['tail_after_compute_ms']:.0f} ms after the last compute ended",
        f"  KV check      {s['layers_bit_exact']}/{cfg['layers']} layers bit-exact "
        f"(sha256 of prefill's K/V == sha256 of what landed)",
        f"                received cache == decode's own recompute, byte for byte: "
        f"{yes[s['received_equals_recompute']]}",
        f"  generation    {len(s['tokens_received'])} greedy tokens (the first from prefill): "
        f"received cache {'==' if s['tokens_equal'] else '!='} local cache: "
        f"{'EQUAL' if s['tokens_equal'] else 'DIFFERENT'}",
        f"                received {s['tokens_received']}",
        f"                local    {s['tokens_local']}",
    ]
    if "elapsed_s" in s:
        t = s["timings_s"]
        lines.append(
            f"  time          {s['elapsed_s']:.1f} s for the demo; of it: model build "
            f"{t['prefill_model_build']:.1f} s, decode's recompute {t['decode_recompute']:.1f} "
            f"s, generation {t['decode_generate']:.1f} s"
        )
    return "\n".join(lines)
