"""Channels: one thread's blocking puts and gets between two fixed regions, at verbs pace.

A :class:`Channel` holds a connection's *direct lane* (see
:mod:`hixl.engine.connection`): a queue pair with a completion queue of its own.  Its
regions, keys, access and the peer's region tuple are checked once, when it is opened;
a call checks only its three integers and that nothing was closed or withdrawn since,
then points a one-WR chain (one per direction, built once) at the new addresses, posts
it with one ``post_send`` and polls the channel's own queue for its completion.  No
handle, no send window, no progress thread, and no engine lock on the way: a call owns
the channel by popping its one token, and marks the lane busy before it reads the
engine's and the connection's state, which ``close``/``disconnect`` change under the
lock before they wait for (or skip) a busy lane.  The lock is taken only to fail the
connection, or to release a notification that was queued while the call was out and
held behind it (see :meth:`Channel._end` and ``Queuer.queue``).

Why it exists: on a blocking ``Engine.put`` of one range most of the time is the
engine's general bookkeeping, not the device (docs/benchmarks.md).  A channel is the
shape of ``ib_write_lat``'s loop, kept safe: bounds, alignment, access and region
lifetimes are still checked on every call before anything is posted.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, SupportsIndex

import numpy as np

from hixl.core import wire
from hixl.core.descriptors import ContiguousDesc
from hixl.core.plan import check_alignment, check_bounds
from hixl.core.states import ConnState
from hixl.core.wire import RemoteRegion
from hixl.engine.handles import SPIN_S
from hixl.engine.regions import Access, Region
from hixl.errors import (
    ArgumentError,
    CompletionError,
    ConnectionFailed,
    HixlError,
    RegistrationError,
    StateError,
    TransferTimeout,
)
from hixl.verbs import adapter as verbs
from hixl.verbs.chain import SendChain

if TYPE_CHECKING:
    from hixl.engine.connection import Connection, Lane
    from hixl.engine.posting import Poster

__all__ = ["CHANNEL_WAIT_S", "Channel", "ChannelHost", "LaneBusy", "hold_direct_lane"]

#: Longest :meth:`Engine.channel` waits for a blocking put or get on the direct lane.
CHANNEL_WAIT_S = 60.0

_NAP_MAX = 0.001  # longest sleep between polls once the spin is over (seconds)
#: Bare polls right after the post, before the timed wait (about 0.1 ms natively, a few
#: ms under emulation): a small request's completion comes within them.
SPIN_POLLS = 512


class ChannelHost(Protocol):
    """What a :class:`Channel` needs of its engine, besides the values it is given."""

    def check_open(self) -> None:
        """Raise :class:`StateError` when the engine is closed or broken."""

    def fail(self, conn: Connection, reason: str, error: HixlError | None = None) -> None:
        """Fail ``conn`` (engine lock held): flush it and fail its pending transfers."""


def hold_direct_lane(
    peer: str,
    conn: Connection,
    lock: threading.RLock,
    check_open: Callable[[], None],
    make: Callable[[], Channel],
    *,
    direct_lane: bool,
) -> Channel:
    """A user's channel on ``conn``'s direct lane, made by ``make`` under the engine
    ``lock`` once the lane is free (see :meth:`Engine.channel`); ``direct_lane`` is this
    engine's option of that name, for the message when the connection has no such lane."""
    with lock:
        check_open()
        conn.check_ready()
        if conn.direct is None:
            raise StateError(
                f"connection to {peer} has no direct lane for a channel: "
                + (
                    "this engine was made with direct_lane=False"
                    if not direct_lane
                    else "the peer made fewer queue pairs (a smaller lanes= or direct_lane=False)"
                )
            )
        if conn.channel is not None:
            raise StateError(
                f"connection to {peer} already has an open channel {conn.channel!r}; "
                "close it first (one channel per connection)"
            )
        ch = make()
        conn.channel = ch
    # A blocking put or get of this engine's may be finishing on the lane (see
    # SinglePaths._on_lane); from here on none starts there.  Wait for it, without the lock.
    deadline = time.monotonic() + CHANNEL_WAIT_S
    nap = 0.00005
    while not conn.direct_token:
        if time.monotonic() >= deadline or conn.state is not ConnState.READY:
            with lock:
                if conn.channel is ch:
                    conn.channel = None
            conn.check_ready()
            raise StateError(
                f"the direct lane to {peer} stayed busy for {CHANNEL_WAIT_S} s "
                "(a blocking put or get on it did not end)"
            )
        time.sleep(nap)
        nap = min(nap * 2, 0.001)
    return ch


