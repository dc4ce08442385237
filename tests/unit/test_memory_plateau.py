"""Memory under a steady random load reaches a plateau, within the caches' written bounds.

Natively on the null device (benchmarks/backends/nulldev.py: engines handshake over TCP
and run the whole software path; the device's part is a no-op), so the check costs
seconds. Three threads put, get and put_async random contiguous and strided layouts at
random offsets (thousands of layouts: every cache fills and turns over); the run is cut
into phases of a fixed number of transfers, with the RSS read after each. ``make soak``
runs more phases (``HIXL_PLATEAU_PHASES``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.backends.nulldev import null_device
from hixl import Access, Engine
from hixl.core.descriptors import ContiguousDesc, Descriptor, StridedDesc
from hixl.engine.datapath import CHAIN_CACHE_BYTES
from hixl.testbed.net import free_tcp_port

RW = Access.REMOTE_READ | Access.REMOTE_WRITE
SPAN = 16 << 20  # bytes of each side's buffer
PHASES = int(os.environ.get("HIXL_PLATEAU_PHASES", "6"))
PER_PHASE = 2400  # transfers per phase, over the three threads
CHAIN_KEPT = 8 << 20  # ChainMemory's default retain: freed chain blocks kept beyond the reserve
OTHER_CACHES = 16 << 20  # plans (512), templates (1024) and the allocator's slack
# The later half of the phases may pass the first half's high-water mark by this much: the
# C allocator's fragmentation as chain blocks of many sizes come and go.
LATE_GROWTH = 8 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _layouts(r: random.Random) -> tuple[Descriptor, Descriptor]:
    if r.random() < 0.5:
        n = r.choice([64, 4096, 65536, 1 << 20])
        return (
            ContiguousDesc(offset=r.randrange(0, SPAN - n, 64), nbytes=n),
            ContiguousDesc(offset=r.randrange(0, SPAN - n, 64), nbytes=n),
        )
    size = r.choice([64, 128, 256, 512])
    count = r.randrange(1, 512)
    stride = size * r.choice([1, 2, 4])
    return (
        StridedDesc(offset=r.randrange(0, SPAN // 2, 64), count=count, size=size, stride=stride),
        StridedDesc(offset=r.randrange(0, SPAN // 2, 64), count=count, size=size, stride=stride),
    )


@contextlib.contextmanager
def _pair() -> Iterator[tuple[Engine, Engine, object]]:
    # No direct lane: the null device does not poll one.
    with (
        null_device(),
        Engine(f"127.0.0.1:{free_tcp_port()}", direct_lane=False) as srv,
        Engine("127.0.0.1:0", direct_lane=False) as cli,
    ):
        srv.register(np.zeros(SPAN, np.uint8), access=RW, name="dst")
        src = cli.register(np.zeros(SPAN, np.uint8), access=RW)
        cli.connect(srv.id, timeout=10)
        yield srv, cli, src


def _measure() -> tuple[int, list[int]]:
    """The idle RSS and the RSS after each phase, in this process."""
    errors: list[BaseException] = []
    with _pair() as (srv, cli, src):

        def work(seed: int, count: int) -> None:
            r = random.Random(seed)
            try:
                for _ in range(count):
                    ld, rd = _layouts(r)
                    kw = {"local_desc": ld, "remote_desc": rd, "timeout": 30}
                    op = r.random()
                    if op < 0.4:
                        cli.put(srv.id, src, "dst", **kw)  # type: ignore[arg-type]
                    elif op < 0.8:
                        cli.get(srv.id, src, "dst", **kw)  # type: ignore[arg-type]
                    else:
                        cli.put_async(srv.id, src, "dst", **kw).wait()  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors.append(exc)

        idle = rss_bytes()
        samples = []
        for phase in range(PHASES):
            threads = [
                threading.Thread(target=work, args=(1000 * phase + i, PER_PHASE // 3))
                for i in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            samples.append(rss_bytes())
    return idle, samples


def test_rss_reaches_a_plateau_under_random_transfers() -> None:
    # A fresh interpreter: the heap the earlier tests of a run leave behind would move the
    # figures. One malloc arena: glibc gives threads arenas of their own now and then, and
    # each new one shows as a step of about 10 MiB that no cache holds.
    root = Path(__file__).resolve().parents[2]
    code = "import json, tests.unit.test_memory_plateau as m; print(json.dumps(m._measure()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "MALLOC_ARENA_MAX": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    idle, samples = json.loads(out.stdout.strip().splitlines()[-1])
    grown = [(s - idle) / 2**20 for s in samples]
    half = PHASES // 2
    print(f"RSS over the idle engines after each of {PHASES} phases: {grown} MiB")
    late = max(samples[half:]) - max(samples[:half])
    assert late <= LATE_GROWTH, (
        f"RSS still grew {late / 2**20:.1f} MiB in the later phases: {grown} MiB"
    )
    bound = CHAIN_CACHE_BYTES + CHAIN_KEPT + OTHER_CACHES
    assert max(samples) - idle <= bound, (
        f"RSS grew {(max(samples) - idle) / 2**20:.1f} MiB under load, more than the "
        f"caches' {bound / 2**20:.0f} MiB: {grown} MiB"
    )
