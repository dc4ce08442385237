#!/usr/bin/env python3
"""Move a buffer between two processes with the hixl Python API, and check every byte.

This is written the way a user of Huawei's hixl package writes it: status codes,
``register_mem`` with a ``MemDesc``, ``transfer_sync``/``transfer_async`` with
``TransferOpDesc`` lists of absolute addresses, ``send_notify``/``get_notifies``.
The only line that differs from code for Ascend is the marked import.

The server fills the first half of a buffer with a pattern and registers it.
The client reads that half with ``transfer_sync(READ)``, checks it, writes its
own pattern into the second half with ``transfer_async(WRITE)``, polls it to
completion and sends a notification; the server then checks the second half.
Each process exits 0 only when every byte it checked is right.

    python examples/hixl_style_script.py --role server --local-engine 127.0.0.1:16001 &
    python examples/hixl_style_script.py --role client --remote-engine 127.0.0.1:16001

Host memory only: an NPU tensor's ``data_ptr()`` becomes a numpy buffer's address.
The server tells the client the buffer's address over a plain TCP socket (port
``--side-port``, by default the engine port + 1000), as hixl's samples do.
"""

from __future__ import annotations

import argparse
import logging
import socket
import struct
import sys
import time

import numpy as np

from hixl import compat as hixl  # on Ascend: `import hixl` -- the only line that changes

BUF_SIZE = 1024 * 1024
HALF = BUF_SIZE // 2
BLOCK = 16 * 1024 + 40  # deliberately not a power of two: any address works
CONNECT_TIMEOUT_MS = 10_000
TRANSFER_TIMEOUT_MS = 30_000
DONE_NOTIFY = "client_done"
WAIT_S = 120.0

log = logging.getLogger("hixl_style_script")


def server_pattern() -> np.ndarray:
    return (np.arange(HALF, dtype=np.uint32) * 7 % 251).astype(np.uint8)


def client_pattern() -> np.ndarray:
    return (np.arange(HALF, dtype=np.uint32) * 13 % 239 + 1).astype(np.uint8)


def op_descs(local_addr: int, remote_addr: int, nbytes: int) -> list[hixl.TransferOpDesc]:
    descs = []
    offset = 0
    while offset < nbytes:
        size = min(BLOCK, nbytes - offset)
        descs.append(
            hixl.TransferOpDesc(
                local_addr=local_addr + offset, remote_addr=remote_addr + offset, len=size
            )
        )
        offset += size
    return descs


def port_of(engine: str) -> int:
    return int(engine.rpartition(":")[2])


def run_server(args: argparse.Namespace) -> int:
    buf = np.zeros(BUF_SIZE, dtype=np.uint8)
    buf[:HALF] = server_pattern()
    addr = int(buf.ctypes.data)

    engine = hixl.Hixl()
    handle = None
    try:
        ret = engine.initialize(args.local_engine, {hixl.OPTION_BUFFER_POOL: "0:0"})
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"server initialize failed, ret={ret}")
        ret, handle = engine.register_mem(hixl.MemDesc(addr, BUF_SIZE), hixl.MemType.MEM_HOST)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"server register_mem failed, ret={ret}")
        log.info("server buffer at 0x%x, %d bytes, handle %d", addr, BUF_SIZE, handle)

        with socket.create_server(("127.0.0.1", args.side_port)) as side:
            side.settimeout(WAIT_S)
            conn, _ = side.accept()
            with conn:
                conn.sendall(struct.pack("!QQ", addr, BUF_SIZE))

        deadline = time.monotonic() + WAIT_S
        done = None
        while done is None and time.monotonic() < deadline:
            ret, notifies = engine.get_notifies()
            if ret != hixl.SUCCESS:
                raise RuntimeError(f"server get_notifies failed, ret={ret}")
            done = next((n for n in notifies if n.name == DONE_NOTIFY), None)
            time.sleep(0.01)
        if done is None:
            raise RuntimeError(f"no {DONE_NOTIFY!r} notification within {WAIT_S} s")
        log.info("server got %s: %s", done.name, done.notify_msg)

        if not np.array_equal(buf[HALF:], client_pattern()):
            bad = int(np.count_nonzero(buf[HALF:] != client_pattern()))
            raise RuntimeError(f"server verify failed: {bad} of {HALF} written bytes differ")
        if not np.array_equal(buf[:HALF], server_pattern()):
            raise RuntimeError("server verify failed: the first half changed")
        log.info("server verify ok: %d bytes written by the client are right", HALF)
        return 0
    finally:
        if handle is not None:
            ret = engine.deregister_mem(handle)
            if ret != hixl.SUCCESS:
                log.warning("server deregister_mem ret=%s", ret)
        engine.finalize()


