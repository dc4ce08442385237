"""Two RC queue pairs on one device connected to each other: the raw-verbs probes' wire.

The probes (``bench_overhead``'s per-WR cost on a device, ``bench_transfer --diagnose``'s
Python loop, ``bench_ceiling``'s ring) post on one and let the device deliver to the
other, with no engine, handshake or listener in between.
"""

from __future__ import annotations

import random
from typing import Any


def loopback_qp(dev: Any, cq: Any, max_send_wr: int, max_send_sge: int) -> tuple[Any, Any]:
    """``(a, b)``: two RC queue pairs of ``dev`` on completion queue ``cq`` (send and
    receive), each connected to the other, ready to send (random start PSNs)."""
    a = dev.create_rc_qp(cq, cq, max_send_wr, 4, max_send_sge)
    b = dev.create_rc_qp(cq, cq, max_send_wr, 4, max_send_sge)
    pa, pb = random.getrandbits(24), random.getrandbits(24)
    a.connect(b.qpn, pb, pa, dev.gid, dev.active_mtu)
    b.connect(a.qpn, pa, pb, dev.gid, dev.active_mtu)
    return a, b
