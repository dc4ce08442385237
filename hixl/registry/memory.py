"""The in-process registry store: etcd's lease and watch semantics inside one process.

For engines in one process (tests, a single-machine demo) that want names without running
etcd: ``open_registry("memory://NAME")`` gives every caller in the process the same
:class:`MemoryStore` for ``NAME``. It behaves like a one-member etcd for what hixl uses:
revisions, leases that expire after their TTL unless refreshed (keys go with them), a
bounded history for watches (older revisions are "compacted"), and a documented test hook
to take the store down and bring it back (:meth:`MemoryStore.stop`, :meth:`MemoryStore.start`)
or to write a raw value (:meth:`MemoryStore.put_raw`).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterator

from hixl.errors import ArgumentError, RegistryUnavailable
from hixl.registry._backend import MAX_ENTRIES, Compacted, LeaseLost, WatchItem

__all__ = ["MemoryStore", "MemoryBackend", "store_named"]

_HISTORY = 4096

_stores_lock = threading.Lock()
_stores: dict[str, MemoryStore] = {}


def store_named(name: str) -> MemoryStore:
    """The process-wide store called ``name``, created on first use."""
    with _stores_lock:
        store = _stores.get(name)
        if store is None:
            store = _stores[name] = MemoryStore(name)
        return store


class MemoryStore:
    """An in-process key-value store with leases and watch history.

    One lock guards everything; no call does I/O or sleeps under it (watchers wait on the
    condition, which releases it). Lease expiry is checked on every call and by waiting
    watchers, so an expired key is deleted within about 0.1 s of its deadline.
    """

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self._clock = time.monotonic
        self._cond = threading.Condition()
        self._up = True
        self._epoch = 0
        self._revision = 1
        self._kv: dict[str, tuple[bytes, int]] = {}  # key -> (value, lease id or 0)
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._ids = itertools.count(0x1000)
        self._history: collections.deque[WatchItem] = collections.deque(maxlen=_HISTORY)
        self._floor = 1  # every change at a revision >= _floor is still in _history

    def __repr__(self) -> str:
        state = "up" if self._up else "down"
        return f"<MemoryStore {self.name!r} {state} keys={len(self._kv)} rev={self._revision}>"

    # -- test hooks ----------------------------------------------------------------------

    def stop(self) -> None:
        """Take the store down: every call fails with RegistryUnavailable, watches break.

        Like a stopped etcd, leases do not run out while it is down.
        """
        with self._cond:
            self._up = False
            self._epoch += 1
            self._cond.notify_all()

    def start(self, *, wipe: bool = False) -> None:
        """Bring the store back. Leases get a full TTL again, as etcd gives them on restart.

        ``wipe=True`` starts empty instead, as an etcd with a new data directory would.
        """
        with self._cond:
            now = self._clock()
            if wipe:
                self._kv.clear()
                self._leases.clear()
                self._history.clear()
                self._floor = self._revision + 1
            self._leases = {i: (ttl, now + ttl) for i, (ttl, _) in self._leases.items()}
            self._up = True
            self._cond.notify_all()

    def put_raw(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key`` with no lease, as any other etcd client could."""
        with self._cond:
            self._check()
            self._write(key, value, 0)

    # -- internals, all under self._cond -------------------------------------------------

    def _check(self) -> None:
        if not self._up:
            raise RegistryUnavailable(f"registry memory://{self.name} is down")
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        dead = [i for i, (_, deadline) in self._leases.items() if deadline <= now]
        for lease in dead:
            del self._leases[lease]
            for key in [k for k, (_, owner) in self._kv.items() if owner == lease]:
                self._remove(key)

    def _record(self, item: WatchItem) -> None:
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0].revision + 1
        self._history.append(item)
        self._cond.notify_all()

    def _write(self, key: str, value: bytes, lease: int) -> None:
        self._revision += 1
        self._kv[key] = (bytes(value), lease)
        self._record(WatchItem(self._revision, key, bytes(value)))

    def _remove(self, key: str) -> None:
        if key in self._kv:
            self._revision += 1
            del self._kv[key]
            self._record(WatchItem(self._revision, key, None))

    def _next_deadline(self) -> float | None:
        return min((d for _, d in self._leases.values()), default=None)


class MemoryBackend:
    """A client of a :class:`MemoryStore`, implementing the registry's backend protocol."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.url = f"memory://{store.name}"

    def check(self) -> None:
        with self.store._cond:
            self.store._check()

    def grant(self, ttl: int) -> int:
        if ttl < 1:
            raise ArgumentError(f"lease ttl={ttl} must be at least 1 s")
        s = self.store
        with s._cond:
            s._check()
            lease = next(s._ids)
            s._leases[lease] = (ttl, s._clock() + ttl)
            return lease

    def keepalive(self, lease: int) -> int:
        s = self.store
        with s._cond:
            s._check()
            entry = s._leases.get(lease)
            if entry is None:
                return -1
            s._leases[lease] = (entry[0], s._clock() + entry[0])
            return entry[0]

    def revoke(self, lease: int) -> None:
        s = self.store
        with s._cond:
            s._check()
            if s._leases.pop(lease, None) is not None:
                for key in [k for k, (_, owner) in s._kv.items() if owner == lease]:
                    s._remove(key)

    def put(self, key: str, value: bytes, lease: int) -> None:
        s = self.store
        with s._cond:
            s._check()
            if lease and lease not in s._leases:
                raise LeaseLost(f"registry {self.url}: lease {lease:#x} not found")
            s._write(key, value, lease)

    def delete(self, key: str) -> None:
        s = self.store
        with s._cond:
            s._check()
            s._remove(key)

    def get(self, key: str) -> bytes | None:
        s = self.store
        with s._cond:
            s._check()
            entry = s._kv.get(key)
            return None if entry is None else entry[0]

    def list(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        s = self.store
        with s._cond:
            s._check()
            items = sorted((k, v) for k, (v, _) in s._kv.items() if k.startswith(prefix))
            return s._revision, items[: MAX_ENTRIES + 1]

    def watch(self, prefix: str, start_revision: int, stop: threading.Event) -> Iterator[WatchItem]:
        s = self.store
        next_rev = start_revision
        with s._cond:
            s._check()
            epoch = s._epoch
        while not stop.is_set():
            batch: list[WatchItem] = []
            with s._cond:
                if s._epoch != epoch or not s._up:
                    raise RegistryUnavailable(f"registry {self.url}: watch stream broken")
                s._expire()
                if next_rev < s._floor:
                    raise Compacted(f"registry {self.url}: revision {next_rev} compacted")
                batch = [
                    item
                    for item in s._history
                    if item.revision >= next_rev and item.key.startswith(prefix)
                ]
                if s._history:
                    next_rev = max(next_rev, s._history[-1].revision + 1)
                if not batch:
                    wait = 0.25
                    deadline = s._next_deadline()
                    if deadline is not None:
                        wait = min(wait, max(0.0, deadline - s._clock()) + 0.01)
                    s._cond.wait(wait)
            yield from batch

    def close(self) -> None:
        pass
