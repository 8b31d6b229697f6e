"""The gate's session: the upstream ext_proc stream of one attempt, a plain executor.

Every decision and every wait of the attempt (the intake, the admission, a write sent
again, the hold, the fence, the release or failure, the close and the end) is a row of
`core.gate.GateMachine`, so `extproc replay` and the property tests see them all: Envoy's
messages become its events, its actions codec writes (`WRITES`) or port calls (`ACTS`:
`attempt_record`, `agent_link`, `causes`) whose answers are fed back, at once or later
under the stream's lock. Logs, spans and metrics are `observer.gate`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..core import events as E
from ..core import headers as H
from ..core.gate import GateMachine, admission_decided, request_started, word
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from .agent_link import AgentLink
from .attempt_record import AttemptRecord
from .leases import AttemptLease
from .ports import GatePorts
from .processor import HandedOff
from .session import INVALID, Messages, Session
from .telemetry import TRACEPARENT_HEADER

# Test-only: proves the fault sweep can fail (docs/sweep.md). Logged loudly at start-up.
UNSAFE_RELEASE_WITHOUT_FENCE = os.environ.get("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE") == "1"


class GateSession(Session):
    __slots__ = ("agent", "m", "parent_tp", "rec", "replica")
    ROLE = "gate"

    def __init__(self, proc: GatePorts, ctx: Messages) -> None:
        super().__init__(proc, ctx, proc.work.spawn)
        self.m: GateMachine | None = None
        self.replica: str | None = None
        self.parent_tp: str | None = None
        self.rec: AttemptRecord | None = None  # the attempt's journal calls, its lease
        self.agent: AgentLink | None = None  # an agent-fronted replica's (decision 0034)

    @property
    def aid(self) -> str:
        return self.m.attempt_id if self.m is not None else ""

    @property
    def lease(self) -> AttemptLease | None:
        return self.rec.lease if self.rec is not None else None

    @property
    def record(self) -> AttemptRecord:
        """The record port of a gated attempt (every action has one)."""
        assert self.rec is not None
        return self.rec

    @property
    def machine(self) -> GateMachine:
        assert self.m is not None
        return self.m

    # --- Envoy's messages -> events ---------------------------------------------------

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        if which == "request_headers":
            return await self.started(msg)
        if which == "response_headers" and UNSAFE_RELEASE_WITHOUT_FENCE and self.m is not None:
            # Test-only sabotage (docs/sweep.md): release at once, no hold, no fence.
            # The fault sweep must catch what this breaks; never set it in production.
            # Without a machine no close row runs: what would feed it stops here.
            self.m = None
            self.timers.stop()
            self.stop_watching(E.StopWatching())
        read = _EVENTS.get(which)
        if self.m is None or self.rec is None or read is None:  # not gated, or not an event
            return await self.write(codec.passed_by_gate(which))
        await self.feed(read(self.rec, msg))

    async def started(self, msg: ep.ProcessingRequest) -> None:
        (hd, self.replica), clock = codec.attempt_request(msg), self.p.clock
        self.parent_tp = hd.get(TRACEPARENT_HEADER)
        got = request_started(hd, self.replica, self.p.ids.attempt_id, clock.monotonic(),
                              clock.wall())
        if got is None:  # not a journaled request (e.g. /v1/models): nothing to gate
            return await self.write(codec.continue_request_headers())
        (ev, secret), self.rid = got, hd[H.REQUEST_ID]
        self.m = GateMachine.new(self.rid, params=self.p.gate_params)
        self.rec = AttemptRecord(self.p, self.rid, ev.attempt_id, secret)
        await self.feed(ev)

    async def on_closed(self) -> None:
        if self.m is not None:
            # What the close stops and how the attempt ends (a revoke, Envoy's word, the
            # record) are its rows'; that end outlives the stream's handler.
            self.later(lambda c: E.StreamClosed(c.monotonic(), c.wall()), f"gate-end-{self.aid}")

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: E.Event) -> None:
        """The actions' answers are fed in the order they came, after the whole batch."""
        m = self.m
        assert m is not None
        queue = [ev]
        while queue:
            e = queue.pop(0)
            before = m.state
            actions = m.handle(e)
            observer.gate(self, before, e, actions)
            for a in actions:
                if (c := self.act(a)) is not None and (nxt := await c) is not None:
                    queue.append(nxt)

    # --- actions -> port calls --------------------------------------------------------

    async def decide(self, a: E.Decide) -> E.Event:
        return admission_decided(self.p.decide(a.request, self.p.clock.monotonic()))

    async def go_upstream(self, a: E.ContinueRequest) -> None:
        self.p.reached.mark(self.rid or "")
        # A replica's agent addresses its word to this process's watch by its instance id.
        await self.write(codec.attempt_upstream(
            self.aid, self.record.secret, self.p.instance_id if a.agent else None))

    def link(self) -> AgentLink:
        if self.agent is None:  # a cancel for an attempt that never listened (its admission)
            self.agent = AgentLink(self.p, self.rid or "", self.aid)
        return self.agent

    def watch_source(self, a: E.WatchSource) -> None:
        self.link().listen(lambda at: self.later(
            lambda c: E.SourceSent(at, c.monotonic()), f"gate-source-{self.aid}", open_only=True))

    async def fail(self, a: E.FailAttempt) -> None:
        await self.write(codec.failed_attempt(self.rid or "", a.retry, str(a.error.code)))
        for i in range(a.held_chunks):
            await self.write(codec.replace_response_body(self.machine.error_body(a, i)))

    async def release(self, a: E.Release) -> None:
        # From here the guard owns the attempt: it sees the rest of the response, its end,
        # and writes the attempt's record with the request's outcome (one etcd txn).
        # Registered before the headers go out: the guard looks for it when they arrive.
        if self.agent is not None:
            self.agent.stop()
        ho, header = self.machine.hand_off(a, self.record.lease_id)
        self.p.handoffs.put(self.aid, HandedOff(self.span, ho))
        self.span = INVALID
        await self.write(codec.released(self.aid, header))
        for _ in range(a.held_chunks):
            await self.write(codec.continue_response_body())
        self.detach = a.hand_off

    def timed_out(self, a: E.MarkTimedOut) -> None:  # the health port's answer unused
        self.p.health.first_delta_timed_out(a.replica, self.p.clock.monotonic())

    def stop_watching(self, a: E.StopWatching) -> None:
        self.record.stop()
        if self.agent is not None:
            self.agent.stop()

    def await_cause(self, a: E.AwaitCause) -> None:
        self.p.causes.expect(a.attempt_id or self.aid, a.timeout_s or 0.0, lambda heard:
                             self.later(lambda c: word(heard, c.wall()), f"gate-word-{self.aid}"))


