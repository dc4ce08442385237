"""KV caches: registering a cache's tensors and moving a request's blocks.

:class:`KVBlocks` is the engine's part for :meth:`Engine.register_kv` and the
``put_blocks``/``get_blocks`` calls. It talks to the engine through :class:`KVHost` (the
engine implements it): register and deregister memory, read a small remote region, and
queue one chain of work requests as one transfer.

How a peer learns a cache's geometry: :meth:`KVBlocks.register` registers, besides the
tensors' storage (one region per storage span, named ``hixl.kv:<name>/<k>``), a small
read-only region named ``hixl.kv:<name>`` holding the cache's
:class:`~hixl.core.kvblocks.KVGeometry` document. Both ride on the ordinary region
announcement. The first transfer to a remote cache reads that document with one RDMA
READ, parses it as untrusted input and keeps it while the peer's announced regions stay
the same (a re-registration under the same name is read again). Every check of the two
geometries against each other, the block ids and the access rights happens before
anything is posted.

A request is planned by :func:`~hixl.core.kvblocks.plan_groups` (one plan per distinct
pair of tensor geometries and run length, laid out for every tensor) and written into one
chain of work requests whose WRs and SGEs carry each tensor's own keys.  What every
request between two caches shares (the tensor pairs, their groups by pattern, their
addresses and keys) is worked out once and kept, so a request pays only for its own block
lists.  The engine queues the chain as one
transfer, with the notification after all of its data. Chains go back to the engine's
pool once posted and are refilled by later requests of a similar size.

Memory lifetime: a :class:`KVCache` keeps the tensors it registered alive (their storage
is registered by address), until :meth:`KVCache.close`.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from hixl.core import wire
from hixl.core.kvblocks import (
    I64Array,
    KVGeometry,
    RequestPlan,
    TensorGeometry,
    TensorGroup,
    block_ids,
    check_alignment,
    check_unique,
    landed_blocks,
    pair_tensors,
    plan_groups,
    tensor_groups,
)
from hixl.core.plan import DeviceLimits, Op
from hixl.core.wire import RemoteRegion
from hixl.engine.handles import TransferHandle, TransferStatus
from hixl.engine.regions import Access, Region
from hixl.errors import (
    ArgumentError,
    CompletionError,
    DescriptorError,
    HixlError,
    RegistrationError,
)
from hixl.verbs import adapter as verbs
from hixl.verbs.chain import ChainMemory, SendChain

if TYPE_CHECKING:
    from hixl.core.window import Chunk
    from hixl.engine.connection import Connection

__all__ = [
    "KV_PREFIX",
    "BlocksHandle",
    "BuiltRequest",
    "KVBlocks",
    "KVCache",
    "KVHost",
    "build_request",
]

log = logging.getLogger("hixl.kv")

#: Region names of a cache ``n``: ``hixl.kv:n`` (its geometry), ``hixl.kv:n/<k>`` (storage).
KV_PREFIX = "hixl.kv:"
#: Longest cache name (the region names stay within the wire's 128 characters).
MAX_NAME = 96
#: Largest geometry document read from a peer.
MAX_GEOMETRY_BYTES = 1 << 20
#: Longest a transfer waits for a peer's cache to be announced (it may be registering it).
ANNOUNCE_WAIT_S = 2.0
#: Block ids shown in an error message (the exception's attributes hold them all).
_SHOWN_IDS = 16


class KVHost(Protocol):
    """What :class:`KVBlocks` needs from its engine."""

    @property
    def limits(self) -> DeviceLimits: ...

    @property
    def alignment(self) -> int | None: ...

    def register(self, buffer: object, *, access: Access = ..., name: str = ...) -> Region: ...

    def deregister(self, region: Region) -> None: ...

    def get(
        self, peer: str, local: Region, remote: RemoteRegion | str, *, timeout: float = ...
    ) -> None: ...

    def connection(self, peer: str) -> Connection: ...

    def queue_chain(
        self,
        conn: Connection,
        chain: SendChain,
        nbytes: int,
        key: tuple[Any, ...],
        notify: str | None,
        notify_message: bytes,
        reads: bool,
        timeout: float,
        now: bool,
    ) -> tuple[TransferHandle, list[Chunk]]: ...

    def idle_chain(self, key: tuple[Any, ...]) -> SendChain | None: ...


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True, slots=True)
class _Tensor:
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    addr: int  # element 0
    span: tuple[int, int]  # the storage: (address, bytes)
    readonly: bool


def _describe(i: int, obj: object) -> _Tensor:
    """The geometry and storage span of a numpy array or a CPU torch tensor."""
    if isinstance(obj, np.ndarray):
        arr = obj
        if arr.size == 0:
            raise RegistrationError(f"tensor {i} is empty (shape {arr.shape})")
        if any(s < 0 for s in arr.strides):
            raise RegistrationError(f"tensor {i} has negative strides {arr.strides}")
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        addr = int(arr.__array_interface__["data"][0])
        if root.flags.c_contiguous or root.flags.f_contiguous:
            span = (int(root.__array_interface__["data"][0]), int(root.nbytes))
        else:
            extent = sum((n - 1) * s for n, s in zip(arr.shape, arr.strides, strict=True))
            span = (addr, extent + arr.itemsize)
        return _Tensor(
            arr.dtype.name,
            arr.itemsize,
            tuple(arr.shape),
            tuple(arr.strides),
            addr,
            span,
            not arr.flags.writeable,
        )
    if hasattr(obj, "data_ptr") and hasattr(obj, "untyped_storage") and hasattr(obj, "stride"):
        t: Any = obj  # a torch tensor, duck-typed: hixl does not depend on torch
        device = getattr(getattr(t, "device", None), "type", "cpu")
        if device != "cpu":
            raise RegistrationError(f"tensor {i} is on device {device}; only CPU tensors")
        if t.numel() == 0:
            raise RegistrationError(f"tensor {i} is empty (shape {tuple(t.shape)})")
        itemsize = int(t.element_size())
        storage = t.untyped_storage()
        return _Tensor(
            str(t.dtype).removeprefix("torch."),
            itemsize,
            tuple(int(n) for n in t.shape),
            tuple(int(s) * itemsize for s in t.stride()),
            int(t.data_ptr()),
            (int(storage.data_ptr()), int(storage.nbytes())),
            False,
        )
    raise RegistrationError(
        f"tensor {i} is a {type(obj).__name__}: expected a numpy array or a CPU torch tensor"
    )


def _spans(tensors: list[_Tensor]) -> tuple[list[tuple[int, int]], list[int]]:
    """The storage spans merged where they overlap, and each tensor's span index."""
    order = sorted(range(len(tensors)), key=lambda k: tensors[k].span)
    spans: list[list[int]] = []
    index = [0] * len(tensors)
    for k in order:
        a, n = tensors[k].span
        if spans and a < spans[-1][0] + spans[-1][1]:
            last = spans[-1]
            last[1] = max(last[1], a + n - last[0])
        else:
            spans.append([a, n])
        index[k] = len(spans) - 1
    return [(a, n) for a, n in spans], index


