"""How far one Envoy message reaches through a session (issue 25: at most four files).

Each Envoy message kind is played through each session on the hermetic harness (the memory
store, a fake clock, the sessions of `test_sessions`), one message at a time, and every
Python frame entered while it is handled is seen by `sys.setprofile`: the session's own
handling, and the work it spawned (a task inherits the message's context, so its frames
count for the message that started it). What counts:

- *The session* is the role's file (`adapters/gate.py`, `adapters/guard.py`) and the read
  loop it inherits (`session.Session`).
- Only what a session frame calls *directly* is counted; what a callee calls in turn is
  its own (the machine's rows and the helpers they call are the machine's, a port's
  internals the port's).
- *The machine* is one part: the role's rows (`core/gate.py` or `core/guard.py`), the
  dispatcher (`core/machine.py`) and the vocabulary (`core/events.py`).
- *The codec* is `adapters/envoy_codec.py`.
- *A port* is one adapter file the session calls to do I/O or to reach the process's shared
  state (the journal, the timers, the clock, the intakes and hand-offs in flight, an agent's
  link); each port file counts on its own.
- *The observer* (`adapters/observer.py`) is called once per transition from the session's
  `feed` and returns nothing the session reads: listed, and asserted entered only from
  `feed`, but not counted among the four.
- Any other file a session frame enters is counted too, and it is a failure if it is in
  `core/` (a decision taken outside the machine) or is not in the allowed set below.

`REACH` is the allowed set per message, with its count; a message reaching a file not in
it, or more than four counted files, fails. Shown with `-s`: each message's set.
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
from extproc.adapters.session import Processor
from extproc.core import headers as H

from .support import SSE_CONTENT, SSE_DONE, SSE_ROLE, FakeClock, FakeTimers, idle
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
    return file in SESSIONS or (file == "adapters/session.py" and name.startswith("Session."))


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
        await send(guard, resp_body(SSE_DONE, eos=True), "response_body(end)", 5, timers)
        guard.close()
        await asyncio.wait_for(gtask, 3)
        await idle()
        await p.drain()
    assert json.loads(ho)["attempt"] == 2


# The allowed parts per message ("session" and "machine" always; the observer apart).
REACH: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def seen() -> Seen:
    s = Seen()
    asyncio.run(play(s))
    return s


def test_print_reach(seen: Seen) -> None:
    for label in sorted(seen.edges):
        parts, observed = reach(seen.edges[label])
        counted = sorted(x for x in parts if x != "adapters/observer.py")
        print(f"{label}: {len(counted)} {counted} observer-from={sorted(observed)}")
