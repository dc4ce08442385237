"""The peers (other KV-transfer libraries) and the virtual environment they live in.

They are installed on demand into their own venv, ``.venv-peers`` in the checkout (ignored
by git), made by the system Python without access to the project's venv or the system's
site-packages, so nothing they pull in can reach hixl's environment and hixl's venv never
sees them. Each peer is then driven by :mod:`benchmarks.backends.worker` run with that
venv's Python. An install that fails is recorded with its error, never raised: the
benchmark reports the peer as not run and carries on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..common.setup import REPO

#: Where the peers are installed (the project's own venv is ``.venv``).
PEERS_VENV = REPO / ".venv-peers"
#: The system interpreter the peers' venv is made with (hixl's venv uses it too).
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """How to install, check and run one peer.

    ``pip`` is one ``pip install`` argument list per step. ``env`` is what its processes
    need; ``{device}``, ``{port}`` and ``{shim}`` in a value become the device and port
    under test and the peers' libibverbs shim directory. ``variants`` are contenders run
    with the same install and extra environment (e.g. a tuned configuration).
    """

    name: str
    title: str
    pip: tuple[tuple[str, ...], ...]
    dist: str  # the distribution whose version is reported
    check: str  # Python that must run in the peers' venv once installed
    env: dict[str, str] = field(default_factory=dict)
    variants: dict[str, dict[str, str]] = field(default_factory=dict)
    opt_in: bool = False  # installed only when asked for by name
    verbs_shim: bool = False  # its wheel bundles a libibverbs that must be the system's
    note: str = ""

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(a for step in self.pip for a in step if not a.startswith("-"))

    def contenders(self) -> dict[str, dict[str, str]]:
        """Contender name -> environment (before templating), the plain one first."""
        return {self.name: dict(self.env)} | {
            name: {**self.env, **extra} for name, extra in self.variants.items()
        }


PEERS: dict[str, PeerSpec] = {
    "mooncake": PeerSpec(
        name="mooncake",
        title="Mooncake Transfer Engine",
        pip=(("mooncake-transfer-engine-non-cuda",),),
        dist="mooncake-transfer-engine-non-cuda",
        check="from mooncake.engine import TransferEngine",
        env={"MC_LOG_LEVEL": "WARNING"},
        # Its documented runtime options set for this device (rxe: active MTU 1024, the
        # IPv4-mapped RoCEv2 GID at index 1; slices, QPs per endpoint and workers at the
        # documented values) and as many batches in flight as hixl has requests.
        variants={
            "mooncake-tuned": {
                "MC_MTU": "1024",
                "MC_GID_INDEX": "1",
                "MC_SLICE_SIZE": "65536",
                "MC_NUM_QP_PER_EP": "2",
                "MC_WORKERS_PER_CTX": "2",
                "HIXL_PEER_MC_BATCHES": "depth",
            }
        },
        note="host memory, P2PHANDSHAKE metadata (no etcd), RDMA on the device hixl uses, "
        "system libibverbs; about 170 MB download",
    ),
    "nixl": PeerSpec(
        name="nixl",
        title="NVIDIA NIXL (UCX backend)",
        # nixl-cu12 declares torch (CUDA wheels, about 5.8 GB) but never imports it for
        # host memory: install it without dependencies, then the one it uses (numpy).
        pip=(("--no-deps", "nixl-cu12"), ("numpy",)),
        dist="nixl-cu12",
        check="from nixl_cu12._api import nixl_agent",
        env={
            "LD_LIBRARY_PATH": "{shim}",
            "UCX_TLS": "rc_verbs,ud_verbs",
            "UCX_NET_DEVICES": "{device}:{port}",
            # The benchmark freezes idle contenders (SIGSTOP) for tens of seconds; without
            # these, UCX's keepalive and UD timeout declare the frozen peer gone.
            "UCX_KEEPALIVE_INTERVAL": "inf",
            "UCX_UD_TIMEOUT": "600s",
        },
        # Tuned: descriptor lists prepared once and reused (make_prepped_xfer), no progress
        # thread (two cores: the caller's polling progresses), UCX zero-copy throughout.
        variants={
            "nixl-tuned": {
                "UCX_ZCOPY_THRESH": "0",
                "HIXL_PEER_NIXL_PREPPED": "1",
                "HIXL_PEER_NIXL_PROGRESS_THREAD": "0",
            }
        },
        opt_in=True,
        verbs_shim=True,
        note="opt in (--peers mooncake,nixl); host memory over UCX rc_verbs; its wheel's "
        "libibverbs is pointed at the system's (which has the rxe provider) through a "
        "symlink on LD_LIBRARY_PATH; without UCX_TLS/UCX_NET_DEVICES UCX copies through cma "
        "and rxe carries nothing; 'nixl-tuned' adds UCX_ZCOPY_THRESH=0; about 70 MB "
        "without torch",
    ),
}
#: The system libibverbs, which finds the distribution's providers (rxe among them).
SYSTEM_VERBS = Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")


def shim_dir(venv: Path = PEERS_VENV) -> Path:
    """The directory put on a peer's LD_LIBRARY_PATH (see :func:`make_verbs_shim`)."""
    return venv / "verbs-shim"


