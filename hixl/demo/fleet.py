"""``hixl demo --prefill P --decode D``: many workers, found through etcd, surviving a lost one.

Theory of operation
-------------------
The orchestrator (:func:`run_fleet`) starts a private etcd, ``D`` decode workers and ``P``
prefill workers, each its own process with its own engine, on this machine's RDMA device.

* A **decode worker** (``decode-i``) announces itself in etcd with role ``decode`` and a
  capacity: its free request slots (each slot is a set of blocks of a paged KV pool).
  It serves three notifications: ``alloc`` (reserve a slot for a request attempt; the
  answer ``slot`` names it, or -1 when full), ``kv`` (the request's KV has landed in the
  slot: check each layer's sha256, generate tokens from the received cache, recompute the
  prefill itself and generate from that too, and answer ``result``) and it re-announces its
  capacity after each change. A slot whose prefill went away is freed.
* A **prefill worker** owns a share of the request stream (request ``r`` goes to prefill
  ``r mod P``). Per request it asks :func:`hixl.demo.router.choose` for the decode worker
  with the most free announced capacity in its registry watch, connects by name, reserves
  a slot, computes the prompt's KV layer by layer (each request has its own prompt), puts
  every layer into the slot's blocks in one batch with the notification ``kv``, and waits
  for ``result``. Any failure (the connection failed, a deadline passed) gives up that
  attempt in its :class:`~hixl.demo.router.Ledger`, marks that decode process as bad (until
  it is announced by a new process) and runs the request again elsewhere. A late answer
  from a given-up attempt is refused, so a request completes exactly once.
* The orchestrator kills one decode worker (SIGKILL) once a third of the requests are done,
  if there are two or more; then it checks from the prefill workers' results that every
  request completed exactly once with identical tokens on both sides. It runs a 1x1 fleet
  with the same requests first, so the summary can give the P x D throughput as a ratio
  measured in the same run.

Every engine of a fleet proves a token shared by the run: the orchestrator makes one and
hands it to the workers in ``$HIXL_FLEET_TOKEN`` (:func:`fleet_token`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from hixl.demo.fleet_report import (
    LEAVE_GRACE_S,
    LEAVE_LIMIT_S,
    check_results,
    cut_in_time,
    cut_timeline,
    etcd_warnings,
    format_fleet,
    format_fleet_hosts,
    hosts_summary,
)
from hixl.demo.fleet_workers import request_prompt, run_fleet_decode, run_fleet_prefill
from hixl.demo.kvdemo import (
    _child_env,
    add_model_options,
    config_from_args,
)
from hixl.demo.kvmodel import DemoConfig
from hixl.errors import ArgumentError, HixlError, TransferTimeout

__all__ = [
    "FLEET_CONFIG",
    "LEAVE_GRACE_S",
    "LEAVE_LIMIT_S",
    "TOKEN_ENV",
    "check_results",
    "cut_in_time",
    "cut_timeline",
    "etcd_warnings",
    "fleet_token",
    "format_fleet",
    "request_prompt",
    "run_fleet_prefill",
    "run_fleet",
    "run_fleet_hosts",
]

Emit = Callable[[str], None]

FLEET_CONFIG = DemoConfig(layers=4, heads=4, head_dim=64, d_model=64, tokens=48, gen_tokens=6)
"""A small model: under emulation a request costs a fraction of a second of compute."""


TOKEN_ENV = "HIXL_FLEET_TOKEN"
"""The variable that carries the fleet's shared token from the runner to every worker."""


