"""hixl put against ib_write_bw between two hosts, in the same run.

Method: two VMs (``hixl vm hosts``), each with its own kernel and rxe on a virtio NIC,
joined by one virtual wire. host1 writes into host0. For every message size and
repeat, ``ib_write_bw`` runs first (server on host0, client on host1, ``-n ITERS``) and
then hixl does the same work: ``ITERS`` ``put_async`` of that size, up to ``--depth``
in flight (perftest's default tx depth is 128), timed from the first post to the last
completion. The table gives medians over the repeats and hixl / ib_write_bw.

Caveat: with one vCPU per host, ``ib_write_bw``'s client spins on its CQ and so takes
the CPU from rxe's own kernel work on the same vCPU, while hixl's progress thread sleeps
on completion events. (``ib_write_bw -e``, which sleeps on CQ events, left its
server hanging on rxe here, so the tool runs in its default polling mode.)

Both tools cross the same wire in the same boot, so their ratio is meaningful even
though absolute numbers under emulation are slow and noisy.

Run it from the repository root (it boots the VMs itself)::

    .venv/bin/python benchmarks/bench_hosts.py [--sizes 64K,1M] [--repeats 3] [--json F]

Inside the VMs it re-runs itself with ``--role`` (host0 serves, host1 drives), and the
two talk over :class:`hixl.testbed.hosts.Control` with a deadline on every wait.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from hixl import Access, ContiguousDesc, Engine
from hixl.testbed.hosts import Control, HostEnv, host_address, run_hosts
from hixl.testbed.net import read_listening_ports
from hixl.testbed.vm import VMConfig

from .. import entry
from ..backends.perftest import parse_bw
from ..common import (
    fmt_rate,
    fmt_size,
    json_out,
    parse_sizes,
)

CONTROL_PORT = 7200
ENGINE_PORT = 5700
PERFTEST_PORT = 18700


def iterations(size: int, target: int) -> int:
    """Messages per measurement: about ``target`` bytes, between 8 and 2000."""
    return max(8, min(2000, target // size))


def perftest_cmd(port: int, size: int, iters: int) -> list[str]:
    """``ib_write_bw`` on rxe0 with the IPv4 RoCEv2 GID (index 1), no CPU-frequency check."""
    return [
        "ib_write_bw",
        "-d",
        "rxe0",
        "-x",
        "1",
        "-F",
        "-p",
        str(port),
        "-s",
        str(size),
        "-n",
        str(iters),
    ]


def _wait_listen(port: int, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while port not in read_listening_ports():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate(timeout=10.0)
            raise RuntimeError(
                f"ib_write_bw server did not listen on {port}:\n{out.decode()[-2000:]}"
            )
        time.sleep(0.05)


def serve(host: HostEnv, largest: int) -> int:
    """host0: the target of both tools."""
    buf = np.zeros(largest * 2, np.uint8)
    with Engine(f"{host.address}:{ENGINE_PORT}", insecure=True) as eng:  # a benchmark wire
        eng.register(buf, access=Access.REMOTE_WRITE, name="sink")
        with Control.serve(host.address, CONTROL_PORT, timeout=400.0) as ctl:
            while True:
                req = ctl.recv(timeout=400.0)
                if req["op"] == "bye":
                    ctl.send({"ok": True})
                    return 0
                if req["op"] == "perftest":
                    port = int(req["port"])
                    cmd = perftest_cmd(port, int(req["size"]), int(req["iters"]))
                    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    try:
                        _wait_listen(port, server, 30.0)
                        ctl.send({"ok": True})
                        if not ctl.recv(timeout=300.0)["ok"]:  # the client finished
                            server.kill()  # a failed client leaves the server waiting
                        out, _ = server.communicate(timeout=60.0)
                        ctl.send({"ok": server.returncode == 0, "out": out.decode()[-2000:]})
                    finally:
                        if server.poll() is None:
                            server.kill()
                            server.wait()


def drive(host: HostEnv, sizes: list[int], repeats: int, target: int, depth: int) -> int:
    """host1: runs both tools against host0 and returns the rows as JSON on stdout."""
    peer_addr = host.peers[0]
    rows: list[dict[str, Any]] = []
    src = np.random.default_rng(1).integers(0, 256, max(sizes) * 2, dtype=np.uint8)
    with (
        Control.connect(peer_addr, CONTROL_PORT, timeout=300.0) as ctl,
        Engine(f"{host.address}:0") as eng,
    ):
        region = eng.register(src, name="source")
        peer = f"{peer_addr}:{ENGINE_PORT}"
        conn = eng.connect(peer, timeout=30.0)
        port = PERFTEST_PORT
        for size in sizes:
            iters = iterations(size, target)
            for rep in range(repeats):
                port += 1
                ctl.call("perftest", size=size, iters=iters, port=port)
                client = subprocess.run(
                    [*perftest_cmd(port, size, iters), peer_addr],
                    capture_output=True,
                    text=True,
                    timeout=300.0,
                    check=False,
                )
                ctl.send({"op": "client-done", "ok": client.returncode == 0})
                ctl.recv(timeout=120.0)
                if client.returncode != 0:
                    raise RuntimeError(f"ib_write_bw client failed:\n{client.stdout[-2000:]}")
                perf = parse_bw(client.stdout)

                pending: deque[Any] = deque()
                t0 = time.perf_counter()
                for i in range(iters):
                    if len(pending) >= depth:
                        pending.popleft().wait(timeout=120.0)
                    off = (i % 2) * size
                    desc = ContiguousDesc(offset=off, nbytes=size)
                    pending.append(
                        eng.put_async(
                            peer, region, "sink", local_desc=desc, remote_desc=desc, timeout=120.0
                        )
                    )
                while pending:
                    pending.popleft().wait(timeout=120.0)
                elapsed = time.perf_counter() - t0
                hixl_bps = size * iters / elapsed
                rows.append(
                    {
                        "size": size,
                        "iters": iters,
                        "repeat": rep,
                        "ib_write_bw_Bps": perf.avg_Bps,
                        "hixl_put_Bps": hixl_bps,
                    }
                )
                print(
                    f"size {fmt_size(size)} rep {rep}: ib_write_bw {fmt_rate(perf.avg_Bps)}"
                    f", hixl put {fmt_rate(hixl_bps)}",
                    file=sys.stderr,
                    flush=True,
                )
        ctl.call("bye")
        mtu = conn.mtu
    print(json.dumps({"rows": rows, "path_mtu": mtu}), flush=True)
    return 0


def table(data: dict[str, Any]) -> str:
    lines = [
        "| size | ib_write_bw (median) | hixl put (median) | hixl / ib_write_bw |",
        "| ---: | ---: | ---: | ---: |",
    ]
    sizes = sorted({r["size"] for r in data["rows"]})
    for size in sizes:
        rs = [r for r in data["rows"] if r["size"] == size]
        perf = statistics.median(r["ib_write_bw_Bps"] for r in rs)
        ours = statistics.median(r["hixl_put_Bps"] for r in rs)
        lines.append(
            f"| {fmt_size(size)} | {fmt_rate(perf)} | {fmt_rate(ours)} | {ours / perf:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,1M", help="message sizes (default 64K,1M)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per size (default 3)")
    p.add_argument("--bytes", default="16M", help="bytes per measurement (default 16M)")
    p.add_argument("--depth", type=int, default=128, help="hixl puts in flight (default 128)")
    p.add_argument("--mtu", type=int, action="append", default=[], help="NIC MTU(s)")
    p.add_argument("--json", type=json_out, help="write the rows and the table here")
    p.add_argument("--role", choices=("serve", "drive"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    target = parse_sizes(args.bytes)[0]
    if args.role == "serve":
        return serve(HostEnv.from_environ(), max(sizes))
    if args.role == "drive":
        return drive(HostEnv.from_environ(), sizes, args.repeats, target, args.depth)

    share = Path(tempfile.mkdtemp(prefix="hixl-bench-hosts-"))
    try:
        me = [
            sys.executable,
            "-u",
            str(entry("bench_hosts")),
            "--sizes",
            args.sizes,
            "--repeats",
            str(args.repeats),
            "--bytes",
            args.bytes,
            "--depth",
            str(args.depth),
        ]
        out = share / "drive.json"
        commands = [
            [*me, "--role", "serve"],
            ["sh", "-c", f"{shlex.join(me)} --role drive > {shlex.quote(str(out))}"],
        ]
        print(
            f"bench_hosts: ib_write_bw vs hixl put, host1 ({host_address(1)}) writes into "
            f"host0 ({host_address(0)}); sizes {args.sizes}, {args.repeats} repeats, "
            f"~{args.bytes} per measurement, hixl depth {args.depth}",
            flush=True,
        )
        rc = run_hosts(
            commands, VMConfig(cpus=1, memory="2G", timeout=1200.0, rw_dirs=(share,)), mtus=args.mtu
        )
        if rc != 0:
            print(f"bench_hosts: a host failed (exit {rc})", file=sys.stderr)
            return rc
        data = json.loads(out.read_text())
    finally:
        shutil.rmtree(share, ignore_errors=True)
    text = table(data)
    print(f"\npath MTU {data['path_mtu']}; medians over {args.repeats} repeats\n\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps({**data, "table": text}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
