"""A process that announces one name and then only keeps its lease alive, until killed.

Usage: python announcer.py URL NAME ENGINE_ID TTL. Prints ``ready <instance>`` once the
announcement is in the store.
"""

from __future__ import annotations

import sys
import time

from hixl.registry import open_registry


def main() -> None:
    url, name, engine_id, ttl = sys.argv[1:5]
    reg = open_registry(url, ttl=int(ttl))
    reg.announce(name, role="decode", engine_id=engine_id, gid="fe80::7", mtu=1024, capacity=5)
    print("ready", reg.instance, flush=True)
    deadline = time.monotonic() + 120  # never outlive a forgotten test
    while time.monotonic() < deadline:
        time.sleep(0.5)
    reg.close()


if __name__ == "__main__":
    main()
