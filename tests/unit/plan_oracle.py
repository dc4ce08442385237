"""The byte-level oracle shared by the planner tests: execute a plan as the NIC would."""

from __future__ import annotations

import numpy as np

from hixl.core.plan import Op, Plan


def _bytes(buf: object) -> memoryview:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8).data
    return memoryview(buf).cast("B")  # type: ignore[arg-type]


def apply_plan(plan: Plan, local: object, remote: object) -> None:
    """Copy every planned SGE between ``local`` and ``remote`` with memoryview slices."""
    lv, rv = _bytes(local), _bytes(remote)
    for r, sges in plan.wrs():
        pos = r
        for lo, n in sges:
            if plan.op is Op.WRITE:
                rv[pos : pos + n] = lv[lo : lo + n]
            else:
                lv[lo : lo + n] = rv[pos : pos + n]
            pos += n
