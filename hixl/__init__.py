"""hixl: one-sided RDMA transfers in pure Python over pyverbs.

The package root re-exports the public API; modules whose names start with
an underscore are private.
"""

from __future__ import annotations

from hixl._errors import (
    AlignmentError,
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

__version__ = "0.1.0"

__all__ = [
    "AlignmentError",
    "BoundsError",
    "CompletionError",
    "ConnectionFailed",
    "DescriptorError",
    "DeviceError",
    "HandshakeError",
    "HixlError",
    "PeerError",
    "RegistrationError",
    "StateError",
    "TransferTimeout",
    "VMError",
    "VerbsError",
    "__version__",
]
