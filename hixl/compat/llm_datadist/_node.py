"""The engines and tables behind one initialized ``LLMDataDist``.

Theory of operation
-------------------
``link_clusters`` makes this instance a *client* of the peer's listener.  A
:class:`Node` holds two :class:`hixl.Engine` objects:

* the *server* engine listens at ``listen_ip_info`` (none without it);
* the *client* engine (``"ip:0"``, no listener) makes the links of ``link_clusters``.

Every cache is registered with both engines as a KV cache (``Engine.register_kv``)
under a name that says what it is (see ``_plan``); a remotely accessible one is thereby
announced to peers.  Right after a link is made the client
sends a *hello* notification carrying its cluster id, so the server side knows the
link by cluster id too.  A push or pull to a cluster runs over the link this side
made when there is one (``Route.side`` 0, the client engine), else over the link the
peer made to this side's listener (side 1, the server engine): after a peer linked to
it, an instance can push to and pull from that peer as CANN's default backend allows.
Two instances that link to each other at the same moment make two independent links.

Locking: ``Node._lock`` guards the tables (links, caches, the next cache id, the
parsed remote tables) and is held only for dictionary updates.  Registrations,
connects, transfers and closes run outside it.  ``finalize`` and ``switch_role`` must
not run concurrently with other calls (as CANN requires of ``finalize``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from hixl.compat.llm_datadist._config import DataDistOptions
from hixl.compat.llm_datadist._plan import (
    CacheName,
    RemoteTable,
    cache_name,
    index_remote,
    local_name,
)
from hixl.compat.llm_datadist._status import LLMStatusCode, code_of, refuse, require
from hixl.compat.llm_datadist._types import Cache, CacheDesc, Placement
from hixl.core.states import ConnState
from hixl.core.wire import RemoteRegion
from hixl.engine import Access, Engine, Region
from hixl.engine.kv import KVCache
from hixl.errors import HixlError, TransferTimeout

__all__ = ["CLIENT", "SERVER", "CacheEntry", "Node", "Route"]

log = logging.getLogger("hixl.compat.llm_datadist")


HELLO = "hixl.lldd.hello"  # notification a client sends after linking: its cluster id
CLIENT, SERVER = 0, 1


@dataclass(slots=True)
class CacheEntry:
    """A registered cache: its object, how peers find it, its KV cache on each engine
    (``kv[CLIENT]``, ``kv[SERVER]``; None where that engine is not open)."""

    cache: Cache
    model_id: int | None
    remote_accessible: bool
    kv: list[KVCache | None] = field(default_factory=lambda: [None, None])

    def name(self) -> str:
        """The KV cache name (peers parse it; see ``_plan``)."""
        cache = self.cache
        if not self.remote_accessible:
            return local_name(cache.cache_id)
        desc = cache.cache_desc
        return cache_name(
            CacheName(
                cache_id=cache.cache_id,
                num_tensors=desc.num_tensors,
                model_id=self.model_id,
                is_blocks=cache.is_blocks_cache,
                data_type=desc.data_type.value,
                unit=desc.unit_size,
                units=desc.shape[0],
            )
        )

    def local(self, side: int) -> KVCache:
        """The KV cache on engine ``side``."""
        kv = self.kv[side]
        if kv is None:
            refuse(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{self.cache!r} is not registered with the {'server' if side else 'client'} "
                "engine (its listener was closed)",
            )
        return kv

    def tensor(self, side: int, index: int) -> tuple[Region, int]:
        """Tensor ``index``'s region on engine ``side`` and its offset there."""
        kv = self.local(side)
        geometry = kv.geometry.tensors[index]
        return kv.regions[geometry.region], geometry.offset


@dataclass(frozen=True, slots=True)
class Route:
    """How to reach a cluster: which engine (``side``) and the peer id it knows."""

    engine: Engine
    peer: str
    side: int


def _engine_kwargs(opts: DataDistOptions) -> dict[str, object]:
    # Caches start anywhere in a tensor: no offset alignment policy.
    return {"device": opts.device, "token": opts.token, "alignment": None}


