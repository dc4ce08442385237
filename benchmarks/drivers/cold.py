"""Native software cost of a layer put in the engine's own path: cold, refill, repeated.

Each sample is a fresh process with two engines on a null device
(:mod:`benchmarks.backends.nulldev`: the engine's code runs up to the ``ibv_post_send``
call, which does nothing; completions come at once, and the time that takes is counted
apart as the device's).  Connected and registered untimed, it then times, in order:

1. ``cold layer``: the first put of a KV layer, 8192 rows of 256 bytes, stride 320 on
   both sides (8192 work requests) -- the first plan and the first chain of the process;
2. ``warm layer``: the same put again (the engine's pooled chain);
3. ``new layer layout, same size``: 8192 rows of 256 bytes at stride 384 (a new plan;
   the chain of step 1, idle in the pool, is refilled);
3b. ``new layer size (a new chain)``: 4096 rows of 512 bytes at stride 640 (a plan of a
   size no idle chain has: a chain formatted and filled in the engine's chain memory);
4. ``new block list``: a put of 8192 blocks of 256 bytes at random offsets on both sides,
   a new list (a layout never seen, of a size seen before: a refill);
5. ``another new block list``: a second new list of that size;
6. ``repeated block list``: the same list object as in 5 again.

The engine formats one chain of 8192 WRs in its chain memory when it is made, and the
first plan of more than 4096 WRs fills it (step 1); step 3b shows what a chain formatted
for its plan costs.  For each: the call's wall time, the device's share (subtracted:
``software`` is the rest, so validation, region lookup, planning, building, posting and
the engine's hand-offs), the time inside the engine's ``Planner.build`` (checks, plan,
chain), the calling thread's CPU time in it (``time.thread_time``: the build's own cost,
without the time the thread waited for a CPU, which a loaded host adds to the wall
time), and the minor page faults (``getrusage`` ``ru_minflt``, the whole process).
Medians over the samples.  Targets (natively): the cold layer's build <= 168 us (2 MiB
at 100 Gb/s), and <= 120 us warm, for a new layout into memory the engine holds
already: step 3 (a layer's rows) and step 5 (a block list of a size seen before).

    python benchmarks/bench_cold.py --samples 30
    python benchmarks/bench_cold.py --samples 30 --json results/cold.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .. import entry
from ..common import (
    BenchError,
    command_line,
    fmt_us,
    json_out,
    markdown_table,
    median,
    print_header,
    quiet_logs,
    write_json,
)

ROWS, ROW_BYTES, STRIDE = 8192, 256, 320
POOL_BLOCKS = 4 * ROWS  # block lists pick their blocks from this many
STEPS = (
    "cold layer",
    "warm layer",
    "new layer layout, same size",
    "new layer size (a new chain)",
    "new block list",
    "another new block list",
    "repeated block list",
)
BUILD_TARGET_COLD_US = 2 * 1024 * 1024 * 8 / 100e9 * 1e6  # 167.8
BUILD_TARGET_WARM_US = 120.0


def child() -> int:
    """One sample: the steps in a fresh process; one JSON line on stdout."""
    quiet_logs()
    from hixl import Access, BlockListDesc, Engine, StridedDesc
    from hixl.engine import datapath
    from hixl.testbed.net import free_tcp_port

    from ..backends.nulldev import null_device

    spent = [0.0, 0.0]
    real_build = datapath.Planner.build

    def build(self: Any, *args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return real_build(self, *args)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += time.thread_time() - c0

    datapath.Planner.build = build  # type: ignore[method-assign,assignment]
    out: dict[str, Any] = {}
    with null_device() as devs:
        server = Engine(f"127.0.0.1:{free_tcp_port()}")
        client = Engine("127.0.0.1:0")
        try:
            n = POOL_BLOCKS * ROW_BYTES
            src = np.zeros(max(n, ROWS * 384), np.uint8)
            dst = np.zeros(max(n, ROWS * 384), np.uint8)
            r = client.register(src)
            server.register(dst, access=Access.REMOTE_WRITE, name="dst")
            client.connect(server.id, timeout=30.0)
            dev = devs[1]  # the client's
            layer = StridedDesc(offset=0, count=ROWS, size=ROW_BYTES, stride=STRIDE)
            rng = np.random.default_rng()

            def blocks() -> Any:
                offs = rng.choice(POOL_BLOCKS, ROWS, replace=False).astype(np.int64) * ROW_BYTES
                return BlockListDesc(offsets=offs, lengths=np.full(ROWS, ROW_BYTES))

            lists = [(blocks(), blocks()), (blocks(), blocks())]
            other = StridedDesc(offset=0, count=ROWS, size=ROW_BYTES, stride=384)
            half = StridedDesc(offset=0, count=ROWS // 2, size=2 * ROW_BYTES, stride=640)
            plan = [
                (layer, layer),
                (layer, layer),
                (other, other),
                (half, half),
                lists[0],
                lists[1],
                lists[1],
            ]
            for name, (ld, rd) in zip(STEPS, plan, strict=True):
                spent[0] = spent[1] = 0.0
                d0 = dev.device_s
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                client.put(server.id, r, "dst", local_desc=ld, remote_desc=rd, timeout=30)
                wall = time.perf_counter() - t0
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                device = dev.device_s - d0
                out[name] = {
                    "wall_us": wall * 1e6,
                    "device_us": device * 1e6,
                    "software_us": (wall - device) * 1e6,
                    "build_us": spent[0] * 1e6,
                    "build_cpu_us": spent[1] * 1e6,
                    "minflt": f1 - f0,
                }
        finally:
            client.close()
            server.close()
    print(json.dumps(out), flush=True)
    return 0


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for step in STEPS:
        got = [s[step] for s in samples if step in s]
        rows.append(
            {"step": step, **{k: median([g[k] for g in got]) for k in got[0]}, "n": len(got)}
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    headers = [
        "step",
        "wall",
        "device (left out)",
        "software",
        "Planner.build",
        "its CPU time",
        "page faults",
    ]
    body = [
        [
            r["step"],
            fmt_us(r["wall_us"]),
            fmt_us(r["device_us"]),
            fmt_us(r["software_us"]),
            fmt_us(r["build_us"]),
            fmt_us(r["build_cpu_us"]) if r.get("build_cpu_us") is not None else "n/a",
            f"{r['minflt']:.0f}",
        ]
        for r in rows
    ]
    return markdown_table(headers, body, "lrrrrrr")


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The build targets, met or not, from the summary rows."""
    by = {r["step"]: r for r in rows}
    out = []
    for step, bound in (
        ("cold layer", BUILD_TARGET_COLD_US),
        ("new layer layout, same size", BUILD_TARGET_WARM_US),
        ("another new block list", BUILD_TARGET_WARM_US),
    ):
        r = by.get(step)
        if r is None or r.get("build_us") is None:
            continue
        met = r["build_us"] <= bound
        cpu = r.get("build_cpu_us")
        of_cpu = f" ({fmt_us(cpu)} of CPU)" if cpu is not None else ""
        out.append(
            f"natively, {step} (8192 x 256 B): built in {fmt_us(r['build_us'])}{of_cpu} in "
            f"the engine's path (target <= {bound:.0f} µs): "
            f"{'**met**' if met else '**not met**'}"
        )
    return out


