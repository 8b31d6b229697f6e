#!/usr/bin/env bash
# Build the local base image from Debian packages alone: no container registry is needed.
#
#   image/build-base.sh IMAGE INPUTS_HASH
#
# debootstrap (minbase) lays down Debian bookworm with python3 (3.11) and python3-venv, the
# apt caches, docs, man pages and locales are dropped, and the tree is imported as a one-layer
# image labelled with INPUTS_HASH (image.mk skips the build when the label already matches).
# The Containerfile's BASE defaults to a public Python image instead; this is what it gets
# here, where no registry answers. Needs root, debootstrap and podman (image.mk installs them).
set -euo pipefail

image=${1:?usage: build-base.sh IMAGE INPUTS_HASH}
inputs=${2:?usage: build-base.sh IMAGE INPUTS_HASH}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=${IMAGE_WORK:-/var/tmp/llm-failover-extproc}

mkdir -p "$work"
rootfs=$(mktemp -d "$work/rootfs.XXXXXX")
trap 'rm -rf "$rootfs"' EXIT
chmod 0755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would lock out non-root users

debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

# What a runtime image does not need: package caches and lists, documentation, translations.
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/* "$rootfs"/tmp/* "$rootfs"/var/tmp/*
# The runtime provides these per container.
: >"$rootfs/etc/hostname"
: >"$rootfs/etc/resolv.conf"
rm -f "$rootfs/etc/machine-id" "$rootfs/var/lib/dbus/machine-id"

tar --numeric-owner --xattrs -C "$rootfs" -c . | podman import --quiet \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL llm-failover-extproc.inputs=$inputs" \
    --change "LABEL org.opencontainers.image.description=Debian $suite minbase with python3" \
    - "$image" >/dev/null
echo "built $image ($(podman image inspect --format '{{.Size}}' "$image") bytes)"
