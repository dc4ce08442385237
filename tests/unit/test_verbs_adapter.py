"""The verbs adapter, where no device is needed."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_adapter_loads_no_pyverbs_and_leaves_logging_alone() -> None:
    # The data path is cffi over libibverbs: pyverbs (which configures root logging on
    # import) is for tests and the doctor's child-process probe only.
    code = (
        "import logging, sys\n"
        "import hixl, hixl.engine\n"
        "import hixl.verbs.adapter as v\n"
        "ok, why = v.available()\n"
        "root = logging.getLogger()\n"
        "print(ok, len(root.handlers), root.level, 'pyverbs' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out[1:] == ["0", "30", "False"], out


def test_status_names_cover_the_verbs_enum() -> None:
    from hixl.verbs.adapter import WC_STATUS_NAMES

    assert WC_STATUS_NAMES[10] == "IBV_WC_REM_ACCESS_ERR"
    assert WC_STATUS_NAMES[12] == "IBV_WC_RETRY_EXC_ERR"
    assert sorted(WC_STATUS_NAMES) == list(range(22))
