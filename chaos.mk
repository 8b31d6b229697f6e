# The chaos harness (docs/chaos.md): mixed traffic while replicas, the processor and etcd
# members are killed, frozen and restarted; every request checked against the contract and
# the journal. Included from the Makefile (after PY is defined).
# `make soak DURATION=180 SEED=1`; more options: CHAOS_ARGS="--workers 8 --etcd-members 3".
.PHONY: soak soak-quick chaos-lint

DURATION ?= 180
SEED ?= 1
CHAOS_OUT ?= chaos-out/soak-seed$(SEED)

## The soak: DURATION seconds of traffic and faults, then the settle phase and the checks.
soak: install
	$(PY) -m chaos --duration $(DURATION) --seed $(SEED) --etcd-members 3 \
		--out $(CHAOS_OUT) $(CHAOS_ARGS)

## The fixed-seed slice `make test` runs (tests/e2e/test_chaos.py), and the checker's self-test.
soak-quick: install
	$(BIN)/pytest -q tests/chaos tests/e2e/test_chaos.py

## Lint and type-check the harness (it is dev tooling, outside the shipped package).
chaos-lint: install
	$(BIN)/ruff check chaos
	$(BIN)/mypy --strict chaos
