"""The prefill/decode demo on two hosts: decode in one VM, prefill in another.

The hosts and the wire between them are :mod:`hixl.testbed.hosts`'s; this module only
chooses the commands, collects each role's result and combines them with the demo's own
summary.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hixl.errors import HixlError, VMError
from hixl.testbed.hosts import ONE_BLAS_THREAD, host_address, host_mtus, run_hosts
from hixl.testbed.vm import VMConfig


def _require_vm_path() -> None:
    if os.environ.get("HIXL_IN_VM") == "1":
        raise VMError("a multi-host run cannot start inside a hixl VM")


DEMO_PORT = 5600


def align_clocks(prefill: dict[str, Any], decode: dict[str, Any]) -> float:
    """Shift decode's arrival times onto prefill's clock; returns the shift in seconds.

    Each host has its own monotonic clock. Layer ``i`` cannot be seen on decode before
    prefill posted it, and decode sees it at about the time prefill's completion arrives,
    so the shift makes the earliest ``arrived - transfer_end`` zero. Only ``arrived_ms``
    in the summary depends on it; every check (bit-exact layers, equal tokens) does not.
    """
    gaps = [
        d["arrived"] - p["transfer"][1]
        for p, d in zip(prefill["layers"], decode["layers"], strict=True)
    ]
    shift = float(min(gaps))
    for d in decode["layers"]:
        d["arrived"] -= shift
    return shift


def run_demo_hosts(
    cfg: Any,
    *,
    timeout: float = 600.0,
    json_path: str | None = None,
    vm: VMConfig | None = None,
    mtus: Sequence[int] = (),
) -> dict[str, Any]:
    """The prefill/decode demo with decode on host0 and prefill on host1.

    ``cfg`` is a :class:`hixl.demo.kvdemo.DemoConfig`. Each role runs as ``python -m
    hixl.demo.kvdemo`` in its own VM and writes its result into a directory shared with this
    process, which combines them with the demo's own ``summarize``, prints the summary
    and returns it (also as JSON to ``json_path``). Raises :class:`HixlError` when a host
    fails or leaves no result.
    """
    import dataclasses
    import shutil
    import tempfile

    from hixl.demo.kvdemo import TOKEN_ENV, format_summary, summarize

    _require_vm_path()
    base = VMConfig(cpus=1, memory="2G", timeout=timeout + 300.0) if vm is None else vm
    share = Path(tempfile.mkdtemp(prefix="hixl-demo-hosts-"))
    try:
        vmcfg = dataclasses.replace(base, rw_dirs=(*base.rw_dirs, share))
        decode_id = f"{host_address(0)}:{DEMO_PORT}"
        worker = [sys.executable, "-u", "-m", "hixl.demo.kvdemo"]
        common = ["--seconds", f"{max(1.0, timeout - 5.0):.1f}", *cfg.to_argv()]
        commands = [
            [*worker, "decode", "--listen", decode_id, "--result", str(share / "decode.json")],
            [*worker, "prefill", "--peer", decode_id, "--result", str(share / "prefill.json")],
        ]
        print(
            f"hixl demo --hosts 2: decode on host0 ({host_address(0)}), prefill on host1 "
            f"({host_address(1)}), each in its own VM (boots take 30-90 s under emulation)",
            flush=True,
        )
        env = {**ONE_BLAS_THREAD, TOKEN_ENV: secrets.token_hex(32)}  # decode is off loopback
        rc = run_hosts([c + common for c in commands], vmcfg, mtus=mtus, env=env)
        results = {}
        for role in ("prefill", "decode"):
            try:
                results[role] = json.loads((share / f"{role}.json").read_text())
            except (OSError, ValueError) as exc:
                raise HixlError(
                    f"demo {role} host left no result ({exc}); run status {rc}"
                ) from None
        if rc != 0:
            raise HixlError(f"a demo host failed (exit status {rc}); its output is above")
    finally:
        shutil.rmtree(share, ignore_errors=True)
    shift = align_clocks(results["prefill"], results["decode"])
    summary = summarize(cfg, results["prefill"], results["decode"])
    summary["hosts"] = {
        "decode": host_address(0),
        "prefill": host_address(1),
        "mtus": host_mtus(2, mtus),
        "clock_shift_s": shift,
    }
    print("\n" + format_summary(summary), flush=True)
    print(
        f"hosts: decode {host_address(0)}, prefill {host_address(1)} (two kernels, one "
        "virtual wire); arrival times use prefill's clock",
        flush=True,
    )
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