def report_markdown(data: dict[str, Any]) -> str:
    """The suite's section: the table and the command."""
    return "\n".join(
        [
            markdown(data["rows"]),
            "",
            f"Medians of {data['rows'][0]['n']} fresh processes on the host (no VM), "
            f"load {data.get('load', 'n/a')}: `{data.get('command')}`. The device's share "
            "(no-op `ibv_post_send`, completions written at once) is left out of "
            '"software"; "build" is the engine\'s `Planner.build` (checks, plan, chain), its '
            "CPU time the calling thread's.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=30, help="fresh processes")
    ap.add_argument("--json", type=json_out, default=None, help="write results here")
    ap.add_argument("--quick", action="store_true", help="5 samples")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child()
    if args.quick:
        args.samples = min(args.samples, 5)
    from ..common import gather_setup

    setup = gather_setup(need_device=False)
    load = os.getloadavg()[0]
    print_header(
        "engine path, natively on a null device: cold, refill, repeated",
        setup,
        [f"{args.samples} fresh processes; load {load:.2f}", command_line()],
    )
    samples = []
    for i in range(args.samples):
        proc = subprocess.run(
            [sys.executable, str(entry("bench_cold")), "--child"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise BenchError(f"sample {i}: exit {proc.returncode}: {proc.stderr[-1500:]}")
        samples.append(json.loads(lines[-1]))
    rows = summarize(samples)
    print(markdown(rows))
    print()
    for v in verdicts(rows):
        print(v)
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "cold",
                "setup": setup,
                "command": command_line(),
                "load": round(load, 2),
                "rows": rows,
                "samples": samples,
            },
        )
    return 0
