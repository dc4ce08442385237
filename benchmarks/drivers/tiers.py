"""The engine's single-request shortcuts, each against the path its calls take without it.

A shortcut earns its place only if it is cheaper than its fallback by more than the
noise, so each case is measured next to the case below it, in the same process, in
rounds that alternate the order.  By default on the null device
(:mod:`benchmarks.backends.nulldev`: the engine's own software up to the device call);
``--device`` uses a real device (rxe in the VM), the only way to reach the direct-lane
shortcuts, which poll the caller's own completion queue.

The cases (4 KiB puts of one registered buffer):

* ``put runner`` -- the direct lane's repeat runner (the same arguments again), against
* ``put on_lane`` -- the direct lane with the runner cleared, against
* ``put solo`` -- an engine without direct lanes: the refilled template posted at once, against
* ``put template`` -- the same, with the refilled template queued to the poster instead, against
* ``put general`` -- ``transfer`` of one request (checks, plan, queue);
* ``async ring runner`` -- ``put_async`` at a new offset each call, through the ring's
  runner, against
* ``async ring`` -- the ring with its runner cleared, against
* ``async general`` -- ``transfer_async`` of one request.

To take the path below a shortcut the benchmark clears that shortcut's hook on the
engine's single-request part: measurement only, not an API.  Per case it prints the
median CPU time per call (``time.process_time``) and wall time per call over the
rounds, then each shortcut over its fallback as the median of the per-round ratios,
with the rounds' range.

    python benchmarks/bench_tiers.py --rounds 12
    python benchmarks/bench_tiers.py --rounds 4 --device      # in the VM (hixl run --)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..common import command_line, json_out, median_of, print_header, quiet_logs, write_json

N_BLOCKING = 3000
N_ASYNC = 6000
SIZE = 4096

#: (shortcut, fallback): each shortcut against the path its calls take without it.
PAIRS = [
    ("put runner", "put on_lane"),
    ("put on_lane", "put solo"),
    ("put solo", "put template"),
    ("put template", "put general"),
    ("async ring runner", "async ring"),
    ("async ring", "async general"),
]

Case = tuple[Callable[[int], None], int, Callable[[], None] | None]


@contextlib.contextmanager
def _pair(direct: bool) -> Iterator[tuple[Any, Any, Any]]:
    """A connected (server, client, client's source) pair; the server exposes ``dst``."""
    import hixl
    from hixl.testbed.net import free_tcp_port

    server = hixl.Engine(f"127.0.0.1:{free_tcp_port()}", direct_lane=direct)
    client = hixl.Engine("127.0.0.1:0", direct_lane=direct)
    try:
        src = client.register(np.zeros(8 << 20, np.uint8))
        server.register(np.zeros(8 << 20, np.uint8), access=hixl.Access.REMOTE_WRITE, name="dst")
        client.connect(server.id, timeout=30.0)
        yield server, client, src
    finally:
        client.close()
        server.close()


def _cases(
    direct: tuple[Any, Any, Any], solo: tuple[Any, Any, Any], queued: tuple[Any, Any, Any]
) -> dict[str, Case]:
    import hixl

    d_server, d_client, d_src = direct
    s_server, s_client, s_src = solo
    q_server, q_client, q_src = queued
    whole = hixl.ContiguousDesc(offset=0, nbytes=SIZE)
    singles = d_client._singles
    q_singles = q_client._singles

    def queue_instead(t: Any, la: Any, ra: Any, timeout: float) -> Any:
        return q_singles._queuer.queue1(
            t.conn, q_singles._planner.rebuild(t, la, ra), timeout, True
        )

    setattr(q_singles, "_solo", queue_instead)  # noqa: B010 - measurement only
    req = hixl.TransferRequest(
        op="write", local=d_src, remote="dst", local_desc=whole, remote_desc=whole
    )
    pending: list[Any] = []

    def keep(handle: Any) -> None:
        pending.append(handle)
        if len(pending) >= 128:
            drain()

    def drain() -> None:
        for h in pending:
            h.wait(30)
        pending.clear()

    def at(i: int) -> Any:
        return hixl.ContiguousDesc(offset=(i % 1024) * SIZE, nbytes=SIZE)

    def put_runner(i: int) -> None:
        d_client.put(d_server.id, d_src, "dst", local_desc=whole, remote_desc=whole)

    def put_on_lane(i: int) -> None:
        singles.repeat_put = None
        d_client.put(d_server.id, d_src, "dst", local_desc=whole, remote_desc=whole)

    def put_solo(i: int) -> None:
        s_client.put(s_server.id, s_src, "dst", local_desc=whole, remote_desc=whole)

    def put_template(i: int) -> None:
        q_client.put(q_server.id, q_src, "dst", local_desc=whole, remote_desc=whole)

    def put_general(i: int) -> None:
        d_client.transfer(d_server.id, [req])

    def async_runner(i: int) -> None:
        keep(d_client.put_async(d_server.id, d_src, "dst", local_desc=at(i), remote_desc=at(i)))

    def async_ring(i: int) -> None:
        singles.ring_put = None
        keep(d_client.put_async(d_server.id, d_src, "dst", local_desc=at(i), remote_desc=at(i)))

    def async_general(i: int) -> None:
        r = hixl.TransferRequest(
            op="write", local=d_src, remote="dst", local_desc=at(i), remote_desc=at(i)
        )
        keep(d_client.transfer_async(d_server.id, [r]))

    return {
        "put runner": (put_runner, N_BLOCKING, None),
        "put on_lane": (put_on_lane, N_BLOCKING, None),
        "put solo": (put_solo, N_BLOCKING, None),
        "put template": (put_template, N_BLOCKING, None),
        "put general": (put_general, N_BLOCKING, None),
        "async ring runner": (async_runner, N_ASYNC, drain),
        "async ring": (async_ring, N_ASYNC, drain),
        "async general": (async_general, N_ASYNC, drain),
    }


def _timed(fn: Callable[[int], None], n: int) -> dict[str, float]:
    for i in range(min(n, 100)):
        fn(i)
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        fn(i)
    return {
        "cpu_us": (time.process_time() - c0) / n * 1e6,
        "wall_us": (time.perf_counter() - t0) / n * 1e6,
    }


def measure(rounds: int, device: bool, scale: float = 1.0) -> dict[str, list[dict[str, float]]]:
    """Per case, one ``{"cpu_us", "wall_us"}`` per round."""
    from ..backends.nulldev import null_device

    res: dict[str, list[dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        if not device:
            stack.enter_context(null_device())
        pairs = [stack.enter_context(_pair(direct)) for direct in (True, False, False)]
        cases = _cases(*pairs)
        if not device:  # the null device has no direct lane's own CQ to poll
            for name in ("put runner", "put on_lane"):
                del cases[name]
        names = list(cases)
        for k in range(rounds):
            for name in names if k % 2 == 0 else names[::-1]:
                fn, n, after = cases[name]
                res.setdefault(name, []).append(_timed(fn, max(1, int(n * scale))))
                if after is not None:
                    after()
    return res


def ratios(res: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """Each measured shortcut over its fallback: median and range of the per-round ratios."""
    out = []
    for fast, slow in PAIRS:
        if fast in res and slow in res:
            rs = [f["cpu_us"] / s["cpu_us"] for f, s in zip(res[fast], res[slow], strict=True)]
            out.append(
                {
                    "shortcut": fast,
                    "fallback": slow,
                    "cpu_ratio": median_of(rs),
                    "min": min(rs),
                    "max": max(rs),
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=12, help="alternating rounds (default 12)")
    ap.add_argument("--device", action="store_true", help="a real device, not the null one")
    ap.add_argument("--quick", action="store_true", help="2 rounds of a tenth of the calls")
    ap.add_argument("--json", type=json_out, default=None, help="write results here")
    args = ap.parse_args(argv)
    quiet_logs()
    from ..common import gather_setup

    rounds, scale = (2, 0.1) if args.quick else (args.rounds, 1.0)
    setup = gather_setup(need_device=args.device)
    where = "device" if args.device else "null device"
    print_header(
        "single-request shortcuts against their fallbacks",
        setup,
        [
            f"{rounds} rounds; {where}; load {os.getloadavg()[0]:.2f}",
            command_line(),
        ],
    )
    res = measure(rounds, args.device, scale)
    for name, rows in res.items():
        cpu, wall = median_of([r["cpu_us"] for r in rows]), median_of([r["wall_us"] for r in rows])
        print(f"{name:18s} CPU {cpu:8.2f} us/call   wall {wall:8.2f} us/call")
    for r in ratios(res):
        print(
            f"{r['shortcut']:18s} / {r['fallback']:14s} CPU {r['cpu_ratio']:.2f} "
            f"(rounds {r['min']:.2f}-{r['max']:.2f})"
        )
    if args.json is not None:
        write_json(args.json, {"setup": setup, "rounds": res, "ratios": ratios(res)})
    return 0
