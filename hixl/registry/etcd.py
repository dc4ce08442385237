"""The etcd store: etcd 3.4+ through its HTTP/JSON gateway, with the ``etcd3gw`` client.

Unary calls (status, lease grant/keep-alive/revoke, put, delete, range) go through
``etcd3gw.Etcd3Client`` with a per-request timeout. The watch stream is read here rather
than through ``etcd3gw``'s ``watch_prefix``: that one reads the stream in a pool thread and,
when etcd goes away, ends that thread silently while the caller's iterator waits forever
(seen with etcd3gw 2.7.0 and etcd 3.4.23). Here the stream is read with a read timeout,
an idle stream is re-opened from the last revision seen, and a broken one raises
:class:`~hixl.errors.RegistryUnavailable` so the registry lists again and re-watches.

Everything etcd answers is untrusted: JSON is parsed defensively, base64 fields are
checked, a line of the watch stream is at most 1 MiB, a listing at most
:data:`~hixl.registry._backend.MAX_ENTRIES` + 1 keys.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import contextlib
import json
import logging
import re
import threading
from collections.abc import Iterator
from typing import Any

import requests
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

from hixl.errors import RegistryError, RegistryUnavailable
from hixl.registry._backend import MAX_ENTRIES, Compacted, LeaseLost, WatchItem

__all__ = ["EtcdBackend"]

_log = logging.getLogger("hixl.registry")

_MAX_LINE = 1 << 20
_IDLE = 1.0  # seconds without a byte on the watch stream before it is re-opened
_POOL = 4  # idle HTTP clients kept for reuse


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(what: str, text: object) -> bytes:
    if not isinstance(text, str) or len(text) > 2 * _MAX_LINE:
        raise ValueError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{what} is not base64: {exc}") from None


def _prefix_end(prefix: str) -> bytes:
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # the prefix ends in "/", never 0xff
    return bytes(raw)


def _int_field(doc: object, name: str, default: int | None = None) -> int:
    value = doc.get(name, default) if isinstance(doc, dict) else default
    if isinstance(value, str) and value.isdigit() and len(value) < 20:
        return int(value)
    if type(value) is int:
        return value
    if value is None and default is not None:
        return default
    raise ValueError(f"field {name!r} is not an integer: {str(value)[:40]!r}")


class EtcdBackend:
    """One etcd endpoint, ``host:port``, spoken to over HTTP on its client port.

    ``timeout`` bounds every request (connect and read). A ``requests`` session is not
    meant to be shared between threads, so each call borrows an ``Etcd3Client`` from a
    small pool (at most :data:`_POOL` idle ones are kept) and each watch has its own.
    """

    def __init__(self, host: str, port: int, *, timeout: float = 2.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        shown = f"[{host}]" if ":" in host else host
        self.url = f"etcd://{shown}:{port}"
        self._lock = threading.Lock()  # guards _idle, _busy and _closed only
        self._idle: list[Etcd3Client] = []
        self._busy: set[Etcd3Client] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<EtcdBackend {self.url}>"

    def _borrow(self) -> Etcd3Client:
        with self._lock:
            if self._closed:
                raise RegistryError(f"registry {self.url} is closed")
            client = self._idle.pop() if self._idle else None
            if client is None:
                client = Etcd3Client(
                    host=self.host, port=self.port, api_path="/v3/", timeout=self.timeout
                )
            self._busy.add(client)
            return client

    def _give_back(self, client: Etcd3Client) -> None:
        with self._lock:
            self._busy.discard(client)
            if not self._closed and len(self._idle) < _POOL:
                self._idle.append(client)
                return
        client.session.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        client = self._borrow()
        try:
            return self._post_with(client, path, body)
        finally:
            self._give_back(client)

    def _post_with(self, client: Etcd3Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            doc = client.post(client.get_url(path), json=body)
        except (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError) as exc:
            raise RegistryUnavailable(
                f"registry {self.url} is unreachable ({path}): {_detail(exc)}"
            ) from None
        except gw_exc.Etcd3Exception as exc:
            detail = _detail(exc)
            if "lease not found" in detail:
                raise LeaseLost(f"registry {self.url}: {detail}") from None
            raise RegistryError(f"registry {self.url} refused {path}: {detail}") from None
        except (requests.RequestException, ValueError) as exc:
            raise RegistryUnavailable(
                f"registry {self.url} gave no usable answer to {path}: {_why(exc)}"
            ) from None
        if not isinstance(doc, dict):
            raise RegistryError(f"registry {self.url}: {path} answered {type(doc).__name__}")
        return doc

    def check(self) -> None:
        doc = self._post("/maintenance/status", {})
        version = doc.get("version")
        if not isinstance(version, str):
            raise RegistryError(f"registry {self.url} does not look like etcd: no version")
        parts = version.split(".")
        if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
            raise RegistryError(f"registry {self.url}: unreadable etcd version {version[:40]!r}")
        if (int(parts[0]), int(parts[1])) < (3, 4):
            raise RegistryError(f"registry {self.url} runs etcd {version}; hixl needs 3.4 or newer")

    def grant(self, ttl: int) -> int:
        doc = self._post("/lease/grant", {"TTL": ttl, "ID": 0})
        try:
            return _int_field(doc, "ID")
        except ValueError as exc:
            raise RegistryError(f"registry {self.url}: lease grant answer: {exc}") from None

    def keepalive(self, lease: int) -> int:
        doc = self._post("/lease/keepalive", {"ID": lease})
        try:
            return _int_field(doc.get("result"), "TTL", -1)
        except ValueError as exc:
            raise RegistryError(f"registry {self.url}: keep-alive answer: {exc}") from None

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(LeaseLost):
            self._post("/kv/lease/revoke", {"ID": lease})

    def put(self, key: str, value: bytes, lease: int) -> None:
        self._post("/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    def delete(self, key: str) -> None:
        self._post("/kv/deleterange", {"key": _b64(key)})

    def _items(self, doc: dict[str, Any]) -> list[tuple[str, bytes]]:
        kvs = doc.get("kvs", [])
        if not isinstance(kvs, list):
            raise RegistryError(f"registry {self.url}: range answer has kvs={str(kvs)[:40]!r}")
        out: list[tuple[str, bytes]] = []
        for kv in kvs[: MAX_ENTRIES + 1]:
            try:
                key = _unb64("key", kv.get("key") if isinstance(kv, dict) else None)
                value = _unb64("value", kv.get("value", ""))
                out.append((key.decode("utf-8"), value))
            except (ValueError, UnicodeDecodeError) as exc:
                _log.warning("registry %s: skipping an entry etcd returned: %s", self.url, exc)
        return out

    def get(self, key: str) -> bytes | None:
        items = self._items(self._post("/kv/range", {"key": _b64(key)}))
        return items[0][1] if items and items[0][0] == key else None

    def list(self, prefix: str) -> tuple[int, list[tuple[str, bytes]]]:
        body = {
            "key": _b64(prefix),
            "range_end": _b64(_prefix_end(prefix)),
            "limit": MAX_ENTRIES + 1,
        }
        doc = self._post("/kv/range", body)
        try:
            revision = _int_field(doc.get("header"), "revision")
        except ValueError as exc:
            raise RegistryError(f"registry {self.url}: range answer: {exc}") from None
        return revision, self._items(doc)

    def watch(self, prefix: str, start_revision: int, stop: threading.Event) -> Iterator[WatchItem]:
        client = self._borrow()
        try:
            yield from self._watch_with(client, prefix, start_revision, stop)
        finally:
            self._give_back(client)

    def _watch_with(
        self, client: Etcd3Client, prefix: str, start_revision: int, stop: threading.Event
    ) -> Iterator[WatchItem]:
        url = client.get_url("/watch")
        next_rev = start_revision
        while not stop.is_set():
            body: dict[str, Any] = {
                "create_request": {
                    "key": _b64(prefix),
                    "range_end": _b64(_prefix_end(prefix)),
                    "start_revision": next_rev,
                }
            }
            try:
                resp = client.session.post(
                    url, json=body, stream=True, timeout=(self.timeout, _IDLE)
                )
            except requests.RequestException as exc:
                raise RegistryUnavailable(
                    f"registry {self.url} is unreachable (watch): {_why(exc)}"
                ) from None
            try:
                if resp.status_code != 200:
                    raise RegistryUnavailable(
                        f"registry {self.url}: watch answered HTTP {resp.status_code}"
                    )
                for line in _lines(resp):
                    for item in self._watch_items(line):
                        next_rev = max(next_rev, item.revision + 1)
                        yield item
                    if stop.is_set():
                        return
                raise RegistryUnavailable(f"registry {self.url}: watch stream closed by etcd")
            except requests.ConnectionError as exc:
                if not _is_read_timeout(exc):
                    raise RegistryUnavailable(
                        f"registry {self.url}: watch stream broke: {_why(exc)}"
                    ) from None
                # Idle for _IDLE seconds: re-open from the next revision (nothing is lost).
            except requests.RequestException as exc:
                raise RegistryUnavailable(
                    f"registry {self.url}: watch stream broke: {_why(exc)}"
                ) from None
            finally:
                resp.close()

    def _watch_items(self, line: bytes) -> builtins.list[WatchItem]:
        try:
            doc = json.loads(line)
            result = doc.get("result") if isinstance(doc, dict) else None
            if not isinstance(result, dict):
                if isinstance(doc, dict) and "error" in doc:
                    raise RegistryUnavailable(
                        f"registry {self.url}: watch error {str(doc['error'])[:200]}"
                    )
                raise ValueError("no result object")
            if result.get("canceled"):
                compact = result.get("compact_revision")
                if compact not in (None, "0", 0):
                    raise Compacted(f"registry {self.url}: watch compacted at {compact}")
                reason = str(result.get("cancel_reason", ""))[:200]
                raise RegistryUnavailable(f"registry {self.url}: watch canceled {reason}")
            events = result.get("events", [])
            if not isinstance(events, list):
                raise ValueError("events is not a list")
            items = []
            for ev in events:
                kv = ev.get("kv") if isinstance(ev, dict) else None
                if not isinstance(kv, dict):
                    raise ValueError("event without kv")
                key = _unb64("key", kv.get("key")).decode("utf-8")
                revision = _int_field(kv, "mod_revision")
                if ev.get("type", "PUT") == "DELETE":
                    items.append(WatchItem(revision, key, None))
                else:
                    items.append(WatchItem(revision, key, _unb64("value", kv.get("value", ""))))
            return items
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
            # A broken message cannot be skipped safely (it may hide a delete): re-list.
            raise RegistryUnavailable(
                f"registry {self.url}: malformed watch message ({exc}); listing again"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for client in idle:  # busy ones are closed when given back
            client.session.close()


def _lines(resp: requests.Response) -> Iterator[bytes]:
    """Newline-separated messages of a streamed response; a line may be at most 1 MiB."""
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1 :]
            if line.strip():
                yield line
        if len(buf) > _MAX_LINE:
            raise RegistryUnavailable(f"watch message longer than {_MAX_LINE} bytes")
    if buf.strip():
        yield buf


def _is_read_timeout(exc: BaseException) -> bool:
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if "ReadTimeout" in type(node).__name__ or "Read timed out" in str(node):
            return True
        node = (
            node.__cause__
            or node.__context__
            or (node.args[0] if node.args and isinstance(node.args[0], BaseException) else None)
        )
    return False


_ERRNO_RE = re.compile(r"\[Errno -?\d+\] [^'\")]*")


def _why(exc: BaseException) -> str:
    """The useful part of a requests/urllib3 message: the OS error, or a timeout."""
    text = str(exc)
    m = _ERRNO_RE.search(text)
    if m is not None:
        return m.group(0).strip()
    if "timed out" in text.lower():
        return "timed out"
    return text[:200]


def _detail(exc: gw_exc.Etcd3Exception) -> str:
    text = exc.detail_text or " ".join(str(a) for a in exc.args) or type(exc).__name__
    if "Errno" in text or "timed out" in text.lower():
        return _why(Exception(text))
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):
            text = doc["message"]
    except ValueError:
        pass
    return text[:300]
