"""The registry client: announcements under a lease, lookups, and watches.

Theory of operation
-------------------
One :class:`Registry` holds at most one lease. Everything it announces is attached to that
lease, so when the process dies the store deletes its keys after the TTL and watchers see
them leave.

Writes go through one thread, the *announcer*. :meth:`Registry.announce`,
:meth:`Registry.update` and :meth:`Registry.withdraw` record the wanted state in a table
under the lock, wake the announcer and wait (with a deadline) until it reports that
generation written, or failed. The announcer alone talks to the store for writes: it grants
the lease, refreshes it every TTL/3, and writes dirty names. If a refresh finds the lease
gone (it expired while the store was unreachable, or the store lost its data), it grants a
new one and writes every wanted name again. If the store is unreachable it keeps the wanted
state and retries every 0.5 s, so announcements come back on their own when the store does.

Reads: :meth:`Registry.resolve` and :meth:`Registry.list` ask the store directly and fail
fast (within the backend's timeout) with :class:`~hixl.errors.RegistryUnavailable` naming
the registry. :meth:`Registry.watch` starts (once) a *watch thread* that lists the prefix,
then follows changes from the next revision; whenever the stream breaks it lists again and
turns the difference into events, so a watcher's view is right again after an outage.

Locking: ``Registry._lock`` guards the wanted table, the lease id, the write generations and
the list of watches. No store call, sleep or wait on another thread happens under it
(``Condition.wait`` releases it). Each :class:`Watch` has its own lock for its queue; the
watch thread takes a watch's lock without holding ``Registry._lock``.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from hixl.core.directory import (
    PREFIX,
    Announcement,
    Directory,
    DirectoryEvent,
    Rejected,
    decode,
    encode,
    key_for,
    validate_name,
)
from hixl.errors import (
    ArgumentError,
    NameNotFound,
    RegistryError,
    RegistryUnavailable,
    StateError,
    TransferTimeout,
)
from hixl.registry._backend import MAX_ENTRIES, Backend, Compacted, LeaseLost

__all__ = ["Registry", "Watch"]

_log = logging.getLogger("hixl.registry")

_RETRY = 0.5  # seconds between attempts while the store is unreachable
_WATCH_QUEUE = 1024  # events a Watch holds before it drops the oldest


class Watch:
    """A live view of the registry and the stream of changes to it.

    :meth:`members` is the current view (name -> :class:`Announcement`), kept up to date by
    the registry's watch thread. :meth:`get` returns the next :class:`DirectoryEvent`. The
    queue holds at most 1024 events; past that the oldest are dropped (with a warning) and
    :attr:`dropped` counts them, while :meth:`members` stays exact.
    """

    def __init__(
        self,
        registry: Registry,
        members: dict[str, Announcement],
        synced: bool,
        callback: Callable[[DirectoryEvent], None] | None = None,
    ) -> None:
        self._registry = weakref.ref(registry)
        self._callback = callback
        self._cond = threading.Condition()
        self._events: collections.deque[DirectoryEvent] = collections.deque()
        self._members = members
        self._synced = synced
        self._closed = False
        self.dropped = 0

    def __repr__(self) -> str:
        return (
            f"<Watch members={len(self._members)} queued={len(self._events)} "
            f"synced={self._synced} closed={self._closed}>"
        )

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[DirectoryEvent]:
        """Events as they come, until the watch is closed."""
        while True:
            try:
                yield self.get(timeout=None)
            except StateError:
                return

    @property
    def synced(self) -> bool:
        """True while the view follows the store; False after the store became unreachable
        (the view then keeps the last state known until the store is back)."""
        return self._synced

    def members(self, role: str | None = None) -> dict[str, Announcement]:
        """The current view, optionally only the names announced with ``role``."""
        with self._cond:
            members = self._members
        if role is None:
            return dict(members)
        return {n: a for n, a in members.items() if a.role == role}

    def get(self, timeout: float | None) -> DirectoryEvent:
        """The next event; waits up to ``timeout`` seconds (``None``: until one comes).

        Raises :class:`~hixl.errors.TransferTimeout` when none came in time and
        :class:`~hixl.errors.StateError` once the watch is closed and drained.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._events:
                if self._closed:
                    raise StateError("watch is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TransferTimeout(f"no registry event within {timeout} s")
                self._cond.wait(remaining)
            return self._events.popleft()

    def drain(self) -> list[DirectoryEvent]:
        """Every queued event, without waiting."""
        with self._cond:
            out = list(self._events)
            self._events.clear()
            return out

    def close(self) -> None:
        """Stop receiving events; idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        registry = self._registry()
        if registry is not None:
            registry._forget(self)

    def _publish(
        self, events: list[DirectoryEvent], members: dict[str, Announcement], synced: bool
    ) -> None:
        with self._cond:
            if self._closed:
                return
            self._members = members
            self._synced = synced
            callback = self._callback
            for ev in [] if callback is not None else events:
                if len(self._events) >= _WATCH_QUEUE:
                    self._events.popleft()
                    self.dropped += 1
                    if self.dropped == 1 or self.dropped % 1000 == 0:
                        _log.warning("registry watch: %d events dropped, queue full", self.dropped)
                self._events.append(ev)
            self._cond.notify_all()
        if callback is not None:
            for ev in events:
                try:
                    callback(ev)
                except Exception:  # noqa: BLE001 - a watcher's bug must not stop the thread
                    _log.exception("registry watch callback failed on %s", ev)


class Registry:
    """A client of one registry store (etcd, or the in-process store).

    Made by :func:`hixl.registry.open_registry`. ``ttl`` is the lease TTL in whole seconds:
    a process that dies without closing disappears from the registry within about that
    long. ``timeout`` bounds each write call's wait for the announcer. The constructor
    checks that the store answers and raises :class:`~hixl.errors.RegistryUnavailable`
    naming the URL if it does not.
    """

    def __init__(self, backend: Backend, *, ttl: int = 3, timeout: float = 5.0) -> None:
        if type(ttl) is not int or not 1 <= ttl <= 3600:
            raise ArgumentError(f"registry ttl={ttl!r} must be whole seconds in [1, 3600]")
        if not timeout > 0:
            raise ArgumentError(f"registry timeout={timeout!r} must be > 0")
        self._backend = backend
        self.url = backend.url
        self.ttl = ttl
        self.timeout = timeout
        self.instance = secrets.token_hex(8)
        backend.check()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        # -- guarded by _lock: the wanted state and the announcer's progress
        self._wanted: dict[str, Announcement] = {}
        self._dirty: dict[str, int] = {}  # name -> generation to write (put or delete)
        self._gen = 0
        self._done_gen = 0
        self._failure: tuple[int, RegistryError] | None = None
        self._lease: int | None = None
        self._watches: list[Watch] = []
        self._view: dict[str, Announcement] = {}
        self._synced = False
        # -- threads
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._announcer: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._warned: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        lease = "none" if self._lease is None else f"{self._lease:#x}"
        return f"<Registry {self.url} {state} names={sorted(self._wanted)} lease={lease}>"

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- writes ------------------------------------------------------------------------

    def announce(
        self,
        name: str,
        *,
        role: str,
        engine_id: str,
        gid: str,
        mtu: int,
        capacity: int,
        timeout: float | None = None,
    ) -> Announcement:
        """Announce an engine under ``name``, attached to this registry's lease.

        Returns once the store has it. A name announced again replaces the old value (the
        last announcer of a name wins). Raises :class:`~hixl.errors.ArgumentError` for a bad
        field (naming it), :class:`~hixl.errors.RegistryUnavailable` if the store cannot be
        reached within ``timeout`` (default: the registry's): the announcement is kept and
        made as soon as the store is back.
        """
        try:
            ann = Announcement(
                name=name,
                role=role,
                engine=engine_id,
                gid=gid,
                mtu=mtu,
                capacity=capacity,
                instance=self.instance,
            )
        except ValueError as exc:
            raise ArgumentError(f"announce {name!r}: {exc}") from None
        self._want(ann.name, ann, timeout)
        return ann

    def update(self, name: str, *, capacity: int, timeout: float | None = None) -> Announcement:
        """Change the capacity announced under ``name`` (which this registry announced).

        Raises :class:`~hixl.errors.StateError` if it did not announce ``name``.
        """
        with self._lock:
            old = self._wanted.get(name)
        if old is None:
            raise StateError(f"registry {self.url}: {name!r} is not announced by this process")
        try:
            ann = Announcement(
                name=old.name,
                role=old.role,
                engine=old.engine,
                gid=old.gid,
                mtu=old.mtu,
                capacity=capacity,
                instance=old.instance,
            )
        except ValueError as exc:
            raise ArgumentError(f"update {name!r}: {exc}") from None
        self._want(name, ann, timeout)
        return ann

    def withdraw(self, name: str, timeout: float | None = None) -> None:
        """Remove ``name`` from the registry now (watchers see it leave)."""
        try:
            validate_name(name)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        self._want(name, None, timeout)

    def _want(
        self, name: str, ann: Announcement | None, timeout: float | None
    ) -> Announcement | None:
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise StateError(f"registry {self.url} is closed")
            if ann is None:
                if self._wanted.pop(name, None) is None:
                    return None
            else:
                self._wanted[name] = ann
            self._gen += 1
            gen = self._dirty[name] = self._gen
            if self._announcer is None:
                self._announcer = threading.Thread(
                    target=_announce_loop,
                    args=(weakref.ref(self),),
                    name=f"hixl-registry-announce {self.url}",
                    daemon=True,
                )
                self._announcer.start()
        self._wake.set()
        self._wait_written(gen, limit)
        return ann

    def _wait_written(self, gen: int, limit: float) -> None:
        deadline = time.monotonic() + limit
        with self._cond:
            while self._done_gen < gen:
                if self._failure is not None and self._failure[0] >= gen:
                    raise type(self._failure[1])(str(self._failure[1]))
                if self._closed:
                    raise StateError(f"registry {self.url} closed before the write was made")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RegistryUnavailable(
                        f"registry {self.url} did not confirm the write within {limit} s"
                    )
                self._cond.wait(remaining)

    # -- reads -------------------------------------------------------------------------

    def resolve(self, name: str) -> Announcement:
        """The live announcement for ``name``, read from the store now.

        Raises :class:`~hixl.errors.NameNotFound` if nobody announces it (or its value is
        malformed: that is logged as a warning), :class:`~hixl.errors.RegistryUnavailable`
        naming the registry if the store cannot be reached within its timeout.
        """
        self._check_open()
        try:
            key = key_for(name)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        value = self._backend.get(key)
        if value is None:
            raise NameNotFound(f"no engine named {name!r} in registry {self.url}")
        try:
            return decode(key, value)
        except ValueError as exc:
            self._warn(Rejected(key, str(exc)))
            raise NameNotFound(
                f"registry {self.url}: the value for {name!r} is malformed and was skipped"
            ) from None

    def list(self, role: str | None = None) -> list[Announcement]:
        """Every live, well-formed announcement (optionally only ``role``), by name.

        Malformed or foreign values under the prefix are skipped with a warning.
        """
        self._check_open()
        _, items = self._backend.list(PREFIX)
        if len(items) > MAX_ENTRIES:
            _log.warning(
                "registry %s: more than %d names; reading the first", self.url, MAX_ENTRIES
            )
            items = items[:MAX_ENTRIES]
        out = []
        for key, value in items:
            try:
                ann = decode(key, value)
            except ValueError as exc:
                self._warn(Rejected(key, str(exc)))
                continue
            if role is None or ann.role == role:
                out.append(ann)
        return out

    def watch(self, callback: Callable[[DirectoryEvent], None] | None = None) -> Watch:
        """A :class:`Watch`: the current view and the changes from now on.

        The first call starts the watch thread; the view is complete once
        :attr:`Watch.synced` is true (:meth:`wait_synced`). With ``callback``, events are
        not queued but passed to it on the watch thread, outside every registry lock; it
        must return quickly and not call back into this registry's write methods.
        """
        with self._lock:
            self._check_open()
            w = Watch(self, dict(self._view), self._synced, callback)
            self._watches.append(w)
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=_watch_loop,
                    args=(weakref.ref(self), self._backend, self._stop, self.url),
                    name=f"hixl-registry-watch {self.url}",
                    daemon=True,
                )
                self._watcher.start()
        return w

    def wait_synced(self, watch: Watch, timeout: float) -> None:
        """Wait until ``watch`` follows the store; :class:`~hixl.errors.RegistryUnavailable`
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with watch._cond:
            while not watch._synced:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RegistryUnavailable(f"registry {self.url}: no listing within {timeout} s")
                watch._cond.wait(remaining)

    def _forget(self, w: Watch) -> None:
        with self._lock:
            if w in self._watches:
                self._watches.remove(w)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"registry {self.url} is closed")

    def _warn(self, rejected: Rejected) -> None:
        """Warn once per (key, reason); remembers at most 1024 of them."""
        tag = (rejected.key[:200], rejected.reason[:200])
        with self._lock:
            if tag in self._warned:
                return
            self._warned[tag] = None
            if len(self._warned) > 1024:
                self._warned.popitem(last=False)
        _log.warning("registry %s: skipping %s", self.url, rejected.reason)

    # -- lifetime ----------------------------------------------------------------------

    def close(self, timeout: float = 2.0, *, revoke: bool = True) -> None:
        """Stop the threads, revoke the lease (its names leave at once), close watches.

        Idempotent. A store that cannot be reached is not waited for beyond ``timeout``:
        the names then leave when the lease expires. ``revoke=False`` leaves the lease to
        expire, as the death of the process would (a documented test hook).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches, self._watches = self._watches, []
            self._cond.notify_all()
        self._stop.set()
        self._wake.set()
        me = threading.current_thread()
        for t in (self._announcer, self._watcher):
            if t is not None and t is not me:
                t.join(timeout)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None and revoke:
            try:
                self._backend.revoke(lease)
            except RegistryError as exc:
                _log.warning(
                    "registry %s: could not revoke lease %#x (%s); its names expire in %d s",
                    self.url,
                    lease,
                    exc,
                    self.ttl,
                )
        for w in watches:
            w.close()
        self._backend.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._stop.set()
            self._wake.set()


def _announce_loop(ref: weakref.ref[Registry]) -> None:
    """The announcer thread: holds the lease and makes every wanted write."""
    reg = ref()
    if reg is None:
        return
    stop, wake, backend, ttl, url = reg._stop, reg._wake, reg._backend, reg.ttl, reg.url
    del reg
    refresh_every = ttl / 3
    next_refresh = 0.0
    down_since: float | None = None
    while not stop.is_set():
        reg = ref()
        if reg is None:
            return
        with reg._lock:
            gen = reg._gen
            lease = reg._lease
            wanted = dict(reg._wanted)
            dirty = dict(reg._dirty)
        del reg
        pause = refresh_every
        try:
            now = time.monotonic()
            rewrite = False
            if lease is not None and now >= next_refresh:
                left = backend.keepalive(lease)
                if left <= 0:
                    _log.warning("registry %s: lease %#x was lost; announcing again", url, lease)
                    lease = None
                else:
                    next_refresh = now + refresh_every
            if lease is None and wanted:
                lease = backend.grant(ttl)
                next_refresh = time.monotonic() + refresh_every
                rewrite = True
            names = set(wanted) | set(dirty) if rewrite else set(dirty)
            for name in sorted(names):
                ann = wanted.get(name)
                if ann is None:
                    backend.delete(key_for(name))
                elif lease is not None:
                    backend.put(key_for(name), encode(ann), lease)
            reg = ref()
            if reg is None:
                return
            with reg._lock:
                reg._lease = lease
                for name, g in dirty.items():
                    if reg._dirty.get(name) == g:
                        del reg._dirty[name]
                reg._done_gen = max(reg._done_gen, gen)
                reg._failure = None
                reg._cond.notify_all()
            del reg
            if down_since is not None:
                _log.warning(
                    "registry %s: reachable again after %.1f s; %d names announced",
                    url,
                    time.monotonic() - down_since,
                    len(wanted),
                )
                down_since = None
            if lease is not None:
                pause = max(0.0, next_refresh - time.monotonic())
        except LeaseLost:
            reg = ref()
            if reg is None:
                return
            with reg._lock:
                reg._lease = None
            del reg
            pause = 0.0
        except RegistryError as exc:
            reg = ref()
            if reg is None:
                return
            with reg._lock:
                reg._failure = (gen, exc)
                reg._cond.notify_all()
            del reg
            if down_since is None:
                down_since = time.monotonic()
                _log.warning("registry %s: %s; retrying every %.1f s", url, exc, _RETRY)
            next_refresh = 0.0
            pause = _RETRY
        wake.wait(pause)
        wake.clear()


def _watch_loop(
    ref: weakref.ref[Registry], backend: Backend, stop: threading.Event, url: str
) -> None:
    """The watch thread: list, then follow changes; list again whenever the stream breaks."""
    directory = Directory(max_members=MAX_ENTRIES)
    down_since: float | None = None

    def publish(events: list[DirectoryEvent], rejected: list[Rejected], synced: bool) -> bool:
        reg = ref()
        if reg is None:
            return False
        for r in rejected:
            reg._warn(r)
        members = directory.members()
        with reg._lock:
            reg._view = members
            reg._synced = synced
            watches = list(reg._watches)
        for w in watches:
            w._publish(events, members, synced)
        return True

    while not stop.is_set():
        try:
            revision, items = backend.list(PREFIX)
            events, rejected = directory.replace(items[:MAX_ENTRIES])
            if not publish(events, rejected, True):
                return
            if down_since is not None:
                _log.warning(
                    "registry %s: watching again after %.1f s", url, time.monotonic() - down_since
                )
                down_since = None
            for item in backend.watch(PREFIX, revision + 1, stop):
                if item.value is None:
                    ev = directory.delete(item.key)
                    rej = None
                else:
                    ev, rej = directory.put(item.key, item.value)
                if not publish([] if ev is None else [ev], [] if rej is None else [rej], True):
                    return
        except Compacted:
            continue
        except RegistryError as exc:
            if not publish([], [], False):
                return
            if down_since is None:
                down_since = time.monotonic()
                _log.warning("registry %s: watch interrupted: %s", url, exc)
            stop.wait(_RETRY)
