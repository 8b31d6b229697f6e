"""The guard: the downstream ext_proc stream that owns a logical request.

A plain executor of `core.guard.GuardMachine`: Envoy's messages become events (the machine
reads the headers and the body, `core.guard.request_started` and `read_body`), each action
is a codec write (`WRITES`) or a port call (`ACTS`), and a port's answer is fed back as the
next event. The request's journal record is `request_record`'s (the intake in flight,
`IntakeRun`, and the intake flow's actions), the released attempt `released`'s, the tool
route `tools`'s, the timers a `timers.TimerSet`; logs, spans and metrics are
`observer.guard`'s.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry.trace import Span

from ..core import events as E
from ..core import guard as G
from ..core import headers as H
from ..core.guard import GuardMachine
from ..core.intake import Generation, Prepared, StatusLookup, ToolCall, Verdict
from ..core.journal import Rerun
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from . import request_record as R
from .ports import GuardPorts, credential
from .released import Released
from .session import INVALID, Messages, Session
from .timers import TimerSet
from .tools import ToolCallHandler

# Response headers that never reach a client: the gate's hand-off, and an attempt's secret
# (a replica could echo it back; decision 0028).
NEVER_TO_CLIENT = (H.HANDOFF, H.ATTEMPT_SECRET)


class GuardSession(Session):
    TIMED = "response_body"
    __slots__ = ("_tx", "body", "envoy_request_id", "first_delta_evented", "gen", "intake", "m",
                 "released", "secret1", "timers", "tool", "tools_listener", "verdict")

    def __init__(self, proc: GuardPorts, ctx: Messages, tools: bool = False) -> None:
        self.detach, self.closed, self.p, self.cfg, self.ctx = False, False, proc, proc.cfg, ctx
        # The role of the stream's filter: False, the client listener (role `guard`), which
        # never serves the tool route; True, the tool listener (role `tools`), which serves
        # only it (decision 0028).
        self.tools_listener = tools
        self.lock = asyncio.Lock()
        self.m: GuardMachine | None = None
        self.rid: str | None = None
        self.verdict: Verdict | None = None  # what core.intake read from the headers
        self.gen: Generation | None = None
        self.intake: Prepared | None = None  # the body, the route, the record, attempt 1
        self.timers = TimerSet(proc.timers, proc.clock, self.fired)
        self.tool: ToolCallHandler | None = None
        self._tx: R.IntakeRun | None = None  # the intake transaction (decision 0021)
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.first_delta_evented = False
        self.envoy_request_id: str | None = None
        # Attempt 1's secret until the body answer carries it to its gate (never logged).
        self.secret1: str | None = None
        self.released: Released | None = None  # the attempt the gate handed over
        self.body = b""  # the request body until a row reads it (ReadBody)

    @property
    def aid1(self) -> str:
        return str(self.intake.first["attempt_id"]) if self.intake is not None else ""

    @property
    def rerun(self) -> Rerun | None:
        """A repeat that runs again (decision 0027), as its intake re-opened it."""
        return self._tx.rerun if self._tx is not None else None

    # --- Envoy's messages -> events ---------------------------------------------------

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        if self.tool is not None and which in TOOL_MESSAGES:
            return await self.tool.on_message(which, msg)
        if which == "response_body":  # the hot path, read here: one call less per chunk
            # With the chunk, the released attempt's lease port's answer.
            body, r = msg.response_body, self.released
            return await self.feed(E.ResponseBody(body.body, body.end_of_stream,
                                                  r is not None and r.expired()))
        await _READS[which](self, msg)

    async def on_request_headers(self, msg: ep.ProcessingRequest) -> None:
        h = msg.request_headers
        got = G.request_started(codec.headers_dict(h.headers), h.end_of_stream, self.cfg,
                                self.tools_listener, self.p.ids.request_id,
                                self.p.trace_budget())
        self.m, self.verdict, self.gen = got.machine, got.verdict, got.generation
        self.envoy_request_id = got.envoy_request_id
        if self.gen is not None:
            self.rid = self.gen.request_id
        await self.feed(got.event)

    async def on_closed(self) -> None:
        self.timers.stop()
        p, rid = self.p, self.rid
        if rid is not None and self.intake is not None and self.tool is None:
            # The request is over, and with it its re-prefills (the released one too).
            p.budget.request_ended(rid, self.aid1)
        late = self._tx.closed() if self._tx is not None else None
        if self.released is not None:
            self.released.stop_watching()
        if self.m is not None:
            p.spawn(self.locked(E.StreamClosed()), f"guard-close-{rid}")
        if late is not None:  # closed while the intake was in flight: its answer still counts
            p.spawn(self.answered(late), f"guard-opened-{rid}")
        if self.tool is not None:
            p.spawn(self.tool.on_closed(), f"tool-close-{rid}")

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: E.Event) -> None:
        assert self.m is not None
        actions = self.m.handle(ev)
        observer.guard(self, ev, actions)
        # The outcome is recorded first, in its own task: once our terminal event is
        # written Envoy may close this stream and cancel us mid-await (found by the sweep).
        for a in actions:
            if isinstance(a, E.Finish):
                self.p.spawn(self.record(a), f"guard-finish-{self.rid}")
        for a in actions:
            if (w := WRITES.get(type(a))) is not None:
                await self.write(w(self, a))
            elif (do := ACTS.get(type(a))) is not None and (c := do(self, a)) is not None:
                await c

    @property
    def tx(self) -> R.IntakeRun:
        """The intake in flight (every intake action has one)."""
        assert self._tx is not None
        return self._tx

    async def feed_from(self, answer: Awaitable[E.Event]) -> None:
        """A port's answer that the row waits for, fed as the next event."""
        await self.feed(await answer)

    async def locked(self, ev: E.Event, while_open: bool = False) -> None:
        """An event from outside Envoy's message order (a port's answer, a timer)."""
        async with self.lock:
            if self.m is not None and not (while_open and self.closed):
                await self.feed(ev)

    def fired(self, kind: E.TimerKind) -> None:
        now = self.p.clock
        self.p.spawn(self.locked(E.TimerFired(kind, now.monotonic(), now.wall()),
                                 while_open=True), f"guard-timer-{self.rid}")

    # --- actions -> codec writes and port calls ---------------------------------------

    async def send(self, a: E.Send) -> None:
        if a.data or a.end_of_stream:
            await self.write(codec.streamed_response_body(a.data, a.end_of_stream))

    async def read_body(self, a: E.ReadBody) -> None:
        p, body, self.body = self.p, self.body, b""
        assert self.gen is not None and self.m is not None
        self.intake, ev = G.read_body(
            self.m, body, self.cfg, self.gen, self.envoy_request_id, pool=p.pool,
            order_hosts=p.host_order, new_attempt_id=p.ids.attempt_id, wall=p.clock.wall(),
            tokenizers=p.tokenizers)
        if self.intake is not None:
            # Attempt 1's credential (decision 0028): its digest is recorded with it, the
            # secret goes to its gate (and on to its replica) in the body answer.
            self.secret1, cred = credential(p.ids)
            self._tx = R.IntakeRun(p, self.gen, self.intake, cred, self.envoy_request_id)
        # The intake's order (open, register, answer the body, wait) is the machine's rows.
        await self.feed(ev)

    async def look_up_status(self, a: E.LookUpStatus) -> None:
        assert isinstance(self.verdict, StatusLookup)
        await self.feed(await R.read_status(self.p, self.verdict))

    async def start_tool_call(self, a: E.StartToolCall) -> None:
        assert isinstance(self.verdict, ToolCall)
        self.tool = ToolCallHandler.over(self.p, self.write)
        await self.tool.on_request_headers(dict(self.verdict.headers))
        self.rid = self.tool.rid

    async def answer_body(self, a: E.AnswerBody) -> None:
        assert self.intake is not None
        secret, self.secret1 = self.secret1, None  # kept no longer than this answer
        set_headers, lb = G.body_answer(self.intake, secret=secret, rerun=self.rerun,
                                        traceparent=self.p.tel.traceparent(self.span))
        await self.write(codec.continue_request_body_with(set_headers, lb,
                                                          self.intake.meta.upstream_body))

    def accepted(self, a: E.Accepted) -> None:
        # In flight for the retry budget until this stream ends (on_closed).
        self.p.budget.request_started(self.rid or "", self.p.clock.monotonic(), self.aid1)

    def take_over(self, a: E.TakeOver) -> None:
        if a.handoff is not None:  # unreadable: the observer says so, nothing to own
            self.released = Released.take_over(self.p, self.rid or "", a.handoff, self.fenced)

    def fenced(self) -> None:
        """The released attempt's `live` key was revoked or replaced: the machine says it."""
        self.p.spawn(self.locked(E.Fenced("revoked or replaced"), while_open=True),
                     f"guard-fenced-{self.rid}")

    def lose_lease(self, a: E.LoseLease) -> None:
        if self.released is not None:
            self.released.lose(a.why)

    def write_progress(self, a: E.WriteProgress) -> None:
        self.p.spawn(self.progress(a.delivered), f"guard-progress-{self.rid}")

    async def await_cause(self, a: E.AwaitCause) -> None:
        # Why it ended, and how much of the body Envoy sent the client (decision 0025).
        got = await self.p.causes.wait_sent(self.rid or "", self.cfg.timeouts.access_log_wait_s)
        await self.feed(E.CauseLearned("unknown", None) if got is None
                        else E.CauseLearned(got[0], got[1]))

    # --- the work that outlives a message ---------------------------------------------

    async def answered(self, answer: Awaitable[E.Event]) -> None:
        await self.locked(await answer)

    async def progress(self, n: int) -> None:
        await R.write_progress(self.p, self.rid or "", n)
        await self.locked(E.ProgressWritten())

    async def record(self, f: E.Finish) -> None:
        rid, r = self.rid, self.released
        if rid is None:
            return
        if r is not None:
            r.stop_watching()  # our own finish deletes `live`: no revocation to react to
        await self.locked(E.RecordWritten(await R.write_outcome(self.p, rid, f, self.m, r)))


