#!/usr/bin/env bash
# Print one hash of every file under the given paths (names and contents; bytecode and
# caches left out): image.mk rebuilds an image only when its inputs' hash changed.
set -euo pipefail
find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
