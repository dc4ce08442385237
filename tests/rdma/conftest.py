from __future__ import annotations

from collections.abc import Iterator

import pytest

from hixl.verbs import adapter as _verbs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/rdma/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.rdma)


@pytest.fixture
def device() -> Iterator[_verbs.Device]:
    dev = _verbs.open_device()
    try:
        yield dev
    finally:
        dev.close()