class KVCache:
    """A KV cache registered with :meth:`Engine.register_kv`.

    ``name`` is how peers find it; ``geometry`` what they learn about it;
    ``regions`` the registered storage (one region per storage span). ``tensors`` are the
    objects registered, kept alive until :meth:`close` (or the engine's close).
    """

    def __init__(
        self,
        owner: KVBlocks,
        name: str,
        tensors: tuple[object, ...],
        geometry: KVGeometry,
        regions: tuple[Region, ...],
        meta: Region | None,
        meta_buffer: np.ndarray[Any, Any] | None,
    ) -> None:
        self._owner = owner
        self.name = name
        self.tensors = tensors
        self.geometry = geometry
        self.regions = regions
        self._meta = meta  # the geometry region; None for a cache peers cannot reach
        self._meta_buffer = meta_buffer  # the memory the meta region points at
        self._closed = False
        self._keys = tuple((r.addr, r.lkey) for r in regions)  # (address, lkey) of each
        self._writable = all(r.access & Access.LOCAL_WRITE for r in regions)

    @property
    def closed(self) -> bool:
        return self._closed or any(r.closed for r in self.regions)

    @property
    def num_tensors(self) -> int:
        return len(self.geometry.tensors)

    @property
    def num_blocks(self) -> int:
        """Blocks every tensor has (the smallest block axis)."""
        return min(t.num_blocks for t in self.geometry.tensors)

    def close(self) -> None:
        """Deregister the cache's regions (peers are told); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._owner._forget(self)

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return (
            f"<KVCache name={self.name!r} tensors={self.num_tensors} "
            f"blocks={self.num_blocks} regions={len(self.regions)}{state}>"
        )


# --------------------------------------------------------------------------- handles


def _show(ids: list[int]) -> str:
    head = ", ".join(str(i) for i in ids[:_SHOWN_IDS])
    more = f", ... ({len(ids)} in all)" if len(ids) > _SHOWN_IDS else ""
    return f"[{head}{more}]"


def _annotated(err: HixlError, message: str) -> HixlError:
    """A copy of ``err`` (same class and attributes) whose message is ``message``.  Made
    without calling the class's constructor, whose arguments differ from class to class
    (a :class:`CompletionError` takes the operation and the completion status)."""
    cls = type(err)
    out = cls.__new__(cls)
    out.__dict__.update(err.__dict__)
    # errno lives in OSError's own field (str() formats it once it is set, even to None)
    if isinstance(err, OSError) and err.errno is not None:
        assert isinstance(out, OSError)
        out.errno = err.errno
    out.args = (message,)
    return out


class BlocksHandle(TransferHandle):
    """The :class:`TransferHandle` of a ``put_blocks_async``/``get_blocks_async``.

    On failure its error (the transfer's own class: :class:`TransferTimeout`,
    :class:`CompletionError`, :class:`ConnectionFailed`...) names the request and the
    block ids whose bytes are not known to have landed, and carries attributes
    ``request``, ``local_blocks`` and ``remote_blocks`` (the pairs not known to have
    landed) and ``landed_local_blocks``/``landed_remote_blocks`` (the pairs known to have
    landed, in request order).

    What is known: a queue pair completes its work requests in order, and the engine
    signals the last WR of every group of them, so a group whose completion was reaped
    before the failure has landed; a failed WR reports its group, and the groups before
    it on its queue pair have landed. A pair has landed when every WR carrying its bytes,
    of every tensor, has. The chain goes run by run (all tensors of a block run, then the
    next run), so what landed is whole blocks from the front of each queue pair's share
    of the request. WRs that completed but whose completion was not reaped before the
    connection failed count as not known.
    """

    __slots__ = (
        "_inner",
        "_failed",
        "_parts",
        "_plan",
        "local_blocks",
        "remote_blocks",
        "request",
    )

    def __init__(
        self,
        inner: TransferHandle,
        request: str | None,
        local: list[int],
        remote: list[int],
        plan: RequestPlan | None = None,
        parts: list[Chunk] | None = None,
    ) -> None:
        # The base's own state is never used: every reader goes to ``inner``.
        self._inner = inner
        self.request = request
        self.local_blocks = local
        self.remote_blocks = remote
        self._plan = plan
        self._parts = parts or []
        self._failed: HixlError | None = None
        self.peer = inner.peer
        self.nbytes = inner.nbytes
        self.num_wrs = inner.num_wrs
        self.deadline = inner.deadline

    def _landed(self, err: HixlError) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which pairs are known to have landed, once the transfer failed with ``err``
        (the engine no longer changes its chunks' counts then)."""
        n = len(self.local_blocks)
        plan = self._plan
        if plan is None:
            return np.zeros(n, bool)
        failed = err.wr_id if isinstance(err, CompletionError) else None
        done = np.zeros(plan.num_wrs, bool)
        for part in self._parts:
            k = part.done
            if failed is not None and part.first_id <= failed < part.first_id + part.groups:
                # the failed WR's group counted as complete: only the groups before it are
                k = min(k, (failed - part.first_id) * part.every)
            done[part.start : part.start + k] = True
        return landed_blocks(plan, done, n)

    @property
    def status(self) -> TransferStatus:
        return self._inner.status

    @property
    def error(self) -> HixlError | None:
        err = self._inner.error
        if err is None:
            return None
        if self._failed is None:
            what = f"request {self.request!r}" if self.request is not None else "request"
            landed = self._landed(err)
            lids, rids = np.asarray(self.local_blocks), np.asarray(self.remote_blocks)
            lost_l, lost_r = lids[~landed].tolist(), rids[~landed].tolist()
            out = _annotated(
                err,
                f"{err}; {what}: blocks not known to have landed: local "
                f"{_show(lost_l)}, remote {_show(lost_r)} ({int(landed.sum())} of "
                f"{landed.size} known to have landed)",
            )
            out.request = self.request  # type: ignore[attr-defined]
            out.local_blocks = lost_l  # type: ignore[attr-defined]
            out.remote_blocks = lost_r  # type: ignore[attr-defined]
            out.landed_local_blocks = lids[landed].tolist()  # type: ignore[attr-defined]
            out.landed_remote_blocks = rids[landed].tolist()  # type: ignore[attr-defined]
            out.__cause__ = err
            self._failed = out
        return self._failed

    def done(self) -> bool:
        """As :meth:`TransferHandle.done`."""
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> None:
        """As :meth:`TransferHandle.wait`; a failure raises :attr:`error`.

        Without a ``timeout`` this returns or raises only once the transfer is final: a
        transfer past its deadline is failed by the engine, which first moves the
        connection's queue pairs to the error state, so no write of it lands after its
        :class:`TransferTimeout` is raised here.  (A plain handle's waiter gives up on
        its own a second after the deadline, whether or not the engine has done so.)
        """
        inner = self._inner
        while True:
            try:
                if timeout is not None:
                    inner.wait(timeout)
                else:
                    inner.wait(max(0.05, inner.deadline - time.monotonic() + 0.05))
            except HixlError:
                if inner.status is TransferStatus.PENDING:
                    if timeout is not None:
                        raise  # this wait's own timeout: the transfer goes on
                    continue  # past the deadline: the engine fails it (progress thread)
            break
        err = self.error
        if err is not None:
            raise err

    def finish(self, error: HixlError | None) -> None:
        raise ArgumentError("a blocks handle's outcome is its transfer's")

    def __repr__(self) -> str:
        return (
            f"<BlocksHandle request={self.request!r} peer={self.peer} nbytes={self.nbytes} "
            f"wrs={self.num_wrs} status={self.status.value}>"
        )


