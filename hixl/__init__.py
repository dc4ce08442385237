"""hixl: one-sided RDMA transfers in pure Python over pyverbs.

The package root re-exports the public API; modules whose names start with
an underscore are private.  ``hixl.compat`` offers the call style of
Huawei's hixl Python API on top of the same engine.

Importing hixl loads numpy only; pyverbs is imported when an engine opens a
device, so the descriptor core and planner work on machines without RDMA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hixl._descriptors import (
    DEFAULT_ALIGNMENT,
    BlockListDesc,
    ContiguousDesc,
    Descriptor,
    NdStridedDesc,
    Segments,
    StridedDesc,
    desc_from_view,
)
from hixl._errors import (
    AlignmentError,
    ArgumentError,
    BoundsError,
    CompletionError,
    ConnectionFailed,
    DescriptorError,
    DeviceError,
    HandshakeError,
    HixlError,
    PeerError,
    RegistrationError,
    StateError,
    TransferTimeout,
    VerbsError,
    VMError,
)
from hixl._kv import ContiguousKVLayout, PagedKVLayout, padded_stride
from hixl._plan import DeviceLimits, Op, Plan, plan_transfer

if TYPE_CHECKING:
    from hixl._engine import (
        Access,
        Connection,
        ConnState,
        Engine,
        Notification,
        Region,
        RemoteRegion,
        TransferHandle,
        TransferRequest,
        TransferStatus,
    )

__version__ = "0.1.0"

_ENGINE_NAMES = frozenset(
    {
        "Access",
        "Connection",
        "ConnState",
        "Engine",
        "Notification",
        "Region",
        "RemoteRegion",
        "TransferHandle",
        "TransferRequest",
        "TransferStatus",
    }
)


def __getattr__(name: str) -> Any:
    # The engine imports pyverbs; load it on first use so the pure core stays importable
    # (and fast to import) where pyverbs is missing.
    if name in _ENGINE_NAMES:
        from hixl import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module 'hixl' has no attribute {name!r}")


__all__ = [
    "DEFAULT_ALIGNMENT",
    "Access",
    "AlignmentError",
    "ArgumentError",
    "BlockListDesc",
    "BoundsError",
    "CompletionError",
    "ConnState",
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
    "NdStridedDesc",
    "Notification",
    "Op",
    "PagedKVLayout",
    "PeerError",
    "Plan",
    "Region",
    "RegistrationError",
    "RemoteRegion",
    "Segments",
    "StateError",
    "StridedDesc",
    "TransferHandle",
    "TransferRequest",
    "TransferStatus",
    "TransferTimeout",
    "VMError",
    "VerbsError",
    "__version__",
    "desc_from_view",
    "padded_stride",
    "plan_transfer",
]
