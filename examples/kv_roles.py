"""What the two KV examples share: two roles in two processes.

The first process (the *listener*: prefill in ``kv_pull.py``, decode in ``kv_push.py``)
opens its engine on a port, starts the other role as a child process with the engine's
id, and waits until the child has connected (it prints ``ready``). Then it sends the
child one JSON line per request, ``{"request": "req-<r>", "blocks": [...]}``, and a last
line ``{"done": true}``. The child reads them with :func:`requests`.

Not an example of its own: ``kv_pull.py`` and ``kv_push.py`` import it from this folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import IO

SHAPE = ("requests", "layers", "blocks", "num_blocks")  # the options the child is given


def parse_args(
    doc: str,
    listener: str,
    child: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line of both roles: ``--role`` (default ``listener``), ``--peer`` (the
    child's: the listener's engine id), ``--port`` (the listener's; default: a free one)
    and the request shape; ``extra`` adds an example's own options."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=sorted((listener, child)), default=listener)
    p.add_argument("--peer", help=f"{child}: the {listener} engine's id")
    p.add_argument("--port", type=int, default=None, help=f"{listener}: listen port (default: any)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=6, help="blocks per request")
    p.add_argument("--num-blocks", type=int, default=64, help="blocks per cache")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.role == child and not args.peer:
        p.error(f"--role {child} needs --peer")
    if args.role == listener and args.port is None:
        from hixl.testbed.net import free_tcp_port

        args.port = free_tcp_port()
    return args


def start_child(
    script: str, args: argparse.Namespace, role: str, engine_id: str
) -> subprocess.Popen[str] | None:
    """Start ``script`` as ``role`` connecting to ``engine_id``; return it once it has
    connected, or None (it is stopped) when it did not get there."""
    shape = [x for k in SHAPE for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    child = subprocess.Popen(
        [sys.executable, script, "--role", role, "--peer", engine_id, *shape],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        child.kill()
        child.wait()
        return None
    return child


def tell(child: subprocess.Popen[str], request: str, blocks: list[int]) -> None:
    """Send the child one request and its block ids."""
    stdin: IO[str] | None = child.stdin
    assert stdin is not None
    stdin.write(json.dumps({"request": request, "blocks": blocks}) + "\n")
    stdin.flush()


def done(child: subprocess.Popen[str]) -> None:
    """Tell the child that no more requests come."""
    assert child.stdin is not None
    child.stdin.write(json.dumps({"done": True}) + "\n")
    child.stdin.close()


def ready() -> None:
    """The child: connected, tell the listener."""
    print("ready", flush=True)


def requests() -> Iterator[tuple[str, int, list[int]]]:
    """The child: ``(request id, its number, block ids)`` as the listener sends them."""
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("done"):
            return
        rid = msg["request"]
        yield rid, int(rid.removeprefix("req-")), [int(b) for b in msg["blocks"]]
