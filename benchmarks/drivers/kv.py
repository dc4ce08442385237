"""A request's KV blocks: the engine's software cost natively, and on the wire in the VM.

Natively (no device), the engine's own path of one ``put_blocks`` -- the checks of both
caches and of the block lists, the plan, the chain of work requests
(:func:`hixl.engine.kv.build_request`, what ``put_blocks`` runs before it queues the
chain) -- for two requests of vLLM's FlashAttention layout, ``(2, num_blocks, 16, 8,
128)`` fp16 per layer:

* ``full``: 32 layers x (K, V) x 64 scattered blocks of 32 KiB (128 MiB, 4096 WRs);
* ``tp4``: the same with a quarter of the heads (heads 2..3 of 8) into a 2-head cache
  (decode at tensor parallel 4): rows of 512 B, 65536 SGEs, 32 MiB.

Every request draws a new scattered block list (``--blocks`` of ``--num-blocks`` on each
side). *Cold* is the first request in a fresh process (a child per form, run
``--cold-runs`` times: the median; the child first does what opening an engine and
``register_kv`` do anyway: the engine's planner, with its kept chain memory, and the
cache's warm-up); *warm* the median of ``--repeat`` requests after it.
Minor page faults are counted per request (``getrusage``), and the thread's CPU time
beside the wall time (on a shared host the two differ by the time others ran). Chains
come from and go back to a real :class:`hixl.engine.datapath.Planner`'s pool and
memory, as in the engine. The target: software time <= the request's wire time at
100 Gb/s (moonshot: 400 Gb/s).

With ``--device`` (in the VM: ``hixl run -- ... --device``), the same shape scaled down
(``--device-layers``, ``--device-blocks``) is moved by ``put_blocks`` between two engines
on one device, alternating round by round with C moving the same bytes in the same number
of work requests.  The yardstick is ``benchmarks/c/kv_wr.c`` (compiled on first use with
gcc and libibverbs-dev): one process timed by one clock, on as many queue pairs as the
engine has lanes, with one SGE per work request and with the request's own SGEs, posting
from one thread and from one thread per queue pair; the best configuration is named beside
the ratio.  perftest's figures stay beside it: ``ib_write_bw`` plain, with a post list
``-l``, one process pair per lane (``benchmarks/common/yardstick.py``) and
``ib_write_bw -q <lanes>``, each work request one SGE of the same size.  Beside each
request, the engine's own path for the same shape (checks, plan, chain: no device) is timed
in the same process, which says how much of a request's time is software.

    python benchmarks/bench_kv.py                      # native: cold and warm, both forms
    python benchmarks/bench_kv.py --json results/kv.json --repeat 50
    hixl run -- .venv/bin/python benchmarks/bench_kv.py --device --device-only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import numpy as np

from ..common import (
    command_line,
    fmt_us,
    gather_setup,
    json_out,
    markdown_table,
    median_of,
    print_header,
    write_json,
)
from .kv_request import FORMS, LIMITS, form, one_request, planner, wire_us


def cold_child(name: str, blocks: int, num_blocks: int, layers: int, seed: int) -> None:
    """The first request of a fresh process, as one JSON line.  Before it, what opening
    an engine and ``register_kv`` do anyway: the engine's planner (kept chain memory,
    touched; its warm-up) and the cache's warm-up (:func:`hixl.engine.kv.warm_up`)."""
    from hixl.engine.kv import warm_up

    plan = planner()
    f = form(name, layers, num_blocks)
    warm_up(f["local"], f["lreg"], LIMITS, plan.memory)
    dt, faults, (wrs, sges, nbytes, cpu) = one_request(
        f, np.random.default_rng(seed), blocks, num_blocks, plan
    )
    out = {"us": dt, "cpu_us": cpu, "faults": faults, "wrs": wrs, "sges": sges, "nbytes": nbytes}
    print(json.dumps(out))


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cold = []
    for run in range(args.cold_runs):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_kv",
            "--cold-child",
            name,
            "--blocks",
            str(args.blocks),
            "--num-blocks",
            str(args.num_blocks),
            "--layers",
            str(args.layers),
            "--seed",
            str(run),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        cold.append(json.loads(out.stdout.strip().splitlines()[-1]))
    f = form(name, args.layers, args.num_blocks)
    rng = np.random.default_rng(1234)
    plan = planner()
    for _ in range(args.warmup):
        one_request(f, rng, args.blocks, args.num_blocks, plan)
    warm, warm_cpu, faults = [], [], []
    shape: Any = None
    for _ in range(args.repeat):
        dt, pf, shape = one_request(f, rng, args.blocks, args.num_blocks, plan)
        warm.append(dt)
        warm_cpu.append(shape[3])
        faults.append(pf)
    wrs, sges, nbytes, _ = shape
    return {
        "name": name,
        "wrs": wrs,
        "sges": sges,
        "nbytes": nbytes,
        "cold_us": median_of([c["us"] for c in cold]),
        "cold_cpu_us": median_of([c["cpu_us"] for c in cold]),
        "warm_cpu_us": median_of(warm_cpu),
        "cold_faults": median_of([float(c["faults"]) for c in cold]),
        "warm_us": median_of(warm),
        "warm_p90_us": float(np.percentile(warm, 90)),
        "warm_faults": median_of([float(x) for x in faults]),
        "wire_100g_us": wire_us(nbytes, 100),
        "wire_400g_us": wire_us(nbytes, 400),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--forms", nargs="+", choices=FORMS, default=list(FORMS), help="forms, in this order"
    )
    p.add_argument("--layers", type=int, default=32, help="layers (one (2, ...) tensor each)")
    p.add_argument("--blocks", type=int, default=64, help="blocks per request")
    p.add_argument("--num-blocks", type=int, default=4096, help="blocks per cache")
    p.add_argument("--repeat", type=int, default=30, help="warm requests (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests before them")
    p.add_argument("--cold-runs", type=int, default=5, help="fresh processes per form")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cold-child", choices=FORMS, help=argparse.SUPPRESS)
    p.add_argument("--json", type=json_out, default=None, help="write results to this file")
    p.add_argument("--quick", action="store_true", help="a smoke run: few repeats")
    p.add_argument("--device", action="store_true", help="also move the scaled shape vs perftest")
    p.add_argument("--device-only", action="store_true", help="with --device: only the wire")
    p.add_argument("--device-layers", type=int, default=4)
    p.add_argument("--device-blocks", type=int, default=16)
    p.add_argument("--device-repeat", type=int, default=5, help="alternating pairs (median)")
    args = p.parse_args(argv)
    if args.cold_child:
        cold_child(args.cold_child, args.blocks, args.num_blocks, args.layers, args.seed)
        return 0
    if args.quick:
        args.repeat, args.warmup, args.cold_runs = 3, 1, 1
        args.device_repeat = 1
    setup = gather_setup(need_device=args.device)
    print_header(
        "hixl put_blocks: the engine's software cost per request"
        + (" and the wire vs ib_write_bw" if args.device else ""),
        setup,
        [
            f"command: {command_line(argv)}",
            "target: software time (checks + plan + chain) <= the request's wire time at "
            "100 Gb/s, cold and warm; moonshot 400 Gb/s",
        ],
    )
    results = [] if args.device_only else [measure(n, args) for n in args.forms]
    rows = []
    for r in results:
        rows.append(
            [
                r["name"],
                f"{r['wrs']} WRs, {r['sges']} SGEs, {r['nbytes'] >> 20} MiB",
                f"{fmt_us(r['cold_us'])} (CPU {fmt_us(r['cold_cpu_us'])}, "
                f"{r['cold_faults']:.0f} faults)",
                f"{fmt_us(r['warm_us'])} (p90 {fmt_us(r['warm_p90_us'])}, CPU "
                f"{fmt_us(r['warm_cpu_us'])}, {r['warm_faults']:.0f} faults)",
                fmt_us(r["wire_100g_us"]),
                fmt_us(r["wire_400g_us"]),
                "met" if max(r["cold_us"], r["warm_us"]) <= r["wire_100g_us"] else "NOT met",
            ]
        )
    if rows:
        print()
        print(
            markdown_table(
                ["form", "request", "cold", "warm", "wire 100G", "wire 400G", "100G target"],
                rows,
            )
        )
    wire: list[dict[str, Any]] = []
    if args.device:
        from .kv_device import device_section

        wire = device_section(
            args.device_layers, args.device_blocks, args.device_repeat, args.forms
        )
    if args.json is not None:
        write_json(
            args.json,
            {"setup": setup, "command": command_line(argv), "results": results, "wire": wire},
        )
        print(f"wrote {args.json}")
    return 0
