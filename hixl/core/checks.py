"""Checks of single values from callers and from peers, shared by the wire messages
(:mod:`hixl.core.messages`) and the descriptors (:mod:`hixl.core.segments`): each caller
raises its own error class.  Pure: no I/O, no numpy."""

from __future__ import annotations

import operator

from hixl.errors import HixlError

__all__ = ["plain_int", "shown"]


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: values may come from untrusted peers."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plain_int(
    where: str,
    value: object,
    error: type[HixlError],
    refused: tuple[type, ...] = (bool,),
) -> int:
    """``value`` as a Python int: anything with ``__index__`` (numpy integers too) is
    accepted, the ``refused`` types (bool by default) and everything else raise
    ``error`` naming ``where``."""
    if isinstance(value, refused):
        raise error(f"{where} must be an integer, got bool {value!r}")
    try:
        return int(operator.index(value))  # type: ignore[arg-type]
    except TypeError:
        raise error(
            f"{where} must be an integer, got {type(value).__name__} {shown(value)}"
        ) from None
