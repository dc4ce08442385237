"""The pure core (``hixl/core``) imports without pyverbs or sockets.

The subprocess blocks ``pyverbs`` and ``socket`` in ``sys.modules`` and loads the core
modules through a bare ``hixl`` package object, so what the package root imports (the
engine, the CLI) does not matter here. The static check makes sure the core modules do
not import I/O, clock or process modules at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = sorted(p.stem for p in (ROOT / "hixl" / "core").glob("*.py"))
FORBIDDEN = {"pyverbs", "socket", "time", "os", "subprocess", "select", "selectors", "threading"}

PROBE = f"""
import sys, types
for name in ("pyverbs", "socket"):
    sys.modules[name] = None
pkg = types.ModuleType("hixl")
pkg.__path__ = [{str(ROOT / "hixl")!r}]
sys.modules["hixl"] = pkg
import hixl.core.descriptors, hixl.core.plan, hixl.core.kv, hixl.core.wire, hixl.core.handshake
import hixl.core.kvblocks, hixl.core.shapes
from hixl.core.descriptors import StridedDesc, ContiguousDesc
from hixl.core.plan import Op, plan_transfer
plan = plan_transfer(
    StridedDesc(offset=0, count=64, size=256, stride=1024),
    ContiguousDesc(offset=0, nbytes=64 * 256),
    Op.WRITE,
)
assert plan.num_wrs == 2, plan
assert sys.modules["socket"] is None and sys.modules["pyverbs"] is None
print("core-ok")
"""


def test_core_imports_without_pyverbs_or_sockets() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "core-ok"


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_io(module: str) -> None:
    tree = ast.parse((ROOT / "hixl" / "core" / f"{module}.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"hixl/core/{module}.py imports {imported & FORBIDDEN}"
