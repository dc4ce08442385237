"""Test tiers: pure tests run everywhere; tests marked ``rdma`` need a verbs device.

RDMA tests skip only when no device exists *and* the run is not one that
promised a device: ``make test`` (``HIXL_REQUIRE_RDMA=1``), the hixl VM
(``HIXL_IN_VM=1``) and CI (``CI=true``) turn a missing device into a failure.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Inside the VM the checkout is read-only: keep Hypothesis' example database in memory.
if os.environ.get("HIXL_IN_VM") == "1":
    settings.register_profile("hixl-vm", database=None)
    settings.load_profile("hixl-vm")


def _rdma_required() -> bool:
    env = os.environ
    return (
        env.get("HIXL_REQUIRE_RDMA") == "1"
        or env.get("HIXL_IN_VM") == "1"
        or env.get("CI", "").lower() == "true"
    )


def _device_problem() -> str | None:
    from hixl.verbs import adapter as _verbs

    try:
        if not _verbs.device_names():
            return "no verbs device on this machine"
    except Exception as exc:  # noqa: BLE001 - any failure means "no device"
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rdma_items = [i for i in items if i.get_closest_marker("rdma")]
    if not rdma_items:
        return
    problem = _device_problem()
    if problem is None:
        return
    if _rdma_required():
        raise pytest.UsageError(
            f"RDMA tests were required (HIXL_REQUIRE_RDMA, HIXL_IN_VM or CI) but there is no "
            f"usable device: {problem}"
        )
    skip = pytest.mark.skip(
        reason=f"no verbs device ({problem}); run 'make test' or 'hixl vm run -- pytest -m rdma'"
    )
    for item in rdma_items:
        item.add_marker(skip)
