"""The guard: the downstream ext_proc stream that owns a logical request.

A plain executor of `core.guard.GuardMachine`, so that every decision, the order of its
waits and its close included, is a row `extproc replay` and the property tests see: Envoy's
messages become events, each action a codec write (`WRITES`) or a port call (`ACTS`) whose
answer is the next event. The ports: `request_record` (the intake, the record), `released`,
`tools`, `causes`; logs, spans and metrics are `observer.guard`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from ..core import events as E
from ..core import guard as G
from ..core import headers as H
from ..core.guard import GuardMachine
from ..core.intake import Generation, Prepared, ToolCall, Verdict
from ..core.journal import Rerun
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from . import request_record as R
from .ports import GuardPorts, credential
from .released import Released
from .session import Messages, Session
from .tools import ToolCallHandler

_STALL = E.TimerKind.STALL  # a module global: an enum member read costs more (decision 0041)


class Kept:
    """What an accepted request's stream reads of its intake after the body's answer: the
    observer's model, stream flag, fingerprint and start, and attempt 1's id (the retry
    budget's). The intake's `Prepared` (record, attempt 1, parsed body, hosts) is let go
    once the body is answered and the intake wrote it (decision 0055)."""

    __slots__ = ("aid1", "created_at", "fingerprint", "model", "stream")

    def __init__(self, prep: Prepared) -> None:
        meta, route = prep.meta, prep.route
        # The model's name interned: one string per name for every open stream, not the
        # parsed body's copy each (a name no stream holds any more is freed as before).
        self.model = None if meta.model is None else sys.intern(meta.model)
        self.stream = meta.stream
        self.fingerprint = route[0] if route else None
        self.created_at = float(prep.record["created_at"])
        self.aid1 = str(prep.first["attempt_id"])


class GuardSession(Session):
    TIMED, ROLE = "response_body", "guard"
    __slots__ = ("_tx", "body", "envoy_request_id", "first_delta_evented", "gen", "intake", "kept",
                 "m", "released", "secret1", "tool", "tools_listener", "verdict")

    def __init__(self, proc: GuardPorts, ctx: Messages, tools: bool = False) -> None:
        super().__init__(proc, ctx, proc.spawn)
        self.cfg = proc.cfg
        # False: the client listener (role `guard`), never the tool route; True: the tool
        # listener (role `tools`), only the tool route (decision 0028).
        self.tools_listener = tools
        self.m: GuardMachine | None = None
        self.verdict: Verdict | None = None  # what core.intake read from the headers
        self.gen: Generation | None = None
        # The body, the route, the record, attempt 1: until the body's answer carried them.
        self.intake: Prepared | None = None
        self.kept: Kept | None = None  # what is read of them later (an accepted body's)
        self.tool: ToolCallHandler | None = None
        self._tx: R.IntakeRun | None = None  # the intake transaction (decision 0021)
        self.first_delta_evented = False
        self.envoy_request_id: str | None = None
        # Attempt 1's secret until the body answer carries it to its gate (never logged).
        self.secret1: str | None = None
        self.released: Released | None = None  # the attempt the gate handed over
        self.body = b""  # the request body until a row reads it (ReadBody)

    @property
    def aid1(self) -> str:
        return self.kept.aid1 if self.kept is not None else ""

    @property
    def rerun(self) -> Rerun | None:
        """A repeat that runs again (decision 0027), as its intake re-opened it."""
        return self._tx.rerun if self._tx is not None else None

    # --- Envoy's messages -> events ---------------------------------------------------

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        if self.tool is not None and which in TOOL_MESSAGES:
            return await self.tool.on_message(which, msg)
        if which == "response_body":  # the hot path, read here: one call less per chunk
            r = self.released
            return await self.feed(codec.response_body(msg, r is not None and r.expired()))
        await _READS[which](self, msg)

    FAST = "response_body"

    def fast(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        """The common chunk by the core's fast path (core.guard.streaming_chunk), the row's
        Send as the answer, its StartTimer `fast_done` (the observer is done by then)."""
        m = self.m
        if m is None or not self.first_delta_evented or self.tool is not None:
            return None
        r, body = self.released, msg.response_body
        out = G.streaming_chunk(m, body.body, body.end_of_stream,
                                r is not None and r.expired())
        return None if out is None else codec.streamed_response_body(out, False)

    def fast_done(self) -> None:
        assert self.m is not None
        self.timers.start(_STALL, self.m.stall_after_first_delta_s)

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
        if self.m is not None:  # what the close stops, closes and ends: its rows' actions
            self.later(E.StreamClosed(), f"guard-close-{self.rid}")

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: E.Event) -> None:
        """An action's answer is fed at once, before the batch's next action."""
        assert self.m is not None
        actions = self.m.handle(ev)
        observer.guard(self, ev, actions)
        for a in actions:
            if (c := self.act(a)) is not None and (nxt := await c) is not None:
                await self.feed(nxt)

    # --- actions -> codec writes and port calls ---------------------------------------

    async def read_body(self, a: E.ReadBody) -> E.Event:
        p, body, self.body = self.p, self.body, b""
        assert self.gen is not None and self.m is not None
        self.intake, ev = G.read_body(
            self.m, body, self.cfg, self.gen, self.envoy_request_id, pool=p.pool,
            order_hosts=p.host_order, new_attempt_id=p.ids.attempt_id, wall=p.clock.wall(),
            tokenizers=p.tokenizers)
        if self.intake is not None:
            self.kept = Kept(self.intake)
            # Attempt 1's credential (decision 0028): its digest is recorded with it, the
            # secret goes to its gate (and on to its replica) in the body answer.
            self.secret1, cred = credential(p.ids)
            self._tx = R.IntakeRun(p, self.gen, self.intake, cred, self.envoy_request_id)
        # The intake's order (open, register, answer the body, wait) is the machine's rows.
        return ev

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
        G.body_answered(self.intake)
        # Read no more here: the intake's run holds its own until it wrote them (decision
        # 0055), the observer and the budget read `kept`.
        self.intake = None

    def fenced(self) -> None:
        """The released attempt's `live` key was revoked or replaced: the machine says it."""
        self.later(E.Fenced("revoked or replaced"), f"guard-fenced-{self.rid}", open_only=True)

    def close_tool(self, a: E.CloseTool) -> None:
        assert self.tool is not None  # started by the row's StartToolCall
        self.spawn(self.tool.on_closed(), f"tool-close-{self.rid}")

    async def await_cause(self, a: E.AwaitCause) -> E.Event:
        # Why it ended, and how much of the body Envoy sent the client (decision 0025).
        heard = await self.p.causes.wait(self.rid or "", self.cfg.timeouts.access_log_wait_s)
        return G.word(heard)


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
GuardSession.WRITES = {
    E.PassBody: lambda s, a: codec.continue_request_body(),
    E.AnswerHeaders: lambda s, a: codec.client_request_headers(s.rid or ""),
    E.PassRequest: lambda s, a: codec.passed_request_headers(),
    E.AnswerStatus: lambda s, a: codec.status_answer(a.view.to_dict(), a.view.request_id),
    E.PassAside: lambda s, a: codec.aside_response_headers(),
    E.PassHeaders: lambda s, a: codec.client_response_headers(s.rid or "", a.as_json),
    E.Refuse: lambda s, a: codec.immediate(a.error, {H.REQUEST_ID: s.rid} if s.rid else None),
    E.Send: lambda s, a: codec.streamed_response_body(a.data, a.end_of_stream),
}

# The other actions' executors: a port call, whose answer (if it waits) is the next event.
# IntakeFailed (its gate answers; nothing ran) and UnreadableHandOff (nothing to own) are
# the observer's alone. Every intake action has its IntakeRun (`_tx`): ReadBody made it.
GuardSession.ACTS = {
    **Session.TIMER_ACTS,
    E.LookUpStatus: lambda s, a: R.read_status(s.p, s.verdict),  # a StatusLookup's
    E.StartToolCall: GuardSession.start_tool_call,
    E.OpenIntake: lambda s, a: s._tx.open(), E.RegisterIntake: lambda s, a: s._tx.register(),
    E.AnswerBody: GuardSession.answer_body, E.AwaitIntake: lambda s, a: s._tx.opened(),
    # In flight for the retry budget from its acceptance until the stream's end.
    E.Accepted: lambda s, a: s.p.budget.request_started(s.rid or "", s.p.clock.monotonic(),
                                                        s.aid1),
    E.RequestEnded: lambda s, a: s.p.budget.request_ended(s.rid or "", s.aid1),
    E.TakeOver: lambda s, a: setattr(s, "released", Released.take_over(
        s.p, s.rid or "", a.handoff, s.fenced)),
    E.LoseLease: lambda s, a: s.released.lose(a.why) if s.released is not None else None,
    # The close's (each after what the rows put before it).
    E.StopWatching: lambda s, a: s.released.stop_watching() if s.released is not None else None,
    E.CloseIntake: lambda s, a: s._tx.close(),
    E.AwaitLateIntake: lambda s, a: s.later(s._tx.late(), f"guard-opened-{s.rid}"),
    E.CloseTool: GuardSession.close_tool,
    E.WriteProgress: lambda s, a: s.later(R.write_progress(s.p, s.rid or "", a.delivered),
                                          f"guard-progress-{s.rid}"),
    E.AwaitCause: GuardSession.await_cause, E.ReadBody: GuardSession.read_body,
    # Its own task (the rows put it before the batch's bytes): it outlives the stream.
    E.Finish: lambda s, a: s.later(R.write_outcome(s.p, s.rid or "", a, s.m, s.released),
                                   f"guard-finish-{s.rid}"),
}
