#!/usr/bin/env bash
# Idempotent set-up for hixl on Debian/Ubuntu: system packages, then .venv.
# Installs the VM packages only when this kernel cannot run soft-RoCE itself.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "setup: not root and no sudo; install the packages listed in README.md by hand" >&2
  fi
fi

# libibverbs-dev and gcc: a unit test checks hixl's cffi layouts against <infiniband/verbs.h>.
pkgs=(rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest python3-pyverbs
      python3-venv iproute2 kmod libibverbs-dev gcc etcd-server etcd-client)

kernel_has_rxe() {
  [ -d /sys/class/infiniband ] && return 0
  modprobe -n rdma_rxe >/dev/null 2>&1
}

if kernel_has_rxe; then
  echo "setup: this kernel can run rdma_rxe; soft-RoCE will run on the host"
  want_vm=0
else
  echo "setup: this kernel cannot run rdma_rxe; installing the VM path (qemu + a Debian kernel)"
  pkgs+=(qemu-system-x86 linux-image-amd64 busybox-static)
  want_vm=1
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: system packages already installed"
fi

# The venv must be made by the system interpreter and see system packages, so
# that the distribution's python3-pyverbs (ABI-matched to rdma-core) imports.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
extras="test,dev,plot,torch"  # torch is pinned in pyproject (see there)
[ "$want_vm" = 1 ] && extras="$extras,vm"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${extras}]"
.venv/bin/python -c "import pyverbs, numpy, hixl; print('setup: ok (hixl', hixl.__version__ + ')')"
