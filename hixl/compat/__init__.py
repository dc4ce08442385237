"""Huawei CANN hixl's Python API on top of hixl's own engine.

Code written against Huawei's ``hixl`` Python package (``hixl.Hixl``,
``register_mem``, ``transfer_sync``, status codes ...) runs on a verbs NIC by
changing one import::

    from hixl import compat as hixl      # instead of: import hixl

Every name the binding exports (hicann/hixl ``src/python/hixl_py/hixl_py.cc``
and ``hixl/__init__.py``) is here with the same numbers, defaults, argument
names and return shapes.  Calls return a status code or ``(status, value)``
and do not raise for a failure; the reason goes to the ``hixl.compat``
logger and to :attr:`Hixl.last_error`.  ``docs/compat.md`` lists the
differences that remain and why.

Layout: ``_types`` (names, enums, value classes), ``_options`` (initialize
options), ``_descs`` (desc checking and grouping), ``_notify`` (notify limits
and fragments), ``_pool`` (buffer-pool relay), ``_connect`` (async connect
workers), ``_hixl`` (the ``Hixl`` object).  All but ``_pool``, ``_connect``
and ``_hixl`` are pure.
"""

from __future__ import annotations

from hixl.compat._descs import DescGroup, RelayPiece, checked_desc, group_op_descs, plan_relay
from hixl.compat._hixl import Hixl, get_capability
from hixl.compat._notify import check_notify
from hixl.compat._options import (
    OPTION_ALIGNMENT,
    OPTION_ASYNC_TRANSFER_TIMEOUT,
    OPTION_DEVICE,
    OPTION_GIL_SWITCH_INTERVAL,
    OPTION_TOKEN,
    ChannelPool,
    CompatOptions,
    engine_id_for,
    parse_options,
    status_of,
)
from hixl.compat._types import (
    ALREADY_CONNECTED,
    AUTO_CONNECT,
    CLIENT_SERVER_COMM,
    CONNECT_FAILED,
    CONNECT_PENDING,
    CONNECTED,
    CONNECTING,
    DISCONNECT_PENDING,
    DISCONNECTING,
    FAILED,
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    MEM_DEVICE,
    MEM_HOST,
    NOT_CONNECT,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    PARAM_INVALID,
    READ,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    UNSUPPORTED,
    WRITE,
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    Status,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
)

# The binding's names, in the order of its hixl/__init__.py.
__all__ = [
    "SUCCESS",
    "PARAM_INVALID",
    "TIMEOUT",
    "NOT_CONNECTED",
    "ALREADY_CONNECTED",
    "NOTIFY_FAILED",
    "UNSUPPORTED",
    "FAILED",
    "RESOURCE_EXHAUSTED",
    "OPTION_ENABLE_USE_FABRIC_MEM",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES",
    "FEATURE_SUPPORTED",
    "FEATURE_NOT_SUPPORTED",
    "MemType",
    "MEM_DEVICE",
    "MEM_HOST",
    "TransferOp",
    "READ",
    "WRITE",
    "TransferStatus",
    "AsyncConnectStatus",
    "NOT_CONNECT",
    "CONNECT_PENDING",
    "CONNECTING",
    "CONNECTED",
    "CONNECT_FAILED",
    "DISCONNECT_PENDING",
    "DISCONNECTING",
    "FeatureType",
    "AUTO_CONNECT",
    "CLIENT_SERVER_COMM",
    "MemDesc",
    "TransferOpDesc",
    "TransferArgs",
    "GetTransferStatusArgs",
    "TransferResult",
    "NotifyDesc",
    "Hixl",
    "get_capability",
    # hixl.compat extras (not in Huawei's binding)
    "OPTION_ALIGNMENT",
    "OPTION_ASYNC_TRANSFER_TIMEOUT",
    "OPTION_DEVICE",
    "OPTION_GIL_SWITCH_INTERVAL",
    "OPTION_TOKEN",
    "ChannelPool",
    "CompatOptions",
    "DescGroup",
    "RelayPiece",
    "Status",
    "check_notify",
    "checked_desc",
    "engine_id_for",
    "group_op_descs",
    "parse_options",
    "plan_relay",
    "status_of",
]