def _headers_answer(s: GuardSession, a: E.PassHeaders) -> ep.ProcessingResponse:
    if a.as_json:  # our error's shape, as JSON
        return codec.continue_response_headers(
            {H.REQUEST_ID: s.rid or "", "content-type": "application/json"},
            remove=("content-length", *NEVER_TO_CLIENT))
    return codec.continue_response_headers({H.REQUEST_ID: s.rid or ""}, remove=NEVER_TO_CLIENT)


def _body(s: GuardSession, msg: ep.ProcessingRequest) -> Awaitable[None]:
    s.body = msg.request_body.body  # read only if a row says ReadBody
    return s.feed(E.RequestBody())


# What the tool route's handler reads once it runs; Envoy's other messages -> events, or
# a write.
TOOL_MESSAGES = ("request_body", "response_headers", "response_body")
_READS: dict[str, Callable[[GuardSession, ep.ProcessingRequest], Awaitable[None]]] = {
    "response_headers": lambda s, msg: s.feed(codec.response_headers(msg)),
    "request_headers": GuardSession.on_request_headers,
    "request_body": _body,
    "response_trailers": lambda s, msg: s.write(codec.trailers_response()),
    "request_trailers": lambda s, msg: s.write(codec.request_trailers_response()),
}

# The actions that are one codec write: the message each one writes.
WRITES: dict[type, Callable[[GuardSession, Any], ep.ProcessingResponse]] = {
    E.PassBody: lambda s, a: codec.continue_request_body(),
    E.AnswerHeaders: lambda s, a: codec.continue_request_headers(
        {H.REQUEST_ID: s.rid or ""}, remove=tuple(h for h in H.OWNED if h != H.REQUEST_ID)),
    E.PassRequest: lambda s, a: codec.continue_request_headers(remove=H.OWNED),
    E.AnswerStatus: lambda s, a: codec.immediate_json(
        200, json.dumps(a.view.to_dict(), separators=(",", ":")).encode(),
        {H.REQUEST_ID: a.view.request_id}),
    E.PassAside: lambda s, a: codec.continue_response_headers(remove=NEVER_TO_CLIENT),
    E.PassHeaders: _headers_answer,
    E.Refuse: lambda s, a: codec.immediate(a.error, {H.REQUEST_ID: s.rid} if s.rid else None),
}

_Do = Callable[[GuardSession, Any], "Awaitable[None] | None"]
# The other actions' executors: a port call, whose answer (if it waits) is the next event.
# Finish is spawned first by `feed`; IntakeFailed is the observer's alone (the gate gives
# the client its error; nothing ran).
ACTS: dict[type, _Do] = {
    E.Send: GuardSession.send, E.StartTimer: lambda s, a: s.timers.start(a.kind, a.seconds),
    E.StopTimers: lambda s, a: s.timers.stop(), E.LookUpStatus: GuardSession.look_up_status,
    E.StartToolCall: GuardSession.start_tool_call,
    E.OpenIntake: lambda s, a: s.tx.open(),
    E.RegisterIntake: lambda s, a: s.tx.register(),
    E.AnswerBody: GuardSession.answer_body,
    E.AwaitIntake: lambda s, a: s.feed_from(s.tx.opened()),
    E.Accepted: GuardSession.accepted,
    E.TakeOver: GuardSession.take_over, E.LoseLease: GuardSession.lose_lease,
    E.WriteProgress: GuardSession.write_progress, E.AwaitCause: GuardSession.await_cause,
    E.ReadBody: GuardSession.read_body,
}