class LaneBusy(StateError):
    """The direct lane is taken by another call (raised before anything is posted)."""


class Channel:
    """Blocking puts and gets of one contiguous range at a time between ``local`` (a
    region of this engine) and ``remote`` (a region the peer exposes).

    Made by :meth:`hixl.Engine.channel`; holds the connection's direct lane until
    :meth:`close` (also a context manager).  One call at a time: a call made while
    another thread's call is running raises :class:`StateError` (use one channel per
    thread, or :meth:`Engine.put` from the others).

    Read-only: ``peer``, ``local``, ``remote``, ``closed``.
    """

    def __init__(
        self,
        host: ChannelHost,
        conn: Connection,
        local: Region,
        remote: RemoteRegion,
        poster: Poster,
        *,
        lock: threading.RLock,
        conns: Mapping[str, Connection],
        max_msg_sz: int,
        alignment: int | None,
        lent: bool = False,
    ) -> None:
        """``lock`` is the engine lock, ``conns`` its connections by peer (read only),
        ``max_msg_sz`` the device's message size and ``alignment`` the engine's offset
        policy; ``poster.closed`` tells that the engine closed.

        ``lent``: the engine's own use of the lane for a blocking single put or get while
        no channel is open (its calls back off with :class:`LaneBusy` once a channel is
        opened, see :meth:`Engine.channel`, and skip the per-call checks, which the
        engine has just made); a user's channel is not lent."""
        assert conn.direct is not None and conn.direct_cq is not None
        self.peer = conn.peer
        self.local = local
        self.remote = remote
        self._host = host
        self._lock = lock
        self._conns = conns
        self._poster = poster
        self._conn = conn
        self._lane: Lane = conn.direct
        self._cq = conn.direct_cq
        self._remotes = conn.remote_regions  # the tuple ``remote`` was found in
        self._llen = local.length
        self._rlen = remote.length
        self._lbase = local.addr
        self._rbase = remote.addr
        self._max = max_msg_sz
        self._align = alignment or 0
        self._closed = False
        self._write = self._chain(verbs.WR_RDMA_WRITE, local, remote)
        self._read = self._chain(verbs.WR_RDMA_READ, local, remote)
        self._lent = lent
        self._token = conn.direct_token  # popped by the call under way (atomic)
        no_write = (
            None
            if remote.access & wire.REMOTE_WRITE
            else f"peer region {remote.name or hex(remote.addr)} of {self.peer} "
            "is not remotely writable"
        )
        no_read = (
            None
            if remote.access & wire.REMOTE_READ and local.access & Access.LOCAL_WRITE
            else "get needs a remotely readable peer region and a local region with "
            f"LOCAL_WRITE access: {remote!r}, {local!r}"
        )
        label = "" if lent else "channel "
        self._put = self._hot_path(self._write, label + "put", no_write)
        self._get = self._hot_path(self._read, label + "get", no_read)
        # The instance's own put and get are the fast versions themselves: no extra call.
        self.put = self._put  # type: ignore[method-assign]
        self.get = self._get  # type: ignore[method-assign]

    @staticmethod
    def _chain(opcode: int, local: Region, remote: RemoteRegion) -> SendChain:
        chain = SendChain(1, 1)
        chain.fill(
            opcode=opcode,
            remote_addr=np.array([remote.addr], np.uint64),
            rkey=remote.rkey,
            sge_start=np.array([0, 1], np.int64),
            sge_addr=np.array([local.addr], np.uint64),
            sge_length=np.array([0], np.int64),
            lkey=local.lkey,
            regions=(local,),
        )
        chain.signal_one(1)
        return chain

    # -- what users call -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def put(
        self,
        local_offset: SupportsIndex,
        remote_offset: SupportsIndex,
        nbytes: SupportsIndex,
        *,
        timeout: float = 30.0,
    ) -> None:
        """RDMA WRITE ``nbytes`` at ``local_offset`` of the local region to
        ``remote_offset`` of the remote one; return once they have landed.

        Raises before posting: :class:`BoundsError`, :class:`AlignmentError`,
        :class:`DescriptorError` (not an integer, negative), :class:`ArgumentError`
        (``nbytes`` of 0 or over the device's message size, ``timeout`` not > 0),
        :class:`RegistrationError` (the remote region is not writable, or a region was
        closed or withdrawn), :class:`StateError` (the channel or engine is closed, or
        another thread's call is running), :class:`ConnectionFailed`.  After posting:
        :class:`CompletionError` with the work request's status, or
        :class:`TransferTimeout` after ``timeout`` seconds; either fails the connection,
        as for :meth:`Engine.put`.
        """
        # Each instance replaces this with its own fast version (see _hot_path).
        self._put(local_offset, remote_offset, nbytes, timeout=timeout)

    def get(
        self,
        local_offset: SupportsIndex,
        remote_offset: SupportsIndex,
        nbytes: SupportsIndex,
        *,
        timeout: float = 30.0,
    ) -> None:
        """RDMA READ ``nbytes`` at ``remote_offset`` of the remote region into
        ``local_offset`` of the local one; return once they are there.

        Errors as for :meth:`put`; the remote region must be remotely readable and the
        local one have ``Access.LOCAL_WRITE``.
        """
        self._get(local_offset, remote_offset, nbytes, timeout=timeout)

    def close(self) -> None:
        """Give the direct lane back to the connection.  Idempotent; waits for nothing
        (a call still running on another thread finishes normally)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if self._conn.channel is self:
                self._conn.channel = None

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Channel to {self.peer} {self.local!r} -> {self.remote!r} {state}>"

    # -- the hot path ----------------------------------------------------------------------
    def _hot_path(self, chain: SendChain, what: str, refused: str | None) -> Callable[..., None]:
        """The put (or get) of this channel as a closure over what never changes, so a
        call reads locals instead of attributes.  ``refused``: why this direction is not
        allowed (checked on each call, after its arguments), None when it is."""
        llen, rlen, biggest = self._llen, self._rlen, self._max
        mask = self._align - 1 if self._align else 0  # a power of two: a bit test
        lbase, rbase = self._lbase, self._rbase
        conn, token, local = self._conn, self._token, self.local
        poster, lock = self._poster, self._lock
        lent = self._lent
        post = self._lane.qp.post_and_poll(chain, self._cq)  # pointers bound once
        place = chain.place_one
        ready = ConnState.READY
        at_lo = at_ro = at_n = -1  # where the chain points now

        def call(lo: Any, ro: Any, n: Any, *, timeout: float = 30.0) -> None:
            nonlocal at_lo, at_ro, at_n
            # Checks first, nothing posted until they all pass; the fast test is exact for
            # plain ints, anything else is checked (and its error named) the slow way.  A
            # lent call's engine has made every one of these checks just before (its
            # template's bounds, access, timeout, region lifetimes and tuple).
            if not lent:
                if not (
                    type(lo) is int
                    and type(ro) is int
                    and type(n) is int
                    and 0 < n <= biggest
                    and 0 <= lo <= llen - n
                    and 0 <= ro <= rlen - n
                    and not (lo | ro) & mask
                ):
                    lo, ro, n = self._checked(lo, ro, n)
                if not timeout > 0:
                    raise ArgumentError(f"timeout must be > 0 seconds, got {timeout}")
                if refused is not None:
                    raise RegistrationError(refused)
                if conn.remote_regions is not self._remotes:
                    self._recheck_remote()
                if local.closed:
                    self._local_closed()
            # Claim the channel (an atomic pop: one call at a time) before touching its
            # chain, which another thread's call may be posting; then mark the lane busy
            # *before* reading the engine's and the connection's state: close() and
            # _drop() change those under the engine lock and then wait for, or skip, a
            # busy lane (Connection.poster), so whichever comes second sees the other.
            try:
                token.pop()
            except IndexError:
                raise LaneBusy(
                    f"channel to {self.peer} is in use by another thread's call: one call "
                    "at a time per channel"
                ) from None
            if lent and conn.channel is not None:  # a channel was opened: it has the lane
                token.append(None)
                raise LaneBusy(f"the direct lane to {self.peer} belongs to a channel now")
            if lo != at_lo or ro != at_ro or n != at_n:  # a loop repeats its offsets
                place(lbase + lo, n, rbase + ro)
                at_lo, at_ro, at_n = lo, ro, n
            conn.direct_busy = True
            if self._closed or poster.closed or conn.state is not ready:
                self._end()
                with lock:
                    self._refuse()
            try:
                got = post(SPIN_POLLS)
            except BaseException as exc:
                self._post_raised(exc)
                raise
            if got is None:
                got = self._wait(timeout, n, what)
            if got[0] == 0:
                conn.direct_busy = False
                token.append(None)
                if conn.held or conn.state is not ready:
                    self._after()
                return
            self._failed(got, what)

        return call

    def repeat_runner(
        self, opcode: int, lo: int, ro: int, n: int, remotes: tuple[RemoteRegion, ...]
    ) -> Callable[[float], bool]:
        """For a lent channel: the engine's blocking put (or get) of ``n`` bytes at fixed
        offsets ``lo``/``ro``, as one function of the timeout, on a chain of its own
        placed once.  True once it completed (its error raised); False, with nothing
        posted, when it cannot run now (a region was closed or withdrawn -- ``remotes``
        is the peer's region tuple the engine checked the call against --, the engine or
        connection is closing or failed, a channel or another call has the lane, the
        timeout is not > 0): the caller then takes the general path, which checks
        everything again and raises what is wrong.

        The checks of the engine's general path and of a lent call, in one frame: this is
        the whole Python cost of a repeated blocking ``Engine.put`` before its post.  Its
        post and its end are written out as in :meth:`_hot_path`'s call, not called from a
        shared helper: a Python call there costs the round trip it is on."""
        assert self._lent
        chain = self._chain(opcode, self.local, self.remote)
        chain.place_one(self._lbase + lo, n, self._rbase + ro)
        post = self._lane.qp.post_and_poll(chain, self._cq)
        conn, token, poster = self._conn, self._token, self._poster
        mr, conns, peer = self.local.mr, self._conns, conn.peer
        ready = ConnState.READY
        what = "put" if opcode == verbs.WR_RDMA_WRITE else "get"

        def run(timeout: float) -> bool:
            if not timeout > 0:
                return False
            # Claim the lane and mark it busy first, as a channel's call does (see
            # _hot_path), then check everything once: a close or drop that comes first is
            # seen here, one that comes after waits for (or skips) the busy lane.
            try:
                token.pop()
            except IndexError:
                return False
            conn.direct_busy = True
            if (
                conn.state is not ready
                or conn.remote_regions is not remotes
                or mr.closed
                or conn.channel is not None
                or poster.closed
                or conns.get(peer) is not conn
            ):
                self._end()
                return False
            try:
                got = post(SPIN_POLLS)
            except BaseException as exc:
                self._post_raised(exc)
                raise
            self._poster.lane_posts += 1  # after the post: nothing between the checks and it
            if got is None:
                got = self._wait(timeout, n, what)
            if got[0] == 0:
                conn.direct_busy = False
                token.append(None)
                if conn.held or conn.state is not ready:
                    self._after()
                return True
            self._failed(got, what)

        return run

    def _failed(self, got: tuple[int, int], what: str) -> NoReturn:
        """End a call whose completion carries an error status, and raise it."""
        conn = self._conn
        status = got[0]
        if conn.state is not ConnState.READY:  # flushed: the connection failed meanwhile
            raise self._gone()
        name = verbs.WC_STATUS_NAMES.get(status, f"IBV_WC_STATUS_{status}")
        err = CompletionError(f"{what} to {self.peer}", status, name, 1, got[1])
        self._end(err, f"completion error {name}")
        raise err

    def _post_raised(self, exc: BaseException) -> None:
        """End a call whose post (or its first polls) raised ``exc``, which the caller
        then re-raises: see :meth:`_post_refused` for an error of the provider's; anything
        else (an interrupt) fails the connection, whose request may be out."""
        if isinstance(exc, HixlError):
            self._post_refused(exc)
        else:
            self._end(None, "a channel's post was interrupted")

    def _post_refused(self, exc: HixlError) -> None:
        """End a call whose post the provider refused; raises ConnectionFailed when the
        connection failed or closed under it (its queue pair was in ERR), else returns
        for the caller to raise ``exc`` (the connection is failed)."""
        conn = self._conn
        if conn.state is not ConnState.READY:
            raise self._gone() from exc
        self._end(exc, f"post_send failed: {exc}")

    def _gone(self) -> ConnectionFailed:
        """End a call whose connection failed or closed under it; the error to raise."""
        self._end()
        conn = self._conn
        why = conn.failure or f"it was {conn.state.name.lower()}"
        return ConnectionFailed(f"connection to {self.peer} failed: {why}")

    def _local_closed(self) -> NoReturn:
        if self._closed or self._poster.closed:
            with self._lock:
                self._refuse()
        raise RegistrationError(f"local region {self.local!r} was deregistered")

    def _wait(self, timeout: float, n: int, what: str) -> tuple[int, int]:
        """Poll the channel's queue until its completion comes: a spin of
        :data:`SPIN_S`, then sleeps of up to 1 ms.  Past ``timeout`` seconds (or on an
        interrupt) the connection fails, as for any transfer that cannot be recalled."""
        cq, conn = self._cq, self._conn
        start = time.monotonic()
        deadline = start + timeout
        spin_until = start + SPIN_S
        nap = 0.00005
        try:
            while True:
                got = cq.poll_one()
                if got is not None:
                    return got
                now = time.monotonic()
                if now >= deadline:
                    err = TransferTimeout(
                        f"{what} of {n} bytes to {self.peer} did not complete within "
                        f"its deadline; the connection is marked failed because its requests "
                        f"cannot be recalled"
                    )
                    self._end(err, "a transfer timed out")
                    raise err
                if now >= spin_until:
                    if conn.state is not ConnState.READY:
                        # Failed elsewhere: its queue pair is in ERR, the flush is coming.
                        nap = min(nap, 0.0002)
                    time.sleep(nap)
                    nap = min(nap * 2, _NAP_MAX)
        except TransferTimeout:
            raise
        except BaseException:
            self._end(None, "a channel's wait was interrupted")
            raise

    def _end(self, error: HixlError | None = None, reason: str = "") -> None:
        """End a call: with ``reason``, fail the connection first (engine lock; ``error``
        is why).  Then free the direct lane and the channel, and :meth:`_after`.  A
        request still out when the connection fails ends with the failure's flush, which
        nobody needs to wait for."""
        conn = self._conn
        if reason:
            with self._lock:
                self._host.fail(conn, reason, error)
            self._poster.wake_if_due()  # the goodbye the failure queued
        conn.direct_busy = False
        self._token.append(None)
        self._after()

    def _after(self) -> None:
        """After the lane was freed: release a notification held behind the call (engine
        lock; the queueing side looks at the lane again after holding, so one of the two
        always sees the other, see ``Queuer.queue``), and have the progress thread free
        a connection that was dropped meanwhile."""
        conn = self._conn
        if conn.held:
            with self._lock:
                if conn.release_held() and not conn.lanes[0].window.poster:
                    self._poster.want_post(conn.lanes[0])
            self._poster.wake_if_due()
        if conn.state is ConnState.CLOSED:
            self._poster.wake()

    # -- the slow path of errors -----------------------------------------------------------
    def _checked(self, lo: Any, ro: Any, n: Any) -> tuple[int, int, int]:
        """The three integers of a call that failed the fast test, checked one by one:
        returns them as ints when they are fine after all (numpy integers, say), or
        raises what is wrong, with the engine's usual errors and messages."""
        if isinstance(lo, bool) or isinstance(ro, bool) or isinstance(n, bool):
            raise ArgumentError("offsets and nbytes must be integers, not bools")
        try:
            lo, ro, n = operator.index(lo), operator.index(ro), operator.index(n)
        except TypeError as exc:
            raise ArgumentError(f"offsets and nbytes must be integers: {exc}") from None
        if n <= 0:
            raise ArgumentError(f"nbytes must be > 0, got {n}")
        if n > self._max:
            raise ArgumentError(
                f"nbytes={n} is over the device's message size {self._max}: a channel "
                "moves one work request per call (use Engine.put for more)"
            )
        ldesc = ContiguousDesc(offset=lo, nbytes=n, alignment=None)
        rdesc = ContiguousDesc(offset=ro, nbytes=n, alignment=None)
        check_bounds(ldesc, self._llen, what="local")
        check_bounds(rdesc, self._rlen, what="remote")
        if self._align:
            check_alignment(ldesc, 0, self._align, what="local")
            check_alignment(rdesc, 0, self._align, what="remote")
        return lo, ro, n

    def _recheck_remote(self) -> None:
        """The peer changed its announced regions: go on only if ours is still there."""
        conn = self._conn
        remotes = conn.remote_regions
        if not conn.exposes(self.remote):
            raise RegistrationError(
                f"peer {self.peer} no longer exposes region "
                f"{self.remote.name or hex(self.remote.addr)}; open a new channel"
            )
        self._remotes = remotes

    def _refuse(self) -> None:
        """Why a call cannot start (engine lock held)."""
        if self._closed:
            raise StateError(f"channel to {self.peer} is closed")
        self._host.check_open()
        conn = self._conn
        if conn.state is not ConnState.READY:
            conn.check_ready()
            raise StateError(f"connection to {self.peer} is {conn.state.name}")
        raise StateError(f"channel to {self.peer} cannot start a call")
