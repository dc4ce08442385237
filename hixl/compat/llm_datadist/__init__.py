"""CANN's ``llm_datadist`` Python API on top of hixl's engine.

Code written for Huawei's ``llm_datadist`` package (``LLMDataDist``, ``LLMConfig``,
``CacheManager``, ``push_blocks``/``pull_blocks`` ...) runs on a verbs NIC with its
import changed::

    from hixl.compat.llm_datadist import LLMDataDist, LLMConfig, ...

Caches are host memory (numpy arrays, CPU torch tensors): ``Placement.DEVICE`` is
treated as host memory, as ``hixl.compat`` treats ``MEM_DEVICE``.  Failures raise
:class:`LLMException` with CANN's :class:`LLMStatusCode`; calls that need Ascend
hardware (HCCL ranktable ``link``, device memory pools) raise it with
``LLM_FEATURE_NOT_ENABLED`` and say why.  ``docs/compat.md`` lists every call.

Layout: ``_status`` (codes, exception, argument checks), ``_types`` (value types),
``_config`` (``LLMConfig``, ``init`` options), ``_plan`` (region names, layer and
block planning) are pure; ``_node`` (the engines, links, caches), ``_manager``
(``CacheManager``, ``CacheTask``) and ``_datadist`` (``LLMDataDist``) use the engine.
"""

from __future__ import annotations

from hixl.compat.llm_datadist._config import (
    OPTION_DEVICE,
    OPTION_TOKEN,
    DataDistOptions,
    LLMConfig,
    LlmConfig,
    parse_options,
)
from hixl.compat.llm_datadist._datadist import LLMDataDist
from hixl.compat.llm_datadist._manager import CacheManager, CacheTask
from hixl.compat.llm_datadist._status import LLMException, LLMStatusCode, code_of
from hixl.compat.llm_datadist._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

KvCache = Cache  # the older name of a cache object


class Status:
    """A status holder (``Status(code).is_ok()``), as CANN's package has."""

    def __init__(self, status: LLMStatusCode) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        return self._status_code == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


# CANN's names, in the order of its llm_datadist/__init__.py, then this module's extras.
__all__ = [
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "LLMRole",
    "LlmConfig",
    "LLMConfig",
    "DataType",
    "Status",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "KvCache",
    "Cache",
    "BlocksCacheKey",
    "LLMDataDist",
    "Placement",
    "RegisterMemStatus",
    "LayerSynchronizer",
    "TransferConfig",
    "CacheTask",
    "TransferWithCacheKeyConfig",
    "Memtype",
    "MemInfo",
    # hixl.compat.llm_datadist extras
    "CacheManager",
    "DataDistOptions",
    "OPTION_DEVICE",
    "OPTION_TOKEN",
    "code_of",
    "parse_options",
]

_V1_NAMES = ("TensorDesc", "Tensor", "KvCacheManager")


def __getattr__(name: str) -> object:
    # CANN's package loads these from its older v1 module on demand; that API (device
    # tensors and the KvCacheManager mode) is not provided here.
    if name in _V1_NAMES:
        raise LLMException(
            f"llm_datadist.{name} belongs to the older v1 API (device tensors, "
            "KvCacheManager), which needs Ascend NPUs and is not provided here",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
