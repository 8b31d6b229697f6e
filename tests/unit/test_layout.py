"""The tests' layout shows the architecture (issue 25, decision 0045): each module under
extproc/core and extproc/adapters has `tests/<layer>/test_<module>.py` holding its own tests,
and every `test_<x>.py` there is named for a module x, but for the few files below that play
a whole path (the hermetic harness that plays Envoy, the interleavings) instead of one module.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "adapters")

# Modules without a test file of their name, each with the reason (keep it a handful).
UNTESTED_ALONE: dict[tuple[str, str], str] = {}

# Test files named for no module: each plays several modules together, on purpose.
HARNESSES: dict[tuple[str, str], str] = {
    ("core", "test_gate_agent.py"):
        "the gate's rows for the replica's agent (core/gate with core/source's word)",
    ("core", "test_gate_interleavings.py"):
        "core/gate under every interleaving of Envoy, etcd and timers",
    ("core", "test_guard_fast.py"):
        "core/guard's fast path for the common chunk against its table row, with core/sse and"
        " core/usage, side by side (decision 0043)",
    ("core", "test_delivery_accounting.py"):
        "core/guard and core/records: delivery from Envoy's access-log word (decision 0025)",
    ("adapters", "test_sessions.py"):
        "the hermetic harness: both sessions played as Envoy plays them, on the memory store",
    ("adapters", "test_session_reach.py"):
        "how far one Envoy message reaches through a session (issue 25's four files)",
    ("adapters", "test_gate_agent.py"):
        "the gate's session with an agent-fronted replica, the store's agent calls",
    ("adapters", "test_budget_hooks.py"):
        "the retry budget's ends as both sessions report them (decision 0023)",
    ("adapters", "test_etcd_group_txn.py"):
        "etcd's own rules for nested Txns in one call (group commit, weighed in decision"
        " 0052), on the real etcd; no module of ours uses them yet",
}


def _modules(layer: str) -> set[str]:
    return {p.stem for p in (ROOT / "extproc" / layer).glob("*.py") if p.stem != "__init__"}


def _tests(layer: str) -> set[str]:
    return {p.name for p in (ROOT / "tests" / layer).glob("test_*.py")}


def test_every_module_has_a_test_file_of_its_name() -> None:
    missing = [f"extproc/{layer}/{m}.py -> tests/{layer}/test_{m}.py"
               for layer in LAYERS for m in sorted(_modules(layer))
               if f"test_{m}.py" not in _tests(layer) and (layer, m) not in UNTESTED_ALONE]
    assert not missing, "modules without their own test file:\n" + "\n".join(missing)


def test_every_test_file_is_named_for_a_module_or_a_listed_harness() -> None:
    stray = [f"tests/{layer}/{t}" for layer in LAYERS for t in sorted(_tests(layer))
             if t[len("test_"):-len(".py")] not in _modules(layer)
             and (layer, t) not in HARNESSES]
    assert not stray, ("test files named for no module (rename, or list in HARNESSES with "
                       "the reason):\n" + "\n".join(stray))


def test_the_lists_name_only_what_exists() -> None:
    """A stale entry would let a module lose its tests, or a harness be renamed unseen."""
    gone = [f"{layer}/{m}" for layer, m in UNTESTED_ALONE if m not in _modules(layer)]
    gone += [f"tests/{layer}/{t}" for layer, t in HARNESSES if t not in _tests(layer)]
    gone += [f"{layer}/{m}: has a test file now" for layer, m in UNTESTED_ALONE
             if f"test_{m}.py" in _tests(layer)]
    assert not gone, gone
    assert all(why.strip() for why in (*UNTESTED_ALONE.values(), *HARNESSES.values()))
