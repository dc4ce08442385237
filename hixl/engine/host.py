"""The engine as its parts see it: one object that serves every part's host protocol.

The poster, reaper, queuer, single-request paths, channels and KV blocks each define a
small ``Protocol`` of what they need of their engine (:class:`~hixl.engine.posting.PostingHost`,
:class:`~hixl.engine.reaping.ReapingHost`, :class:`~hixl.engine.queueing.QueueHost`,
:class:`~hixl.engine.single.SingleHost`, :class:`~hixl.engine.channel.ChannelHost`,
:class:`~hixl.engine.kv.KVHost`).  :class:`Parts` answers them all by handing each call to
the part that owns it.  It is made before those parts (they take it as their host) and
given them with :meth:`Parts.attach` once they exist.

It holds the engine only weakly: the parts live as long as the engine, and an engine the
application forgets to close must still be collected (and warn).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hixl.core import notify as _notify
from hixl.core.plan import DeviceLimits
from hixl.core.window import Chunk
from hixl.core.wire import RemoteRegion
from hixl.engine.channel import Channel
from hixl.engine.connection import Connection
from hixl.engine.datapath import Built, Planner
from hixl.engine.handles import TransferHandle, TransferRequest
from hixl.engine.peers import Peers
from hixl.engine.posting import Poster
from hixl.engine.queueing import Queuer
from hixl.engine.regions import Access, Region
from hixl.engine.single import SinglePaths
from hixl.errors import HixlError, StateError
from hixl.verbs.chain import SendChain

__all__ = ["Parts", "PublicEngine"]


class PublicEngine(Protocol):
    """The engine's public calls that its parts use (the KV blocks register and read
    through them as an application would)."""

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


class Parts:
    """Every host protocol of one engine's parts, each call handed to the part that owns it."""

    __slots__ = (
        "_engine", "_lock", "_planner", "limits", "_poster", "_queuer", "_peers", "_singles",
    )  # fmt: skip

    _poster: Callable[[], Poster | None]
    _queuer: Queuer
    _peers: Peers
    _singles: SinglePaths

    def __init__(
        self, engine: PublicEngine, lock: threading.RLock, planner: Planner, limits: DeviceLimits
    ) -> None:
        self._engine: Callable[[], PublicEngine | None] = weakref.ref(engine)
        self._lock = lock
        self._planner = planner
        self.limits = limits

    def attach(self, poster: Poster, queuer: Queuer, peers: Peers, singles: SinglePaths) -> None:
        """Give the parts made after this object (they took it as their host).

        Held weakly: each holds this object in turn, and a cycle would keep a closed
        engine's connections and buffers until the cyclic collector runs.  The engine
        holds them (``queuer`` through ``singles``)."""
        self._poster = weakref.ref(poster)  # a channel is given the poster itself
        self._queuer, self._peers, self._singles = (
            weakref.proxy(queuer), weakref.proxy(peers), weakref.proxy(singles),
        )  # fmt: skip

    def _owner(self) -> PublicEngine:
        engine = self._engine()
        if engine is None:
            raise StateError("the engine was collected")
        return engine

    # -- the connection table (Peers) ----------------------------------------------------
    def fail(
        self,
        conn: object,
        reason: str,
        error: HixlError | None = None,
        *,
        culprit: TransferHandle | None = None,
    ) -> None:
        assert isinstance(conn, Connection)
        self._peers.fail(conn, reason, error, culprit=culprit)

    def release_notify(self, chunk: Chunk) -> None:
        self._peers.release_notify(chunk)

    def connection_of(self, peer: str) -> Connection | None:
        return self._peers.conns.get(peer)

    def check_open(self) -> None:
        self._peers.check_open()

    def take_credit(self, conn: Connection, deadline: float, timeout: float) -> None:
        self._peers.take_credit(conn, deadline, timeout)

    # -- the general path and channels ---------------------------------------------------
    def submit(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        notify: str | None,
        notify_message: bytes,
        timeout: float,
        *,
        now: bool,
        tkey: tuple[Any, ...] | None = None,
    ) -> TransferHandle:
        """The general path (see :meth:`SinglePaths.submit`) for the engine's regions."""
        engine = self._owner()
        return self._singles.submit(
            engine, engine.connection, peer, requests, notify, notify_message, timeout,
            now=now, tkey=tkey,
        )  # fmt: skip

    def new_channel(
        self, conn: Connection, local: Region, remote: RemoteRegion, *, lent: bool
    ) -> Channel:
        """A channel on ``conn``'s direct lane; ``lent``: one a single call borrows."""
        poster = self._poster()
        if poster is None:
            raise StateError("the engine was collected")
        return Channel(
            self, conn, local, remote, poster, lock=self._lock, conns=self._peers.conns,
            max_msg_sz=self.limits.max_msg_sz, alignment=self._planner.alignment, lent=lent,
        )  # fmt: skip

    def lent_channel(self, conn: Connection, local: Region, remote: RemoteRegion) -> Channel:
        return self.new_channel(conn, local, remote, lent=True)

    # -- KV blocks (KVHost) --------------------------------------------------------------
    @property
    def alignment(self) -> int | None:
        return self._planner.alignment

    def register(
        self, buffer: object, *, access: Access = Access.LOCAL_WRITE, name: str = ""
    ) -> Region:
        return self._owner().register(buffer, access=access, name=name)

    def deregister(self, region: Region) -> None:
        self._owner().deregister(region)

    def get(
        self, peer: str, local: Region, remote: RemoteRegion | str, *, timeout: float = 30.0
    ) -> None:
        self._owner().get(peer, local, remote, timeout=timeout)

    def connection(self, peer: str) -> Connection:
        return self._owner().connection(peer)

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
    ) -> tuple[TransferHandle, list[Chunk]]:
        """Queue a filled chain as one transfer (pooled under ``key`` once posted); return
        its handle and the chunks its WRs went out in (their ``done`` counts what has
        completed, see :class:`~hixl.core.window.Chunk`)."""
        payload = _notify.encode(notify, notify_message) if notify is not None else None
        built = Built(chain, nbytes, key, (0, 0))
        parts: list[Chunk] = []
        return self._queuer.queue(conn, [built], payload, reads, timeout, now, parts), parts

    def idle_chain(self, key: tuple[Any, ...]) -> SendChain | None:
        """An idle chain pooled under ``key`` (taken out of the pool), or None."""
        idle = self._planner.take(key)
        return None if idle is None else idle.chain
