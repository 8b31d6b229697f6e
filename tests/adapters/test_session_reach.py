"""How far one Envoy message reaches through a session (issue 25: at most four files, the
session, the codec, the machine, a port).

Each Envoy message kind is played through each session on the hermetic harness (the memory
store, a fake clock, `test_sessions`'s fake stream), one message at a time, and every frame
of a file under extproc/ entered while it is handled is seen by `sys.setprofile`: the
session's own handling, and the work it spawned (a task inherits the message's context, so
its frames count for the message that started it). What counts:

- *The session* is the role's file (`adapters/gate.py`, `adapters/guard.py`) and the read
  loop it inherits (`session.Session`, with its lock `session.Turn`).
- Only what a session frame calls *directly* is counted: what a callee calls in turn is its
  own (the machine's rows and the pure helpers they call are the machine's, a port's
  internals the port's).
- *The machine* is one part: the role's rows (`core/gate.py` or `core/guard.py`), the
  dispatcher (`core/machine.py`) and the vocabulary (`core/events.py`).
- *The codec* is `adapters/envoy_codec.py`.
- *A port* is a file in `PORTS`, each with what it implements: an adapter that does the
  I/O an action asks for or reaches the process's shared state, or a core class that only
  holds such state (the retry budget's counts, the hosts' health). The ports a message
  reaches count as the one "port" of the four; which files they are is pinned per message
  in `REACH`, so a message that comes to reach one more fails here too.
- *The observer* (`adapters/observer.py`) is called once per transition from the session's
  `feed` and returns nothing the session reads: asserted entered only from `feed`, not
  counted.
- Any other file entered from a session fails: a core file there is a decision taken
  outside the machine.

Not played here: the tool route (its own small machine, `adapters/tools.py`) and the
status lookup.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

import extproc
from extproc.adapters.gate import GateSession
from extproc.adapters.guard import GuardSession
from extproc.adapters.processor import Processor
from extproc.core import headers as H

from .support import SSE_CONTENT, SSE_DONE, SSE_ROLE, SSE_VLLM, FakeClock, FakeTimers, idle
from .test_sessions import (
    CHAT,
    DOWN,
    REPLICA,
    FakeContext,
    proc,
    req_body,
    req_headers,
    resp_body,
    resp_headers,
    set_headers,
)

ROOT = os.path.dirname(extproc.__file__) + os.sep
LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("reach", default=None)
MACHINE = {"core/gate.py", "core/guard.py", "core/machine.py", "core/events.py"}
SESSIONS = {"adapters/gate.py", "adapters/guard.py"}

Edge = tuple[str, str, str, str]  # caller file, caller name, callee file, callee name


class Seen:
    """Every (caller, callee) pair of project frames entered under a message's label."""

    def __init__(self) -> None:
        self.edges: dict[str, set[Edge]] = {}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        label = LABEL.get()
        if label is None or not frame.f_code.co_filename.startswith(ROOT):
            return
        back = frame.f_back
        caller = ("", "")
        if back is not None and back.f_code.co_filename.startswith(ROOT):
            caller = (back.f_code.co_filename[len(ROOT):], back.f_code.co_qualname)
        self.edges.setdefault(label, set()).add(
            (*caller, frame.f_code.co_filename[len(ROOT):], frame.f_code.co_qualname))

    @contextmanager
    def on(self) -> Iterator[None]:
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(None)


def is_session(file: str, name: str) -> bool:
    # session.py's Session (the read loop) and Turn (the stream's lock) are the session's.
    return file in SESSIONS or (file == "adapters/session.py"
                                and name.startswith(("Session.", "Turn.")))


def part(file: str) -> str:
    """What a file entered from the session is, by the docstring's definition."""
    if file in MACHINE:
        return "machine"
    if file in SESSIONS:
        return "session"
    return file


def reach(edges: set[Edge]) -> tuple[set[str], set[str]]:
    """The parts a session's frames entered directly, and the callers of the observer."""
    parts = {part(f) for cf, cn, f, n in edges if is_session(cf, cn) and not is_session(f, n)}
    observed = {cn for cf, cn, f, _ in edges if f == "adapters/observer.py" and is_session(cf, cn)}
    return parts | {"session"}, observed