_Event = Callable[[AttemptRecord, ep.ProcessingRequest], E.Event]
# Envoy's messages that are events of a gated attempt; any other message passes.
_EVENTS: dict[str, _Event] = {
    "response_headers": lambda r, msg: codec.response_headers(msg),
    "response_body": lambda r, msg: codec.response_body(msg, r.expired()),
}

# The actions that are one codec write: the message each one writes.
GateSession.WRITES = {
    E.PassChunk: lambda s, a: codec.continue_response_body(),
    E.DropChunk: lambda s, a: codec.replace_response_body(b""),
    E.PassHeaders: lambda s, a: codec.attempt_headers(a.retry),
    E.Refuse: lambda s, a: codec.immediate(a.error, {H.REQUEST_ID: s.rid or ""}),
}

# The other actions' executors: a port call, whose answer (if it waits) is the next event.
# HoldChunk, MarkSlow and MarkPathLost have none (the observer says the last two).
GateSession.ACTS = {
    E.AwaitIntakeCommit: lambda s, a: s.p.intake_committed(s.rid or "", s.replica or ""),
    E.Decide: GateSession.decide,
    E.TakeLease: lambda s, a: s.record.confirmed(s.record.take_lease()),
    E.Admit: lambda s, a: s.record.confirmed(s.record.admit(
        a, lambda live: s.machine.never_started(live, s.p.causes.no_gate_ran))),
    E.Fence: lambda s, a: s.record.confirmed(s.record.fence(a)),
    E.ContinueRequest: GateSession.go_upstream,
    E.UndoAdmission: lambda s, a: s.record.undo_admission(a),
    E.GiveBack: lambda s, a: s.record.give_back(a),
    E.UndoFence: lambda s, a: s.record.undo_fence(a),
    E.Watch: lambda s, a: s.record.watch(
        lambda v: s.later(E.LiveChanged(v), f"gate-watch-{s.aid}")),
    E.WatchSource: GateSession.watch_source,
    E.PutCancel: lambda s, a: s.link().put_cancel(s.machine.params.gateway_id,
                                                  float(s.machine.params.lease_ttl_s)),
    E.AwaitAck: lambda s, a: s.link().await_ack(a),
    E.AckSettled: lambda s, a: s.link().settled(a),
    E.LoseLease: lambda s, a: s.record.lose(a.why),
    E.StopWatching: GateSession.stop_watching,
    **Session.TIMER_ACTS,
    E.Overloaded: lambda s, a: s.p.health.overloaded(
        s.replica or "", s.p.clock.monotonic() + a.seconds),
    E.Release: GateSession.release, E.FailAttempt: GateSession.fail,
    E.RetryEnded: lambda s, a: s.p.budget.retry_ended(s.aid),
    E.RevokeEarly: lambda s, a: s.record.end_early(a), E.AwaitCause: GateSession.await_cause,
    E.MarkTimedOut: GateSession.timed_out,
    E.KeepTrace: lambda s, a: s.p.work.keep(s.rid or "", a.name, s.machine, dict(a.meta),
                                            a.completed),
    E.CloseAttempt: lambda s, a: s.record.close(a),
}

