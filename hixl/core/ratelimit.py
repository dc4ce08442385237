"""A token bucket over two quantities (bytes and messages), sans-I/O: the caller passes
the clock. Used to bound what one peer's control messages may cost per second."""

from __future__ import annotations

__all__ = ["Budget"]


class Budget:
    """``bytes_per_s`` and ``msgs_per_s``, each with a burst of one second's worth.

    :meth:`charge` takes what was used (the balance may go negative: what arrived has
    arrived) and returns how long to wait, in seconds, until both balances are back to
    zero or above: 0.0 when the sender is within its rate.
    """

    __slots__ = ("_at", "_bytes", "_msgs", "bytes_per_s", "msgs_per_s")

    def __init__(self, bytes_per_s: float, msgs_per_s: float, now: float) -> None:
        if bytes_per_s <= 0 or msgs_per_s <= 0:
            raise ValueError(f"rates must be > 0, got {bytes_per_s}, {msgs_per_s}")
        self.bytes_per_s = bytes_per_s
        self.msgs_per_s = msgs_per_s
        self._bytes = float(bytes_per_s)
        self._msgs = float(msgs_per_s)
        self._at = now

    def __repr__(self) -> str:
        return f"<Budget bytes={self._bytes:.0f}/{self.bytes_per_s} msgs={self._msgs:.0f}>"

    def charge(self, nbytes: int, msgs: int, now: float) -> float:
        """Take ``nbytes`` and ``msgs`` at ``now``; seconds until the balance is back."""
        elapsed = max(0.0, now - self._at)
        self._at = now
        self._bytes = min(self.bytes_per_s, self._bytes + elapsed * self.bytes_per_s) - nbytes
        self._msgs = min(self.msgs_per_s, self._msgs + elapsed * self.msgs_per_s) - msgs
        return max(0.0, -self._bytes / self.bytes_per_s, -self._msgs / self.msgs_per_s)
