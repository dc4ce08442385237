"""The ``hixl`` command line.

Each subcommand is one ``_add_<name>(subparsers)`` function that registers its parser
and sets ``handler`` to a function ``(args) -> exit code``.  To add a subcommand, write
such a function and add it to :data:`_COMMANDS` under the command's name.

Errors: a :class:`~hixl.HixlError` escaping a handler is printed as
``hixl: error: <message>`` on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hixl.errors import ArgumentError, HixlError

__all__ = ["main"]

_Subparsers = Any  # argparse's _SubParsersAction is private; keep the annotation simple


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2))


# --- devices ---------------------------------------------------------------------------


def _cmd_devices(args: argparse.Namespace) -> int:
    from hixl.verbs.devices import devices_to_json, format_devices, list_devices

    devices = list_devices(args.sysfs)
    if args.json:
        data = devices_to_json(devices)
        _print_json(data)
    else:
        print(format_devices(devices))
        data = devices_to_json(devices)
    return 0 if data["selected"] is not None else 1


def _add_devices(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "devices",
        help="list verbs devices, ports, MTU and GIDs",
        description="List verbs devices from sysfs (no verbs library needed) and "
        "mark the GID hixl would use. Exit 0 if a usable "
        "device exists, 1 if not.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--sysfs", default="/sys", help=argparse.SUPPRESS)
    p.set_defaults(handler=_cmd_devices)


# --- rxe -------------------------------------------------------------------------------


def _cmd_rxe_up(args: argparse.Namespace) -> int:
    from hixl.testbed.rxe import rxe_up

    result = rxe_up(args.netdev, name=args.name, timeout=args.timeout)
    print(result.message)
    return 0


def _cmd_rxe_down(args: argparse.Namespace) -> int:
    from hixl.testbed.rxe import rxe_down

    print(rxe_down(args.name).message)
    return 0


def _add_rxe(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "rxe",
        help="create or remove a soft-RoCE (rxe) device",
        description="Create or remove a soft-RoCE device (needs root).",
    )
    rxe = p.add_subparsers(dest="rxe_command", metavar="{up,down}", required=True)
    up = rxe.add_parser(
        "up",
        help="create a soft-RoCE device and wait until it is ACTIVE",
        description="Load rdma_rxe, create an rxe device on NETDEV (default: "
        "the first UP interface with IPv4, else a dummy hixl0 "
        "with 192.168.77.1/24) and wait for its IPv4 RoCEv2 GID. "
        "Does nothing if the netdev already has one.",
    )
    up.add_argument("--netdev", metavar="IF", help="network interface to bind to")
    up.add_argument("--name", help="device name (default: first free rxeN)")
    up.add_argument(
        "--timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="seconds to wait for the port to be ACTIVE (default 15)",
    )
    up.set_defaults(handler=_cmd_rxe_up)
    down = rxe.add_parser(
        "down",
        help="remove a soft-RoCE device",
        description="Remove the soft-RoCE device NAME (default: the only "
        "one), and the dummy netdev if hixl created it.",
    )
    down.add_argument("name", nargs="?", help="device to remove (default: the only rxe)")
    down.set_defaults(handler=_cmd_rxe_down)


# --- doctor ----------------------------------------------------------------------------


def _cmd_doctor(args: argparse.Namespace) -> int:
    from hixl.testbed.doctor import diagnose, format_report, gather_facts, report_to_json

    report = diagnose(gather_facts())
    if args.json:
        _print_json(report_to_json(report))
    else:
        print(format_report(report))
    return report.exit_code


def _add_doctor(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "doctor",
        help="check what hixl needs here and how to fix it",
        description="Check kernel RDMA, rdma_rxe, root, libibverbs, devices "
        "and the VM path (and pyverbs, which only the tests use); print a fix for each "
        "problem. Exit 0 "
        "if hixl can run RDMA here (directly or via the VM).",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_cmd_doctor)


# --- vm / run --------------------------------------------------------------------------


def _vm_config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from hixl.testbed.vm import VMConfig

    return VMConfig(
        memory=args.memory,
        cpus=args.cpus,
        accel=args.accel,
        boot_timeout=args.boot_timeout,
        timeout=args.timeout,
        rw_dirs=tuple(Path(d).resolve() for d in args.rwdir),
    )


def _command_after_dashes(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise HixlError("no command given; put it after '--', e.g. hixl vm run -- hixl devices")
    return cmd


def _cmd_vm_run(args: argparse.Namespace) -> int:
    from hixl.testbed.vm import run

    if args.hosts > 1:
        from hixl.testbed.hosts import run_hosts

        cmd = _command_after_dashes(args)
        return run_hosts([cmd] * args.hosts, _hosts_config(args), mtus=args.mtu)
    return run(_command_after_dashes(args), _vm_config(args))


def _hosts_config(args: argparse.Namespace) -> Any:
    import dataclasses
    from pathlib import Path

    logs = Path(args.logs).resolve() if args.logs else None
    return dataclasses.replace(_vm_config(args), log_dir=logs)


def _cmd_vm_hosts(args: argparse.Namespace) -> int:
    import shlex

    from hixl.testbed.hosts import run_hosts

    if args.cmd:
        raise HixlError("give each host's command with --host 'CMD', not after '--'")
    commands = [shlex.split(c) for c in args.host]
    return run_hosts(commands, _hosts_config(args), mtus=args.mtu)


def _mtu_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--mtu", type=int, action="append", default=[], metavar="BYTES", help=help)


def _hosts_options(p: argparse.ArgumentParser) -> None:
    _mtu_option(p, "NIC MTU: once for all hosts or once per host (default 1500)")
    p.add_argument(
        "--logs",
        metavar="DIR",
        help="also keep each host's stdout, stderr and console in DIR/hostN/",
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from hixl.testbed.vm import run_with_rdma

    return run_with_rdma(_command_after_dashes(args), _vm_config(args))


def _vm_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", default="4G", help="guest memory (default 4G)")
    p.add_argument("--cpus", type=int, default=2, help="guest vCPUs (default 2)")
    p.add_argument(
        "--accel",
        choices=("auto", "kvm", "tcg"),
        default="auto",
        help="KVM, TCG emulation, or auto: KVM if a probe boot works (default)",
    )
    p.add_argument(
        "--boot-timeout",
        type=float,
        default=240.0,
        metavar="S",
        help="fail if the guest has not booted after S seconds (default 240)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="kill the VM and fail after S seconds in all (default 3600)",
    )
    p.add_argument(
        "--rwdir",
        action="append",
        default=[],
        metavar="DIR",
        help="a host directory the guest may write (repeatable); the rest of "
        "the host filesystem is read-only in the guest",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")


def _add_vm(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "vm",
        help="run a command on soft-RoCE inside a small VM",
        description="Boot a kernel that has rdma_rxe (virtme-ng over this "
        "machine's root filesystem), bring up rxe0 and run a "
        "command inside. Output and exit status pass through.",
    )
    vm = p.add_subparsers(dest="vm_command", metavar="{run,hosts}", required=True)
    run = vm.add_parser("run", help="run CMD inside the VM: hixl vm run -- CMD ...")
    _vm_options(run)
    run.add_argument(
        "--hosts",
        type=int,
        default=1,
        metavar="N",
        help="boot N VMs on one virtual network (10.88.0.1, .2, ...), each "
        "with its own rxe, and run CMD on each; it sees HIXL_HOST_INDEX, "
        "HIXL_HOST_ADDR and HIXL_PEER_ADDRS (default 1)",
    )
    _hosts_options(run)
    run.set_defaults(handler=_cmd_vm_run)
    hosts = vm.add_parser(
        "hosts",
        help="one VM per --host CMD, joined by a virtual wire",
        description="Boot one VM per --host on a private network: host i "
        "gets 10.88.0.<i+1>/24 on a virtio NIC, rxe0 on it, and "
        "runs its own command. Output is prefixed per host; "
        "the run fails if any host fails; all VMs are killed "
        "at the end or at --timeout.",
    )
    hosts.add_argument(
        "--host",
        action="append",
        required=True,
        metavar="'CMD'",
        help="one host's command line (repeat per host, at least 2)",
    )
    _hosts_options(hosts)
    _vm_options(hosts)
    hosts.set_defaults(handler=_cmd_vm_hosts, cpus=1, memory="2G", timeout=900.0)


def _add_run(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "run",
        help="run CMD on rxe: on this host if it has a device, else inside the VM",
        description="Run a command where a soft-RoCE device is available: "
        "directly when this host has an ACTIVE RDMA port, "
        "otherwise in the hixl VM (see 'hixl vm run').",
    )
    _vm_options(p)
    p.set_defaults(handler=_cmd_run)


# --- bench -----------------------------------------------------------------------------


#: How a user without a checkout gets the benchmarks (they are not in the wheel).
#: The sections ``hixl bench`` runs unless ``--sections`` names others (run_all.py's own
#: default; ``--peers`` adds the peers).
BENCH_DEFAULT_SECTIONS = "fair,layer,overhead,build"
BENCH_SOURCE_HELP = (
    "the benchmarks are not part of the installed hixl package: they live in benchmarks/ "
    "of hixl's source repository. Clone it and run 'make setup && make bench' there, or "
    "point this command at a checkout with --source DIR (or HIXL_SOURCE=DIR)"
)


def bench_checkout(source: str | None = None) -> Path:
    """The source checkout whose ``benchmarks/run_all.py`` ``hixl bench`` runs.

    ``source`` (``--source``), else ``$HIXL_SOURCE``, else the checkout this hixl was
    imported from (an editable install or a run from the repository). Raises
    :class:`HixlError` saying where to get the benchmarks when none has them.
    """
    import os

    explicit = source or os.environ.get("HIXL_SOURCE")
    if explicit:
        root = Path(explicit).expanduser().resolve()
        if not (root / "benchmarks" / "run_all.py").is_file():
            raise HixlError(f"{root} has no benchmarks/run_all.py; {BENCH_SOURCE_HELP}")
        return root
    root = Path(__file__).resolve().parents[1]
    # A wheel installs hixl/ into site-packages, which has no pyproject.toml beside it.
    if (root / "pyproject.toml").is_file() and (root / "benchmarks" / "run_all.py").is_file():
        return root
    raise HixlError(f"no hixl source checkout found beside {root / 'hixl'}; {BENCH_SOURCE_HELP}")


def _cmd_bench(args: argparse.Namespace) -> int:
    import dataclasses
    import datetime
    import shlex
    import subprocess

    from hixl.testbed.vm import run_with_rdma

    checkout = bench_checkout(args.source)
    script = checkout / "benchmarks" / "run_all.py"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d_%H%M%S")
    run_dir = Path(args.out).resolve() / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = list(args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd)
    flags = ["--quick"] if args.quick else []
    # The command as the user gave it, for the record.
    shown = [*flags, *(["--sections", args.sections] if args.sections else [])]
    shown += ["--peers"] if args.peers else []
    shown += ["--nixl"] if args.peers and args.nixl else []
    invocation = shlex.join(["hixl", "bench", *shown, *(["--", *extra] if extra else [])])
    sections = args.sections
    if "build" in (sections or BENCH_DEFAULT_SECTIONS).split(","):
        # The build costs are measured here, natively, before the VM boots (under
        # emulation they would say nothing); the VM adds the wire ratios.
        subprocess.run(
            [
                sys.executable,
                str(checkout / "benchmarks" / "bench_build.py"),
                *(["--quick"] if args.quick else []),
                "--json",
                str(run_dir / "build-native.json"),
            ],
            check=False,
        )
        subprocess.run(  # and the engine's own path, cold and warm, on a null device
            [
                sys.executable,
                str(checkout / "benchmarks" / "bench_cold.py"),
                *(["--quick"] if args.quick else []),
                "--json",
                str(run_dir / "cold.json"),
            ],
            check=False,
        )
    if args.peers:
        listed = (sections or BENCH_DEFAULT_SECTIONS).split(",")
        sections = ",".join([*listed, "peers"] if "peers" not in listed else listed)
        # The VM sees the host's files read-only: install the peers here, first. A peer
        # that fails to install is recorded in the run directory and reported, not fatal.
        peers = "mooncake,nixl" if args.nixl else "mooncake"
        subprocess.run(
            [
                sys.executable,
                str(checkout / "benchmarks" / "bench_peers.py"),
                "--install",
                "--peers",
                peers,
                "--run-dir",
                str(run_dir),
            ],
            check=False,
        )
        extra = ["--peers-args", f"--peers {peers}", *extra]
    flags += ["--sections", sections] if sections else []
    base = [sys.executable, str(script), "--run-dir", str(run_dir), "--invocation", invocation]
    # Measure where rxe is (the VM writes only into the run directory), report on this host.
    cfg = _vm_config(args)
    cfg = dataclasses.replace(cfg, rw_dirs=(*cfg.rw_dirs, run_dir))
    rc = run_with_rdma([*base, "--measure-only", *flags, *extra], cfg)
    report = subprocess.run(
        [*base, "--report", *(["--no-docs"] if args.no_docs else [])], check=False
    ).returncode
    return rc or report


def _add_bench(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks on rxe and write the report",
        description="Run benchmarks/run_all.py where a soft-RoCE device is "
        "(this host, else the hixl VM): hixl put/get/latency "
        "against perftest, four ways to send a KV layer, and "
        "overheads. Writes JSON, results.md and a plot into "
        "OUT/<date_time>/ and refreshes docs/benchmarks.md. "
        "Arguments after '--' go to run_all.py.",
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument(
        "--sections",
        metavar="LIST",
        help=f"of fair,transfer,layer,overhead,peers,build (default {BENCH_DEFAULT_SECTIONS})",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run hixl beside its peers (Mooncake Transfer Engine), installed on demand "
        "into .venv-peers of the checkout, in the same VM boot",
    )
    p.add_argument(
        "--nixl",
        action="store_true",
        help="with --peers: NVIDIA NIXL too, as installed and tuned (opt in: its wheel bundles "
        "UCX and its own libibverbs; installed without torch, about 70 MB)",
    )
    p.add_argument(
        "--out",
        default="results/bench",
        metavar="DIR",
        help="parent of the run directories (default results/bench)",
    )
    p.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    p.add_argument(
        "--source",
        metavar="DIR",
        help="a hixl source checkout to take benchmarks/ from (default: $HIXL_SOURCE, else "
        "the checkout hixl runs from; the wheel does not ship the benchmarks)",
    )
    _vm_options(p)
    p.set_defaults(handler=_cmd_bench)


# --- demo ------------------------------------------------------------------------------


def _add_demo(sub: _Subparsers) -> None:
    from hixl.demo.kvdemo import add_demo_options, cmd_demo

    p = sub.add_parser(
        "demo",
        help="prefill -> decode KV cache transfer demo on rxe",
        description="Run a small transformer's prefill in one process and "
        "push each layer's K/V with one strided put to a decode "
        "process as soon as it is computed; decode verifies every "
        "layer bit for bit and generates from the received cache. "
        "Runs on this host's rxe, else in the hixl VM. Exit 0 "
        "when verified, 1 when a check failed, 2 on an error.",
    )
    add_demo_options(p)
    p.add_argument(
        "--hosts",
        type=int,
        choices=range(1, 9),
        default=1,
        metavar="N",
        help="2: decode and prefill on two VMs (own kernels and rxe, one "
        "virtual wire) instead of two processes on one device; with --prefill/--decode, "
        "one VM per worker (N = P + D), etcd on host0",
    )
    _mtu_option(p, "with --hosts 2: NIC MTU, once for both or once per host")
    p.add_argument(
        "--prefill",
        type=int,
        default=1,
        metavar="P",
        help="fleet mode: P prefill workers (with --decode; found through a private etcd)",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=1,
        metavar="D",
        help="fleet mode: D decode workers; with D >= 2 one is killed mid-stream",
    )
    p.add_argument(
        "--requests", type=int, default=12, metavar="N", help="fleet mode: requests (default 12)"
    )
    p.set_defaults(handler=_cmd_demo, demo_handler=cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.prefill > 1 or args.decode > 1:
        if args.hosts not in (1, args.prefill + args.decode):
            raise ArgumentError(
                f"--hosts {args.hosts}: the fleet needs one host per worker "
                f"({args.prefill} + {args.decode})"
            )
        from hixl.demo.fleet import cmd_fleet

        return cmd_fleet(args)
    if args.hosts > 1:
        return _cmd_demo_hosts(args)
    handler: Callable[[argparse.Namespace], int] = args.demo_handler
    return handler(args)


def _cmd_demo_hosts(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hixl.demo.hosts import run_demo_hosts
    from hixl.demo.kvdemo import config_from_args

    json_path = str(Path(args.json).resolve()) if args.json else None
    summary = run_demo_hosts(
        config_from_args(args), timeout=args.timeout, json_path=json_path, mtus=args.mtu
    )
    return 0 if summary["ok"] else 1


# --- token -----------------------------------------------------------------------------


def _cmd_token(args: argparse.Namespace) -> int:
    import secrets

    print(secrets.token_hex(32))
    return 0


def _add_token(sub: _Subparsers) -> None:
    p = sub.add_parser(
        "token",
        help="print a fresh random 256-bit token for Engine(token=...)",
        description="Print 64 hex digits (256 bits from the system's secure random "
        "source), to give every engine of a deployment as Engine(token=...). "
        "With a token, engines prove to each other that they know it before "
        "any region key is sent; see docs/architecture.md for what it protects.",
    )
    p.set_defaults(handler=_cmd_token)


# --- entry point -----------------------------------------------------------------------

_COMMANDS: dict[str, Callable[[_Subparsers], None]] = {
    "devices": _add_devices,
    "rxe": _add_rxe,
    "doctor": _add_doctor,
    "vm": _add_vm,
    "run": _add_run,
    "bench": _add_bench,
    "demo": _add_demo,
    "token": _add_token,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the ``hixl`` argument parser with every registered subcommand, or with only
    ``command``'s when that names one (some commands' options come from modules that load
    numpy: a small command such as ``hixl rxe up`` starts without them)."""
    parser = argparse.ArgumentParser(
        prog="hixl",
        description="One-sided RDMA transfers over the system's libibverbs: devices, "
        "soft-RoCE setup and diagnostics.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, register in _COMMANDS.items():
        if command not in _COMMANDS or name == command:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hixl`` command line; return the exit status.

    0 on success, 1 when a command ran but found nothing usable, 2 on an error
    (printed as ``hixl: error: ...``; argparse usage errors also exit 2).
    """
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), None)
    args = build_parser(command).parse_args(words)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except HixlError as exc:
        print(f"hixl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hixl: interrupted", file=sys.stderr)
        return 130
