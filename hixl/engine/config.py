"""An engine's options, checked once: a value of :class:`EngineConfig` cannot be invalid.

:class:`~hixl.engine.engine.Engine` builds one from its keyword arguments before it opens
anything, so a bad option fails with :class:`ArgumentError` naming the option and the
value, and nothing is left to close.  Pure: no device, no socket.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from hixl.core import wire
from hixl.core.wire import MAX_LANES
from hixl.errors import ArgumentError

__all__ = ["EngineConfig", "is_loopback", "token_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The checked options of one engine (see :class:`~hixl.engine.engine.Engine`)."""

    host: str
    tcp_port: int
    token: bytes | None
    lanes: int
    direct_lane: bool
    """One more queue pair per connection for a channel, while the wire has room for it."""
    handshake_timeout: float
    max_peers: int
    max_handshakes: int
    max_handshakes_per_source: int
    max_notifications_per_peer: int
    max_notifications: int
    gil_switch_interval: float | None

    @classmethod
    def check(
        cls,
        engine_id: str,
        *,
        token: bytes | str | None,
        lanes: int,
        direct_lane: bool,
        handshake_timeout: float,
        max_peers: int,
        max_handshakes: int,
        max_handshakes_per_source: int,
        max_notifications_per_peer: int,
        max_notifications: int,
        gil_switch_interval: float | None,
        name: str | None,
        has_registry: bool,
        insecure: bool = False,
    ) -> EngineConfig:
        """Check every option; :class:`ArgumentError` names the first that is wrong."""
        try:
            host, tcp_port = wire.parse_engine_id(engine_id)
        except ValueError as exc:
            raise ArgumentError(f"bad engine id {engine_id!r}: {exc}") from exc
        limits = {
            "max_peers": max_peers,
            "max_handshakes": max_handshakes,
            "max_handshakes_per_source": max_handshakes_per_source,
            "max_notifications_per_peer": max_notifications_per_peer,
            "max_notifications": max_notifications,
        }
        for what, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"{what} must be an integer >= 1, got {value!r}")
        if handshake_timeout <= 0:
            raise ArgumentError(f"handshake_timeout must be > 0 seconds, got {handshake_timeout}")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise ArgumentError(f"lanes must be an integer in [1, {MAX_LANES}], got {lanes!r}")
        if gil_switch_interval is not None and not 0 < gil_switch_interval <= 1:
            raise ArgumentError(
                f"gil_switch_interval must lie in (0, 1] seconds or be None, "
                f"got {gil_switch_interval!r}"
            )
        if name is not None and not has_registry:
            raise ArgumentError(f"name={name!r} needs registry= (an etcd:// or memory:// URL)")
        if name is not None and not tcp_port:
            raise ArgumentError(
                f"name={name!r}: an engine that does not listen (port 0 in {engine_id!r}) "
                "cannot be announced"
            )
        secret = token_bytes(token)
        if tcp_port and secret is None and not insecure and not is_loopback(host):
            raise ArgumentError(
                f"engine {engine_id} would listen on a non-loopback address without a "
                "token: any client that reaches the port would get the rkeys of every "
                "remotely accessible region. Give every engine the same "
                "Engine(token=...) (make one with 'hixl token'), or pass insecure=True "
                "to run without authentication on a trusted network"
            )
        return cls(
            host=host,
            tcp_port=tcp_port,
            token=secret,
            lanes=lanes,
            direct_lane=bool(direct_lane) and lanes < MAX_LANES,
            handshake_timeout=handshake_timeout,
            max_peers=max_peers,
            max_handshakes=max_handshakes,
            max_handshakes_per_source=max_handshakes_per_source,
            max_notifications_per_peer=max_notifications_per_peer,
            max_notifications=max_notifications,
            gil_switch_interval=gil_switch_interval,
        )


def token_bytes(token: bytes | str | None) -> bytes | None:
    """The token as bytes; :class:`ArgumentError` for an empty or mistyped one."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, bytes):
        raise ArgumentError(f"token must be str, bytes or None, got {type(token).__name__}")
    if not token:
        raise ArgumentError(
            "token must not be empty (an empty token would fail every handshake); pass "
            "None for no authentication, or a random one from 'hixl token'"
        )
    return token


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"
