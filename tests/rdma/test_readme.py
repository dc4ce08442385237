"""The README's first-transfer example runs as printed."""

from __future__ import annotations

import re
import socket
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    code = blocks[0]
    with socket.socket() as s:  # the example's fixed port must be free here
        s.bind(("127.0.0.1", 5555))
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
