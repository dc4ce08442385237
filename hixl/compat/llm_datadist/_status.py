"""``LLMStatusCode``, ``LLMException`` and how hixl's errors map onto them (pure).

The numbers are CANN's (hicann/hixl ``include/llm_datadist/llm_error_codes.h``:
``0x5010B000 + n`` for the LLM codes, ``0xFFFFFFFF`` for ``LLM_FAILED``, the ACL
runtime's 507053/507057 for the two memory-error codes), so a status logged here
reads the same as one logged on Ascend.

Argument checks follow the binding's Python layer: a value of the wrong type raises
``TypeError``, an integer out of its C range ``ValueError``, and a value that is the
right type but not allowed (an empty block list, a layer range past the cache)
raises :class:`LLMException` with ``LLM_PARAM_INVALID``.
"""

from __future__ import annotations

import enum
from typing import NoReturn

from hixl.errors import (
    AlignmentError,
    ArgumentError,
    BoundsError,
    CompletionError,
    ConnectionFailed,
    DescriptorError,
    DeviceError,
    HandshakeError,
    RegistrationError,
    StateError,
    TransferTimeout,
    VerbsError,
)

__all__ = [
    "LLMException",
    "LLMStatusCode",
    "check_int",
    "check_type",
    "code_of",
    "refuse",
    "require",
]

_LLM = 0x5010B000


class LLMStatusCode(enum.IntEnum):
    """Status codes of ``llm_datadist`` (``LLMException.status_code``)."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_PARAM_INVALID = _LLM + 5
    LLM_WAIT_PROCESS_TIMEOUT = _LLM + 1
    LLM_KV_CACHE_NOT_EXIST = _LLM + 2
    LLM_REPEAT_REQUEST = _LLM + 3
    LLM_REQUEST_ALREADY_COMPLETED = _LLM + 4
    LLM_ENGINE_FINALIZED = _LLM + 6
    LLM_NOT_YET_LINK = _LLM + 7
    LLM_ALREADY_LINK = _LLM + 8
    LLM_LINK_FAILED = _LLM + 9
    LLM_UNLINK_FAILED = _LLM + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _LLM + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _LLM + 12
    LLM_PROCESSING_LINK = _LLM + 13
    LLM_DEVICE_OUT_OF_MEMORY = _LLM + 14
    LLM_PREFIX_ALREADY_EXIST = _LLM + 15
    LLM_PREFIX_NOT_EXIST = _LLM + 16
    LLM_SEQ_LENOVERLIMIT = _LLM + 17
    LLM_NO_FREE_BLOCK = _LLM + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _LLM + 19
    LLM_EXIST_LINK = _LLM + 24
    LLM_FEATURE_NOT_ENABLED = _LLM + 25
    LLM_TIMEOUT = _LLM + 26
    LLM_LINK_BUSY = _LLM + 27
    LLM_OUT_OF_MEMORY = _LLM + 28
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class LLMException(RuntimeError):
    """A failed ``llm_datadist`` call; :attr:`status_code` says which kind."""

    def __init__(
        self, *args: object, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS
    ) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


def refuse(code: LLMStatusCode, message: str) -> NoReturn:
    """Raise :class:`LLMException` with ``code`` and ``message``."""
    raise LLMException(message, status_code=code)


def require(
    condition: bool, message: str, code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID
) -> None:
    """Raise :class:`LLMException` (``LLM_PARAM_INVALID`` unless told) when not ``condition``."""
    if not condition:
        raise LLMException(message, status_code=code)


def check_type(name: str, value: object, *types: type, allow_none: bool = False) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is one of ``types`` (bool is not int)."""
    if value is None and allow_none:
        return
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = ", ".join(t.__name__ for t in types)
        raise TypeError(f"{name} must be {wanted}, got {type(value).__name__}: {value!r}")


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``: ``TypeError`` if not an int, else ``ValueError``."""
    check_type(name, value, int)
    assert isinstance(value, int)
    if not low <= value <= high:
        raise ValueError(f"{name}={value} is out of range [{low}, {high}]")
    return value


def code_of(exc: BaseException) -> LLMStatusCode:
    """The status code an ``llm_datadist`` call reports for an engine error ``exc``.

    Bad arguments, descriptors, bounds and registrations give ``LLM_PARAM_INVALID``;
    a deadline ``LLM_TIMEOUT``; a connection that is gone ``LLM_NOT_YET_LINK``
    (the link must be made again); completion, device and other errors ``LLM_FAILED``.
    """
    if isinstance(exc, LLMException):
        return exc.status_code
    if isinstance(exc, TransferTimeout):
        return LLMStatusCode.LLM_TIMEOUT
    if isinstance(
        exc, ArgumentError | DescriptorError | AlignmentError | BoundsError | RegistrationError
    ):
        return LLMStatusCode.LLM_PARAM_INVALID
    if isinstance(exc, HandshakeError):
        return LLMStatusCode.LLM_LINK_FAILED
    if isinstance(exc, CompletionError):
        return LLMStatusCode.LLM_FAILED
    if isinstance(exc, ConnectionFailed):
        return LLMStatusCode.LLM_NOT_YET_LINK
    if isinstance(exc, DeviceError | VerbsError | StateError):
        return LLMStatusCode.LLM_FAILED
    if isinstance(exc, TimeoutError):
        return LLMStatusCode.LLM_TIMEOUT
    return LLMStatusCode.LLM_FAILED
