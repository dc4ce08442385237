"""The fleet demo's results, checked and summarised: exactly-once over the prefill
workers' results, when the routers stopped using a worker whose host was cut off (with
the time limits for that), etcd's own warnings, and the summaries as text.  Pure."""

from __future__ import annotations

import json
from typing import Any


def check_results(requests: int, prefills: list[dict[str, Any]]) -> dict[str, Any]:
    """Exactly-once and correctness over the prefill workers' results (pure)."""
    seen: dict[int, int] = {}
    ok = 0
    per_decode: dict[str, int] = {}
    for p in prefills:
        for key, r in p["results"].items():
            seen[int(key)] = seen.get(int(key), 0) + 1
            ok += bool(r["ok"])
            per_decode[r["decode"]] = per_decode.get(r["decode"], 0) + 1
    missing = sorted(set(range(requests)) - set(seen))
    duplicated = sorted(r for r, n in seen.items() if n > 1)
    return {
        "requests": requests,
        "completed": len(seen),
        "missing": missing,
        "duplicated": duplicated,
        "all_ok": ok == requests and not missing and not duplicated,
        "retries": sum(int(p["retries"]) for p in prefills),
        "per_decode": per_decode,
    }


TTL_S = 3
"""The lease TTL of every fleet engine's registry, seconds (the engine's default)."""

LEAVE_LIMIT_S = TTL_S + 3.0
"""How long after the order to cut a host off its name must have left the registry,
seconds.  The lease ends TTL after its last refresh, which comes at most a moment after
the order (the host's process is frozen as soon as it sees the order); etcd looks for
expired leases every 0.5 s, then revokes the lease through its log and sends the event
to the watches, on host0, which shares two emulated CPUs with three other VMs.  Seen
from the order in the four-host VM fleet: 2.9 to 4.9 s (a directly read key vanished with
the watch's event, so the time is etcd's).  The limit still tells a leave from a 10 s
connect timeout."""


def cut_timeline(prefill: dict[str, Any], victim: str, cut: float | None) -> dict[str, Any]:
    """When a router stopped using ``victim`` after its host was cut off (pure).

    ``prefill`` is a prefill worker's result (its timeline is on its own host's clock).
    With ``cut`` (the time of the order to cut the host off, on the same clock), the
    times are seconds after it: ``lease_gone_s`` (the router's watch saw the name leave),
    ``last_choice_s`` (the last time it chose ``victim``; negative if before the cut) and
    ``last_given_up_s`` (the last attempt on ``victim`` given up). Without ``cut`` (a
    router on another host, another clock), they are measured from when this router saw
    the name leave (``lease_gone_s`` is then 0). Missing events give None."""
    leaves = [e["t"] for e in prefill.get("leaves", []) if e["name"] == victim]
    if cut is not None:
        leaves = [t for t in leaves if t >= cut]
    leave = min(leaves, default=None)
    zero = cut if cut is not None else leave
    if zero is None:
        return {"lease_gone_s": None, "last_choice_s": None, "last_given_up_s": None}
    chosen = [c["t"] for c in prefill.get("choices", []) if c["decode"] == victim]
    given_up = [
        f["t_end"]
        for f in prefill.get("failures", [])
        if f["decode"] == victim and f.get("t_end", zero) >= zero
    ]
    return {
        "lease_gone_s": None if leave is None else leave - zero,
        "last_choice_s": None if not chosen else max(chosen) - zero,
        "last_given_up_s": None if not given_up else max(given_up) - zero,
    }


def hosts_summary(
    requests: int, prefills: list[dict[str, Any]], *, prefill: int, decode: int
) -> dict[str, Any]:
    """The multi-host run's summary from every prefill host's result (host0's first)."""
    host0 = prefills[0]
    base = host0["baseline"]
    bsum = check_results(requests, [base])
    bsum["requests_per_s"] = requests / base["wall_s"]
    summary = check_results(requests, prefills)
    wall = max(p["wall_s"] for p in prefills)
    summary |= {
        "prefill": prefill,
        "decode": decode,
        "hosts": prefill + decode,
        "elapsed_s": wall,
        "requests_per_s": requests / wall,
        "baseline": bsum | {"elapsed_s": base["wall_s"]},
        "throughput_ratio": (requests / wall) / bsum["requests_per_s"],
        "failures": [f for p in prefills for f in p["failures"]],
        "etcd_outage": host0.get("etcd_outage"),
    }
    cut = host0.get("cut")
    routers = []
    if cut is not None:
        routers.append({"router": "prefill-0", **cut_timeline(host0, "decode-0", cut["t"])})
        for j, p in enumerate(prefills[1:], start=1):
            routers.append(
                {"router": f"prefill-{j}", "from_leave": True, **cut_timeline(p, "decode-0", None)}
            )
    summary["cut"] = None if cut is None else {**cut, "routers": routers}
    summary["cut_ok"] = cut is not None and cut_in_time(routers)
    summary["etcd_warnings"] = list(host0.get("etcd_warnings", []))
    return summary


LEAVE_GRACE_S = 0.5
"""How long after a router sees the lost worker's name leave it may still give up an
attempt there (or choose it), seconds."""


