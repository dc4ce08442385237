"""The pyverbs adapter, where no device is needed."""

from __future__ import annotations

import subprocess
import sys


def test_importing_hixl_leaves_the_root_logger_alone() -> None:
    # Debian's pyverbs calls logging.basicConfig() on import; hixl must undo that.
    code = (
        "import logging\n"
        "import hixl.verbs.adapter as v\n"
        "ok, why = v.available()\n"
        "root = logging.getLogger()\n"
        "print(ok, len(root.handlers), root.level)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out[1:] == ["0", "30"], out


def test_status_names_cover_the_verbs_enum() -> None:
    from hixl.verbs.adapter import WC_STATUS_NAMES

    assert WC_STATUS_NAMES[10] == "IBV_WC_REM_ACCESS_ERR"
    assert WC_STATUS_NAMES[12] == "IBV_WC_RETRY_EXC_ERR"
    assert sorted(WC_STATUS_NAMES) == list(range(22))
