"""One SweepEnv per test module: it owns at most one gateway stack at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.sweep.harness import SweepEnv


@pytest.fixture(scope="module")
def sweep_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SweepEnv]:
    out = os.environ.get("EXTPROC_SWEEP_OUT")
    out_dir = Path(out) if out else tmp_path_factory.mktemp("sweep-results")
    env = SweepEnv(tmp_path_factory.mktemp("sweep-stacks"), out_dir, log=lambda s: None)
    try:
        yield env
    finally:
        env.close()
