# Generated Python stubs for our own wire-compatible subset of the Envoy API.
# Included from the main Makefile; run `make proto` from the repository root.
# The generated files under extproc/gen/ are committed and must never be edited by hand.

PY ?= .venv/bin/python

PROTO_SRC_DIR := proto
PROTO_GEN_DIR := extproc/gen
PROTO_FILES = $(shell find $(PROTO_SRC_DIR) -name '*.proto' | LC_ALL=C sort)
# Well-known types (struct, any, duration, timestamp, wrappers, ...) bundled with grpcio-tools.
GRPC_TOOLS_PROTO_INCLUDE = $(shell $(PY) -c 'import os, grpc_tools; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')

.PHONY: proto
proto:
	rm -rf $(PROTO_GEN_DIR)/envoy
	$(PY) -m grpc_tools.protoc -I $(PROTO_SRC_DIR) -I $(GRPC_TOOLS_PROTO_INCLUDE) \
		--python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_FILES)
	find $(PROTO_GEN_DIR) -type d -name __pycache__ -prune -o -type d -exec touch {}/__init__.py \;