class Labelled:
    """A session whose messages (and stream end) are handled under the label the test set."""

    next_label = ""

    async def on_message(self, which: str, msg: Any) -> None:
        tok = LABEL.set(f"{self.role}.{Labelled.next_label or which}")  # type: ignore[attr-defined]
        try:
            await super().on_message(which, msg)  # type: ignore[misc]
        finally:
            LABEL.reset(tok)

    def fast(self, msg: Any) -> Any:
        tok = LABEL.set(f"{self.role}.{Labelled.next_label}")  # type: ignore[attr-defined]
        try:
            return super().fast(msg)  # type: ignore[misc]
        finally:
            LABEL.reset(tok)

    def fast_done(self) -> None:
        tok = LABEL.set(f"{self.role}.{Labelled.next_label}")  # type: ignore[attr-defined]
        try:
            super().fast_done()  # type: ignore[misc]
        finally:
            LABEL.reset(tok)

    async def on_closed(self) -> None:
        tok = LABEL.set(f"{self.role}.closed")  # type: ignore[attr-defined]
        try:
            await super().on_closed()  # type: ignore[misc]
        finally:
            LABEL.reset(tok)


class Gate(Labelled, GateSession):
    __slots__ = ()
    role = "gate"


class Guard(Labelled, GuardSession):
    __slots__ = ()
    role = "guard"


def start(cls: type[Any], p: Processor) -> tuple[FakeContext, Any, asyncio.Task[None]]:
    ctx = FakeContext()
    s = cls(p, ctx)
    return ctx, s, asyncio.ensure_future(s.run())


async def send(ctx: FakeContext, msg: Any, label: str, n: int, timers: FakeTimers) -> None:
    """One message, handled to its answers and its spawned work's end (the fake clock moved
    for what waits on it: Envoy's word that never comes)."""
    Labelled.next_label = label
    ctx.send(msg)
    await ctx.wait_for(n)
    await idle()
    timers.advance(1.0)
    await idle()


async def play(seen: Seen) -> None:
    """A keyed request: attempt 1 refused by its replica (503, failed, Envoy retries),
    attempt 2 admitted, held, fenced, released, taken over and streamed to its end."""
    timers = FakeTimers(FakeClock())
    p, _store = proc(None, timers)
    with seen.on():
        guard, _, gtask = start(Guard, p)
        await send(guard, req_headers(DOWN), "request_headers", 1, timers)
        rid = set_headers(guard.out[0], "request_headers")[H.REQUEST_ID]
        await send(guard, req_body(CHAT), "request_body", 2, timers)
        sent = set_headers(guard.out[1], "request_body")
        gate_h = {H.REQUEST_ID: rid, H.ACCEPTED_AT: sent[H.ACCEPTED_AT],
                  H.PREADMITTED: sent[H.PREADMITTED], H.ATTEMPT_SECRET: sent[H.ATTEMPT_SECRET]}
        # Attempt 1: its lease (taken with the request), then the replica's 503.
        g1, _, t1 = start(Gate, p)
        await send(g1, req_headers({**gate_h, H.ENVOY_ATTEMPT_COUNT: "1"},
                                   attrs={"upstream.address": REPLICA}),
                   "request_headers(lease)", 1, timers)
        await send(g1, resp_headers({":status": "503", "content-type": "application/json"},
                                    eos=True), "response_headers(fail)", 2, timers)
        g1.close()
        await asyncio.wait_for(t1, 3)
        await idle()
        timers.advance(1.0)
        await p.drain()
        # Attempt 2: the admission transaction, held until its first delta is fenced.
        g2, _, t2 = start(Gate, p)
        await send(g2, req_headers({**gate_h, H.ENVOY_ATTEMPT_COUNT: "2"},
                                   attrs={"upstream.address": REPLICA}),
                   "request_headers(admit)", 1, timers)
        await send(g2, req_body(b"{}"), "request_body", 2, timers)
        await send(g2, resp_headers({":status": "200", "content-type": "text/event-stream"}),
                   "response_headers(hold)", 2, timers)
        await send(g2, resp_body(SSE_ROLE), "response_body(held)", 2, timers)
        await send(g2, resp_body(SSE_CONTENT), "response_body(release)", 5, timers)
        await asyncio.wait_for(t2, 3)  # detached
        ho = set_headers(g2.out[2], "response_headers")[H.HANDOFF]
        await send(guard, resp_headers({":status": "200", "content-type": "text/event-stream",
                                        H.HANDOFF: ho}), "response_headers", 3, timers)
        await send(guard, resp_body(SSE_CONTENT), "response_body", 4, timers)
        # The common chunk past the first delta: the guard's fast path (no event).
        await send(guard, resp_body(SSE_VLLM), "response_body(fast)", 5, timers)
        await send(guard, resp_body(SSE_DONE, eos=True), "response_body(end)", 6, timers)
        guard.close()
        await asyncio.wait_for(gtask, 3)
        await idle()
        await p.drain()
    assert json.loads(ho)["attempt"] == 2