# --------------------------------------------------------------------------- the part


@dataclass(slots=True)
class _RemoteKV:
    meta: RemoteRegion
    geometry: KVGeometry
    remotes: tuple[RemoteRegion, ...]  # the connection's tuple these were resolved from
    regions: tuple[RemoteRegion, ...]
    keys: tuple[tuple[int, int], ...] = field(init=False)  # each region's (address, rkey)
    access: int = field(init=False)  # the access every region grants

    def __post_init__(self) -> None:
        self.keys = tuple((r.addr, r.rkey) for r in self.regions)
        self.access = functools.reduce(operator.and_, (r.access for r in self.regions), -1)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_NAME
        or not name.isprintable()
        or "/" in name
    ):
        raise ArgumentError(
            f"a KV cache name is 1..{MAX_NAME} printable characters without '/', got {name!r}"
        )
    return name


class KVBlocks:
    """The engine's KV caches: local ones by name, peers' geometries by connection.

    ``_lock`` guards ``_caches`` (dictionary updates only; registration runs outside
    it). ``_remote`` is a cache of read-only values replaced whole: read without a lock.
    """

    def __init__(self, host: KVHost, memory: ChainMemory | None = None) -> None:
        self._host = host
        self._memory = memory
        self._lock = threading.Lock()
        self._caches: dict[str, KVCache] = {}
        self._remote: dict[tuple[int, str], _RemoteKV] = {}

    # -- registration -------------------------------------------------------------------
    def register(
        self,
        name: str,
        tensors: object,
        *,
        block_axis: int = 0,
        heads_axis: int | None = None,
        access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE,
    ) -> KVCache:
        name = _name(name)
        if hasattr(tensors, "shape"):
            objs: tuple[object, ...] = (tensors,)
        elif isinstance(tensors, Sequence) and not isinstance(tensors, str | bytes):
            objs = tuple(tensors)
        else:
            raise ArgumentError(
                f"tensors must be a list of arrays or tensors, got {type(tensors).__name__}"
            )
        if not objs:
            raise ArgumentError("register_kv needs at least one tensor")
        described = [_describe(i, t) for i, t in enumerate(objs)]
        spans, index = _spans(described)
        geoms = []
        for i, (d, k) in enumerate(zip(described, index, strict=True)):
            try:
                geoms.append(
                    TensorGeometry(
                        dtype=d.dtype,
                        itemsize=d.itemsize,
                        shape=d.shape,
                        strides=d.strides,
                        offset=d.addr - spans[k][0],
                        region=k,
                        block_axis=block_axis,
                        heads_axis=heads_axis,
                    )
                )
            except DescriptorError as exc:
                raise RegistrationError(f"tensor {i}: {exc}") from None
            if d.readonly and access & (Access.LOCAL_WRITE | Access.REMOTE_WRITE):
                raise RegistrationError(
                    f"tensor {i} is read-only; register the cache with access=Access.REMOTE_READ"
                )
        geometry = KVGeometry(region_lengths=tuple(n for _, n in spans), tensors=tuple(geoms))
        check_alignment(geometry, self._host.alignment, f"cache {name!r}: ")
        doc = geometry.to_bytes()
        if len(doc) > MAX_GEOMETRY_BYTES:
            raise RegistrationError(
                f"cache {name!r}: its geometry takes {len(doc)} bytes, more than "
                f"{MAX_GEOMETRY_BYTES}"
            )
        with self._lock:
            if name in self._caches:
                raise RegistrationError(f"a KV cache named {name!r} is already registered")
            self._caches[name] = None  # type: ignore[assignment]  # reserved
        host = self._host
        regions: list[Region] = []
        meta: Region | None = None
        meta_buffer: np.ndarray[Any, Any] | None = None
        try:
            for k, span in enumerate(spans):
                regions.append(host.register(span, access=access, name=f"{KV_PREFIX}{name}/{k}"))
            # Only a cache peers can reach announces its geometry (nothing to read otherwise).
            if access & (Access.REMOTE_READ | Access.REMOTE_WRITE):
                meta_buffer = np.zeros(-(-len(doc) // 64) * 64, dtype=np.uint8)
                meta_buffer[: len(doc)] = np.frombuffer(doc, dtype=np.uint8)
                meta_buffer.setflags(write=False)
                meta = host.register(meta_buffer, access=Access.REMOTE_READ, name=KV_PREFIX + name)
        except BaseException:
            for r in regions:
                host.deregister(r)
            with self._lock:
                del self._caches[name]
            raise
        cache = KVCache(self, name, objs, geometry, tuple(regions), meta, meta_buffer)
        with self._lock:
            self._caches[name] = cache
        try:
            warm_up(geometry, [(r.addr, r.lkey) for r in regions], host.limits, self._memory)
        except HixlError as exc:  # only a cost moved earlier: the transfer says what is wrong
            log.debug("warming up %r: %s", cache, exc)
        log.debug("registered %r", cache)
        return cache

    def _forget(self, cache: KVCache) -> None:
        with self._lock:
            if self._caches.get(cache.name) is cache:
                del self._caches[cache.name]
        for r in (cache._meta, *cache.regions):
            if r is not None:
                self._host.deregister(r)

    def announced(self, peer: str) -> tuple[str, ...]:
        """The names of the KV caches ``peer`` announces now (sorted)."""
        remotes = self._host.connection(peer).remote_regions
        return tuple(sorted(
            r.name[len(KV_PREFIX):] for r in remotes
            if r.name.startswith(KV_PREFIX) and "/" not in r.name[len(KV_PREFIX):]
        ))  # fmt: skip

    # -- peers' caches --------------------------------------------------------------------
    def _remote_cache(self, conn: Connection, peer: str, name: str, timeout: float) -> _RemoteKV:
        remotes = conn.remote_regions
        key = (id(conn), name)
        known = self._remote.get(key)
        if known is not None and known.remotes is remotes:
            return known
        by_name = {r.name: r for r in remotes if r.name.startswith(KV_PREFIX + name)}
        meta = by_name.get(KV_PREFIX + name)
        # A cache the peer registered a moment ago may not be announced yet: look again
        # for a little while (no lock is held; the announced tuple is swapped whole).
        deadline = time.monotonic() + min(timeout, ANNOUNCE_WAIT_S)
        while meta is None and time.monotonic() < deadline:
            time.sleep(0.005)
            conn.check_ready()
            remotes = conn.remote_regions
            by_name = {r.name: r for r in remotes if r.name.startswith(KV_PREFIX + name)}
            meta = by_name.get(KV_PREFIX + name)
        if meta is None:
            raise RegistrationError(
                f"peer {peer} has no KV cache named {name!r} (none announced within "
                f"{min(timeout, ANNOUNCE_WAIT_S)} s)"
            )
        if known is not None and known.meta == meta:
            geometry = known.geometry
        else:
            geometry = self._read_geometry(peer, meta, timeout)
            check_alignment(geometry, self._host.alignment, f"peer {peer}'s KV cache {name!r}: ")
        regions = []
        for k, length in enumerate(geometry.region_lengths):
            r = by_name.get(f"{KV_PREFIX}{name}/{k}")
            if r is None or r.length != length:
                raise RegistrationError(
                    f"peer {peer}'s KV cache {name!r}: region {k} is "
                    f"{'missing' if r is None else f'{r.length} bytes'}, its geometry says "
                    f"{length} bytes"
                )
            regions.append(r)
        entry = _RemoteKV(meta, geometry, remotes, tuple(regions))
        if len(self._remote) >= 1024:
            self._remote.clear()
        self._remote[key] = entry
        return entry

    def _read_geometry(self, peer: str, meta: RemoteRegion, timeout: float) -> KVGeometry:
        if not 0 < meta.length <= MAX_GEOMETRY_BYTES or not meta.access & wire.REMOTE_READ:
            raise RegistrationError(
                f"peer {peer}'s KV geometry region {meta.name!r} is not readable or has "
                f"{meta.length} bytes (limit {MAX_GEOMETRY_BYTES})"
            )
        buf = np.zeros(meta.length, dtype=np.uint8)
        host = self._host
        scratch = host.register(buf, access=Access.LOCAL_WRITE)
        try:
            host.get(peer, scratch, meta, timeout=timeout)
        finally:
            host.deregister(scratch)
        try:
            return KVGeometry.from_bytes(buf.tobytes())
        except DescriptorError as exc:
            raise RegistrationError(f"peer {peer}'s KV cache {meta.name!r}: {exc}") from None

    # -- transfers ----------------------------------------------------------------------
    def transfer(
        self,
        op: Op,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None,
        heads: tuple[int, int] | None,
        remote_heads: tuple[int, int] | None,
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        now: bool,
        remote_tensors: Sequence[int] | range | None = None,
    ) -> BlocksHandle:
        """Check, plan, build and queue one request's blocks (see Engine.put_blocks)."""
        if not isinstance(kv, KVCache) or kv._owner is not self:
            raise RegistrationError(f"{kv!r} is not a KV cache registered with this engine")
        if kv.closed:
            raise RegistrationError(f"{kv!r} is closed")
        if timeout <= 0:
            raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        host = self._host
        conn = host.connection(peer)
        conn.check_ready()
        rkv = self._remote_cache(conn, peer, _name(remote_name), timeout)
        need = wire.REMOTE_WRITE if op is Op.WRITE else wire.REMOTE_READ
        if not rkv.access & need:
            r = next(r for r in rkv.regions if not r.access & need)
            verb = "writable" if op is Op.WRITE else "readable"
            raise RegistrationError(
                f"peer {peer}'s KV cache {remote_name!r}: region {r.name!r} is not remotely {verb}"
            )
        if op is Op.READ and not kv._writable:
            raise RegistrationError(f"{kv!r}: get_blocks needs LOCAL_WRITE access")
        req = build_request(
            op,
            kv.geometry,
            kv._keys,
            rkv.geometry,
            rkv.keys,
            local_blocks,
            remote_blocks,
            tensors=tensors,
            heads=heads,
            remote_heads=remote_heads,
            limits=host.limits,
            remote_tensors=remote_tensors,
            idle=host.idle_chain,
            regions=kv.regions,
            memory=self._memory,
        )
        inner, parts = host.queue_chain(
            conn,
            req.chain,
            req.nbytes,
            req.key,
            notify,
            notify_message,
            op is Op.READ,
            timeout,
            now,
        )
        return BlocksHandle(
            inner, notify, req.local_ids.tolist(), req.remote_ids.tolist(), req.plan, parts
        )


def warm_up(
    geometry: KVGeometry,
    regions: Sequence[tuple[int, int]],
    limits: DeviceLimits,
    memory: ChainMemory | None = None,
) -> None:
    """Build (and drop) the chain of a one-block request of a cache into itself: the
    first run of the checks, the planner and the chain code in a process costs several
    times a later one (numpy's first calls, the cached block patterns and run plans),
    and :meth:`Engine.register_kv` pays that rather than the first transfer."""
    build_request(
        Op.WRITE, geometry, regions, geometry, regions, [0], [0],
        tensors=None, heads=None, remote_heads=None, limits=limits, memory=memory,
    )  # fmt: skip


#: Pairings of two caches' tensors, by the caches' identities and the selection (a cache
#: of immutable values: an entry is used only for the very geometry objects it holds).
_PAIRS: dict[tuple[Any, ...], tuple[KVGeometry, KVGeometry, list[Any]]] = {}
_PAIRS_MAX = 256


def _paired(
    local: KVGeometry,
    remote: KVGeometry,
    tensors: Sequence[int] | range | None,
    heads: tuple[int, int] | None,
    remote_heads: tuple[int, int] | None,
    remote_tensors: Sequence[int] | range | None,
) -> list[Any]:
    """:func:`pair_tensors`, remembered for a repeated selection between two caches."""
    try:
        chosen = None if tensors is None else tuple(tensors)
        theirs = None if remote_tensors is None else tuple(remote_tensors)
        key = (
            id(local),
            id(remote),
            chosen,
            theirs,
            None if heads is None else tuple(heads),
            None if remote_heads is None else tuple(remote_heads),
        )
        hash(key)
    except TypeError:
        return pair_tensors(local, remote, tensors, heads, remote_heads, remote_tensors)
    known = _PAIRS.get(key)
    if known is not None and known[0] is local and known[1] is remote:
        return known[2]
    pairs = pair_tensors(local, remote, tensors, heads, remote_heads, remote_tensors)
    if len(_PAIRS) >= _PAIRS_MAX:
        _PAIRS.clear()
    _PAIRS[key] = (local, remote, pairs)
    return pairs


#: What every request between two caches' regions shares, by the pairing's identity
#: and the regions: the block counts and the tensors grouped by patterns.
_FRAMES: dict[tuple[Any, ...], tuple[list[Any], int, int, list[TensorGroup]]] = {}


def _framed(
    local: KVGeometry,
    remote: KVGeometry,
    pairs: list[Any],
    local_regions: Sequence[tuple[int, int]],
    remote_regions: Sequence[tuple[int, int]],
) -> tuple[int, int, list[TensorGroup]]:
    """The blocks each side has (its shortest paired tensor's) and the request's
    :func:`tensor_groups` for ``pairs`` between these regions, remembered."""
    key = (id(pairs), tuple(local_regions), tuple(remote_regions))
    known = _FRAMES.get(key)
    if known is not None and known[0] is pairs:
        return known[1], known[2], known[3]
    lgeo, rgeo = local.tensors, remote.tensors
    lnum = min(lgeo[i].num_blocks for i, _, _, _ in pairs)
    rnum = min(rgeo[j].num_blocks for _, j, _, _ in pairs)
    items = []
    for i, j, lp, rp in pairs:
        lt, rt = lgeo[i], rgeo[j]
        la, lkey = local_regions[lt.region]
        ra, rkey = remote_regions[rt.region]
        items.append((lp, rp, la + lt.offset, ra + rt.offset, lkey, rkey))
    groups = tensor_groups(items)
    if len(_FRAMES) >= _PAIRS_MAX:
        _FRAMES.clear()
    _FRAMES[key] = (pairs, lnum, rnum, groups)
    return lnum, rnum, groups


class BuiltRequest(NamedTuple):
    """A request ready to queue: its chain (filled), bytes, the chain's pool key, the two
    block id arrays and the plan the chain was filled from."""

    chain: SendChain
    nbytes: int
    key: tuple[Any, ...]
    local_ids: I64Array
    remote_ids: I64Array
    plan: RequestPlan


def build_request(
    op: Op,
    local: KVGeometry,
    local_regions: Sequence[tuple[int, int]],
    remote: KVGeometry,
    remote_regions: Sequence[tuple[int, int]],
    local_blocks: object,
    remote_blocks: object,
    *,
    tensors: Sequence[int] | range | None,
    heads: tuple[int, int] | None,
    remote_heads: tuple[int, int] | None,
    limits: DeviceLimits,
    remote_tensors: Sequence[int] | range | None = None,
    idle: Callable[[tuple[Any, ...]], SendChain | None] = lambda key: None,
    regions: tuple[Any, ...] = (),
    memory: ChainMemory | None = None,
) -> BuiltRequest:
    """The checks, the plan and the chain of one request (no I/O): what a ``put_blocks``
    costs before the engine queues it.  ``local_regions``/``remote_regions`` are each
    region's ``(address, key)``; ``idle`` returns a pooled chain for a size key, and a
    new chain takes its memory from ``memory`` (the engine's kept, touched memory).  Raises
    :class:`DescriptorError` before anything is built."""
    pairs = _paired(local, remote, tensors, heads, remote_heads, remote_tensors)
    lnum, rnum, groups = _framed(local, remote, pairs, local_regions, remote_regions)
    lids = block_ids("local_blocks", local_blocks, lnum)
    rids = block_ids("remote_blocks", remote_blocks, rnum)
    if lids.size != rids.size:
        raise DescriptorError(
            f"local_blocks has {lids.size} ids and remote_blocks {rids.size}: they pair"
        )
    check_unique(
        "remote_blocks" if op is Op.WRITE else "local_blocks", rids if op is Op.WRITE else lids
    )
    plan = plan_groups(groups, lids, rids, op, limits)
    key = ("kv", _pow2(plan.num_wrs), _pow2(plan.num_sges))
    opcode = verbs.WR_RDMA_WRITE if op is Op.WRITE else verbs.WR_RDMA_READ
    chain = idle(key)
    if chain is None:
        chain = SendChain.blank(key[1], key[2], opcode, memory)
    chain.fill_tiles(opcode, plan.tiles, regions)
    return BuiltRequest(chain, plan.nbytes, key, lids, rids, plan)
