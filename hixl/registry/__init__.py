"""Discovery and liveness of engines: names, roles and capacities in a shared registry.

``open_registry(url)`` connects to a store:

- ``etcd://HOST:PORT`` (port 2379 if omitted): an etcd 3.4+ member, through its
  HTTP/JSON gateway (client: ``etcd3gw``);
- ``memory://NAME``: a store inside this process, shared by everything in the process that
  opens the same name (one machine, tests).

An engine announces itself under a lease with :meth:`Registry.announce`; a peer finds it with
:meth:`Registry.resolve` and follows joins, leaves and capacity changes with
:meth:`Registry.watch`. What is stored, and why nothing more, is in
:mod:`hixl.core.directory` and docs/architecture.md.
"""

from __future__ import annotations

import re

from hixl.core.directory import Announcement, DirectoryEvent, EventKind
from hixl.errors import ArgumentError
from hixl.registry._registry import Registry, Watch
from hixl.registry.memory import MemoryBackend, MemoryStore, store_named

__all__ = [
    "Announcement",
    "DirectoryEvent",
    "EventKind",
    "MemoryBackend",
    "MemoryStore",
    "Registry",
    "Watch",
    "open_registry",
    "parse_url",
]

_ETCD_RE = re.compile(
    r"etcd://(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<host>[A-Za-z0-9.-]{1,253}))(?::(?P<port>\d{1,5}))?/?"
)
_MEMORY_RE = re.compile(r"memory://(?P<name>[A-Za-z0-9._-]{1,64})")


def parse_url(url: str) -> tuple[str, str, int]:
    """Split a registry URL into (scheme, host or store name, port).

    ``etcd://HOST[:PORT]`` (IPv6 in brackets; default port 2379) or ``memory://NAME``.
    Raises :class:`~hixl.errors.ArgumentError` naming the URL.
    """
    if not isinstance(url, str):
        raise ArgumentError(f"registry URL must be a str, got {type(url).__name__}")
    m = _ETCD_RE.fullmatch(url)
    if m is not None:
        port = int(m.group("port") or 2379)
        if not 1 <= port <= 0xFFFF:
            raise ArgumentError(f"registry URL {url!r}: port {port} out of range [1, 65535]")
        return "etcd", m.group("v6") or m.group("host"), port
    m = _MEMORY_RE.fullmatch(url)
    if m is not None:
        return "memory", m.group("name"), 0
    raise ArgumentError(
        f"registry URL {url[:100]!r} is neither etcd://HOST[:PORT] nor memory://NAME"
    )


def open_registry(url: str, *, ttl: int = 3, timeout: float = 2.0) -> Registry:
    """Connect to the registry at ``url`` and check that it answers.

    ``ttl`` is the lease TTL in whole seconds (how long a dead process stays listed);
    ``timeout`` bounds every request to the store. Raises
    :class:`~hixl.errors.ArgumentError` for a malformed URL and
    :class:`~hixl.errors.RegistryUnavailable` naming the URL when nothing answers there.
    """
    scheme, host, port = parse_url(url)
    if scheme == "memory":
        return Registry(MemoryBackend(store_named(host)), ttl=ttl, timeout=max(timeout, 1.0))
    from hixl.registry.etcd import EtcdBackend  # needs etcd3gw; imported only for etcd

    backend = EtcdBackend(host, port, timeout=timeout)
    try:
        return Registry(backend, ttl=ttl, timeout=max(timeout * 2, 1.0))
    except BaseException:
        backend.close()
        raise
