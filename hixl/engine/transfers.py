"""The public calls that move data, as a base class of :class:`~hixl.engine.Engine`.

:class:`TransferCalls` holds put/get (blocking and async), batches, KV blocks and
notifications.  Each call checks nothing itself: it hands the request to the part that
serves it, the single-request paths (:mod:`~hixl.engine.single`), the KV blocks
(:mod:`~hixl.engine.kv`) or the connection table (:mod:`~hixl.engine.peers`).  The engine
gives it those parts as the four attributes declared below; it reads nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

from hixl.core.descriptors import Descriptor
from hixl.core.notify import Notification
from hixl.core.plan import Op
from hixl.core.wire import RemoteRegion
from hixl.engine.handles import TransferHandle, TransferRequest
from hixl.engine.host import Parts
from hixl.engine.kv import KVBlocks, KVCache
from hixl.engine.peers import Peers
from hixl.engine.regions import Access, Region
from hixl.engine.single import SinglePaths

__all__ = ["TransferCalls"]


class TransferCalls:
    """Put, get, batches, KV blocks and notifications: the engine's data calls.

    ``_singles``, ``_kv``, ``_peers`` and ``_parts`` are the engine's parts these calls
    delegate to; the engine sets them when it is built.
    """

    _singles: SinglePaths
    _kv: KVBlocks
    _peers: Peers
    _parts: Parts

    # -- transfers -----------------------------------------------------------------------
    def put(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA WRITE ``local_desc`` of ``local`` into ``remote_desc`` of the peer's ``remote``.

        Blocks until the data has landed (and the notification, if any, was
        delivered), or raises: :class:`BoundsError`, :class:`RegistrationError`,
        :class:`AlignmentError`, :class:`DescriptorError` before posting;
        :class:`CompletionError`, :class:`ConnectionFailed` or
        :class:`TransferTimeout` (after ``timeout`` seconds) after it.

        A repeated put of one work request is posted and polled by this thread (on the
        direct lane while no channel holds it, else on an idle queue pair;
        ``Diagnostics.direct_posts``); otherwise it is queued like :meth:`put_async`.
        """
        again = self._singles.repeat_put  # the same call as the last one on the lane: no lookup
        if (
            again is not None
            and notify is None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._singles.one(
            "write",
            peer,
            local,
            remote,
            local_desc,
            remote_desc,
            notify,
            notify_message,
            timeout,
            now=True,
        )
        if handle is not None:  # None: posted and completed on this thread (see SinglePaths._solo)
            handle.wait()

    def get(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        timeout: float = 30.0,
    ) -> None:
        """RDMA READ the peer's ``remote_desc`` of ``remote`` into ``local_desc`` of ``local``.

        Errors, and the direct post of a repeated single work request, as for
        :meth:`put`.  ``local`` needs ``Access.LOCAL_WRITE``.
        """
        again = self._singles.repeat_get
        if (
            again is not None
            and again[0] == (peer, local, remote, local_desc, remote_desc)
            and again[1](timeout)
        ):
            return
        handle = self._singles.one(
            "read", peer, local, remote, local_desc, remote_desc, None, b"", timeout, now=True
        )
        if handle is not None:
            handle.wait()

    def put_async(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a put (see :meth:`put`); return its :class:`TransferHandle`.

        A put of one contiguous range, once checked, goes into its queue pair's ring of
        slots with the puts queued before it, posted as one range with one completion
        (``Diagnostics.slot_messages``): its handle is done when that group is; if one
        fails, those before it are done, it fails with its status, the later ones with
        the connection.
        """
        again = self._singles.ring_put  # the last ring template's call: no lookup if it matches
        if again is not None and notify is None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._singles.one(
            "write",
            peer,
            local,
            remote,
            local_desc,
            remote_desc,
            notify,
            notify_message,
            timeout,
            now=False,
        )
        assert handle is not None  # only a blocking call finishes on its own thread
        return handle

    def get_async(
        self,
        peer: str,
        local: Region,
        remote: RemoteRegion | str,
        *,
        local_desc: Descriptor | None = None,
        remote_desc: Descriptor | None = None,
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a get (see :meth:`get`); return its :class:`TransferHandle`.

        A get of one work request of one SGE goes through a ring of slots as a put does
        (see :meth:`put_async`)."""
        again = self._singles.ring_get
        if again is not None:
            fast = again(peer, local, remote, local_desc, remote_desc, timeout)
            if fast is not None:
                return fast
        handle = self._singles.one(
            "read", peer, local, remote, local_desc, remote_desc, None, b"", timeout, now=False
        )
        assert handle is not None
        return handle

    def transfer(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        *,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """Run a batch of requests to one peer as one transfer; block until done."""
        self._parts.submit(peer, requests, notify, notify_message, timeout, now=True).wait()

    def transfer_async(
        self,
        peer: str,
        requests: Sequence[TransferRequest],
        *,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Validate and plan every request, then post them all; return one handle.

        Nothing is posted unless every request is valid.  With ``notify``,
        the peer receives a :class:`Notification` once all the data has
        landed.  ``timeout`` (seconds) is the transfer's deadline: after it,
        the transfer fails with :class:`TransferTimeout` and the connection is
        marked failed (its requests cannot be recalled otherwise).

        The progress thread posts the work requests with whatever else was queued
        meanwhile (one ``post_send`` for many calls); this returns without waiting.
        """
        return self._parts.submit(peer, requests, notify, notify_message, timeout, now=False)

    # -- KV caches (hixl.engine.kv) ------------------------------------------------------
    def register_kv(
        self,
        name: str,
        tensors: object,
        *,
        block_axis: int = 0,
        heads_axis: int | None = None,
        access: Access = Access.REMOTE_READ | Access.REMOTE_WRITE,
    ) -> KVCache:
        """Register a KV cache: ``tensors`` (numpy arrays or CPU torch tensors, one or more
        per layer) whose ``block_axis`` indexes blocks; ``heads_axis`` names the KV-heads
        axis where head ranges are wanted.  Each storage span is registered once; peers
        find the cache by ``name`` and learn its geometry.  Raises
        :class:`RegistrationError` (also for a name in use) or :class:`ArgumentError`."""
        self._peers.check_open()
        return self._kv.register(
            name, tensors, block_axis=block_axis, heads_axis=heads_axis, access=access
        )

    def remote_kv_caches(self, peer: str) -> tuple[str, ...]:
        """Names of the KV caches ``peer`` announces now, sorted (see docs/api.md)."""
        return self._kv.announced(peer)

    def put_blocks(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA WRITE blocks ``local_blocks[i]`` of ``kv`` into blocks ``remote_blocks[i]``
        of the peer's cache ``remote_name``, for every tensor (or the indices ``tensors``,
        paired with the same indices there or with ``remote_tensors``), narrowed to head
        ranges ``heads``/``remote_heads``; block until done.  The
        notification, if any, arrives after all the data.  Errors before posting:
        :class:`DescriptorError` (a mismatch of the caches, a bad or repeated destination
        block id), :class:`RegistrationError`; after: as :meth:`put`, naming the request
        and the blocks not known to have landed.  See docs/api.md."""
        self._kv.transfer(
            Op.WRITE, peer, kv, remote_name, local_blocks, remote_blocks, tensors=tensors,
            heads=heads, remote_heads=remote_heads, remote_tensors=remote_tensors,
            notify=notify, notify_message=notify_message, timeout=timeout, now=True,
        ).wait()  # fmt: skip

    def get_blocks(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> None:
        """RDMA READ the peer's blocks ``remote_blocks[i]`` into ``local_blocks[i]`` of
        ``kv``; as :meth:`put_blocks` otherwise (the notification follows the reads)."""
        self._kv.transfer(
            Op.READ, peer, kv, remote_name, local_blocks, remote_blocks, tensors=tensors,
            heads=heads, remote_heads=remote_heads, remote_tensors=remote_tensors,
            notify=notify, notify_message=notify_message, timeout=timeout, now=True,
        ).wait()  # fmt: skip

    def put_blocks_async(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a :meth:`put_blocks`; return its handle."""
        return self._kv.transfer(
            Op.WRITE, peer, kv, remote_name, local_blocks, remote_blocks, tensors=tensors,
            heads=heads, remote_heads=remote_heads, remote_tensors=remote_tensors,
            notify=notify, notify_message=notify_message, timeout=timeout, now=False,
        )  # fmt: skip

    def get_blocks_async(
        self,
        peer: str,
        kv: KVCache,
        remote_name: str,
        local_blocks: object,
        remote_blocks: object,
        *,
        tensors: Sequence[int] | range | None = None,
        heads: tuple[int, int] | None = None,
        remote_heads: tuple[int, int] | None = None,
        remote_tensors: Sequence[int] | range | None = None,
        notify: str | None = None,
        notify_message: bytes = b"",
        timeout: float = 30.0,
    ) -> TransferHandle:
        """Start a :meth:`get_blocks`; return its handle."""
        return self._kv.transfer(
            Op.READ, peer, kv, remote_name, local_blocks, remote_blocks, tensors=tensors,
            heads=heads, remote_heads=remote_heads, remote_tensors=remote_tensors,
            notify=notify, notify_message=notify_message, timeout=timeout, now=False,
        )  # fmt: skip

    # -- notifications -------------------------------------------------------------------
    def notify(self, peer: str, name: str, message: bytes = b"", timeout: float = 10.0) -> None:
        """Send a notification to ``peer`` alone (after everything posted before it)."""
        self.transfer(peer, [], notify=name, notify_message=message, timeout=timeout)

    def notifications(self) -> list[Notification]:
        """Take every notification received so far (oldest first)."""
        return self._peers.take_notes()

    def wait_notification(self, name: str, timeout: float, peer: str | None = None) -> Notification:
        """Wait up to ``timeout`` s for a notification called ``name`` (from ``peer``).

        The matching notification is taken out of the queue; others stay.  ``peer`` is
        matched against the id the sender's connection proved in its handshake.
        Raises :class:`TransferTimeout` when none arrives in time, :class:`StateError`
        when the engine is closed (or closes while waiting).
        """
        return self._peers.wait_note(name, timeout, peer)