# A port: an adapter file the session calls to do I/O or to reach the process's shared
# state (what it implements of ports.py), or a core class that only holds such state.
PORTS = {
    "adapters/attempt_record.py": "the gate's record: the attempt's journal calls, its lease",
    "adapters/request_record.py": "the guard's record: the intake in flight, the outcome",
    "adapters/released.py": "the attempt the guard took over (its watch, its end)",
    "adapters/agent_link.py": "a replica agent's word, the cancel, its acknowledgement",
    "adapters/processor.py": "the Processor: the intake's wait, the admission's verdict with "
                           "the retry budget, the intakes and hand-offs in flight, the "
                           "attempts that reached a replica, background work",
    "adapters/timers.py": "the Timers port (a session's TimerSet), and the tests' FakeClock",
    "adapters/ports.py": "the clock and the ids (a credential minted with its digest)",
    "adapters/telemetry.py": "the trace context the body's answer carries to the gate",
    "adapters/causes.py": "Envoy's access-log entries",
    "core/budget.py": "the retry budget's counts (ports.Budget: counted, no verdict)",
    "core/health.py": "the hosts' passive health (ports.Health)",
}
CODEC, OBSERVER = "adapters/envoy_codec.py", "adapters/observer.py"

# Per message: the port files it reaches (with the session, the machine and the codec).
REACH: dict[str, set[str]] = {
    "guard.request_headers": {"adapters/processor.py"},
    "guard.request_body": {"adapters/ports.py", "adapters/request_record.py",
                           "adapters/telemetry.py", "adapters/timers.py", "core/budget.py"},
    "gate.request_headers(lease)": {"adapters/attempt_record.py", "adapters/processor.py",
                                    "adapters/timers.py"},
    "gate.response_headers(fail)": set(),
    "gate.closed": {"adapters/attempt_record.py", "adapters/processor.py",
                    "adapters/timers.py", "core/budget.py"},
    "gate.request_headers(admit)": {"adapters/attempt_record.py", "adapters/processor.py",
                                    "adapters/timers.py"},
    "gate.request_body": set(),  # not an event: passed by the codec alone
    "gate.response_headers(hold)": set(),
    "gate.response_body(held)": {"adapters/attempt_record.py"},
    "gate.response_body(release)": {"adapters/attempt_record.py", "adapters/processor.py",
                                    "adapters/timers.py"},
    "guard.response_headers": {"adapters/released.py"},
    "guard.response_body": {"adapters/released.py", "adapters/timers.py"},
    "guard.response_body(fast)": {"adapters/released.py", "adapters/timers.py"},
    "guard.response_body(end)": {"adapters/released.py", "adapters/timers.py"},
    "guard.closed": {"adapters/released.py", "adapters/request_record.py",
                     "adapters/processor.py", "adapters/timers.py", "core/budget.py"},
}


@pytest.fixture(scope="module")
def seen() -> Seen:
    s = Seen()
    asyncio.run(play(s))
    return s


def test_every_message_was_played(seen: Seen) -> None:
    assert set(seen.edges) == set(REACH)


@pytest.mark.parametrize("label", sorted(REACH))
def test_a_message_reaches_the_session_codec_machine_and_ports_only(
        seen: Seen, label: str) -> None:
    parts, observed = reach(seen.edges[label])
    files = parts - {"session", "machine", CODEC, OBSERVER}
    kinds = {"session"} | ({"machine"} & parts) | ({"codec"} if CODEC in parts else set()) | (
        {"port"} if files else set())
    print(f"{label}: {sorted(kinds)} ports={sorted(files)}")
    # No decision outside the machine: every other file entered is a port's.
    assert files <= set(PORTS), sorted(files - set(PORTS))
    assert files == REACH[label]
    assert len(kinds) <= 4
    # The observer is fed once per transition, by feed, and returns nothing the session reads.
    assert observed <= {"GateSession.feed", "GuardSession.feed"}
