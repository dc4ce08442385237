"""What :class:`~hixl.registry.Registry` needs from a store: a key-value map with leases.

Two stores implement it: :class:`~hixl.registry.memory.MemoryBackend` (in-process) and
:class:`~hixl.registry.etcd.EtcdBackend` (etcd 3.4+ through its HTTP/JSON gateway). Every
call returns or raises within the backend's own timeout; none waits forever.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from hixl.errors import RegistryError

__all__ = ["Backend", "WatchItem", "LeaseLost", "Compacted", "MAX_ENTRIES"]

MAX_ENTRIES = 4096
"""Most keys a listing returns; the registry warns when the prefix holds more."""


class LeaseLost(RegistryError):
    """The store no longer knows the lease (it expired, or the store lost its data)."""


class Compacted(RegistryError):
    """A watch asked for revisions the store no longer keeps; list again."""


@dataclass(frozen=True, slots=True)
class WatchItem:
    """One change under the watched prefix: ``value`` is ``None`` for a delete."""

    revision: int
    key: str
    value: bytes | None


class Backend(Protocol):
    """A store with leases. Errors: :class:`~hixl.errors.RegistryUnavailable` when it
    cannot be reached in time, :class:`LeaseLost`, :class:`Compacted`, and
    :class:`~hixl.errors.RegistryError` for anything else it refuses."""

    url: str

    def check(self) -> None:
        """Raise if the store is not reachable and healthy."""

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; the TTL it has now, or a value <= 0 if the store lost it."""

    def revoke(self, lease: int) -> None:
        """End ``lease`` now; its keys are deleted."""

    def put(self, key: str, value: bytes, lease: int) -> None:
        """Store ``value`` at ``key`` attached to ``lease``; :class:`LeaseLost` if unknown."""

    def delete(self, key: str) -> None:
        """Delete ``key`` (no error if absent)."""

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None``."""

    def list(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        """(store revision, at most :data:`MAX_ENTRIES` + 1 (key, value) pairs under prefix)."""

    def watch(self, prefix: str, start_revision: int, stop: threading.Event) -> Iterator[WatchItem]:
        """Changes under ``prefix`` from ``start_revision`` on, until ``stop`` is set.

        Checks ``stop`` at least once a second. Raises
        :class:`~hixl.errors.RegistryUnavailable` when the stream breaks and
        :class:`Compacted` when ``start_revision`` is no longer kept.
        """

    def close(self) -> None:
        """Release connections; idempotent."""