def fleet_token(environ: Mapping[str, str] | None = None) -> str:
    """The fleet's shared engine token, from ``$HIXL_FLEET_TOKEN``.

    Every runner (:func:`run_fleet`, :func:`run_fleet_hosts`, ``make test-fleet``) makes
    one with :func:`secrets.token_hex` and hands it to its workers in the environment, so
    no fleet engine runs unauthenticated. Raises :class:`ArgumentError` when it is unset."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV, "")
    if not token:
        raise ArgumentError(
            f"${TOKEN_ENV} is unset: fleet workers share a token (the runners set it; "
            "'hixl token' makes one)"
        )
    return token


def _wait_file(path: str, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while not Path(path).exists():
        if time.monotonic() > end:
            raise TransferTimeout(f"{what}: {path} did not appear within {seconds:.0f} s")
        time.sleep(0.2)


def wait_for_registry(url: str, seconds: float) -> None:
    """Return once the registry at ``url`` answers; RegistryUnavailable after ``seconds``."""
    from hixl.errors import RegistryUnavailable
    from hixl.registry import open_registry

    end = time.monotonic() + seconds
    while True:
        try:
            open_registry(url, timeout=1.0).close()
            return
        except RegistryUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


# -- orchestration --------------------------------------------------------------------------


def _fleet_once(
    cfg: DemoConfig,
    *,
    prefill: int,
    decode: int,
    requests: int,
    kill: bool,
    timeout: float,
    out: IO[str],
    tag: str,
) -> dict[str, Any]:
    from hixl.testbed.etcd import EtcdServer
    from hixl.testbed.net import free_tcp_port

    lock = threading.Lock()
    done_count = [0]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ready: dict[str, threading.Event] = {}

    def forward(role: str, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith("ready:"):
                ready[role].set()
            if role.startswith("prefill") and ": done on " in line:
                done_count[0] += 1
            with lock:
                out.write(f"[{tag} {role:<9}] {line}\n")
                out.flush()

    base = [sys.executable, "-u", "-m", "hixl.demo.fleet"]
    env = _child_env() | {TOKEN_ENV: secrets.token_hex(32)}  # this fleet's shared token
    with EtcdServer() as etcd, tempfile.TemporaryDirectory(prefix="hixl-fleet-") as tmp:
        start = time.monotonic()
        threads = []
        killed: str | None = None
        try:

            def spawn(role: str, argv: list[str]) -> None:
                ready[role] = threading.Event()
                procs[role] = subprocess.Popen(
                    [*base, *argv, "--registry", etcd.url, "--seconds", f"{timeout:.0f}"]
                    + ["--result", str(Path(tmp) / f"{role}.json"), *cfg.to_argv()],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                assert procs[role].stdout is not None
                th = threading.Thread(target=forward, args=(role, procs[role].stdout), daemon=True)
                th.start()
                threads.append(th)

            for i in range(decode):
                listen = f"127.0.0.1:{free_tcp_port()}"
                spawn(f"decode-{i}", ["decode", "--name", f"decode-{i}", "--listen", listen])
            for i in range(decode):
                if not ready[f"decode-{i}"].wait(max(1.0, start + 120 - time.monotonic())):
                    raise HixlError(f"decode-{i} did not become ready")
            for j in range(prefill):
                mine = ",".join(str(r) for r in range(requests) if r % prefill == j)
                spawn(f"prefill-{j}", ["prefill", "--requests", mine])
            t0 = time.monotonic()
            pre = [p for r, p in procs.items() if r.startswith("prefill")]
            while any(p.poll() is None for p in pre):
                if time.monotonic() > start + timeout:
                    raise HixlError(f"fleet {tag} exceeded {timeout:.0f} s")
                if kill and killed is None and decode >= 2 and done_count[0] >= requests // 3:
                    killed = "decode-0"
                    procs[killed].kill()
                    with lock:
                        out.write(f"[{tag} orchestr.] killed {killed} (SIGKILL) mid-stream\n")
                time.sleep(0.05)
            elapsed = time.monotonic() - t0
            failed = {
                r: p.returncode
                for r, p in procs.items()
                if r.startswith("prefill") and p.returncode != 0
            }
            if failed:
                raise HixlError(f"fleet {tag}: prefill workers failed: {failed}")
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for th in threads:
                th.join(5)
        prefills = [
            json.loads((Path(tmp) / f"prefill-{j}.json").read_text()) for j in range(prefill)
        ]
    summary = check_results(requests, prefills)
    summary |= {
        "prefill": prefill,
        "decode": decode,
        "killed": killed,
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed,
    }
    return summary


def run_fleet(
    cfg: DemoConfig = FLEET_CONFIG,
    *,
    prefill: int = 2,
    decode: int = 2,
    requests: int = 12,
    kill: bool = True,
    baseline: bool = True,
    timeout: float = 600.0,
    json_path: str | None = None,
    out: IO[str] | None = None,
) -> dict[str, Any]:
    """A 1x1 fleet (unless not ``baseline``), then a ``prefill`` x ``decode`` fleet (one
    decode killed mid-stream when ``kill`` and there are two or more), each serving
    ``requests`` requests; returns and prints the summary.  Without the 1x1 fleet the
    summary's ``baseline`` and ``throughput_ratio`` are None.  Raises :class:`HixlError`
    if a worker fails or time runs out."""
    if not (1 <= prefill <= 16 and 1 <= decode <= 16 and 1 <= requests <= 10_000):
        raise ArgumentError(
            f"fleet: prefill={prefill} decode={decode} requests={requests} out of range"
        )
    out = out or sys.stdout
    base = (
        _fleet_once(
            cfg,
            prefill=1,
            decode=1,
            requests=requests,
            kill=False,
            timeout=timeout,
            out=out,
            tag="1x1",
        )
        if baseline
        else None
    )
    main = _fleet_once(
        cfg,
        prefill=prefill,
        decode=decode,
        requests=requests,
        kill=kill,
        timeout=timeout,
        out=out,
        tag=f"{prefill}x{decode}",
    )
    summary = {
        "baseline": base,
        "fleet": main,
        "throughput_ratio": None
        if base is None
        else main["requests_per_s"] / base["requests_per_s"],
        "ok": (base is None or base["all_ok"]) and main["all_ok"],
    }
    out.write("\n" + format_fleet(summary) + "\n")
    out.flush()
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


ETCD_PORT = 2379
DECODE_PORT = 5600


def run_fleet_hosts(
    cfg: DemoConfig = FLEET_CONFIG,
    *,
    prefill: int = 2,
    decode: int = 2,
    requests: int = 8,
    timeout: float = 600.0,
    json_path: str | None = None,
) -> dict[str, Any]:
    """The fleet on ``prefill + decode`` hosts of the virtual wire, one VM each.

    host0 runs etcd and prefill-0, the next hosts the other prefill workers, then the
    decode workers. Every engine has the run's shared token (``$HIXL_FLEET_TOKEN``).

    First a 1 x 1 fleet serves the same requests: prefill-0 on host0 and a decode worker
    on the first decode host (role ``base``; the other workers wait for it to end), so
    the summary gives the ``P x D`` fleet's throughput as a ratio measured in the same
    boot. Then the ``P x D`` fleet, where three things go wrong on purpose, each checked:

    * after prefill-0's first request, the last decode worker restarts under the same
      name: the prefill workers find it again and replace their connections to it;
    * with two or more decode workers, once prefill-0 has completed two requests, the
      next time decode-0 reserves a slot for it host0 orders decode-0's host cut off (no
      FIN, no goodbye) before the KV goes out, so that request is in flight when the host
      dies. On host0's clock the summary gives the time from that order to decode-0's
      lease leaving (within TTL + 3 s), to the last choice of decode-0, and to the last
      attempt on it given up (and re-run elsewhere), each at most 0.5 s after the leave
      (:func:`cut_in_time`);
    * after that, etcd on host0 is stopped for 5 s: work goes on over live connections,
      and announcements are made again when it is back.
    """
    import shutil

    from hixl.testbed.hosts import ONE_BLAS_THREAD, host_address, run_hosts
    from hixl.testbed.vm import VMConfig

    hosts = prefill + decode
    if not (prefill >= 1 and decode >= 1 and 2 <= hosts <= 8):
        raise ArgumentError(f"--hosts fleet: prefill={prefill} decode={decode}, 2..8 hosts")
    share = Path(tempfile.mkdtemp(prefix="hixl-fleet-hosts-"))
    etcd_url = f"etcd://{host_address(0)}:{ETCD_PORT}"
    worker = [sys.executable, "-u", "-m", "hixl.demo.fleet"]
    common = ["--registry", etcd_url, "--seconds", f"{timeout:.0f}", *cfg.to_argv()]
    results = [str(share / f"prefill-{j}.json") for j in range(prefill)]
    stop, restart = str(share / "stop"), str(share / "restart")
    base_done, cut = str(share / "baseline-done"), str(share / "cut-decode-0")
    commands = []
    for j in range(prefill):
        mine = ",".join(str(r) for r in range(requests) if r % prefill == j)
        cmd = [*worker, "prefill", "--host", host_address(j), "--requests", mine]
        cmd += ["--result", results[j], "--expect", str(decode)]
        if j == 0:
            cmd += ["--etcd", f"{host_address(0)}:{ETCD_PORT}", "--stop-file", stop]
            cmd += ["--wait-results", ",".join(results[1:])]
            cmd += ["--baseline-requests", str(requests), "--baseline-done", base_done]
            cmd += ["--restart-file", restart, "--restart-at", "1"]
            cmd += ["--etcd-outage-seconds", "5"]
            if decode >= 2:
                cmd += ["--vanish-file", cut]
        else:
            cmd += ["--after", base_done]
        commands.append(cmd + common)
    for i in range(decode):
        addr = host_address(prefill + i)
        cmd = [*worker, "decode", "--name", f"decode-{i}", "--listen", f"{addr}:{DECODE_PORT}"]
        cmd += ["--stop-file", stop, "--result", str(share / f"decode-{i}.json")]
        if i == 0:
            cmd += ["--baseline-until", base_done]
            if decode >= 2:
                cmd += ["--vanish-file", cut]
        else:
            cmd += ["--after", base_done]
        if i == decode - 1:
            cmd += ["--restart-file", restart]
        commands.append(cmd + common)
    print(
        f"hixl demo --hosts {hosts}: etcd and prefill-0 on host0 ({host_address(0)}), "
        f"{prefill} prefill and {decode} decode workers, one VM each; a 1 x 1 fleet first",
        flush=True,
    )
    vmcfg = VMConfig(cpus=1, memory="1536M", timeout=timeout + 300.0, rw_dirs=(share,))
    env = ONE_BLAS_THREAD | {TOKEN_ENV: secrets.token_hex(32)}  # this run's shared token
    t0 = time.monotonic()
    try:
        rc = run_hosts(commands, vmcfg, env=env)
        took = time.monotonic() - t0
        prefills = []
        for path in results:
            try:
                prefills.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as exc:
                raise HixlError(f"{path} missing ({exc}); run status {rc}") from None
        vanished = decode >= 2 and not (share / "decode-0.json").exists()
        last = share / f"decode-{decode - 1}.json"
        restarted = last.exists() and bool(json.loads(last.read_text()).get("restarted"))
        if rc != 0:
            raise HixlError(f"a fleet host failed (exit status {rc}); its output is above")
    finally:
        shutil.rmtree(share, ignore_errors=True)
    summary = hosts_summary(requests, prefills, prefill=prefill, decode=decode)
    summary |= {"killed": "decode-0 (host cut off)" if vanished else None, "run_s": took}
    summary["restarted"] = restarted
    summary["ok"] = (
        summary["all_ok"]
        and summary["baseline"]["all_ok"]
        and (decode < 2 or (vanished and summary["cut_ok"]))
        and summary["etcd_outage"] is not None
        and restarted
    )
    print("\n" + format_fleet_hosts(summary), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def cmd_fleet(args: argparse.Namespace) -> int:
    """``hixl demo --prefill P --decode D``: run here if this host has RDMA, else in the VM.

    The fleet uses :data:`FLEET_CONFIG` (a small model; ``--seed`` applies)."""
    from dataclasses import replace

    from hixl.testbed.vm import VMConfig, host_has_rdma, run_with_rdma

    json_path = str(Path(args.json).resolve()) if args.json else None
    if args.hosts > 1:
        hsum = run_fleet_hosts(
            replace(FLEET_CONFIG, seed=args.seed),
            prefill=args.prefill,
            decode=args.decode,
            requests=args.requests,
            timeout=args.timeout,
            json_path=json_path,
        )
        return 0 if hsum["ok"] else 1
    if os.environ.get("HIXL_IN_VM") != "1" and not host_has_rdma():
        print("hixl demo: no RDMA device here; running the fleet in the hixl VM", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "hixl",
            "demo",
            f"--prefill={args.prefill}",
            f"--decode={args.decode}",
            f"--requests={args.requests}",
            f"--seed={args.seed}",
            f"--timeout={args.timeout}",
        ]
        rw: tuple[Path, ...] = ()
        if json_path:
            cmd.append(f"--json={json_path}")
            rw = (Path(json_path).parent,)
        return run_with_rdma(cmd, VMConfig(rw_dirs=rw, timeout=2 * args.timeout + 300.0))
    cfg = replace(FLEET_CONFIG, seed=args.seed)
    summary = run_fleet(
        cfg,
        prefill=args.prefill,
        decode=args.decode,
        requests=args.requests,
        timeout=args.timeout,
        json_path=json_path,
    )
    return 0 if summary["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point: ``python -m hixl.demo.fleet {decode,prefill} ...``.

    The engines take the fleet's token from ``$HIXL_FLEET_TOKEN`` (:func:`fleet_token`)."""
    p = argparse.ArgumentParser(prog="python -m hixl.demo.fleet")
    p.add_argument("role", choices=("decode", "prefill"))
    p.add_argument("--name", help="decode: registry name")
    p.add_argument("--listen", help="decode: engine id to listen on")
    p.add_argument("--host", default="127.0.0.1", help="prefill: local address")
    p.add_argument("--slots", type=int, default=2, help="decode: request slots")
    p.add_argument("--requests", default="", help="prefill: comma-separated request ids")
    p.add_argument("--registry", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--after", help="start once this file exists (a phase before ended)")
    p.add_argument("--expect", type=int, default=1, help="prefill: start once N decode are up")
    p.add_argument("--stop-file", help="decode: stop serving once this file exists")
    p.add_argument(
        "--vanish-file",
        help="decode: cut this host off once the file exists; prefill with --etcd: write it",
    )
    p.add_argument("--scratch-mib", type=int, default=0, help="decode: a 'scratch' region")
    p.add_argument("--restart-after", type=int, help="decode: restart once after N requests")
    p.add_argument(
        "--restart-file",
        help="decode: restart once when this file exists; prefill with --etcd: write it",
    )
    p.add_argument("--restart-at", type=int, help="prefill with --etcd: after N requests")
    p.add_argument("--etcd-outage-seconds", type=float, default=0.0)
    p.add_argument("--etcd", help="prefill: run etcd here first, on HOST:PORT")
    p.add_argument(
        "--wait-results", default="", help="prefill with --etcd: result files to wait for"
    )
    p.add_argument(
        "--baseline-until", help="decode: first serve a 1x1 fleet (role base) until this file"
    )
    p.add_argument(
        "--baseline-requests", type=int, default=0, help="prefill with --etcd: a 1x1 fleet first"
    )
    p.add_argument("--baseline-done", help="prefill with --etcd: write this file after it")
    add_model_options(p)
    args = p.parse_args(argv)

    def emit(line: str) -> None:
        print(line, flush=True)

    try:
        cfg = config_from_args(args)
        token = fleet_token()
        if args.role == "decode":
            if not args.name or not args.listen:
                raise ArgumentError("decode needs --name and --listen")
            wait_for_registry(args.registry, 120.0)
            baseline = None
            if args.baseline_until:
                baseline = run_fleet_decode(
                    cfg,
                    f"base-{args.name}",
                    args.listen,
                    args.registry,
                    args.slots,
                    args.seconds,
                    emit,
                    stop_file=args.baseline_until,
                    role="base",
                    token=token,
                )
            if args.after:
                _wait_file(args.after, args.seconds, args.name)
            result = run_fleet_decode(
                cfg,
                args.name,
                args.listen,
                args.registry,
                args.slots,
                args.seconds,
                emit,
                stop_file=args.stop_file,
                vanish_file=args.vanish_file,
                restart_after=args.restart_after,
                restart_file=args.restart_file,
                scratch=args.scratch_mib << 20,
                token=token,
            )
            result["baseline"] = baseline
        elif args.etcd:
            return _prefill_with_etcd(cfg, args, emit, token)
        else:
            wait_for_registry(args.registry, 120.0)
            if args.after:
                _wait_file(args.after, args.seconds, "prefill")
            reqs = [int(x) for x in args.requests.split(",") if x]
            result = run_fleet_prefill(
                cfg,
                args.host,
                args.registry,
                reqs,
                args.seconds,
                emit,
                expect=args.expect,
                token=token,
            )
    except HixlError as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        return 1
    Path(args.result).write_text(json.dumps(result))
    return 0


def _prefill_with_etcd(cfg: DemoConfig, args: argparse.Namespace, emit: Emit, token: str) -> int:
    """host0 of the multi-host fleet: etcd, the 1x1 fleet's prefill, a prefill worker of the
    fleet, the orders that make things go wrong (restart, cut, etcd outage), and the end of
    the run (wait for every prefill's result, then tell the decode workers to stop)."""
    from hixl.testbed.etcd import EtcdServer

    host, _, port = args.etcd.rpartition(":")
    reqs = [int(x) for x in args.requests.split(",") if x]
    end = time.monotonic() + args.seconds
    outage: dict[str, Any] = {}
    cut: dict[str, Any] = {}
    done = [0]
    timers: list[threading.Timer] = []
    with EtcdServer(host, client_port=int(port), peer_port=int(port) + 1) as etcd:
        emit(f"etcd up at {etcd.url}")

        def back() -> None:
            etcd.start()
            outage["back"] = time.monotonic()
            emit(f"etcd started again after {outage['back'] - outage['stopped']:.1f} s")

        def stop_etcd(n: int) -> None:
            etcd.stop()
            outage["stopped"] = time.monotonic()
            emit(f"etcd stopped (for {args.etcd_outage_seconds:.0f} s) after {n} requests")
            timer = threading.Timer(args.etcd_outage_seconds, back)
            timer.start()
            timers.append(timer)

        def order_cut(req: int | None) -> None:
            Path(args.vanish_file).write_text("cut\n")
            cut.update(t=time.monotonic(), req=req)
            held = f"request {req} about to go there" if req is not None else "nothing of ours"
            emit(f"ordered decode-0's host cut off ({held})")

        def on_slot(worker: str, req: int) -> None:
            if args.vanish_file and not cut and worker == "decode-0" and done[0] >= 2:
                order_cut(req)

        def on_done(n: int) -> None:
            done[0] = n
            if args.restart_file and n == args.restart_at:
                Path(args.restart_file).write_text("restart\n")
                emit(f"asked the last decode worker to restart, after {n} requests")
            if args.vanish_file and not cut and n >= len(reqs) - 2:
                order_cut(None)  # decode-0 never reserved a slot for us late enough
            if cut and n == len(reqs):
                # Our last request: keep this router and its watch up until decode-0's lease
                # must have gone, so the summary sees the leave (and etcd is not stopped
                # before it).  A plain wait in this driver thread; no lock is held.
                time.sleep(max(0.0, cut["t"] + LEAVE_LIMIT_S + 0.5 - time.monotonic()))
            late = not args.vanish_file or (cut and time.monotonic() > cut["t"] + LEAVE_LIMIT_S)
            if args.etcd_outage_seconds and not outage and late:
                stop_etcd(n)

        try:
            baseline = None
            if args.baseline_requests:
                emit(f"1 x 1 fleet first: {args.baseline_requests} requests")
                baseline = run_fleet_prefill(
                    cfg,
                    args.host,
                    etcd.url,
                    list(range(args.baseline_requests)),
                    args.seconds,
                    emit,
                    role="base",
                    token=token,
                )
                emit(f"1 x 1 fleet done in {baseline['wall_s']:.1f} s")
                Path(args.baseline_done).write_text("done\n")
            result = run_fleet_prefill(
                cfg,
                args.host,
                etcd.url,
                reqs,
                args.seconds,
                emit,
                on_done=on_done,
                on_slot=on_slot,
                expect=args.expect,
                token=token,
            )
            if args.etcd_outage_seconds and not outage:
                stop_etcd(len(reqs))  # every request finished first: nothing ran during it
            for timer in timers:
                timer.join(args.etcd_outage_seconds + 35.0)
            if outage:
                during = [
                    r
                    for r in result["results"].values()
                    if outage["stopped"] < r["finished"] < outage.get("back", float("inf"))
                ]
                result["etcd_outage"] = {
                    "seconds": outage.get("back", float("nan")) - outage["stopped"],
                    "completed_during": len(during),
                }
            result["baseline"] = baseline
            result["cut"] = cut or None
            result["etcd_warnings"] = etcd_warnings(etcd.log_tail())
            Path(args.result).write_text(json.dumps(result))
            for path in [p for p in args.wait_results.split(",") if p]:
                while not Path(path).exists():
                    if time.monotonic() > end:
                        raise TransferTimeout(f"no result {path} within {args.seconds} s")
                    time.sleep(0.5)
        finally:
            if args.stop_file:
                Path(args.stop_file).write_text("stop\n")
            time.sleep(2.0)  # let the decode workers see it while etcd still runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
