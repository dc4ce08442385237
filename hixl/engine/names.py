"""An engine's names: its own announcement in a registry, and the peers it reached by name.

``Engine(name=..., registry=...)`` announces the engine (role, id, GID, MTU, capacity)
under the registry's lease; ``connect("decode-1")`` resolves the name to an engine id and
remembers the alias, so ``put("decode-1", ...)`` finds the connection. Once the engine has
connected by name it watches the registry: when such a name leaves (its lease expired:
the process or its host is gone) or is announced by a new process (a restart), the
connection to the old engine fails at once, so its in-flight transfers end with
:class:`~hixl.errors.ConnectionFailed` instead of waiting for their deadlines, and the next
``connect(name)`` makes a new connection. A ``connect(name)`` still under way when its
name leaves (or is taken by a new process) gives up at once with
:class:`~hixl.errors.ConnectionFailed` (:meth:`Names.gone` is its abort check): a host that
died during its lease window does not make a connect wait for its own timeout.

Locking: ``Names._lock`` guards the alias table only and is never held while calling the
registry or the engine. The watch callback runs on the registry's watch thread and takes
the engine lock (through ``Engine._peer_gone``) without holding ``Names._lock``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from hixl.core.directory import Announcement, DirectoryEvent, EventKind
from hixl.errors import ArgumentError, StateError

if TYPE_CHECKING:
    from hixl.registry import Registry, Watch

__all__ = ["Names"]

log = logging.getLogger("hixl.engine")

MAX_ALIASES = 4096


class Names:
    """The registry side of one engine. ``registry`` is a URL (opened and owned here) or a
    :class:`~hixl.registry.Registry` the caller owns and shares."""

    def __init__(
        self,
        registry: str | Registry,
        on_gone: Callable[[str, str], None],
        *,
        ttl: int = 3,
    ) -> None:
        from hixl.registry import Registry, open_registry

        if isinstance(registry, Registry):
            self.registry = registry
            self._owned = False
        elif isinstance(registry, str):
            self.registry = open_registry(registry, ttl=ttl)
            self._owned = True
        else:
            raise ArgumentError(
                f"registry must be a URL or a Registry, got {type(registry).__name__}"
            )
        # Weakly: the engine owns this object; a strong bound method would make a cycle.
        self._on_gone = weakref.WeakMethod(on_gone)
        self._lock = threading.Lock()
        self._aliases: dict[str, Announcement] = {}  # name -> what it resolved to
        # name -> (instance, reason) of the last process seen leaving or replaced under it;
        # only names in _aliases get an entry, so it is bounded by MAX_ALIASES.
        self._gone: dict[str, tuple[str, str]] = {}
        self._watch: Watch | None = None
        self.name: str | None = None

    def announce(
        self, name: str, role: str, engine_id: str, gid: str, mtu: int, capacity: int
    ) -> Announcement:
        ann = self.registry.announce(
            name, role=role, engine_id=engine_id, gid=gid, mtu=mtu, capacity=capacity
        )
        self.name = name
        return ann

    def set_capacity(self, capacity: int) -> Announcement:
        if self.name is None:
            raise StateError("this engine has no name in a registry (Engine(name=...))")
        return self.registry.update(self.name, capacity=capacity)

    def resolve(self, name: str) -> tuple[Announcement, Announcement | None]:
        """(the live announcement for ``name``, the one a previous connect saw, if any)."""
        ann = self.registry.resolve(name)
        self._ensure_watch()
        with self._lock:
            old = self._aliases.get(name)
            if old is None and len(self._aliases) >= MAX_ALIASES:
                raise StateError(f"engine already tracks {MAX_ALIASES} peer names")
            self._aliases[name] = ann
        return ann, old

    def gone(self, name: str, instance: str) -> str | None:
        """Why process ``instance`` of ``name`` is gone (it left the registry or a new process
        took the name), or None while it is still the one announced, as far as this
        engine's watch has seen. Safe from any thread; no registry call."""
        seen = self._gone.get(name)  # one dict lookup: atomic, no lock
        return seen[1] if seen is not None and seen[0] == instance else None

    def engine_id(self, name: str) -> str | None:
        """The engine id ``name`` was last resolved to by this engine, if any."""
        ann = self._aliases.get(name)  # one dict lookup: atomic, no lock on the hot path
        return None if ann is None else ann.engine

    def _ensure_watch(self) -> None:
        with self._lock:
            if self._watch is not None:
                return
        ref = weakref.ref(self)

        def on_event(ev: DirectoryEvent) -> None:
            me = ref()
            if me is not None:
                me._on_event(ev)

        w = self.registry.watch(callback=on_event)
        with self._lock:
            if self._watch is None:
                self._watch = w
                w = None  # type: ignore[assignment]
        if w is not None:
            w.close()

    def _on_event(self, ev: DirectoryEvent) -> None:
        if ev.kind is EventKind.JOIN:
            return
        with self._lock:
            known = self._aliases.get(ev.name)
        if known is None or (ev.kind is EventKind.UPDATE and not ev.restarted):
            return
        if ev.current is not None and ev.current.instance == known.instance:
            return  # this engine already resolved (and connected to) the new process
        if ev.kind is EventKind.LEAVE:
            reason = f"{ev.name} left registry {self.registry.url} (lease expired or withdrawn)"
        else:
            reason = f"{ev.name} was restarted (new announcement in {self.registry.url})"
        with self._lock:
            self._gone[ev.name] = (known.instance, reason)
        log.warning("peer %s (%s): %s", ev.name, known.engine, reason)
        on_gone = self._on_gone()
        if on_gone is not None:
            on_gone(known.engine, reason)

    def close(self) -> None:
        with self._lock:
            w, self._watch = self._watch, None
        if w is not None:
            w.close()
        if self._owned:
            self.registry.close()
        elif self.name is not None and not self.registry.closed:
            try:
                self.registry.withdraw(self.name)
            except Exception as exc:  # noqa: BLE001 - closing must go on
                log.warning("could not withdraw %s from %s: %s", self.name, self.registry.url, exc)
