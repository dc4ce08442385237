"""The first real verbs path: two RC QPs on one device, RDMA WRITE and READ."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from hixl.errors import StateError
from hixl.verbs import adapter as _verbs


def _wait_one(cq: _verbs.CompletionQueue, timeout: float = 10.0) -> _verbs.Completion:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wcs = cq.poll(1)
        if wcs:
            return wcs[0]
        time.sleep(0.0005)
    raise AssertionError(f"no completion within {timeout} s")


def _pair(dev: _verbs.Device) -> tuple[_verbs.QueuePair, _verbs.QueuePair, _verbs.CompletionQueue]:
    cq = dev.create_cq(64)
    a = dev.create_rc_qp(cq, cq, 32, 4, dev.caps.max_sge)
    b = dev.create_rc_qp(cq, cq, 32, 4, dev.caps.max_sge)
    pa, pb = random.getrandbits(24), random.getrandbits(24)
    a.connect(b.qpn, pb, pa, dev.gid, dev.active_mtu)
    b.connect(a.qpn, pa, pb, dev.gid, dev.active_mtu)
    return a, b, cq


RW = _verbs.ACCESS_LOCAL_WRITE | _verbs.ACCESS_REMOTE_WRITE | _verbs.ACCESS_REMOTE_READ


def test_device_reports_rxe_limits(device: _verbs.Device) -> None:
    assert device.caps.max_sge >= 1
    assert device.caps.max_msg_sz >= 4096
    assert device.active_mtu in (256, 512, 1024, 2048, 4096)
    assert len(device.gid) == 16 and device.gid != bytes(16)


def test_rdma_write_then_read_moves_exact_bytes(device: _verbs.Device) -> None:
    a, b, cq = _pair(device)
    n = 256 * 1024
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    back = np.zeros(n, dtype=np.uint8)
    msrc = device.register(src.ctypes.data, n, _verbs.ACCESS_LOCAL_WRITE, src)
    mdst = device.register(dst.ctypes.data, n, RW, dst)
    mback = device.register(back.ctypes.data, n, _verbs.ACCESS_LOCAL_WRITE, back)

    a.post_send(
        [
            _verbs.SendRequest(
                1, _verbs.WR_RDMA_WRITE, [(msrc.addr, n, msrc.lkey)], mdst.addr, mdst.rkey
            )
        ]
    )
    wc = _wait_one(cq)
    assert wc.ok, wc.status_name
    assert wc.wr_id == 1
    assert np.array_equal(src, dst)

    a.post_send(
        [
            _verbs.SendRequest(
                2, _verbs.WR_RDMA_READ, [(mback.addr, n, mback.lkey)], mdst.addr, mdst.rkey
            )
        ]
    )
    wc = _wait_one(cq)
    assert wc.ok, wc.status_name
    assert np.array_equal(back, src)


def test_gather_write_with_unequal_sges_and_chain(device: _verbs.Device) -> None:
    a, b, cq = _pair(device)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    ms = device.register(src.ctypes.data, src.nbytes, _verbs.ACCESS_LOCAL_WRITE, src)
    md = device.register(dst.ctypes.data, dst.nbytes, RW, dst)
    # WR 1 gathers 3 unequal pieces into dst[0:700]; WR 2 moves src[2000:2100] to dst[1000:]
    sges = [
        (ms.addr + 0, 100, ms.lkey),
        (ms.addr + 512, 300, ms.lkey),
        (ms.addr + 3000, 300, ms.lkey),
    ]
    reqs = [
        _verbs.SendRequest(10, _verbs.WR_RDMA_WRITE, sges, md.addr, md.rkey, signaled=False),
        _verbs.SendRequest(
            11, _verbs.WR_RDMA_WRITE, [(ms.addr + 2000, 100, ms.lkey)], md.addr + 1000, md.rkey
        ),
    ]
    a.post_send(reqs)
    wc = _wait_one(cq)
    assert wc.ok and wc.wr_id == 11
    expect = np.zeros(4096, dtype=np.uint8)
    expect[0:700] = np.concatenate([src[0:100], src[512:812], src[3000:3300]])
    expect[1000:1100] = src[2000:2100]
    assert np.array_equal(dst, expect)


def test_bad_rkey_completes_with_remote_access_error(device: _verbs.Device) -> None:
    a, b, cq = _pair(device)
    buf = np.zeros(4096, dtype=np.uint8)
    m = device.register(buf.ctypes.data, buf.nbytes, RW, buf)
    a.post_send(
        [
            _verbs.SendRequest(
                5, _verbs.WR_RDMA_WRITE, [(m.addr, 64, m.lkey)], m.addr, m.rkey ^ 0x5A5A00
            )
        ]
    )
    wc = _wait_one(cq)
    assert not wc.ok
    assert wc.status_name == "IBV_WC_REM_ACCESS_ERR"


def test_close_is_idempotent_and_blocks_use(device: _verbs.Device) -> None:
    a, b, cq = _pair(device)
    a.close()
    a.close()
    with pytest.raises(StateError):
        a.post_send([_verbs.SendRequest(1, _verbs.WR_RDMA_WRITE, [], 0, 0)])
    device.close()
    device.close()
    assert device.closed
