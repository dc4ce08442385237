"""Helpers for the tests on host0 (the driving side)."""

from __future__ import annotations

import time
from typing import Any

from hixl import Engine, RegistrationError
from hixl.testbed.hosts import Control


def remote_buffer(
    agent: Control, engine: Engine, peer: str, name: str, nbytes: int, seed: int | None = None
) -> dict[str, Any]:
    """Have host1 register ``name`` (zeros, or seeded bytes) and wait until host0 sees it.

    A peer announces new regions on the control socket, so a put right after the agent
    answered could otherwise race the announcement.
    """
    reply = agent.call("register", name=name, nbytes=nbytes, seed=seed)
    deadline = time.monotonic() + 20.0
    while True:
        try:
            engine.connection(peer).remote_region(name)
            return reply
        except RegistrationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
