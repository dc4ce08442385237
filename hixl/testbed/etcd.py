"""A private etcd for tests and demos: Debian's ``etcd`` on free ports with a fresh data dir.

``EtcdServer().start()`` picks two free ports (client and peer) on ``host``, makes a new
data directory, runs ``etcd`` (from the ``etcd-server`` package, which ``make setup``
installs) as a one-member cluster, and waits, with a deadline, until ``/health`` says
``true``. :meth:`EtcdServer.stop` ends it (SIGTERM, then SIGKILL after a deadline),
:meth:`EtcdServer.kill` crashes it, :meth:`EtcdServer.start` again brings it back on the
same ports and data (or, with ``wipe=True``, empty), and :meth:`EtcdServer.close` stops it
and deletes the data. It never touches the system's own etcd service (port 2379).

Run ``python -m hixl.testbed.etcd`` to start one in the foreground and print its URL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from hixl.errors import HixlError

__all__ = ["EtcdError", "EtcdServer", "find_etcd"]

log = logging.getLogger("hixl.testbed.etcd")


class EtcdError(HixlError):
    """etcd is not installed, would not start, or did not become healthy in time."""


def find_etcd() -> str:
    """Path of the ``etcd`` binary; :class:`EtcdError` naming the package if missing."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise EtcdError("etcd is not installed: run 'make setup' (Debian package etcd-server)")
    return path


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd process owned by the caller. A context manager: ``with EtcdServer() as e:``.

    ``host`` is the address etcd listens on (``127.0.0.1``; inside the multi-host tier,
    host0's address on the wire so the other hosts reach it). ``client_port`` and
    ``peer_port`` fix the ports (0: free ones, picked at the first start).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        start_timeout: float = 30.0,
        client_port: int = 0,
        peer_port: int = 0,
    ) -> None:
        self.host = host
        self.start_timeout = start_timeout
        self.client_port = client_port  # 0: a free port, picked at the first start
        self.peer_port = peer_port
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<EtcdServer {self.url if self.client_port else '(not started)'} {state}>"

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        """``etcd://HOST:PORT``, what :func:`hixl.registry.open_registry` takes."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"etcd://{host}:{self.client_port}"

    @property
    def http(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "etcd.log"

    def log_tail(self, nbytes: int = 1 << 18) -> str:
        """The last ``nbytes`` of etcd's log ('' before the first start), decoded leniently."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with path.open("rb") as fh:
            fh.seek(max(0, path.stat().st_size - nbytes))
            return fh.read().decode("utf-8", "replace")

    def start(self, *, wipe: bool = False) -> EtcdServer:
        """Start etcd (again) and wait until it is healthy; returns ``self``.

        The first start picks the ports and the data directory; later starts reuse both,
        so clients find the same URL. ``wipe=True`` empties the data directory first.
        """
        if self.running:
            return self
        binary = find_etcd()
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="hixl-etcd-"))
        data = self._dir / "data"
        if wipe and data.exists():
            shutil.rmtree(data)
        attempts = 3 if self.client_port == 0 else 1
        for attempt in range(attempts):
            if attempt or self.client_port == 0:
                self.client_port = _free_port(self.host)
            if attempt or self.peer_port == 0:
                self.peer_port = _free_port(self.host)
            try:
                self._launch(binary, data)
                return self
            except EtcdError as exc:
                self._terminate(5.0)
                if attempt + 1 == attempts:
                    raise
                log.warning("etcd did not start (%s); trying other ports", exc)
        raise AssertionError("unreachable")

    def _launch(self, binary: str, data: Path) -> None:
        assert self._dir is not None
        host = f"[{self.host}]" if ":" in self.host else self.host
        client = f"http://{host}:{self.client_port}"
        peer = f"http://{host}:{self.peer_port}"
        argv = [
            binary,
            "--name=hixl",
            f"--data-dir={data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=hixl={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        log_path = self._dir / "etcd.log"
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EtcdError(
                    f"etcd exited with status {self._proc.returncode} at start: {_tail(log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1.0) as resp:
                    doc = json.loads(resp.read(4096))
                if doc.get("health") == "true":
                    log.debug("etcd healthy at %s (pid %d)", client, self._proc.pid)
                    return
                last = f"health={doc.get('health')!r}"
            except (OSError, ValueError, urllib.error.URLError) as exc:
                last = str(exc)
            time.sleep(0.1)
        raise EtcdError(
            f"etcd at {client} not healthy within {self.start_timeout} s ({last}): "
            f"{_tail(log_path)}"
        )

    def _terminate(self, timeout: float, sig: int = signal.SIGTERM) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop etcd cleanly (SIGTERM; SIGKILL after ``timeout`` s). Data is kept."""
        self._terminate(timeout)

    def kill(self) -> None:
        """Crash etcd (SIGKILL). Data is kept."""
        self._terminate(5.0, signal.SIGKILL)

    def close(self) -> None:
        """Stop etcd and delete its data directory; idempotent."""
        self._terminate(10.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])[-1500:]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="run a private etcd until interrupted")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="client port (default: a free one)")
    args = parser.parse_args()
    with EtcdServer(args.host, client_port=args.port) as server:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
