"""hixl: one-sided RDMA transfers in pure Python over the system's libibverbs (cffi).

The package root re-exports the public API; modules whose names start with
an underscore are private.  ``hixl.compat`` offers the call style of
Huawei's hixl Python API on top of the same engine.

Importing hixl works without libibverbs (the descriptor core and planner need
only numpy); opening an engine then raises :class:`DeviceError` saying why.

The names below are imported on first use (``hixl.Engine`` loads the engine, numpy and the
verbs binding then), so that ``import hixl.errors`` or the command line's small tools start
without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hixl.core.descriptors import (
        DEFAULT_ALIGNMENT,
        BlockListDesc,
        ContiguousDesc,
        Descriptor,
        NdStridedDesc,
        Segments,
        StridedDesc,
        desc_from_view,
    )
    from hixl.core.kv import ContiguousKVLayout, PagedKVLayout, padded_stride
    from hixl.core.plan import DeviceLimits, Op, Plan, plan_transfer
    from hixl.engine import (
        Access,
        BlocksHandle,
        Channel,
        Connection,
        ConnState,
        Diagnostics,
        Engine,
        KVCache,
        Notification,
        Region,
        RemoteRegion,
        TransferHandle,
        TransferRequest,
        TransferStatus,
    )
    from hixl.errors import (
        AlignmentError,
        ArgumentError,
        AuthenticationError,
        BoundsError,
        CompletionError,
        ConnectionFailed,
        DescriptorError,
        DeviceError,
        HandshakeError,
        HixlError,
        NameNotFound,
        PeerError,
        RegistrationError,
        RegistryError,
        RegistryUnavailable,
        StateError,
        TransferTimeout,
        VerbsError,
    )

_WHERE: dict[str, str] = {
    "Access": "hixl.engine",
    "AlignmentError": "hixl.errors",
    "ArgumentError": "hixl.errors",
    "AuthenticationError": "hixl.errors",
    "BlockListDesc": "hixl.core.descriptors",
    "BlocksHandle": "hixl.engine",
    "BoundsError": "hixl.errors",
    "Channel": "hixl.engine",
    "CompletionError": "hixl.errors",
    "ConnState": "hixl.engine",
    "Connection": "hixl.engine",
    "ConnectionFailed": "hixl.errors",
    "ContiguousDesc": "hixl.core.descriptors",
    "ContiguousKVLayout": "hixl.core.kv",
    "DEFAULT_ALIGNMENT": "hixl.core.descriptors",
    "Descriptor": "hixl.core.descriptors",
    "DescriptorError": "hixl.errors",
    "DeviceError": "hixl.errors",
    "DeviceLimits": "hixl.core.plan",
    "Diagnostics": "hixl.engine",
    "Engine": "hixl.engine",
    "HandshakeError": "hixl.errors",
    "HixlError": "hixl.errors",
    "KVCache": "hixl.engine",
    "NameNotFound": "hixl.errors",
    "NdStridedDesc": "hixl.core.descriptors",
    "Notification": "hixl.engine",
    "Op": "hixl.core.plan",
    "PagedKVLayout": "hixl.core.kv",
    "PeerError": "hixl.errors",
    "Plan": "hixl.core.plan",
    "Region": "hixl.engine",
    "RegistrationError": "hixl.errors",
    "RegistryError": "hixl.errors",
    "RegistryUnavailable": "hixl.errors",
    "RemoteRegion": "hixl.engine",
    "Segments": "hixl.core.descriptors",
    "StateError": "hixl.errors",
    "StridedDesc": "hixl.core.descriptors",
    "TransferHandle": "hixl.engine",
    "TransferRequest": "hixl.engine",
    "TransferStatus": "hixl.engine",
    "TransferTimeout": "hixl.errors",
    "VerbsError": "hixl.errors",
    "desc_from_view": "hixl.core.descriptors",
    "padded_stride": "hixl.core.kv",
    "plan_transfer": "hixl.core.plan",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'hixl' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ALIGNMENT",
    "Access",
    "AlignmentError",
    "ArgumentError",
    "AuthenticationError",
    "BlockListDesc",
    "BlocksHandle",
    "BoundsError",
    "Channel",
    "CompletionError",
    "ConnState",
    "Diagnostics",
    "Connection",
    "ConnectionFailed",
    "ContiguousDesc",
    "ContiguousKVLayout",
    "Descriptor",
    "DescriptorError",
    "DeviceError",
    "DeviceLimits",
    "Engine",
    "HandshakeError",
    "HixlError",
    "KVCache",
    "NameNotFound",
    "NdStridedDesc",
    "Notification",
    "Op",
    "PagedKVLayout",
    "PeerError",
    "Plan",
    "Region",
    "RegistrationError",
    "RegistryError",
    "RegistryUnavailable",
    "RemoteRegion",
    "Segments",
    "StateError",
    "StridedDesc",
    "TransferHandle",
    "TransferRequest",
    "TransferStatus",
    "TransferTimeout",
    "VerbsError",
    "__version__",
    "desc_from_view",
    "padded_stride",
    "plan_transfer",
]