def cut_in_time(routers: list[dict[str, Any]]) -> bool:
    """Whether the routers stopped using the cut worker in time (pure).

    ``routers``: :func:`cut_timeline` rows, the cutting host's router first (times from
    the order), then the others (times from when each saw the name leave).  The name
    must leave within :data:`LEAVE_LIMIT_S` of the order; every router's last choice of
    the worker and last attempt given up there come at most :data:`LEAVE_GRACE_S` after
    it saw the leave.  (A give-up is caused by the leave, so it trails it by the time
    the router takes to act: a bound on the give-up equal to the bound on the leave
    fails a leave seen near that limit.)"""
    if not routers:
        return False
    gone = routers[0].get("lease_gone_s")
    if gone is None or gone > LEAVE_LIMIT_S:
        return False
    for i, r in enumerate(routers):
        until = (gone if i == 0 else 0.0) + LEAVE_GRACE_S
        for key in ("last_choice_s", "last_given_up_s"):
            if r.get(key) is not None and r[key] > until:
                return False
    return True


ETCD_WARNINGS = 8
"""How many of etcd's own warnings host0's result keeps (the last ones)."""


def etcd_warnings(log_text: str, limit: int = ETCD_WARNINGS) -> list[str]:
    """etcd's last ``limit`` warnings and errors from its zap log (JSON lines), each as
    ``"<time> <message> (took <duration>)"`` and at most 200 characters (pure).  Lines
    that are not JSON objects are skipped.  Kept so that a late lease can be told apart
    from a slow etcd ("apply request took too long", slow fdatasync) after the VM is gone."""
    found: list[str] = []
    for line in log_text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or doc.get("level") not in ("warn", "error"):
            continue
        text = f"{doc.get('ts', '?')} {doc.get('msg', '?')}"
        if doc.get("took") is not None:
            text += f" (took {doc['took']})"
        found.append(text[:200])
    return found[-limit:] if limit > 0 else []


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:+.2f} s"


def format_fleet_hosts(s: dict[str, Any]) -> str:
    """The multi-host fleet's summary as text (pure)."""
    b = s["baseline"]
    lines = [
        f"fleet on {s['hosts']} hosts: {s['prefill']} prefill x {s['decode']} decode, "
        f"{s['requests']} requests"
        + (", decode-0's host cut off mid-stream" if s["killed"] else ""),
        f"  completed exactly once: {s['completed']}/{s['requests']} (missing "
        f"{s['missing']}, duplicated {s['duplicated']}), re-run {s['retries']} times",
        f"  served per decode: {s['per_decode']}",
    ]
    for f in s["failures"]:
        lines.append(
            f"  request {f['req']} on {f['decode']} failed after {f['seconds']:.1f} s: "
            f"{f['error'][:120]}"
        )
    cut = s.get("cut")
    if cut is not None:
        held = "with its request " + str(cut["req"]) if cut["req"] is not None else "idle"
        lines.append(f"  decode-0 cut off {held} in flight; on host0's clock, after the order:")
        for r in cut["routers"]:
            if r.get("from_leave") and r["lease_gone_s"] is None:
                lines.append(f"    {r['router']}: its requests were all done before decode-0 left")
            elif r.get("from_leave"):
                lines.append(
                    f"    {r['router']} (own clock, after it saw the leave): last chose "
                    f"decode-0 {_secs(r['last_choice_s'])}, last attempt there given up "
                    f"{_secs(r['last_given_up_s'])}"
                )
            else:
                lines.append(
                    f"    {r['router']}: lease gone {_secs(r['lease_gone_s'])}, last chose "
                    f"decode-0 {_secs(r['last_choice_s'])}, last attempt there given up "
                    f"{_secs(r['last_given_up_s'])} (limits: the leave within TTL + 3 = "
                    f"{LEAVE_LIMIT_S:.0f} s, the others {LEAVE_GRACE_S} s after it)"
                )
        lines.append(f"  routers stopped using decode-0 in time: {'yes' if s['cut_ok'] else 'NO'}")
        warned = s.get("etcd_warnings") or []
        if not s["cut_ok"] and warned:  # a late leave: was etcd itself slow?
            lines.append(f"  etcd's last {len(warned)} warnings on host0:")
            lines += [f"    {w}" for w in warned]
    outage = s.get("etcd_outage")
    if outage is not None:
        lines.append(
            f"  etcd stopped for {outage['seconds']:.1f} s on host0; prefill-0 completed "
            f"{outage['completed_during']} requests meanwhile"
        )
    else:
        lines.append("  etcd outage: DID NOT HAPPEN")
    lines += [
        f"  decode-{s['decode'] - 1} restarted under the same name: "
        f"{'yes' if s['restarted'] else 'NO'}",
        f"  all bit-exact with identical tokens: {'yes' if s['all_ok'] and b['all_ok'] else 'NO'}",
        f"  throughput {s['requests_per_s']:.2f} req/s over {s['elapsed_s']:.1f} s vs 1x1 "
        f"{b['requests_per_s']:.2f} req/s over {b['elapsed_s']:.1f} s in the same run: "
        f"{s['throughput_ratio']:.2f}x; whole run {s['run_s']:.0f} s",
        f"result: {'OK' if s['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def format_fleet(s: dict[str, Any]) -> str:
    f, b = s["fleet"], s["baseline"]
    lines = [
        f"fleet {f['prefill']} prefill x {f['decode']} decode, {f['requests']} requests"
        + (f", {f['killed']} killed mid-stream" if f["killed"] else ""),
        f"  completed exactly once: {f['completed']}/{f['requests']} "
        f"(missing {f['missing']}, duplicated {f['duplicated']}), re-run {f['retries']} times",
        f"  served per decode: {f['per_decode']}",
        f"  all bit-exact with identical tokens: {'yes' if f['all_ok'] else 'NO'}",
        f"  throughput {f['requests_per_s']:.2f} req/s"
        + (
            ""
            if b is None
            else f" vs 1x1 {b['requests_per_s']:.2f} req/s in the same run: "
            f"{s['throughput_ratio']:.2f}x"
        ),
        f"result: {'OK' if s['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)