def make_verbs_shim(venv: Path = PEERS_VENV) -> str | None:
    """Symlink every bundled ``libibverbs-<hash>.so.*`` of the peers' wheels to the system
    library, in :func:`shim_dir`; None when done, else why not."""
    bundled = sorted(venv.glob("lib/python3*/site-packages/*.libs/libibverbs-*.so*"))
    if not bundled:
        return f"no bundled libibverbs under {venv}/lib/python3*/site-packages/*.libs"
    if not SYSTEM_VERBS.exists():
        return f"{SYSTEM_VERBS} is missing (apt-get install libibverbs1)"
    shim = shim_dir(venv)
    shim.mkdir(parents=True, exist_ok=True)
    for lib in bundled:
        link = shim / lib.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(SYSTEM_VERBS)
    return None


def render_env(
    env: dict[str, str], device: str, port: int, venv: Path = PEERS_VENV
) -> dict[str, str]:
    """``env`` with ``{device}``, ``{port}`` and ``{shim}`` filled in."""
    values = {"device": device, "port": str(port), "shim": str(shim_dir(venv))}
    return {k: v.format(**values) for k, v in env.items()}


@dataclass(slots=True)
class PeerStatus:
    """One peer's install outcome: ready to run, or why not."""

    name: str
    ok: bool
    python: str | None = None
    version: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def venv_python(venv: Path = PEERS_VENV) -> Path:
    return venv / "bin" / "python"


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=_clean_env()
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{' '.join(cmd[:4])}...: {exc}"
    return out.returncode, out.stdout + out.stderr


def _clean_env() -> dict[str, str]:
    """This environment without the project venv's traces (so pip targets the peers')."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def ensure_venv(venv: Path = PEERS_VENV) -> str | None:
    """Make the peers' venv if it is missing; None when ready, else the error."""
    if venv_python(venv).is_file():
        return None
    rc, out = _run([SYSTEM_PYTHON, "-m", "venv", str(venv)], timeout=300)
    return None if rc == 0 else f"python3 -m venv {venv} failed (exit {rc}):\n{_tail(out)}"


def probe(spec: PeerSpec, venv: Path = PEERS_VENV) -> PeerStatus:
    """Whether ``spec`` is installed and importable in the peers' venv, and its version."""
    py = venv_python(venv)
    if not py.is_file():
        return PeerStatus(spec.name, False, error=f"no peers venv at {venv}")
    code = f"{spec.check}\nfrom importlib.metadata import version\nprint(version({spec.dist!r}))"
    rc, out = _run([str(py), "-c", code], timeout=120)
    if rc != 0:
        return PeerStatus(spec.name, False, python=str(py), error=_tail(out))
    return PeerStatus(
        spec.name, True, python=str(py), version=out.strip().splitlines()[-1], env=spec.env
    )


def install(spec: PeerSpec, venv: Path = PEERS_VENV, timeout: float = 1800) -> PeerStatus:
    """Install ``spec`` into the peers' venv unless it is there already; never raises."""
    t0 = time.monotonic()
    err = ensure_venv(venv)
    if err is not None:
        return PeerStatus(spec.name, False, error=err, seconds=time.monotonic() - t0)
    status = probe(spec, venv)
    if not status.ok:
        for step in spec.pip:
            rc, out = _run([str(venv_python(venv)), "-m", "pip", "install", "-q", *step], timeout)
            if rc != 0:
                return PeerStatus(
                    spec.name,
                    False,
                    python=str(venv_python(venv)),
                    error=f"pip install {' '.join(step)} failed (exit {rc}):\n{_tail(out)}",
                    seconds=time.monotonic() - t0,
                )
        status = probe(spec, venv)
    if status.ok and spec.verbs_shim:
        err = make_verbs_shim(venv)
        if err is not None:
            status = PeerStatus(spec.name, False, python=status.python, error=err)
    status.seconds = time.monotonic() - t0
    return status


def install_all(names: list[str], out: Path | None, venv: Path = PEERS_VENV) -> list[PeerStatus]:
    """Install every named peer (unknown names are reported, not raised); write ``out``."""
    result = []
    for name in names:
        spec = PEERS.get(name)
        if spec is None:
            result.append(PeerStatus(name, False, error=f"unknown peer (known: {sorted(PEERS)})"))
            continue
        print(f"peers: installing {spec.title} ({' '.join(spec.packages)}) into {venv}")
        sys.stdout.flush()
        st = install(spec, venv)
        print(
            f"peers: {name}: "
            + (f"ready, version {st.version}" if st.ok else f"NOT available: {st.error}")
        )
        result.append(st)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([s.as_dict() for s in result], indent=2) + "\n")
    return result


def load_statuses(path: Path) -> list[PeerStatus]:
    """The statuses :func:`install_all` wrote."""
    return [PeerStatus(**d) for d in json.loads(path.read_text())]