class Node:
    """What ``LLMDataDist.init`` builds: the engines, the links, the caches."""

    def __init__(self, cluster_id: int, opts: DataDistOptions) -> None:
        self.cluster_id = cluster_id
        self.opts = opts
        self._lock = threading.Lock()
        host = opts.listen[0] if opts.listen is not None else "127.0.0.1"
        self.client = Engine(f"{host}:0", **_engine_kwargs(opts))  # type: ignore[arg-type]
        self.server: Engine | None = None
        self.listen: tuple[str, int] | None = None
        self._links: dict[int, str] = {}  # cluster id -> peer's listening engine id (ours)
        self._inbound: dict[int, str] = {}  # cluster id -> peer's client id (its link to us)
        self._caches: dict[int, CacheEntry] = {}
        self._next_id = 1
        self._remote: dict[tuple[int, str], tuple[tuple[RemoteRegion, ...], RemoteTable]] = {}
        try:
            if opts.listen is not None:
                self.open_server(opts.listen)
        except BaseException:
            self.client.close()
            raise

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Close both engines (links fail, regions go).  Idempotent."""
        with self._lock:
            server, self.server = self.server, None
            self._links.clear()
            self._inbound.clear()
            caches = list(self._caches.values())
            self._caches.clear()
            self._remote.clear()
        for entry in caches:
            entry.cache.valid = False
        self.client.close()
        if server is not None:
            server.close()

    def open_server(self, listen: tuple[str, int]) -> None:
        """Listen at ``listen`` (closing any other listener) and register the caches there."""
        self.close_server()
        host, port = listen
        try:
            server = Engine(f"{host}:{port}", **_engine_kwargs(self.opts))  # type: ignore[arg-type]
        except OSError as exc:
            refuse(LLMStatusCode.LLM_PARAM_INVALID, f"cannot listen at {host}:{port}: {exc}")
        except HixlError as exc:
            refuse(code_of(exc), f"cannot open an engine at {host}:{port}: {exc}")
        with self._lock:
            self.server, self.listen = server, listen
            entries = list(self._caches.values())
        for entry in entries:
            entry.kv[SERVER] = self._register_on(server, entry)
        log.info("listening at %s:%d as engine %s", host, port, server.id)

    def close_server(self) -> None:
        """Stop listening: links peers made to this instance close, caches stay registered."""
        with self._lock:
            server, self.server, self.listen = self.server, None, None
            entries = list(self._caches.values())
            self._inbound.clear()
        if server is None:
            return
        for entry in entries:
            entry.kv[SERVER] = None
        server.close()
        log.info("stopped listening (engine %s closed)", server.id)

    # -- caches --------------------------------------------------------------------------
    @staticmethod
    def _register_on(engine: Engine, entry: CacheEntry) -> KVCache:
        """Register every tensor of ``entry`` with ``engine`` as one KV cache: a
        ``(blocks, block bytes)`` uint8 view of each, byte ranges as its heads axis."""
        desc = entry.cache.cache_desc
        access = Access.LOCAL_WRITE
        if entry.remote_accessible:
            access = Access.REMOTE_READ | Access.REMOTE_WRITE
        shape = (desc.shape[0], desc.unit_size)
        views = [
            np.frombuffer(
                memoryview((ctypes.c_uint8 * desc.size).from_address(addr)), np.uint8
            ).reshape(shape)
            for addr in entry.cache.tensor_addrs
        ]
        return engine.register_kv(entry.name(), views, block_axis=0, heads_axis=1, access=access)

    def register(
        self,
        desc: CacheDesc,
        addrs: list[int],
        *,
        blocks: bool,
        model_id: int | None,
        remote_accessible: bool | None,
    ) -> Cache:
        """Register ``addrs`` (one tensor of ``desc.size`` bytes each) as a new cache."""
        require(len(addrs) > 0, "addrs can not be empty.")
        require(
            len(addrs) == desc.num_tensors,
            f"addrs length ({len(addrs)}) should be equal to num_tensors ({desc.num_tensors}).",
        )
        for i, addr in enumerate(addrs):
            require(addr != 0, f"addrs[{i}] can not be zero.")
        size = desc.size
        require(
            desc.unit_size * desc.shape[0] == size,
            f"tensor size {size} is not a whole number of {desc.shape[0]} blocks",
        )
        if remote_accessible is None:
            remote_accessible = desc.placement == Placement.DEVICE
        with self._lock:
            spans = {
                (a, e.cache.cache_desc.size): e.cache.cache_id
                for e in self._caches.values()
                for a in e.cache.tensor_addrs
            }
            for addr in addrs:
                clash = spans.get((addr, size))
                require(
                    clash is None,
                    f"memory at {addr:#x} ({size} bytes) is already registered as cache {clash}",
                )
            cache_id = self._next_id
            self._next_id += 1
            server = self.server
        cache = Cache(cache_id, desc, addrs, blocks)
        entry = CacheEntry(cache=cache, model_id=model_id, remote_accessible=remote_accessible)
        try:
            entry.kv[CLIENT] = self._register_on(self.client, entry)
            if server is not None:
                entry.kv[SERVER] = self._register_on(server, entry)
        except HixlError as exc:
            for kv in entry.kv:
                if kv is not None:
                    kv.close()
            refuse(code_of(exc), f"cannot register cache memory {[hex(a) for a in addrs]}: {exc}")
        with self._lock:
            self._caches[cache_id] = entry
        log.debug("registered %r (remote_accessible=%s)", cache, remote_accessible)
        return cache

    def unregister(self, cache_id: int) -> None:
        with self._lock:
            entry = self._caches.pop(cache_id, None)
        if entry is None:
            refuse(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {cache_id} is not registered")
        entry.cache.valid = False
        for kv in entry.kv:
            if kv is not None:
                kv.close()

    def entry(self, cache: Cache) -> CacheEntry:
        """The registration of ``cache``; ``LLM_KV_CACHE_NOT_EXIST`` when it has none here."""
        with self._lock:
            entry = self._caches.get(cache.cache_id)
        if entry is None or entry.cache is not cache:
            refuse(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{cache!r} is not registered with this LLMDataDist (unregistered, or "
                "registered by another instance)",
            )
        return entry

    # -- links ---------------------------------------------------------------------------
    @property
    def links(self) -> dict[int, str]:
        """The links this side made: cluster id -> the peer's listening engine id."""
        with self._lock:
            return dict(self._links)

    def link(self, cluster_id: int, peer: str, timeout: float) -> LLMStatusCode:
        """Connect to ``peer`` for ``cluster_id``; a status, never raises."""
        with self._lock:
            known = self._links.get(cluster_id)
        if known is not None:
            if _ready(self.client, known):
                log.warning("link to cluster %d (%s) exists already", cluster_id, known)
                return LLMStatusCode.LLM_ALREADY_LINK
            self.client.disconnect(known)  # broken: make it again
        now = time.monotonic()
        deadline = now + timeout
        if self.opts.link_total_time_s > 0:
            deadline = min(deadline, now + self.opts.link_total_time_s)
        error: BaseException | None = None
        for attempt in range(self.opts.link_retry_count):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                self.client.connect(peer, timeout=left)
                self.client.notify(peer, HELLO, str(self.cluster_id).encode(), timeout=left)
            except HixlError as exc:
                error = exc
                log.info("link to cluster %d at %s, try %d: %s", cluster_id, peer, attempt + 1, exc)
                continue
            with self._lock:
                self._links[cluster_id] = peer
            log.info("linked to cluster %d at %s", cluster_id, peer)
            return LLMStatusCode.LLM_SUCCESS
        log.warning("link to cluster %d at %s failed: %s", cluster_id, peer, error)
        if error is None or isinstance(error, TransferTimeout):
            return LLMStatusCode.LLM_TIMEOUT
        return LLMStatusCode.LLM_LINK_FAILED

    def _hellos(self) -> None:
        """Learn the cluster ids of the links peers made to our listener."""
        server = self.server
        if server is None:
            return
        notes = server.notifications()
        learned = {}
        for note in notes:
            if note.name == HELLO and note.message.isdigit():
                learned[int(note.message)] = note.peer
            else:
                log.debug("ignoring notification %r from %s", note.name, note.peer)
        if learned:
            with self._lock:
                self._inbound.update(learned)

    def unlink(self, cluster_id: int) -> LLMStatusCode:
        """Close our link to ``cluster_id``, or the one it made to us; none: nothing to do."""
        self._hellos()
        with self._lock:
            peer = self._links.pop(cluster_id, None)
            inbound = self._inbound.pop(cluster_id, None)
            server = self.server
            self._remote = {k: v for k, v in self._remote.items() if k[1] not in (peer, inbound)}
        if peer is not None:
            self.client.disconnect(peer)
            log.info("unlinked cluster %d (%s)", cluster_id, peer)
        elif inbound is not None and server is not None:
            server.disconnect(inbound)
            log.info("closed the link cluster %d made to us (%s)", cluster_id, inbound)
        else:
            log.info("unlink: no link with cluster %d, nothing to do", cluster_id)
        return LLMStatusCode.LLM_SUCCESS

    def route(self, cluster_id: int) -> Route:
        """How to reach ``cluster_id``; ``LLM_NOT_YET_LINK`` without a working link."""
        with self._lock:
            peer = self._links.get(cluster_id)
        if peer is not None:
            if not _ready(self.client, peer):
                refuse(
                    LLMStatusCode.LLM_NOT_YET_LINK,
                    f"the link to cluster {cluster_id} ({peer}) is broken or was closed by the "
                    "peer; unlink_clusters and link_clusters again",
                )
            return Route(self.client, peer, CLIENT)
        self._hellos()
        with self._lock:
            inbound = self._inbound.get(cluster_id)
            server = self.server
        if inbound is not None and server is not None and _ready(server, inbound):
            return Route(server, inbound, SERVER)
        refuse(
            LLMStatusCode.LLM_NOT_YET_LINK,
            f"cluster {cluster_id} is not linked (linked: {sorted(self.links)}); call "
            "link_clusters first",
        )

    def remote(self, route: Route) -> RemoteTable:
        """The caches the peer of ``route`` exposes, parsed once per announcement."""
        regions = route.engine.connection(route.peer).remote_regions
        key = (route.side, route.peer)
        with self._lock:
            seen = self._remote.get(key)
            if seen is not None and seen[0] is regions:
                return seen[1]
        table = index_remote(route.engine.remote_kv_caches(route.peer))
        with self._lock:
            self._remote[key] = (regions, table)
        return table


def _ready(engine: Engine, peer: str) -> bool:
    try:
        return engine.connection(peer).state is ConnState.READY
    except HixlError:
        return False
