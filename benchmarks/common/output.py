"""Markdown tables and JSON files, the two forms every result is written in."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A GitHub markdown table. ``align`` has one of ``l``/``r``/``c`` per column."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row needs one cell per header")
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    align = align.ljust(len(headers), "l")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(marks[a] for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(obj: object) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[call-overload]
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def json_out(value: str) -> Path | str:
    """The ``--json FILE`` option's type: the file, checked writable when the arguments
    are read rather than after minutes of measuring (inside ``hixl run`` the checkout is
    a read-only view).  ``-`` is passed through for drivers that print JSON instead."""
    if value == "-":
        return value
    path = Path(value)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write {value}: {exc.strerror or exc} ({path.parent})"
        ) from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(
            f"cannot write {value}: not writable (inside `hixl run` only the directories "
            "given with `hixl run --rwdir DIR` are writable: write it under one)"
        )
    return path
