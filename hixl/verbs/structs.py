"""The verbs structs hixl writes and reads, as numpy sees them.

:data:`WR_DTYPE`, :data:`SGE_DTYPE` and :data:`WC_DTYPE` are numpy structured dtypes
laid out with cffi's own offsets and sizes for ``struct ibv_send_wr``, ``struct ibv_sge``
and ``struct ibv_wc``, so an array of them is a view of the C memory itself: send chains
are filled and completions read by vectorized numpy, with no Python object per entry.
The send flags hixl sets are here too.

Like the rest of the chain code this imports no verbs library (cffi's ``ffi`` only knows
the layouts), so it works on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hixl.verbs._ffi import ffi

__all__ = ["SEND_FENCE", "SEND_SIGNALED", "SGE_DTYPE", "WC_DTYPE", "WR_BYTES", "WR_DTYPE"]

#: ``IBV_SEND_SIGNALED``.
SEND_SIGNALED = 2
#: ``IBV_SEND_FENCE``: start only after every earlier READ/atomic has completed.
SEND_FENCE = 1


def _dtype(cname: str, fields: Sequence[tuple[str, str, tuple[str, ...]]]) -> np.dtype[Any]:
    """A numpy structured dtype with cffi's offsets and itemsize for ``cname``."""
    return np.dtype(
        {
            "names": [f[0] for f in fields],
            "formats": [f[1] for f in fields],
            "offsets": [ffi.offsetof(cname, *f[2]) for f in fields],
            "itemsize": ffi.sizeof(cname),
        }
    )


#: numpy view of ``struct ibv_send_wr`` (the fields hixl writes).
WR_DTYPE = _dtype(
    "struct ibv_send_wr",
    [
        ("wr_id", "<u8", ("wr_id",)),
        ("next", "<u8", ("next",)),
        ("sg_list", "<u8", ("sg_list",)),
        ("num_sge", "<i4", ("num_sge",)),
        ("opcode", "<i4", ("opcode",)),
        ("send_flags", "<u4", ("send_flags",)),
        ("imm_data", "<u4", ("imm_data",)),
        ("remote_addr", "<u8", ("wr", "rdma", "remote_addr")),
        ("rkey", "<u4", ("wr", "rdma", "rkey")),
    ],
)

#: numpy view of ``struct ibv_sge``.
SGE_DTYPE = _dtype(
    "struct ibv_sge",
    [("addr", "<u8", ("addr",)), ("length", "<u4", ("length",)), ("lkey", "<u4", ("lkey",))],
)

#: numpy view of ``struct ibv_wc``.
WC_DTYPE = _dtype(
    "struct ibv_wc",
    [
        ("wr_id", "<u8", ("wr_id",)),
        ("status", "<i4", ("status",)),
        ("opcode", "<i4", ("opcode",)),
        ("vendor_err", "<u4", ("vendor_err",)),
        ("byte_len", "<u4", ("byte_len",)),
        ("imm_data", "<u4", ("imm_data",)),
        ("qp_num", "<u4", ("qp_num",)),
        ("src_qp", "<u4", ("src_qp",)),
        ("wc_flags", "<u4", ("wc_flags",)),
    ],
)

#: Bytes of one ``struct ibv_send_wr``.
WR_BYTES = WR_DTYPE.itemsize
