"""hixl: one-sided RDMA transfers in pure Python over pyverbs.

The package root re-exports the public API; modules whose names start with
an underscore are private.  ``hixl.compat`` offers the call style of
Huawei's hixl Python API on top of the same engine.

Importing hixl works without pyverbs (the descriptor core and planner need
only numpy); opening an engine then raises :class:`DeviceError` saying why.
"""

from __future__ import annotations

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

__version__ = "0.1.0"

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
