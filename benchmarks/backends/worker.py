"""One side (target or initiator) of one contender, in a process of its own.

The peers benchmark starts two of these per contender, a target and an initiator, each
with the Python of the contender's environment: the project's venv for hixl, the peers'
venv (``.venv-peers``) for Mooncake. So this file imports nothing from the project at top
level (the peers' venv has neither hixl nor numpy) and each library only when its backend
is chosen.

The driver talks to it in JSON lines on stdin/stdout; stdout carries nothing else.

    {"op": "init", "role": "target"|"initiator", "nbytes": N, "device": "rxe0"}
        -> {"ok": true, "info": {...}, "version": "..."}   (the target's info goes to
           the initiator's "connect")
    {"op": "connect", "peer": {...}}                      initiator
    {"op": "fill", "seed": S}                             new pseudo-random buffer bytes
    {"op": "digest", "ranges": [[off, len], ...]}        -> {"digest": hex}
    {"op": "cpu"}                                         -> {"cpu_s": user + system}
    {"op": "run", "segments": [[src, dst, len], ...], "mode": "stream"|"request",
     "depth": D}                                          -> {"wall_s", "cpu_s"}
    {"op": "latency", "size": S, "iters": N, "warmup": W} -> {"samples_us": [...]}
    {"op": "quit"}

``stream`` moves each segment as its own message with at most ``depth`` in flight (what
``ib_write_bw -t D`` does); ``request`` hands all segments to the library in one call (one
put with a block list for hixl, one batch for Mooncake). Both are RDMA WRITEs from the
initiator's buffer into the target's. Errors come back as ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import random
import resource
import sys
import time
import traceback
from collections import deque
from typing import Any


def cpu_seconds() -> float:
    """User plus system CPU time of this whole process (all its threads), in seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Buffer:
    """Page-aligned anonymous memory with a stable address (registered by the backends)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError(f"buffer size must be >= 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.mm = mmap.mmap(-1, nbytes)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.view = memoryview(self.mm)

    def fill(self, seed: int) -> None:
        self.view[:] = random.Random(seed).randbytes(self.nbytes)

    def digest(self, ranges: list[list[int]]) -> str:
        h = hashlib.blake2b(digest_size=16)
        for off, n in ranges:
            if off < 0 or n < 0 or off + n > self.nbytes:
                raise ValueError(
                    f"digest range out of bounds: offset={off} nbytes={n} buffer={self.nbytes}"
                )
            h.update(self.view[off : off + n])
        return h.hexdigest()


class Side:
    """What every backend provides; the buffer is the source (initiator) or sink (target).

    ``blocking`` says whether the library has a blocking write (for the latency test).
    """

    version = "unknown"
    blocking = True

    def __init__(self, role: str, buf: Buffer, device: str) -> None:
        self.role = role
        self.buf = buf
        self.device = device

    def info(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> None:
        raise NotImplementedError

    def stream(self, segments: list[list[int]], depth: int) -> None:
        raise NotImplementedError

    def request(self, segments: list[list[int]]) -> None:
        raise NotImplementedError

    def blocking_write(self, size: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class HixlSide(Side):
    """hixl: a listening engine (target) or a connect-only engine (initiator)."""

    def __init__(self, role: str, buf: Buffer, device: str) -> None:
        super().__init__(role, buf, device)
        import hixl
        from hixl import Access, BlockListDesc, ContiguousDesc, Engine
        from hixl.testbed.net import free_tcp_port

        self.hixl = hixl
        # Kept here: an import statement in the per-message path costs about as much
        # as the descriptor it names (``_handle_fromlist``, a Python call, per import).
        self._ranges = ContiguousDesc
        self._block_list = BlockListDesc
        self.version = getattr(hixl, "__version__", "unknown")
        if role == "target":
            self.engine = Engine(f"127.0.0.1:{free_tcp_port()}", device=device)
            self.engine.register(buf.mm, access=Access.REMOTE_WRITE, name="sink")
        else:
            self.engine = Engine("127.0.0.1:0", device=device)
            self.region = self.engine.register(buf.mm, access=Access.NONE)
        self.peer = ""

    def info(self) -> dict[str, Any]:
        return {"id": self.engine.id}

    def connect(self, peer: dict[str, Any]) -> None:
        self.peer = str(peer["id"])
        self.engine.connect(self.peer, timeout=30.0)

    def _put_async(self, src: int, dst: int, n: int) -> Any:
        ranges = self._ranges
        return self.engine.put_async(
            self.peer,
            self.region,
            "sink",
            local_desc=ranges(offset=src, nbytes=n, alignment=None),
            remote_desc=ranges(offset=dst, nbytes=n, alignment=None),
            timeout=120.0,
        )

    def stream(self, segments: list[list[int]], depth: int) -> None:
        window: deque[Any] = deque()
        for src, dst, n in segments:
            if len(window) >= depth:
                window.popleft().wait()
            window.append(self._put_async(src, dst, n))
        while window:
            window.popleft().wait()

    def _blocks(self, segments: list[list[int]]) -> dict[str, Any]:
        """The segments as the local and remote block lists of one transfer."""
        blocks = self._block_list
        lengths = [s[2] for s in segments]
        return {
            "local_desc": blocks(offsets=[s[0] for s in segments], lengths=lengths, alignment=None),
            "remote_desc": blocks(
                offsets=[s[1] for s in segments], lengths=lengths, alignment=None
            ),
        }

    def request(self, segments: list[list[int]]) -> None:
        self.engine.put(self.peer, self.region, "sink", timeout=300.0, **self._blocks(segments))

    def blocking_write(self, size: int) -> None:
        desc = self._ranges(offset=0, nbytes=size)
        self.engine.put(
            self.peer, self.region, "sink", local_desc=desc, remote_desc=desc, timeout=60.0
        )

    def close(self) -> None:
        self.engine.close()


class HixlBatchesSide(HixlSide):
    """hixl streaming as Mooncake's batches do: each batch of depth/2 messages is one
    ``put_async`` of a block list, two batches in flight.  Requests and the blocking
    write are hixl's own (not reported twice)."""

    blocking = False

    def stream(self, segments: list[list[int]], depth: int) -> None:
        step = max(1, depth // 2)
        window: deque[Any] = deque()
        for i in range(0, len(segments), step):
            if len(window) >= 2:
                window.popleft().wait()
            descs = self._blocks(segments[i : i + step])
            window.append(
                self.engine.put_async(self.peer, self.region, "sink", timeout=120.0, **descs)
            )
        while window:
            window.popleft().wait()


class MooncakeSide(Side):
    """Mooncake Transfer Engine: P2P handshake (no metadata server), RDMA on ``device``.

    Its Python calls return 0 on success and a negative code on failure; batch calls
    return a batch id, which ``get_batch_transfer_status`` waits for.
    """

    def __init__(self, role: str, buf: Buffer, device: str) -> None:
        super().__init__(role, buf, device)
        from importlib.metadata import version

        from mooncake.engine import TransferEngine

        self.version = version("mooncake-transfer-engine-non-cuda")
        self.te = TransferEngine()
        self._ok(self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", device), "initialize")
        self._ok(self.te.register_memory(buf.address, buf.nbytes, "cpu:0"), "register_memory")
        self.target = ""
        self.remote_base = 0

    @staticmethod
    def _ok(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"mooncake {what} returned {rc}")

    def info(self) -> dict[str, Any]:
        return {"segment": f"127.0.0.1:{self.te.get_rpc_port()}", "base": self.buf.address}

    def connect(self, peer: dict[str, Any]) -> None:
        self.target = str(peer["segment"])
        self.remote_base = int(peer["base"])
        # The first transfer opens the connection: make it now, untimed.
        self._ok(
            self.te.transfer_sync_write(self.target, self.buf.address, self.remote_base, 64),
            "transfer_sync_write (connect)",
        )

    def _batch(self, segments: list[list[int]]) -> int:
        base, rbase = self.buf.address, self.remote_base
        bid = self.te.batch_transfer_async_write(
            self.target,
            [base + s[0] for s in segments],
            [rbase + s[1] for s in segments],
            [s[2] for s in segments],
        )
        if bid <= 0:
            raise RuntimeError(f"mooncake batch_transfer_async_write returned {bid}")
        return int(bid)

    def _wait(self, bid: int) -> None:
        self._ok(self.te.get_batch_transfer_status([bid]), "get_batch_transfer_status")

    def stream(self, segments: list[list[int]], depth: int) -> None:
        # No handle per message: ``batches`` batches in flight (HIXL_PEER_MC_BATCHES, 2 by
        # default; "depth": as many as hixl has requests in flight) of depth/batches
        # messages each, so that at most ``depth`` messages are outstanding, as for every
        # other contender.
        wanted = os.environ.get("HIXL_PEER_MC_BATCHES", "2")
        batches = depth if wanted == "depth" else max(1, int(wanted))
        step = max(1, depth // batches)
        window: deque[int] = deque()
        for i in range(0, len(segments), step):
            if len(window) >= batches:
                self._wait(window.popleft())
            window.append(self._batch(segments[i : i + step]))
        while window:
            self._wait(window.popleft())

    def request(self, segments: list[list[int]]) -> None:
        self._wait(self._batch(segments))

    def blocking_write(self, size: int) -> None:
        self._ok(
            self.te.transfer_sync_write(self.target, self.buf.address, self.remote_base, size),
            "transfer_sync_write",
        )


class NixlSide(Side):
    """NVIDIA NIXL with its UCX backend, host memory ("DRAM").

    The target passes its agent metadata (base64) and buffer address; the initiator adds
    it as a remote agent. Every transfer is a NIXL request (``initialize_xfer``), posted
    and polled with ``check_xfer_state`` until DONE; it has no blocking call.
    """

    blocking = False

    def __init__(self, role: str, buf: Buffer, device: str) -> None:
        super().__init__(role, buf, device)
        from importlib.metadata import version

        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.version = version("nixl-cu12")
        self.name = f"{role}-{os.getpid()}"
        # HIXL_PEER_NIXL_PROGRESS_THREAD=0: no progress thread on the initiator (it spins a
        # CPU; on two cores the initiator's polling progresses its transfers itself).  The
        # target keeps its own: nothing else progresses it (the connection's wire-up hangs
        # without).
        thread = role == "target" or os.environ.get("HIXL_PEER_NIXL_PROGRESS_THREAD") != "0"
        self.agent = nixl_agent(
            self.name, nixl_agent_config(enable_prog_thread=thread, backends=["UCX"])
        )
        # HIXL_PEER_NIXL_PREPPED=1: descriptor lists prepared once per segment list
        # (prep_xfer_dlist) and every request made from them by index (make_prepped_xfer).
        self.prepped = os.environ.get("HIXL_PEER_NIXL_PREPPED", "0") == "1"
        self._dlists: dict[tuple[int, int, int, int], tuple[Any, Any]] = {}
        self.agent.register_memory([(buf.address, buf.nbytes, 0, "")], "DRAM")
        self.remote = ""
        self.remote_base = 0

    def info(self) -> dict[str, Any]:
        import base64

        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"meta": meta, "base": self.buf.address}

    def connect(self, peer: dict[str, Any]) -> None:
        import base64

        name = self.agent.add_remote_agent(base64.b64decode(peer["meta"]))
        self.remote = name.decode() if isinstance(name, bytes) else str(name)
        self.remote_base = int(peer["base"])
        self._wait(self._post([[0, 0, 64]]))  # the first transfer opens the connection

    def _lists(self, segments: list[list[int]]) -> tuple[Any, Any]:
        """The prepared local and remote lists of ``segments`` (made on first use)."""
        key = (len(segments), segments[0][0], segments[-1][1], hash(str(segments)))
        lists = self._dlists.get(key)
        if lists is None:
            base, rbase = self.buf.address, self.remote_base
            local = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(base + s[0], s[2], 0) for s in segments], "DRAM"
            )
            remote = self.agent.prep_xfer_dlist(
                self.remote, [(rbase + s[1], s[2], 0) for s in segments], "DRAM"
            )
            lists = self._dlists[key] = (local, remote)
        return lists

    def _post_prepped(self, lists: tuple[Any, Any], indices: list[int]) -> Any:
        handle = self.agent.make_prepped_xfer("WRITE", lists[0], indices, lists[1], indices)
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("nixl transfer() returned ERR")
        return handle

    def _post(self, segments: list[list[int]]) -> Any:
        base, rbase = self.buf.address, self.remote_base
        local = self.agent.get_xfer_descs([(base + s[0], s[2], 0) for s in segments], "DRAM")
        remote = self.agent.get_xfer_descs([(rbase + s[1], s[2], 0) for s in segments], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.remote)
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("nixl transfer() returned ERR")
        return handle

    def _wait(self, handle: Any, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        n = 0
        while True:
            state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                break
            if state == "ERR":
                raise RuntimeError("nixl transfer failed (check_xfer_state: ERR)")
            n += 1
            if not n & 0xFFF and time.monotonic() > deadline:
                raise RuntimeError(f"nixl transfer not done after {timeout} s")
        self.agent.release_xfer_handle(handle)

    def stream(self, segments: list[list[int]], depth: int) -> None:
        window: deque[Any] = deque()
        lists = self._lists(segments) if self.prepped else None
        for i, seg in enumerate(segments):
            if len(window) >= depth:
                self._wait(window.popleft())
            if lists is not None:
                window.append(self._post_prepped(lists, [i]))
            else:
                window.append(self._post([seg]))
        while window:
            self._wait(window.popleft())

    def request(self, segments: list[list[int]]) -> None:
        if self.prepped:
            lists = self._lists(segments)
            self._wait(self._post_prepped(lists, list(range(len(segments)))))
        else:
            self._wait(self._post(segments))


BACKENDS: dict[str, type[Side]] = {
    "hixl": HixlSide,
    "hixl-batches": HixlBatchesSide,
    "mooncake": MooncakeSide,
    "nixl": NixlSide,
}
OPS = ("init", "connect", "fill", "digest", "cpu", "run", "latency", "quit")


def serve(backend: str) -> int:
    """Answer the driver's commands until ``quit`` or end of input."""
    side: Side | None = None
    buf: Buffer | None = None
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries that print must not corrupt the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd: dict[str, Any] = json.loads(line)
        op = cmd.get("op")
        reply: dict[str, Any] = {"ok": True}
        try:
            if op == "quit":
                break
            if op not in OPS:
                raise ValueError(f"unknown op {op!r} (known: {', '.join(OPS)})")
            if op == "init":
                buf = Buffer(int(cmd["nbytes"]))
                side = BACKENDS[backend](str(cmd["role"]), buf, str(cmd["device"]))
                reply.update(info=side.info(), version=side.version, blocking=side.blocking)
            elif side is None or buf is None:
                raise RuntimeError(f"{op!r} before init")
            elif op == "connect":
                side.connect(cmd["peer"])
            elif op == "fill":
                buf.fill(int(cmd["seed"]))
            elif op == "digest":
                reply["digest"] = buf.digest(cmd["ranges"])
            elif op == "cpu":
                reply["cpu_s"] = cpu_seconds()
            elif op == "run":
                segs, mode = cmd["segments"], cmd["mode"]
                c0, t0 = cpu_seconds(), time.perf_counter()
                if mode == "stream":
                    side.stream(segs, int(cmd["depth"]))
                else:
                    side.request(segs)
                reply.update(wall_s=time.perf_counter() - t0, cpu_s=cpu_seconds() - c0)
            elif op == "latency":
                size, iters, warm = int(cmd["size"]), int(cmd["iters"]), int(cmd["warmup"])
                samples = []
                for i in range(warm + iters):
                    t0 = time.perf_counter()
                    side.blocking_write(size)
                    if i >= warm:
                        samples.append((time.perf_counter() - t0) * 1e6)
                reply["samples_us"] = samples
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc(file=sys.stderr)
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if side is not None:
        side.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in BACKENDS:
        print(
            f"usage: worker.py {{{','.join(BACKENDS)}}}  (driven by bench_peers)", file=sys.stderr
        )
        return 2
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    return serve(args[0])


if __name__ == "__main__":
    # Run by path, this file's folder comes first on sys.path, and its sibling hixl.py
    # would shadow the hixl package: drop it (this file needs nothing beside it).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    raise SystemExit(main())
