# The fault sweep (docs/sweep.md): each fault kind at each token index of a reference answer,
# through real Envoy + etcd + processor + demo replicas, checked per request_id.
# Included from the Makefile (after PY is defined). Extra options: SWEEP_ARGS="--seed 11".
.PHONY: sweep sweep-quick sweep-selfcheck sweep-agents sweep-agents-quick

## Full sweep: every kind at every index 0..N, streaming and non-streaming (~25-30 min).
sweep: install
	$(PY) -m devkit.sweep --full $(SWEEP_ARGS)

## The fast subset `make test` also runs (indices {0,1,2,N}), with the summary table.
sweep-quick: install
	$(PY) -m devkit.sweep --quick $(SWEEP_ARGS)

## Self-check: the sweep must catch a processor that releases without the fence.
sweep-selfcheck: install
	$(PY) -m devkit.sweep --unsafe $(SWEEP_ARGS)

## The full sweep with every demo replica behind `extproc agent` (issue 26): the engine dies,
## the agent lives (engine-dies in place of kill-after-deltas); partitions hear the agent.
sweep-agents: install
	$(PY) -m devkit.sweep --agents --full $(SWEEP_ARGS)

## The quick subset behind agents, with the table.
sweep-agents-quick: install
	$(PY) -m devkit.sweep --agents --quick $(SWEEP_ARGS)
