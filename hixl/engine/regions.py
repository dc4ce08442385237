"""Registered memory: access rights, regions and what peers see of them."""

from __future__ import annotations

import enum
from typing import Any, Protocol

import numpy as np

from hixl.core import wire
from hixl.core.wire import RemoteRegion
from hixl.errors import RegistrationError
from hixl.verbs import adapter as verbs

__all__ = ["Access", "Region", "RegionOwner", "buffer_span"]


class Access(enum.IntFlag):
    """What may be done to a registered region.

    ``NONE`` suits a buffer that is only ever the *source* of a put (it may be
    read-only).  ``LOCAL_WRITE`` lets a ``get`` land in it.  ``REMOTE_READ``
    and ``REMOTE_WRITE`` expose it to connected peers; only such regions'
    addresses and keys are ever sent over the network.  ``REMOTE_WRITE``
    implies ``LOCAL_WRITE`` (a verbs rule).
    """

    NONE = 0
    LOCAL_WRITE = verbs.ACCESS_LOCAL_WRITE
    REMOTE_WRITE = verbs.ACCESS_REMOTE_WRITE
    REMOTE_READ = verbs.ACCESS_REMOTE_READ


# The wire and the verbs adapter must agree on the remote bits (one rule, checked once).
assert wire.REMOTE_WRITE == Access.REMOTE_WRITE and wire.REMOTE_READ == Access.REMOTE_READ
_REMOTE_BITS = int(Access.REMOTE_READ | Access.REMOTE_WRITE)


class RegionOwner(Protocol):
    """The engine a :class:`Region` belongs to, as the region sees it."""

    @property
    def id(self) -> str: ...

    def deregister(self, region: Region) -> None: ...


class Region:
    """A registered memory region of an :class:`Engine`.

    ``addr`` and ``length`` are in bytes.  Offsets in descriptors are relative
    to ``addr``.  Obtain one from :meth:`Engine.register`; release it with
    :meth:`Engine.deregister` (or by closing the engine).
    """

    def __init__(
        self, engine: RegionOwner, mr: verbs.MemoryRegion, access: Access, name: str
    ) -> None:
        self.engine = engine
        self.mr = mr
        self.addr = mr.addr
        self.length = mr.length
        self.access = access
        self.name = name
        bits = int(access) & _REMOTE_BITS
        self._remote = (
            RemoteRegion(addr=self.addr, length=self.length, rkey=mr.rkey, access=bits, name=name)
            if bits
            else None
        )

    @property
    def closed(self) -> bool:
        return self.mr.closed

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def remote(self) -> RemoteRegion | None:
        """What peers see of this region, or None when it is not remotely accessible."""
        return None if self.closed else self._remote

    def __repr__(self) -> str:
        name = f" name={self.name!r}" if self.name else ""
        state = " closed" if self.closed else ""
        return (
            f"<Region addr={self.addr:#x} length={self.length} access={self.access!r}{name}{state}>"
        )


def buffer_span(obj: object) -> tuple[int, int, object, bool]:
    """``(address, nbytes, owner, readonly)`` of a buffer to register."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        addr, length = obj
        return int(addr), int(length), None, False
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "numel"):
        # A torch tensor, duck-typed so hixl does not depend on torch.
        tensor: Any = obj
        dev_type = getattr(getattr(tensor, "device", None), "type", "cpu")
        if dev_type != "cpu":
            raise RegistrationError(f"only CPU tensors can be registered, got device {dev_type}")
        if not tensor.is_contiguous():
            raise RegistrationError("tensor is not contiguous; register .contiguous() instead")
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        return int(tensor.data_ptr()), nbytes, tensor, False
    if isinstance(obj, np.ndarray):
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise RegistrationError(
                f"array is not contiguous (strides {obj.strides}); "
                "register its base buffer and use a strided descriptor"
            )
        return int(obj.ctypes.data), int(obj.nbytes), obj, not obj.flags.writeable
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError as exc:
        raise RegistrationError(
            f"cannot register {type(obj).__name__}: not a buffer, array, tensor or "
            "(address, length) tuple"
        ) from exc
    if not view.contiguous:
        raise RegistrationError("buffer is not contiguous")
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    # The memoryview is kept as the owner: while it is alive a bytearray cannot be resized
    # (and so its memory cannot move under the registration).
    return int(arr.ctypes.data), int(view.nbytes), (view, arr), view.readonly
