"""The single exception tree of hixl.

Every error hixl raises derives from :class:`HixlError`.  Where a builtin
exception describes the same kind of failure, the hixl class inherits it too,
so ``except ValueError`` and ``except TimeoutError`` keep working for callers
who do not know about hixl.
"""

from __future__ import annotations

__all__ = [
    "HixlError",
    "ArgumentError",
    "DescriptorError",
    "AlignmentError",
    "BoundsError",
    "RegistrationError",
    "DeviceError",
    "VerbsError",
    "CompletionError",
    "TransferTimeout",
    "PeerError",
    "HandshakeError",
    "AuthenticationError",
    "ConnectionFailed",
    "StateError",
    "VMError",
    "RegistryError",
    "RegistryUnavailable",
    "NameNotFound",
]


class HixlError(Exception):
    """Root of every error raised by hixl."""


class ArgumentError(HixlError, ValueError):
    """An argument is malformed: a bad engine id, notification name, option value..."""


class DescriptorError(HixlError, ValueError):
    """A descriptor is malformed: bad sizes, overlap, overflow, mismatched totals."""


class AlignmentError(DescriptorError):
    """An address, offset or stride breaks the alignment policy."""


class BoundsError(HixlError, ValueError):
    """A transfer reaches outside the memory region it names."""


class RegistrationError(HixlError, ValueError):
    """Memory is not registered, or not registered with the access a transfer needs."""


class DeviceError(HixlError):
    """No usable verbs device: missing kernel support, no device, no active port."""


class VerbsError(HixlError, OSError):
    """A verbs call failed.

    ``op`` names the operation (``"reg_mr"``, ``"modify_qp(RTR)"``, ...),
    ``errno`` carries the OS error number when the library reported one.
    """

    def __init__(self, op: str, message: str, errno: int | None = None) -> None:
        detail = f"{op} failed: {message}"
        if errno:
            detail += f" (errno {errno})"
        super().__init__(detail)
        self.op = op
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0])


class CompletionError(VerbsError):
    """A work request completed with an error status.

    ``status`` is the numeric ``ibv_wc_status`` and ``status_name`` its name,
    for example ``IBV_WC_REM_ACCESS_ERR``.
    """

    def __init__(
        self, op: str, status: int, status_name: str, wr_id: int = 0, vendor_err: int = 0
    ) -> None:
        super().__init__(
            op,
            f"completion status {status_name} ({status}), wr_id={wr_id}, "
            f"vendor_err={vendor_err:#x}",
        )
        self.status = status
        self.status_name = status_name
        self.wr_id = wr_id
        self.vendor_err = vendor_err


class TransferTimeout(HixlError, TimeoutError):
    """A transfer, connection or wait did not finish before its deadline."""


class PeerError(HixlError, ConnectionError):
    """Something is wrong with a remote peer or the connection to it."""


class HandshakeError(PeerError):
    """Metadata received from the network is malformed, untrusted or incompatible."""


class AuthenticationError(HandshakeError):
    """A handshake proof did not match: a different token, a token on one side only, or
    handshake messages altered on the way. The message says which side lacks what."""


class ConnectionFailed(PeerError):
    """A connection could not be set up, or failed and can no longer be used."""


class StateError(HixlError, RuntimeError):
    """An object was used in a state that does not allow the call (closed, failed...)."""


class VMError(HixlError):
    """The soft-RoCE VM could not be found, booted, or did not finish in time."""


class RegistryError(HixlError):
    """The engine registry (etcd or the in-process one) refused or failed a call."""


class RegistryUnavailable(RegistryError, ConnectionError):
    """The registry cannot be reached in time; the message names its URL."""


class NameNotFound(RegistryError, LookupError):
    """No live engine is announced under the name asked for."""