def fetch_remote_addr(side_port: int) -> tuple[int, int]:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", side_port), timeout=5.0) as sock:
                data = b""
                while len(data) < 16:
                    chunk = sock.recv(16 - len(data))
                    if not chunk:
                        raise ConnectionError("server closed the side channel early")
                    data += chunk
                addr, size = struct.unpack("!QQ", data)
                return int(addr), int(size)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_client(args: argparse.Namespace) -> int:
    buf = np.zeros(BUF_SIZE, dtype=np.uint8)
    buf[HALF:] = client_pattern()
    addr = int(buf.ctypes.data)

    engine = hixl.Hixl()
    handle = None
    connected = False
    try:
        ret = engine.initialize(args.local_engine, {})
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client initialize failed, ret={ret}")
        ret, handle = engine.register_mem(hixl.MemDesc(addr, BUF_SIZE), hixl.MemType.MEM_HOST)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client register_mem failed, ret={ret}")

        remote_addr, remote_size = fetch_remote_addr(args.side_port)
        log.info("client: remote buffer at 0x%x, %d bytes", remote_addr, remote_size)

        ret = engine.connect(args.remote_engine, timeout_in_millis=CONNECT_TIMEOUT_MS)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client connect failed, ret={ret}")
        connected = True

        descs = op_descs(addr, remote_addr, HALF)
        ret = engine.transfer_sync(
            args.remote_engine, hixl.TransferOp.READ, descs, timeout_in_millis=TRANSFER_TIMEOUT_MS
        )
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client transfer_sync READ failed, ret={ret}")
        if not np.array_equal(buf[:HALF], server_pattern()):
            bad = int(np.count_nonzero(buf[:HALF] != server_pattern()))
            raise RuntimeError(f"client verify failed: {bad} of {HALF} read bytes differ")
        log.info("client read %d bytes in %d descs, verify ok", HALF, len(descs))

        descs = op_descs(addr + HALF, remote_addr + HALF, HALF)
        ret, req = engine.transfer_async(args.remote_engine, hixl.TransferOp.WRITE, descs)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client transfer_async WRITE failed, ret={ret}")
        deadline = time.monotonic() + TRANSFER_TIMEOUT_MS / 1000
        while True:
            ret, status = engine.get_transfer_status(req)
            if ret != hixl.SUCCESS or status == hixl.TransferStatus.FAILED:
                raise RuntimeError(f"client async WRITE failed, ret={ret} status={status}")
            if status == hixl.TransferStatus.COMPLETED:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("client async WRITE still waiting at its deadline")
            time.sleep(0.001)
        log.info("client wrote %d bytes in %d descs", HALF, len(descs))

        notify = hixl.NotifyDesc(name=DONE_NOTIFY, notify_msg=f"{HALF} bytes written")
        ret = engine.send_notify(args.remote_engine, notify, timeout_in_millis=CONNECT_TIMEOUT_MS)
        if ret != hixl.SUCCESS:
            raise RuntimeError(f"client send_notify failed, ret={ret}")
        return 0
    finally:
        if connected:
            ret = engine.disconnect(args.remote_engine, timeout_in_millis=CONNECT_TIMEOUT_MS)
            if ret != hixl.SUCCESS:
                log.warning("client disconnect ret=%s", ret)
        if handle is not None:
            ret = engine.deregister_mem(handle)
            if ret != hixl.SUCCESS:
                log.warning("client deregister_mem ret=%s", ret)
        engine.finalize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", required=True, choices=["server", "client"])
    parser.add_argument("--local-engine", default=None, help="server: ip:port, client: ip")
    parser.add_argument("--remote-engine", default="127.0.0.1:16001", help="the server's ip:port")
    parser.add_argument("--side-port", type=int, default=None, help="address exchange port")
    args = parser.parse_args(argv)
    if args.local_engine is None:
        args.local_engine = "127.0.0.1:16001" if args.role == "server" else "127.0.0.1"
    if args.side_port is None:
        server = args.local_engine if args.role == "server" else args.remote_engine
        args.side_port = port_of(server) + 1000
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", level="INFO")
    args = parse_args(argv)
    try:
        code = run_server(args) if args.role == "server" else run_client(args)
    except (RuntimeError, OSError) as exc:
        log.error("%s failed: %s", args.role, exc)
        return 1
    log.info("%s finished", args.role)
    return code


if __name__ == "__main__":
    sys.exit(main())
