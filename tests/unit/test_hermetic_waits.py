"""No real sleeps in tests/core and tests/adapters (issue 25: "on a fake clock, with no real
sleeps"; decision 0054). Our own waits run on the Timers port, which a test drives with a
FakeTimers on a FakeClock; a sleep there would make the test slow and its timing loose.

Checked statically with `ast`: every call of asyncio's or time's `sleep` (by attribute, or
imported by name, under any alias) must be a yield (`sleep(0)`), or sit in one of the few
functions listed below with the reason it needs real time: only a real etcd's own asynchrony
or lease TTL, which no fake clock moves. `extproc.adapters.timers.sleep` (the port) is not
a real sleep and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRS = ("tests/core", "tests/adapters")
SLEEPY = {"asyncio": ("sleep",), "time": ("sleep",), "trio": ("sleep",), "anyio": ("sleep",)}

# (file, enclosing function's qualified name) -> why it waits real time.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/adapters/test_journal_store.py", "Env.pass_time"):
        "the [etcd] contract run: a real lease's TTL runs on etcd's own clock",
    ("tests/adapters/test_journal_store.py", "_until"):
        "the [etcd] contract run: etcd's watch delivers after the transaction returns",
    ("tests/adapters/test_kv_memory.py", "Env.pass_time"):
        "the [etcd] contract run: a real lease's TTL runs on etcd's own clock",
}


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (0, 0.0) \
        and not isinstance(node.value, bool)


def real_sleeps(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, enclosing function's qualified name) of every real sleep in `source`."""
    tree = ast.parse(source, filename=filename)
    modules: set[str] = set()  # names bound to a sleepy module (import asyncio as aio)
    funcs: set[str] = set()  # names bound to a sleepy function (from time import sleep)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name in SLEEPY}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in SLEEPY:
            funcs |= {a.asname or a.name for a in node.names
                      if a.name in SLEEPY[node.module]}
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = (*scope, child.name)
            if isinstance(child, ast.Call):
                f = child.func
                sleepy = ((isinstance(f, ast.Attribute) and f.attr == "sleep"
                           and isinstance(f.value, ast.Name) and f.value.id in modules)
                          or (isinstance(f, ast.Name) and f.id in funcs))
                pause = child.args[0] if child.args else next(
                    (k.value for k in child.keywords if k.arg in ("delay", "secs", "seconds")),
                    None)
                if sleepy and not (pause is not None and _is_zero(pause)):
                    found.append((child.lineno, ".".join(scope) or "<module>"))
            visit(child, inner)
    visit(tree, ())
    return found


def _files() -> list[Path]:
    return sorted(p for d in DIRS for p in (ROOT / d).rglob("*.py"))


def test_no_real_sleep_outside_the_listed_waits() -> None:
    bad, used = [], set()
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for line, scope in real_sleeps(path.read_text(), rel):
            if (rel, scope) in ALLOWED:
                used.add((rel, scope))
            else:
                bad.append(f"{rel}:{line} in {scope}")
    assert not bad, ("real sleeps (wait on the fake clock: FakeTimers.advance, run_on, or an "
                     "event the awaited thing sets; or list the wait in ALLOWED with why):\n"
                     + "\n".join(bad))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED lists waits that are gone: {stale}"
    assert all(why.strip() for why in ALLOWED.values())


def test_the_check_finds_every_spelling_of_a_sleep_and_spares_yields_and_the_port() -> None:
    src = '''
import asyncio
import asyncio as aio
import time
from asyncio import sleep as nap
from time import sleep
from extproc.adapters.timers import sleep as port_sleep

async def a():
    await asyncio.sleep(0)          # a yield
    await asyncio.sleep(0.0, "x")   # a yield
    await asyncio.sleep(0.01)
    await aio.sleep(1)
    await nap(delay=0.5)
    await port_sleep(timers, 1.0)   # the port

class K:
    def b(self):
        time.sleep(2)
        sleep(0)                    # a yield
        sleep(s)
'''
    # (The source's first line is empty: `import asyncio` is line 2.)
    assert real_sleeps(src) == [(12, "a"), (13, "a"), (14, "a"), (19, "K.b"), (21, "K.b")]
