"""Registered memory: access rights, regions and what peers see of them."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hixl.core import wire
from hixl.core.wire import RemoteRegion
from hixl.errors import ArgumentError, RegistrationError
from hixl.verbs import adapter as verbs

__all__ = ["Access", "Region", "RegionOwner", "RegionTable", "buffer_span"]

# Room left in a handshake message for everything but the exposed regions, bytes.
_REGION_BYTES = wire.MAX_PAYLOAD - 4096


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


#: ``announce(add=..., remove=...)``: tell live peers of a change of the exposed regions.
Announce = Callable[..., None]


class RegionTable:
    """An engine's registered regions by span, and what peers see of them: every remotely
    accessible region by ``(rkey, addr)`` in registration order, and the bytes they take
    in a handshake message (at most :data:`_REGION_BYTES`).  Engine lock for every change."""

    def __init__(self, lock: threading.RLock, device: verbs.Device, engine_id: str) -> None:
        self._lock = lock
        self._dev = device
        self._id = engine_id
        self.by_span: dict[tuple[int, int], Region] = {}
        self.exposed_map: dict[tuple[int, int], RemoteRegion] = {}
        self._exposed_bytes = 0

    def __len__(self) -> int:
        return len(self.by_span)

    def exposed(self) -> tuple[RemoteRegion, ...]:
        """What a handshake tells a peer (lock held)."""
        return tuple(self.exposed_map.values())

    def add(
        self, owner: RegionOwner, buffer: object, access: Access, name: str, announce: Announce
    ) -> Region:
        """Register ``buffer`` (see :meth:`Engine.register`); a new exposed region is
        announced to live peers under the same hold of the lock."""
        access = Access(access)
        if access & Access.REMOTE_WRITE:
            access |= Access.LOCAL_WRITE
        addr, length, keep, readonly = buffer_span(buffer)
        if length <= 0:
            raise RegistrationError(f"cannot register an empty buffer (nbytes={length})")
        if readonly and access & (Access.LOCAL_WRITE | Access.REMOTE_WRITE):
            raise RegistrationError(
                f"buffer at {addr:#x} (nbytes={length}) is read-only; "
                f"register it with access=Access.NONE or REMOTE_READ, "
                f"not {access!r}"
            )
        if len(name) > 128 or not all(c.isprintable() for c in name):
            raise ArgumentError(f"region name must be <= 128 printable characters: {name!r}")
        with self._lock:
            existing = self.by_span.get((addr, length))
            if existing is not None:
                if existing.access != access or existing.name != name:
                    raise RegistrationError(
                        f"memory addr={addr:#x} nbytes={length} is already registered with "
                        f"access={existing.access!r} name={existing.name!r}; deregister first"
                    )
                return existing
            exposing = bool(access & (Access.REMOTE_READ | Access.REMOTE_WRITE))
            if exposing and len(self.exposed_map) >= wire.MAX_REGIONS:
                raise RegistrationError(
                    f"engine {self._id} already exposes {len(self.exposed_map)} regions to "
                    f"peers, the most a handshake carries (MAX_REGIONS={wire.MAX_REGIONS}); "
                    "deregister one, or register this one without remote access"
                )
            mr = self._dev.register(addr, length, int(access), keep)
            region = Region(owner, mr, access, name)
            remote = region.remote
            if remote is not None:
                size = wire.region_size(remote)
                if self._exposed_bytes + size > _REGION_BYTES:
                    mr.close()
                    raise RegistrationError(
                        f"engine {self._id} exposes regions taking {self._exposed_bytes} bytes "
                        f"in a handshake message; this one ({size} bytes, name of "
                        f"{len(name)} characters) would pass the {_REGION_BYTES}-byte limit: "
                        "use shorter names or fewer regions"
                    )
                self.exposed_map[(remote.rkey, remote.addr)] = remote
                self._exposed_bytes += size
                announce(add=(remote,))
            self.by_span[(addr, length)] = region
        return region

    def remove(self, region: Region, announce: Announce | None) -> None:
        """Release ``region`` if it is registered here; peers are told unless ``announce``
        is None (the engine is closed)."""
        with self._lock:
            if self.by_span.get((region.addr, region.length)) is not region:
                return
            del self.by_span[(region.addr, region.length)]
            remote = region.remote
            region.mr.close()
            if remote is not None:
                del self.exposed_map[(remote.rkey, remote.addr)]
                self._exposed_bytes -= wire.region_size(remote)
                if announce is not None:
                    announce(remove=(remote,))

    def find(self, addr: int, nbytes: int) -> Region:
        """The region holding ``[addr, addr + nbytes)`` (see :meth:`Engine.find_region`)."""
        with self._lock:
            for r in self.by_span.values():
                if r.addr <= addr and addr + nbytes <= r.addr + r.length:
                    return r
        raise RegistrationError(
            f"local memory not registered: addr={addr:#x} "
            f"nbytes={nbytes} is in no registered region"
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
