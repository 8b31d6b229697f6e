"""No real sleeps in tests/core and tests/adapters (issue 25: "on a fake clock, with no real
sleeps"; decision 0054). Our own waits run on the Timers port, which a test drives with a
FakeTimers on a FakeClock; a sleep there would make the test slow and its timing loose.

Checked statically with `ast`: every call of asyncio's or time's `sleep` (by attribute, or
imported by name, under any alias) must be a yield (`sleep(0)`), or sit in one of the few
functions listed below with the reason it needs real time: only a real etcd's own asynchrony
or lease TTL, which no fake clock moves. `extproc.adapters.timers.sleep` (the port) is not
a real sleep and is not counted.

A bounded wait whose running out is an expected outcome is a real sleep too ("nothing came
within 0.5 s"): an asyncio `wait_for`, `timeout` or `timeout_at` whose TimeoutError is
caught and not raised again, expected (`pytest.raises`) or suppressed, and any
`asyncio.wait(..., timeout=...)`. A bound that fails the test when it runs out is fine.
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


BOUNDED = ("wait_for", "timeout", "timeout_at")
_TIMEOUTS = {"TimeoutError", "Exception", "BaseException"}  # what catches a TimeoutError


def _catches_timeout(t: ast.expr | None) -> bool:
    if t is None:  # a bare except
        return True
    if isinstance(t, ast.Tuple):
        return any(_catches_timeout(e) for e in t.elts)
    return (isinstance(t, ast.Name) and t.id in _TIMEOUTS) or (
        isinstance(t, ast.Attribute) and t.attr in _TIMEOUTS)


def _fails(handler: ast.ExceptHandler) -> bool:
    """The handler fails the test: it raises, or calls a `fail` (pytest.fail)."""
    return any(isinstance(n, ast.Raise) or (
        isinstance(n, ast.Call) and ((isinstance(n.func, ast.Name) and n.func.id == "fail")
                                     or (isinstance(n.func, ast.Attribute)
                                         and n.func.attr == "fail")))
        for n in ast.walk(handler))


def _expects_timeout(item: ast.withitem) -> bool:
    """`pytest.raises(TimeoutError)`, `contextlib.suppress(TimeoutError)`, any spelling."""
    c = item.context_expr
    if not isinstance(c, ast.Call):
        return False
    name = c.func.attr if isinstance(c.func, ast.Attribute) else (
        c.func.id if isinstance(c.func, ast.Name) else "")
    return name in ("raises", "suppress") and any(_catches_timeout(a) for a in c.args)


def expected_expiries(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, enclosing function's qualified name) of every bounded wait in `source` whose
    running out is an expected outcome: a real wait for nothing."""
    tree = ast.parse(source, filename=filename)
    modules: set[str] = set()  # names bound to asyncio
    funcs: dict[str, str] = {}  # a name bound to one of asyncio's waits -> which wait
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "asyncio"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "asyncio":
            funcs |= {a.asname or a.name: a.name for a in node.names
                      if a.name in (*BOUNDED, "wait")}
    found: list[tuple[int, str]] = []

    def which(call: ast.Call) -> str:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and f.value.id in modules:
            return f.attr
        return funcs.get(f.id, "") if isinstance(f, ast.Name) else ""

    def visit(node: ast.AST, scope: tuple[str, ...], expected: bool) -> None:
        if isinstance(node, ast.Try | ast.TryStar):
            swallowed = expected or any(_catches_timeout(h.type) and not _fails(h)
                                        for h in node.handlers)
            for child in node.body:
                visit(child, scope, swallowed)
            for child in (*node.handlers, *node.orelse, *node.finalbody):
                visit(child, scope, expected)
            return
        if isinstance(node, ast.With | ast.AsyncWith):
            inner = expected or any(_expects_timeout(i) for i in node.items)
            for i in node.items:
                visit(i, scope, expected)
            for child in node.body:
                visit(child, scope, inner)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = (*scope, node.name)
        if isinstance(node, ast.Call):
            w = which(node)
            if (w in BOUNDED and expected) or (w == "wait" and (
                    len(node.args) > 1 or any(k.arg == "timeout" for k in node.keywords))):
                found.append((node.lineno, ".".join(scope) or "<module>"))
        for child in ast.iter_child_nodes(node):
            visit(child, scope, expected)
    visit(tree, (), False)
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


def test_no_wait_that_is_meant_to_run_out() -> None:
    bad = [f"{path.relative_to(ROOT).as_posix()}:{line} in {scope}" for path in _files()
           for line, scope in expected_expiries(path.read_text(), str(path))]
    assert not bad, ("bounded waits that are expected to run out (await what says the thing "
                     "was handled, then assert it did nothing):\n" + "\n".join(bad))


def test_the_expiry_check_finds_waits_for_nothing_and_spares_bounds() -> None:
    src = '''
import asyncio
import asyncio as aio
import contextlib
import pytest
from asyncio import wait_for as wf, wait

async def a(q):
    try:
        return await asyncio.wait_for(q.get(), 0.5)
    except TimeoutError:
        return None
    try:
        await aio.wait_for(q.get(), 10)
    except asyncio.TimeoutError:
        raise AssertionError("nothing came") from None
    try:
        async with asyncio.timeout(10):
            await q.get()
    except (OSError, TimeoutError):
        pytest.fail("nothing came")
    with pytest.raises(TimeoutError):
        await wf(q.get(), 0.5)
    with contextlib.suppress(aio.TimeoutError):
        async with aio.timeout_at(1.0):
            await q.get()
    await asyncio.wait_for(q.get(), 10)
    done, pending = await wait({q}, timeout=0.5)
    await asyncio.wait({q})

class K:
    async def b(self, q):
        try:
            try:
                await asyncio.wait_for(q.get(), 0.5)
            except KeyError:
                pass
        except:
            pass
'''
    # (The source's first line is empty: `import asyncio` is line 2.)
    assert expected_expiries(src) == [(10, "a"), (23, "a"), (25, "a"), (28, "a"),
                                      (35, "K.b")]


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
