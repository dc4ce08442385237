"""Checking ``TransferOpDesc`` lists and placing them in registered regions (pure).

``group_op_descs`` turns a list of absolute-address descs into one
:class:`BlockListDesc` pair per (local region, remote region), in list order.
``plan_relay`` cuts descs whose local memory is not registered into chunks
that each fit one staging buffer of the buffer pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hixl.core.descriptors import BlockListDesc
from hixl.errors import ArgumentError, DescriptorError, RegistrationError

__all__ = ["DescGroup", "RelayPiece", "checked_desc", "group_op_descs", "plan_relay"]

_ADDR_LIMIT = 1 << 64


class _Span(Protocol):
    """What grouping needs of a region: its start address and length in bytes."""

    @property
    def addr(self) -> int: ...

    @property
    def length(self) -> int: ...


L = TypeVar("L", bound=_Span)
R = TypeVar("R", bound=_Span)


@dataclass(frozen=True, slots=True)
class DescGroup(Generic[L, R]):
    """The descs of one (local region, remote region) pair, as one descriptor per side.

    ``local_desc``/``remote_desc`` hold offsets relative to ``local.addr`` and
    ``remote.addr``, in the order of ``indices`` (positions in the op_descs list).
    """

    local: L
    remote: R
    local_desc: BlockListDesc
    remote_desc: BlockListDesc
    indices: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: object) -> int | None:
    """``value`` when it is a true int (not a bool), else None."""
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def checked_desc(index: int, desc: object) -> tuple[int, int, int]:
    """``(local_addr, remote_addr, len)`` of ``op_descs[index]``, checked.

    Raises :class:`ArgumentError` unless all three are ints, the addresses
    are >= 0, ``len`` >= 1 and neither range passes the end of the 64-bit space.
    """
    values = []
    for field in ("local_addr", "remote_addr", "len"):
        value = _as_int(getattr(desc, field, None))
        if value is None:
            raise ArgumentError(
                f"op_descs[{index}].{field} must be an int, got "
                f"{getattr(desc, field, None)!r} (desc {desc!r})"
            )
        values.append(value)
    local_addr, remote_addr, nbytes = values
    if nbytes < 1:
        raise ArgumentError(f"op_descs[{index}]: len={nbytes}, must be >= 1")
    for name, addr in (("local_addr", local_addr), ("remote_addr", remote_addr)):
        if addr < 0 or addr + nbytes > _ADDR_LIMIT:
            raise ArgumentError(
                f"op_descs[{index}]: {name}={addr:#x} len={nbytes} is outside the 64-bit "
                "address space"
            )
    return local_addr, remote_addr, nbytes


def group_op_descs(
    op_descs: Iterable[object],
    find_local: Callable[[int, int], L],
    find_remote: Callable[[int, int], R],
    *,
    alignment: int | None = None,
) -> list[DescGroup[L, R]]:
    """Check every desc, place it in its regions, and group them per region pair.

    ``find_local(addr, nbytes)``/``find_remote(addr, nbytes)`` return the
    region holding that range or raise :class:`RegistrationError`.  Groups come
    in order of first appearance; inside a group descs keep their list order.
    ``alignment`` is the policy the descriptors are built under (None = off).

    Raises :class:`ArgumentError` for an empty list or a malformed desc,
    :class:`RegistrationError` (prefixed with the desc's index) for memory that no
    region holds, and :class:`DescriptorError`/:class:`AlignmentError` from the
    descriptors themselves.  Nothing is returned unless every desc is valid.
    """
    if isinstance(op_descs, str | bytes) or not isinstance(op_descs, Iterable):
        raise ArgumentError(f"op_descs must be a list of TransferOpDesc, got {op_descs!r}")
    checked = [checked_desc(i, d) for i, d in enumerate(op_descs)]
    if not checked:
        raise ArgumentError("op_descs is empty: nothing to transfer")
    groups: dict[tuple[int, int], tuple[L, R, list[int]]] = {}
    for i, (local_addr, remote_addr, nbytes) in enumerate(checked):
        try:
            local = find_local(local_addr, nbytes)
            remote = find_remote(remote_addr, nbytes)
        except RegistrationError as exc:
            raise RegistrationError(f"op_descs[{i}]: {exc}") from exc
        key = (id(local), id(remote))
        if key not in groups:
            groups[key] = (local, remote, [])
        groups[key][2].append(i)
    out: list[DescGroup[L, R]] = []
    for local, remote, indices in groups.values():
        try:
            ldesc = BlockListDesc.from_pairs(
                ((checked[i][0] - local.addr, checked[i][2]) for i in indices),
                alignment=alignment,
            )
            rdesc = BlockListDesc.from_pairs(
                ((checked[i][1] - remote.addr, checked[i][2]) for i in indices),
                alignment=alignment,
            )
        except DescriptorError as exc:
            shown = f"{indices[:8]}{'...' if len(indices) > 8 else ''}"
            raise type(exc)(f"op_descs {shown}: {exc}") from exc
        out.append(DescGroup(local, remote, ldesc, rdesc, tuple(indices)))
    return out


@dataclass(frozen=True, slots=True)
class RelayPiece:
    """``nbytes`` at ``local_addr`` <-> ``remote_addr``, staged at ``buf_off`` in a pool buffer."""

    local_addr: int
    remote_addr: int
    nbytes: int
    buf_off: int


def plan_relay(descs: Iterable[tuple[int, int, int]], buffer_size: int) -> list[list[RelayPiece]]:
    """Cut ``(local_addr, remote_addr, nbytes)`` descs into chunks of at most ``buffer_size`` bytes.

    Descs are packed in order, back to back in the buffer: many small descs
    share one chunk, a large one is split over several.  Every byte of every
    desc appears in exactly one piece.  Raises :class:`ArgumentError` for a
    ``buffer_size`` < 1.
    """
    if buffer_size < 1:
        raise ArgumentError(f"buffer_size must be >= 1, got {buffer_size}")
    chunks: list[list[RelayPiece]] = []
    current: list[RelayPiece] = []
    used = 0
    for local_addr, remote_addr, nbytes in descs:
        done = 0
        while done < nbytes:
            if used == buffer_size:
                chunks.append(current)
                current, used = [], 0
            take = min(nbytes - done, buffer_size - used)
            current.append(RelayPiece(local_addr + done, remote_addr + done, take, used))
            used += take
            done += take
    if current:
        chunks.append(current)
    return chunks
