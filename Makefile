# hixl: the one front door for developer tasks.  See README.md.
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
PY := $(BIN)/python
HIXL := $(BIN)/hixl

.PHONY: ffi pyc soak setup test test-unit test-registry test-rdma wheel-check test-hosts test-fleet test-fleet-demo test-fleet-cases check demo bench bench-smoke bench-peers

## setup: system packages (and the VM path if the kernel lacks rdma_rxe), then .venv
setup:
	bash scripts/setup.sh

## test: unit and property tests here, the registry against a private etcd, then the RDMA
## tests on rxe (host or VM)
test: test-unit test-registry test-rdma

test-unit:
	$(PY) -m pytest tests/unit -q

# Starts its own etcd (Debian etcd-server) per test on free ports; never the system one.
test-registry:
	HIXL_REQUIRE_ETCD=1 $(PY) -m pytest -p no:cacheprovider tests/registry -q

## ffi: regenerate hixl/verbs/_ffi_tables.py, cffi's prebuilt tables for the verbs declarations
##   (run after editing CDEF in hixl/verbs/_ffi.py; a unit test fails until then)
ffi:
	$(PY) -c 'from hixl.verbs._ffi import write_tables; write_tables("hixl/verbs/_ffi_tables.py")'

# Bytecode for the VM stages: the VM sees this checkout read-only, so a module without a
# .pyc would be compiled again by every Python process there (seconds each under emulation).
pyc:
	$(PY) -m compileall -q hixl tests benchmarks examples > /dev/null

# `hixl run` uses the host's rxe when there is one and boots the VM otherwise.
# HIXL_REQUIRE_RDMA=1 turns a missing device into a failure, never a skip.
# HIXL_DEBUG_LOCKS=1 checks every engine's lock in the whole tier (no socket send or wake-up
# byte under it); it costs no measurable time (see hixl/engine/locks.py). DEBUG_LOCKS=0 turns it off.
DEBUG_LOCKS ?= 1
test-rdma: pyc
	HIXL_REQUIRE_RDMA=1 $(HIXL) run -- env HIXL_DEBUG_LOCKS=$(DEBUG_LOCKS) $(PY) -m pytest -p no:cacheprovider tests/rdma -q --durations=12

## wheel-check: the wheel in a fresh venv with hixl[vm] (no system packages, so no pyverbs):
## `hixl doctor` must find a path to run on, and the README's first example runs there
## (through the VM on a kernel without rxe). About a minute and a quarter under emulation.
wheel-check:
	bash scripts/wheel-check.sh

## soak: 1000 connect->put->close cycles of a fresh client engine against one server (CI runs
## 40): the server lets each go within 1 s, its fds stay within +4 and RSS within +24 MiB;
## then 40 phases of random put/get (CI runs 6, natively on the null device): RSS reaches a
## plateau within the caches' written bounds.
soak:
	HIXL_SOAK_CYCLES=1000 HIXL_REQUIRE_RDMA=1 $(HIXL) run -- $(PY) -m pytest -p no:cacheprovider \
		tests/rdma/test_adversarial_session.py -q -s -k clients_that_close
	HIXL_PLATEAU_PHASES=40 $(PY) -m pytest -p no:cacheprovider tests/unit/test_memory_plateau.py -q -s

## test-hosts: two VMs, each with its own kernel and rxe, on one virtual wire (MTU 1500 and
## 9000): strided put/get, notifications, MTU negotiation, link flap, a peer host killed.
## host0 runs tests/hosts, host1 the agent they drive. About 2 min under emulation.
test-hosts: pyc
	$(HIXL) vm hosts --mtu 1500 --mtu 9000 --cpus 1 --memory 2G --timeout 900 \
		--host '$(PY) -m pytest -p no:cacheprovider tests/hosts -v -rA --durations=0' \
		--host '$(PY) tests/hosts/agent.py'

## test-fleet: four VMs on one wire, booted twice (about 7 min under emulation on 2 cores):
## test-fleet-demo: the demo: etcd on host0, a 1x1 fleet, then 2 prefill x 2 decode routing
##   by announced capacity, with a decode host cut off mid-stream, a worker restarted under the
##   same name and etcd stopped for 5 s; every request exactly once, bit-exact; the throughput
##   ratio to the 1x1 fleet and the times from the cut to the last choice of the lost host.
## test-fleet-cases: tests/fleet on host0 (pytest, etcd there) driving agents on host1..3: each
##   failure behaviour as a test. Every engine has the run's shared token.
test-fleet: test-fleet-demo test-fleet-cases

test-fleet-demo: pyc
	$(HIXL) demo --hosts 4 --prefill 2 --decode 2 --requests 12 --timeout 600

test-fleet-cases: pyc
	HIXL_FLEET_TOKEN=$$($(HIXL) token) $(HIXL) vm hosts --cpus 1 --memory 1536M --timeout 900 \
		--host '$(PY) -m pytest -p no:cacheprovider tests/fleet -v -rA --durations=0' \
		--host '$(PY) tests/fleet/agent.py' --host '$(PY) tests/fleet/agent.py' \
		--host '$(PY) tests/fleet/agent.py'

## check: format, lint and types (mypy --strict over hixl, benchmarks and tests; see pyproject)
check:
	$(BIN)/ruff format --check hixl tests benchmarks
	$(BIN)/ruff check hixl tests benchmarks
	$(BIN)/mypy

## bench: hixl vs perftest, layer-sending methods, overheads, on rxe (host or VM); writes
## results/bench/<date_time>/ (JSON, results.md, bench.png) and refreshes docs/benchmarks.md.
## BENCH_ARGS=--quick for a short smoke run.
bench:
	$(HIXL) bench $(BENCH_ARGS)

## bench-peers: hixl beside Mooncake's Transfer Engine and perftest in one VM boot; installs the
## peers on demand into .venv-peers (never into .venv). A peer that fails is reported, not fatal.
## NIXL=1 adds NVIDIA NIXL (opt in), as installed and tuned.
bench-peers:
	$(HIXL) bench --peers $(if $(NIXL),--nixl) --sections peers $(BENCH_ARGS)

## bench-smoke: every benchmark's --help (by path and with -m) and every path that needs no
## device, natively and in well under a minute, so that none can rot (CI runs it)
bench-smoke:
	$(PY) -m benchmarks.drivers.smoke

## demo: prefill -> decode KV cache transfer of a small transformer, verified (host or VM)
demo:
	$(HIXL) demo $(DEMO_ARGS)
