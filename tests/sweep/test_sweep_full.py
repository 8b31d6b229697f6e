"""The full fault sweep (every kind at every index 0..N): only with EXTPROC_SWEEP=full.

`make sweep` runs the same plan through `python -m devkit.sweep --full`, which also prints
the summary table; this entry point exists for pytest users (`EXTPROC_SWEEP=full pytest
tests/sweep/test_sweep_full.py`).
"""

from __future__ import annotations

import os

import pytest

from devkit.sweep.harness import Case, SweepEnv, plan_cases

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get("EXTPROC_SWEEP") != "full",
                       reason="the full fault sweep runs with `make sweep` (EXTPROC_SWEEP=full)"),
]


@pytest.mark.parametrize("case", plan_cases(quick=False), ids=str)
def test_fault_at_token_index_full(sweep_env: SweepEnv, case: Case) -> None:
    res = sweep_env.run(case)
    assert not res.violations, res.report()
