"""hixl: one-sided RDMA transfers in pure Python over the system's libibverbs (cffi).

The package root re-exports the public API; modules whose names start with
an underscore are private.  ``hixl.compat`` offers the call style of
Huawei's hixl Python API on top of the same engine.

Importing hixl works without libibverbs (the descriptor core and planner need
only numpy); opening an engine then raises :class:`DeviceError` saying why.
"""

from __future__ import annotations

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
