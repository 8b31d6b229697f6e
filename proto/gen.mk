# Generated Python stubs for our own wire-compatible subset of the Envoy API.
# Included from the main Makefile; run `make proto` from the repository root.
# The generated files under extproc/gen/ are committed and must never be edited by hand.

PY ?= .venv/bin/python

PROTO_SRC_DIR := proto
PROTO_GEN_DIR := extproc/gen
# The sources sit at proto/envoy/... (Envoy's own paths); protoc sees them under the virtual
# path extproc/gen/ (-I extproc/gen=proto), which is what puts the stubs in extproc.gen.
PROTO_FILES = $(shell cd $(PROTO_SRC_DIR) && find envoy -name '*.proto' | LC_ALL=C sort | sed 's|^|$(PROTO_GEN_DIR)/|')
# Well-known types (struct, any, duration, timestamp, wrappers, ...) bundled with grpcio-tools.
GRPC_TOOLS_PROTO_INCLUDE = $(shell $(PY) -c 'import os, grpc_tools; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')

.PHONY: proto
proto:
	rm -rf $(PROTO_GEN_DIR)/envoy
	$(PY) -m grpc_tools.protoc -I $(PROTO_GEN_DIR)=$(PROTO_SRC_DIR) -I $(GRPC_TOOLS_PROTO_INCLUDE) \
		--python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_FILES)
	find $(PROTO_GEN_DIR) -type d -name __pycache__ -prune -o -type d -exec touch {}/__init__.py \;
