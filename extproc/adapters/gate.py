"""The gate's session: the upstream ext_proc stream of one attempt, a plain executor.

Envoy's messages become events for `core.gate.GateMachine`; the actions it answers with
become codec writes and port calls, and what a port answers is fed back as the next event
(at once, or later under the stream's lock: a timer, the revocation watch, Envoy's word).
Every decision (wait for the intake, admit, send a write again, hold, fence, release, fail,
how the attempt ends) is a row of the machine's table; logs, spans and metrics come from
`observer.gate`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from opentelemetry.trace import Span

from ..core import events as E
from ..core import headers as H
from ..core.admission import RETRY_HEADER, decide
from ..core.budget import RetryBudget
from ..core.credentials import digest
from ..core.errors import GatewayError
from ..core.gate import (
    GateMachine,
    GateParams,
    clean,
    request_started,
    response_started,
    word,
)
from ..core.handoff import HandOff
from ..core.health import HostHealth
from ..core.pool import Pool
from ..core.replay import snapshot
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from .agent_link import AgentLink
from .leases import UNDO_SETTLE_S, AttemptLease, StoreUnavailable
from .ports import Clock, EntryLog, GateJournal, Ids
from .session import INVALID, HandedOff, Messages, Pending, Reached, Session, retrying
from .telemetry import TRACEPARENT_HEADER, Telemetry
from .timers import Timers, TimerSet

# Test-only: proves the fault sweep can fail (docs/sweep.md). Logged loudly at start-up.
UNSAFE_RELEASE_WITHOUT_FENCE = os.environ.get("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE") == "1"


class Work(Protocol):
    """Work that outlives the stream's handler, and the attempt's trace kept or not."""

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    def keep(self, rid: str, name: str, m: GateMachine, meta: dict[str, Any],
             clean: bool) -> None: ...


class GatePorts(Protocol):
    """What one attempt's gate needs from its process, declared here by its consumer (14
    read-only members): the rows' parameters, the clock, ids and timers, the journal calls
    of an attempt, Envoy's entries, the pool's view, its health, the retry budget, the
    count of attempts that reached a replica, the intake in flight and the hand-off (the
    request's other stream), telemetry, background work. `session.Processor` provides it."""

    @property
    def gate_params(self) -> GateParams: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def ids(self) -> Ids: ...
    @property
    def timers(self) -> Timers: ...
    @property
    def journal(self) -> GateJournal: ...
    @property
    def causes(self) -> EntryLog: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def health(self) -> HostHealth: ...
    @property
    def budget(self) -> RetryBudget: ...
    @property
    def reached(self) -> Reached: ...
    @property
    def intakes(self) -> Pending[asyncio.Future[GatewayError | None]]: ...
    @property
    def handoffs(self) -> Pending[HandedOff]: ...
    @property
    def tel(self) -> Telemetry: ...
    @property
    def work(self) -> Work: ...
    @property
    def instance_id(self) -> str: ...


class GateSession(Session):
    __slots__ = ("_unwatch", "agent", "lease", "m", "parent_tp", "replica", "secret",
                 "timers")

    def __init__(self, proc: GatePorts, ctx: Messages) -> None:
        self.detach = False
        self.p: GatePorts = proc
        self.ctx = ctx
        self.m: GateMachine | None = None
        self.rid: str | None = None
        self.replica: str | None = None
        self.lease: AttemptLease | None = None
        # This attempt's credential (decision 0028): attempt 1's from the guard, any other's
        # minted at its admission. Sent upstream only; never logged, traced or handed off.
        self.secret: str | None = None
        self.timers = TimerSet(proc.timers, proc.clock, self._fired)
        self._unwatch: Callable[[], None] | None = None
        self.agent: AgentLink | None = None  # an agent-fronted replica's (decision 0034)
        self.closed = False
        self.lock = asyncio.Lock()
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.parent_tp: str | None = None

    # --- Envoy's messages -> events ---------------------------------------------------

    async def on_message(self, msg: ep.ProcessingRequest) -> None:
        which = msg.WhichOneof("request")
        if which == "request_headers":
            hd = codec.headers_dict(msg.request_headers.headers)
            self.replica = str(codec.attributes(msg).get("upstream.address") or "") or None
            self.parent_tp = hd.get(TRACEPARENT_HEADER)
            clock = self.p.clock
            got = request_started(hd, self.replica, self.p.ids.attempt_id, clock.monotonic(),
                                  clock.wall())
            if got is None:  # not a journaled request (e.g. /v1/models): nothing to gate
                await self.write(codec.continue_request_headers())
                return
            ev, self.secret = got
            self.rid = hd[H.REQUEST_ID]
            self.m = GateMachine.new(self.rid, params=self.p.gate_params)
            await self.feed(ev)
        elif which == "response_headers":
            if self.m is not None and UNSAFE_RELEASE_WITHOUT_FENCE:
                # Test-only sabotage (docs/sweep.md): release at once, no hold, no fence.
                # The fault sweep must catch what this breaks; never set it in production.
                self.m = None
            if self.m is None:
                await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
                return
            await self.feed(response_started(codec.headers_dict(msg.response_headers.headers),
                                             msg.response_headers.end_of_stream))
        elif which == "response_body":
            if self.m is None:
                await self.write(codec.continue_response_body())
                return
            lease = self.lease
            if lease is not None and not lease.valid() and not self.m.lease_lost:
                lease.lose("expired locally")  # the port's answer: its local expiry
                await self.feed(E.LeaseLost())
            await self.feed(E.ResponseBody(msg.response_body.body,
                                           msg.response_body.end_of_stream))
        elif which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_trailers":
            await self.write(codec.trailers_response())
        elif which == "request_trailers":
            await self.write(codec.request_trailers_response())

    async def on_closed(self) -> None:
        self.timers.stop()
        if self.agent is not None:
            self.agent.stop()
        if self._unwatch is not None:
            self._unwatch()
        if self.m is not None:
            # Its end (a revoke, Envoy's word, the record) outlives the stream's handler.
            self.later(lambda c: E.StreamClosed(c.monotonic(), c.wall()), "end")

    def later(self, event: Callable[[Clock], E.Event], what: str, open_only: bool = False
              ) -> None:
        """A port's answer that comes on its own (a timer, the watch, Envoy's word, the
        stream's end): fed in turn, under the stream's lock, with the clock's times then."""
        async def fire() -> None:
            async with self.lock:
                if self.m is not None and not (open_only and self.closed):
                    await self.feed(event(self.p.clock))
        self.p.work.spawn(fire(), f"gate-{what}-{self.m.attempt_id if self.m else ''}")

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: E.Event) -> None:
        m = self.m
        assert m is not None
        queue = [ev]
        while queue:
            e = queue.pop(0)
            before = m.state
            actions = m.handle(e)
            observer.gate(self, before, e, actions)
            for a in actions:
                nxt = await self.act(a, m)
                if nxt is not None:
                    queue.append(nxt)

    async def act(self, a: E.Action, m: GateMachine) -> E.Event | None:
        rid, aid, p, now = self.rid or "", m.attempt_id, self.p, self.p.clock
        if isinstance(a, E.PassChunk):
            await self.write(codec.continue_response_body())
        elif isinstance(a, E.DropChunk):
            await self.write(codec.replace_response_body(b""))
        elif isinstance(a, E.PassHeaders):
            # Only the gate may say which attempt the guard owns, never the replica.
            await self.write(codec.continue_response_headers(
                {RETRY_HEADER: "1"} if a.retry else {}, remove=(H.HANDOFF,)))
        elif isinstance(a, E.AwaitIntakeCommit):
            opening = p.intakes.get(rid)
            err = await asyncio.shield(opening) if opening is not None else None
            return E.IntakeCommitted(err, p.reached.get(rid, 0),
                                     p.pool.fingerprint_of(self.replica or ""),
                                     p.pool.enabled, now.wall(),
                                     p.pool.agent_of(self.replica or ""))
        elif isinstance(a, E.Decide):
            verdict = decide(a.request, p.budget, now.monotonic())
            if isinstance(verdict, GatewayError):
                return E.AdmissionDecided(error=verdict)
            return E.AdmissionDecided(admitted=verdict)
        elif isinstance(a, E.TakeLease | E.Admit | E.Fence):
            return await self._write(a, m)
        elif isinstance(a, E.UndoAdmission):
            n = a.attempt
            self._settle(lambda: p.journal.undo_admission(rid, n, aid),
                         "undo an unconfirmed admission", "undo-admit", UNDO_SETTLE_S)
        elif isinstance(a, E.GiveBack):
            n, rec = a.attempt, a.record
            self._settle(lambda: p.journal.end_attempt(rid, n, aid, rec, False),
                         "give back a refused attempt", "refused")
        elif isinstance(a, E.Watch):
            self._unwatch = p.journal.on_live_change(
                rid, lambda v: self.later(lambda _: E.LiveChanged(v), "watch"), aid)
        elif isinstance(a, E.WatchSource):
            self.agent = AgentLink(p, rid, aid)
            self.agent.listen(lambda at: self.later(
                lambda c: E.SourceSent(at, c.monotonic()), "source", open_only=True))
        elif isinstance(a, E.PutCancel):
            self._link().put_cancel(m.params.gateway_id, float(m.params.lease_ttl_s))
        elif isinstance(a, E.AwaitAck):
            return await self._link().await_ack(a)
        elif isinstance(a, E.AckSettled):
            await self._link().settled(a, m, self.replica)
        elif isinstance(a, E.LoseLease):
            if self.lease is not None and self.lease.lose(a.why):  # said once, by its owner
                observer.gate_fenced(self, a.live)
        elif isinstance(a, E.StartTimer):
            self.timers.start(a.kind, a.seconds)
        elif isinstance(a, E.StopTimers):
            self.timers.stop()
        elif isinstance(a, E.ContinueRequest):
            p.reached.mark(rid)
            # The attempt offset stays: a removal here holds for Envoy's later attempts of
            # the request too, whose gates need it (decision 0027). The attempt's own secret
            # replaces whatever an earlier attempt's request carried.
            # A replica's agent addresses its word to this process's watch by its instance
            # id (decision 0034); a replica without one gets no such header.
            via = {H.PROCESSOR: p.instance_id} if m.agent else {}
            await self.write(codec.continue_request_headers(
                {H.ATTEMPT_ID: aid, H.ATTEMPT_SECRET: self.secret, **via} if self.secret else
                {H.ATTEMPT_ID: aid, **via},
                remove=(H.PREADMITTED,) if self.secret else (H.PREADMITTED, H.ATTEMPT_SECRET)))
        elif isinstance(a, E.Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid}))
        elif isinstance(a, E.Overloaded):  # only of an attempt with a replica
            p.health.overloaded(self.replica or "", now.monotonic() + a.seconds)
        elif isinstance(a, E.UndoFence):
            rec = a.facts.fence(now.wall())
            self._settle(lambda: p.journal.undo_fence(rid, rec), "undo an unconfirmed fence",
                         "undo-fence", UNDO_SETTLE_S)
        elif isinstance(a, E.Release):
            await self._release(a, m)
        elif isinstance(a, E.FailAttempt):
            await self.write(codec.fail_attempt_headers(
                rid, {RETRY_HEADER: "1"} if a.retry else {}, str(a.error.code)))
            for i in range(a.held_chunks):
                await self.write(codec.replace_response_body(
                    m.family.error_json(a.error) if i == 0 else b""))
        elif isinstance(a, E.RetryEnded):
            p.budget.retry_ended(aid)
        elif isinstance(a, E.RevokeEarly):
            if self.lease is not None:
                self.lease.lose("ended")
            n, rec = a.attempt, a.record
            return E.Revoked(await retrying(
                lambda: p.journal.end_attempt(rid, n, aid, rec, False),
                "fence the ended attempt", rid, aid))
        elif isinstance(a, E.AwaitCause):
            p.causes.expect(a.attempt_id or aid, a.timeout_s or 0.0,
                            lambda entry: self.later(lambda c: word(entry, c.wall()), "word"))
        elif isinstance(a, E.CloseAttempt):
            await self._close(a, m)
        return None  # HoldChunk, MarkSlow: nothing to carry out

    # --- the port calls that take more than a line ------------------------------------

    async def _write(self, a: E.TakeLease | E.Admit | E.Fence, m: GateMachine) -> E.Event:
        """One try of a conditioned write; not answered: NotConfirmed (the rows decide)."""
        rid, aid, p, sent = self.rid or "", m.attempt_id, self.p, self.p.clock.monotonic()
        try:
            if isinstance(a, E.TakeLease):
                self.lease = await p.journal.attempt_lease()
                return E.AdmitDecided(True, mono=p.clock.monotonic(), wall=p.clock.wall())
            if isinstance(a, E.Admit):
                # The admission makes it live with its own credential (decision 0028), the
                # same on every try: a try that applied unseen is found as this attempt's.
                self.secret = self.secret or p.ids.attempt_secret()
                res = await p.journal.admit_attempt(
                    rid, a.attempt, aid, a.record, a.fence_wait_s,
                    lambda live: m.never_started(live, p.causes.no_gate_ran),
                    first_attempt=a.first_attempt, credential=digest(self.secret))
                self.lease = res.lease
                return E.AdmitDecided(res.admitted, res.reason, res.waited_s,
                                      p.clock.monotonic(), p.clock.wall())
            if self.lease is None or not self.lease.valid() or a.facts is None:
                return E.FenceDecided(False)  # the lease's answer: no permission to fence
            return E.FenceDecided(await p.journal.fence_first_delta(
                rid, aid, a.facts.fence(p.clock.wall())))
        except StoreUnavailable as e:
            return E.NotConfirmed(str(e), sent, p.clock.monotonic(), p.clock.wall())

    async def _release(self, a: E.Release, m: GateMachine) -> None:
        # From here the guard owns the attempt: it sees the rest of the response, its end,
        # and writes the attempt's record with the request's outcome (one etcd txn).
        # Registered before the headers go out: the guard looks for it when they arrive.
        assert a.facts is not None
        if self.agent is not None:
            self.agent.stop()
        ho = HandOff.from_record(a.facts.base(), self.lease.lease_id if self.lease else 0,
                                 snapshot(m))
        self.p.handoffs.put(m.attempt_id, HandedOff(self.span, ho))
        self.span = INVALID
        await self.write(codec.continue_response_headers(
            {H.ATTEMPT_ID: m.attempt_id, H.HANDOFF: ho.header()}))
        for _ in range(a.held_chunks):
            await self.write(codec.continue_response_body())
        self.detach = a.hand_off

    async def _close(self, a: E.CloseAttempt, m: GateMachine) -> None:
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        if a.timed_out and self.replica:
            p.health.first_delta_timed_out(self.replica, p.clock.monotonic())
        if not a.ack_follows:  # else kept once the agent's acknowledgement is settled
            p.work.keep(rid, f"attempt-{a.attempt:03d}", m, {
                "attempt_id": aid, "replica": self.replica, "failure_class": a.failure_class,
                # The end plan's inputs and verdict: `extproc replay` decides it again.
                "end": dict(a.end_trace)}, clean(a))
        if self.lease is not None:
            self.lease.lose("ended")
        n, rec = a.attempt, a.record
        # etcd may be briefly away: retried for a bounded time, so the record does not
        # keep an attempt without its end (found by the fault sweep).
        if a.update_only:
            await retrying(lambda: p.journal.update_attempt(rid, n, rec),
                           "close the attempt record", rid, aid)
        else:
            await retrying(lambda: p.journal.end_attempt(rid, n, aid, rec, a.expire),
                           "fence the ended attempt", rid, aid)

    def _link(self) -> AgentLink:
        if self.agent is None:  # a cancel for an attempt that never listened (its admission)
            assert self.m is not None
            self.agent = AgentLink(self.p, self.rid or "", self.m.attempt_id)
        return self.agent

    def _settle(self, call: Callable[[], Awaitable[Any]], what: str, name: str,
                settle_s: float = 0.0) -> None:
        """A take-back or give-back, retried in the background while etcd is away."""
        aid = self.m.attempt_id if self.m else None
        self.p.work.spawn(retrying(call, what, self.rid, aid, settle_s=settle_s),
                          f"gate-{name}-{aid}")

    def _fired(self, kind: E.TimerKind) -> None:
        self.later(lambda c: E.TimerFired(kind, c.monotonic(), c.wall()), f"timer-{kind}",
                   open_only=True)


__all__ = ["GatePorts", "GateSession"]
