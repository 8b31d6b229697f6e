"""The gate's session: the upstream ext_proc stream of one attempt, a plain executor.

Envoy's messages become events for `core.gate.GateMachine`; the actions it answers with
become codec writes and port calls, and what a port answers is fed back as the next event.
Every decision (wait for the intake, admit, hold, fence, release, fail, how the attempt ends)
is a row of the machine's table; logs, spans and metrics come from `observer.gate`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from opentelemetry.trace import Span

from ..core import headers as H
from ..core.admission import RETRY_HEADER, decide
from ..core.budget import RetryBudget
from ..core.config import Config
from ..core.credentials import digest
from ..core.errors import GatewayError
from ..core.events import (
    AckLearned,
    AckSettled,
    Action,
    AdmissionDecided,
    Admit,
    AdmitDecided,
    AwaitAck,
    AwaitCause,
    AwaitIntakeCommit,
    CauseLearned,
    CloseAttempt,
    ContinueRequest,
    Decide,
    DropChunk,
    Event,
    FailAttempt,
    Fence,
    FenceDecided,
    GiveBack,
    HoldChunk,
    IntakeCommitted,
    LeaseLost,
    Overloaded,
    PassChunk,
    PassHeaders,
    PutCancel,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    RetryEnded,
    Revoked,
    RevokeEarly,
    SourceSent,
    StartTimer,
    State,
    StopTimers,
    StoreDown,
    StreamClosed,
    TakeLease,
    TimerFired,
    TimerKind,
    UndoAdmission,
    UndoFence,
    Watch,
    WatchSource,
)
from ..core.failure import FailureClass
from ..core.families import family_for_path
from ..core.gate import GateMachine, GateParams, clean
from ..core.handoff import HandOff
from ..core.health import HostHealth
from ..core.pool import Pool
from ..core.replay import snapshot
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from .causes import NO_GATE
from .leases import UNDO_SETTLE_S, AttemptLease, StoreUnavailable
from .ports import Clock, EntryLog, GateJournal, Ids
from .session import INVALID, HandedOff, Messages, Pending, Session, resent, retrying
from .telemetry import TRACEPARENT_HEADER, Telemetry
from .timers import TimerHandle, Timers

T = TypeVar("T")

# Test-only: proves the fault sweep can fail (docs/sweep.md). Logged loudly at start-up.
UNSAFE_RELEASE_WITHOUT_FENCE = os.environ.get("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE") == "1"


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


class GatePorts(Protocol):
    """What one attempt's gate needs from its process, declared here by its consumer: the
    configuration, the clock, ids and timers, the journal calls of an attempt, Envoy's
    entries, the request's intake in flight, the pool's view, the budget, the health, the
    hand-off, background work and traces. `session.Processor` provides it."""

    @property
    def cfg(self) -> Config: ...
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
    def budget(self) -> RetryBudget: ...
    @property
    def health(self) -> HostHealth: ...
    @property
    def reached(self) -> Mapping[str, int]: ...
    @property
    def intakes(self) -> Pending[asyncio.Future[GatewayError | None]]: ...
    @property
    def handoffs(self) -> Pending[HandedOff]: ...
    @property
    def tel(self) -> Telemetry: ...
    @property
    def instance_id(self) -> str: ...

    def mark_reached(self, rid: str) -> None: ...
    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    def keep_trace(self, clean: bool) -> bool: ...
    async def save_trace(self, rid: str, name: str, m: GateMachine,
                         meta: dict[str, Any]) -> None: ...


class GateSession(Session):
    __slots__ = ("_ack", "_timers", "_unack", "_unsource", "_unwatch", "lease", "m",
                 "parent_tp", "replica", "secret")

    def __init__(self, proc: GatePorts, ctx: Messages) -> None:
        self.detach = False
        self.p: GatePorts = proc
        self.cfg = proc.cfg
        self.ctx = ctx
        self.m: GateMachine | None = None
        self.rid: str | None = None
        self.replica: str | None = None
        self.lease: AttemptLease | None = None
        # This attempt's credential (decision 0028): attempt 1's from the guard, any other's
        # minted at its admission. Sent upstream only; never logged, traced or handed off.
        self.secret: str | None = None
        self._timers: dict[TimerKind, TimerHandle] = {}
        self._unwatch: Callable[[], None] | None = None
        # The replica's agent (decision 0034): its word that the first content left, and the
        # acknowledgement of a cancel (heard: its evidence; None: not yet).
        self._unsource: Callable[[], None] | None = None
        self._unack: Callable[[], None] | None = None
        self._ack: asyncio.Future[dict[str, Any] | None] | None = None
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
            rid = hd.get(H.REQUEST_ID)
            if not rid:
                # Not a journaled request (e.g. /v1/models): nothing to gate.
                await self.write(codec.continue_request_headers())
                return
            self.rid = rid
            envoy_attempt = _int(hd.get(H.ENVOY_ATTEMPT_COUNT), 1)
            attrs = codec.attributes(msg)
            self.replica = str(attrs.get("upstream.address") or "") or None
            self.parent_tp = hd.get(TRACEPARENT_HEADER)
            first = hd.get(H.PREADMITTED) or None
            # Attempt 1 was admitted by the guard with the request, with its credential; a
            # later attempt never takes either: it gets its own id and, at admission, secret.
            pre = first if envoy_attempt == 1 else None
            if pre is not None:
                self.secret = hd.get(H.ATTEMPT_SECRET) or None
            try:
                accepted_at: float | None = float(hd.get(H.ACCEPTED_AT, ""))
            except ValueError:
                accepted_at = None
            self.m = GateMachine.new(rid, params=self.p.gate_params)
            await self.feed(RequestStarted(
                envoy_attempt, family_for_path(hd.get(":path", "")).name,
                attempt_id=pre or self.p.ids.attempt_id(),
                # Set by our guard only (a client's is stripped), decision 0027.
                attempt_offset=max(0, _int(hd.get(H.ATTEMPT_OFFSET), 0)),
                preadmitted=pre is not None, first_admitted=first, replica=self.replica,
                want_fingerprint=hd.get(H.FINGERPRINT),
                prompt_tokens=_int(hd.get(H.PROMPT_TOKENS), 0), accepted_at=accepted_at,
                mono=self.p.clock.monotonic(), wall=self.p.clock.wall()))
        elif which == "response_headers":
            hd = codec.headers_dict(msg.response_headers.headers)
            if self.m is not None and UNSAFE_RELEASE_WITHOUT_FENCE:
                # Test-only sabotage (docs/sweep.md): release at once, no hold, no fence.
                # The fault sweep must catch what this breaks; never set it in production.
                self.m = None
            if self.m is None:
                await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
                return
            await self.feed(ResponseHeaders(
                _int(hd.get(":status", "0") or "0", 0), hd.get("content-type", ""),
                msg.response_headers.end_of_stream, model_revision=hd.get("x-model-revision"),
                retry_after=hd.get("retry-after")))
        elif which == "response_body":
            if self.m is None:
                await self.write(codec.continue_response_body())
                return
            lease = self.lease
            if lease is not None and not lease.valid() and not self.m.lease_lost:
                lease.lose("expired locally")
                await self.feed(LeaseLost())
            await self.feed(ResponseBody(msg.response_body.body,
                                         msg.response_body.end_of_stream))
        elif which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_trailers":
            await self.write(codec.trailers_response())
        elif which == "request_trailers":
            await self.write(codec.request_trailers_response())

    async def on_closed(self) -> None:
        self._stop_timers()
        self._stop_source()
        if self._unwatch is not None:
            self._unwatch()
        if self.m is not None:
            # Its end (a revoke, Envoy's word, the record) outlives the stream's handler.
            self.p.spawn(self.feed(StreamClosed(self.p.clock.monotonic(), self.p.clock.wall())),
                         f"gate-end-{self.m.attempt_id}")

    def _timer_fired(self, kind: TimerKind) -> None:
        self._timers.pop(kind, None)

        async def fire() -> None:
            async with self.lock:
                if self.m is not None and not self.closed:
                    await self.feed(TimerFired(kind, self.p.clock.monotonic(),
                                               self.p.clock.wall()))
        self.p.spawn(fire(), f"gate-timer-{kind}")

    def _on_source_sent(self, at: float) -> None:
        """The agent's word that the attempt's first content left the replica."""
        async def fire() -> None:
            async with self.lock:
                if self.m is not None and not self.closed:
                    await self.feed(SourceSent(at, self.p.clock.monotonic()))
        self.p.spawn(fire(), "gate-source-sent")

    def _stop_source(self) -> None:
        if self._unsource is not None:
            self._unsource()
            self._unsource = None

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: Event) -> None:
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

    async def act(self, a: Action, m: GateMachine) -> Event | None:
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        if isinstance(a, HoldChunk):
            return None
        if isinstance(a, PassChunk):
            await self.write(codec.continue_response_body())
        elif isinstance(a, DropChunk):
            await self.write(codec.replace_response_body(b""))
        elif isinstance(a, PassHeaders):
            # Only the gate may say which attempt the guard owns, never the replica.
            await self.write(codec.continue_response_headers(
                {RETRY_HEADER: "1"} if a.retry else {}, remove=(H.HANDOFF,)))
        elif isinstance(a, AwaitIntakeCommit):
            opening = p.intakes.get(rid)
            err = await asyncio.shield(opening) if opening is not None else None
            return IntakeCommitted(err, p.reached.get(rid, 0),
                                   p.pool.fingerprint_of(self.replica or ""), p.pool.enabled,
                                   p.clock.wall(), p.pool.agent_of(self.replica or ""))
        elif isinstance(a, Decide):
            verdict = decide(a.request, p.budget, p.clock.monotonic())
            if isinstance(verdict, GatewayError):
                return AdmissionDecided(error=verdict)
            return AdmissionDecided(admitted=verdict)
        elif isinstance(a, TakeLease):
            try:
                self.lease = await self._resent("attempt lease", p.journal.attempt_lease)
            except StoreUnavailable as e:
                return StoreDown(str(e), p.clock.wall())
            return AdmitDecided(True, mono=p.clock.monotonic(), wall=p.clock.wall())
        elif isinstance(a, Admit):
            # The admission makes it live with its own credential (decision 0028).
            self.secret = p.ids.attempt_secret()
            cred = digest(self.secret)
            try:
                res = await self._resent("admission", lambda: p.journal.admit_attempt(
                    rid, a.attempt, aid, a.record, a.fence_wait_s, self._never_started,
                    first_attempt=a.first_attempt, credential=cred), within=a.deadline_s)
            except StoreUnavailable as e:
                return StoreDown(str(e), p.clock.wall())
            self.lease = res.lease
            return AdmitDecided(res.admitted, res.reason, res.waited_s, p.clock.monotonic(),
                                p.clock.wall())
        elif isinstance(a, UndoAdmission):
            n = a.attempt
            p.spawn(retrying(lambda: p.journal.undo_admission(rid, n, aid),
                             "undo an unconfirmed admission", rid, aid,
                             settle_s=UNDO_SETTLE_S), f"gate-undo-admit-{aid}")
        elif isinstance(a, GiveBack):
            n, rec = a.attempt, a.record
            p.spawn(retrying(lambda: p.journal.end_attempt(rid, n, aid, rec, False),
                             "give back a refused attempt", rid, aid), f"gate-refused-{aid}")
        elif isinstance(a, Watch):
            self._unwatch = p.journal.on_live_change(rid, self._on_live_change, aid)
        elif isinstance(a, WatchSource):
            self._unsource = p.journal.on_source_sent(p.instance_id, rid, aid,
                                                      self._on_source_sent)
        elif isinstance(a, PutCancel):
            self._put_cancel(m)
        elif isinstance(a, AwaitAck):
            return await self._await_ack(a)
        elif isinstance(a, AckSettled):
            await self._ack_settled(a, m)
        elif isinstance(a, StartTimer):
            old = self._timers.pop(a.kind, None)
            if old is not None:
                old.cancel()
            kind = a.kind
            self._timers[kind] = p.timers.start(a.seconds, lambda: self._timer_fired(kind))
        elif isinstance(a, StopTimers):
            self._stop_timers()
        elif isinstance(a, ContinueRequest):
            p.mark_reached(rid)
            # The attempt offset stays: a removal here holds for Envoy's later attempts of
            # the request too, whose gates need it (decision 0027). The attempt's own secret
            # replaces whatever an earlier attempt's request carried.
            # A replica's agent addresses its word to this process's watch by its instance
            # id (decision 0034); a replica without one gets no such header.
            via = {H.PROCESSOR: p.instance_id} if m.agent else {}
            if self.secret is not None:
                await self.write(codec.continue_request_headers(
                    {H.ATTEMPT_ID: aid, H.ATTEMPT_SECRET: self.secret, **via},
                    remove=(H.PREADMITTED,)))
            else:
                await self.write(codec.continue_request_headers(
                    {H.ATTEMPT_ID: aid, **via}, remove=(H.PREADMITTED, H.ATTEMPT_SECRET)))
        elif isinstance(a, Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid}))
        elif isinstance(a, Overloaded):
            if self.replica:
                p.health.overloaded(self.replica, p.clock.monotonic() + a.seconds)
        elif isinstance(a, Fence):
            return await self._fence(a, m)
        elif isinstance(a, UndoFence):
            rec = a.facts.fence(p.clock.wall())
            p.spawn(retrying(lambda: p.journal.undo_fence(rid, rec), "undo an unconfirmed fence",
                             rid, aid, settle_s=UNDO_SETTLE_S), f"gate-undo-fence-{aid}")
        elif isinstance(a, Release):
            await self._release(a, m)
        elif isinstance(a, FailAttempt):
            await self.write(codec.fail_attempt_headers(
                rid, {RETRY_HEADER: "1"} if a.retry else {}, str(a.error.code)))
            for i in range(a.held_chunks):
                await self.write(codec.replace_response_body(
                    m.family.error_json(a.error) if i == 0 else b""))
        elif isinstance(a, RetryEnded):
            p.budget.retry_ended(aid)
        elif isinstance(a, RevokeEarly):
            if self.lease is not None:
                self.lease.lose("ended")
            n, rec = a.attempt, a.record
            return Revoked(await retrying(lambda: p.journal.end_attempt(rid, n, aid, rec, False),
                                          "fence the ended attempt", rid, aid))
        elif isinstance(a, AwaitCause):
            entry = await p.causes.wait_entry(a.attempt_id or aid,
                                              self.cfg.timeouts.access_log_wait_s)
            return CauseLearned(entry or "unknown", None, entry is not None, p.clock.wall())
        elif isinstance(a, CloseAttempt):
            await self._close(a, m)
        return None

    # --- the port calls that take more than a line ------------------------------------

    async def _fence(self, a: Fence, m: GateMachine) -> Event:
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        if self.lease is None or not self.lease.valid() or a.facts is None:
            return FenceDecided(False)
        rec = a.facts.fence(p.clock.wall())
        try:
            return FenceDecided(await self._resent(
                "fence", lambda: p.journal.fence_first_delta(rid, aid, rec),
                within=a.until_mono - p.clock.monotonic()))
        except StoreUnavailable as e:
            return StoreDown(str(e), p.clock.wall())

    async def _release(self, a: Release, m: GateMachine) -> None:
        # From here the guard owns the attempt: it sees the rest of the response, its end,
        # and writes the attempt's record with the request's outcome (one etcd txn).
        # Registered before the headers go out: the guard looks for it when they arrive.
        assert a.facts is not None
        self._stop_source()
        ho = HandOff.from_record(a.facts.base(), self.lease.lease_id if self.lease else 0,
                                 snapshot(m))
        self.p.handoffs.put(m.attempt_id, HandedOff(self.span, ho))
        self.span = INVALID
        await self.write(codec.continue_response_headers(
            {H.ATTEMPT_ID: m.attempt_id, H.HANDOFF: ho.header()}))
        for _ in range(a.held_chunks):
            await self.write(codec.continue_response_body())
        if a.hand_off:
            self.detach = True

    async def _close(self, a: CloseAttempt, m: GateMachine) -> None:
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        if a.timed_out and self.replica:
            p.health.first_delta_timed_out(self.replica, p.clock.monotonic())
        if p.keep_trace(clean(a)) and not a.ack_follows:
            p.spawn(p.save_trace(rid, f"attempt-{a.attempt:03d}", m, {
                "attempt_id": aid, "replica": self.replica, "failure_class": a.failure_class,
                # The end plan's inputs and verdict: `extproc replay` decides it again.
                "end": dict(a.end_trace)}), f"trace-{aid}")
        if self.lease is not None:
            self.lease.lose("ended")
        n, rec = a.attempt, a.record
        if a.update_only:
            await retrying(lambda: p.journal.update_attempt(rid, n, rec),
                           "close the attempt record", rid, aid)
            return
        # etcd may be briefly away: retried for a bounded time, so the record does not
        # keep an attempt without its end (found by the fault sweep).
        await retrying(lambda: p.journal.end_attempt(rid, n, aid, rec, a.expire),
                       "fence the ended attempt", rid, aid)

    def _put_cancel(self, m: GateMachine) -> None:
        """Listen for the agent's acknowledgement, then ask it to stop the attempt."""
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        fut: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._ack = fut

        def heard(evidence: dict[str, Any]) -> None:
            if not fut.done():
                fut.set_result(evidence)
        self._unack = p.journal.on_ack(rid, aid, heard)
        rec = {"at": p.clock.wall(), "gateway_id": self.cfg.server.gateway_id,
               "processor": p.instance_id}
        p.spawn(retrying(lambda: p.journal.put_cancel(rid, aid, rec), "put the cancel", rid,
                         aid, limit_s=float(self.cfg.etcd.attempt_lease_ttl_s)),
                f"gate-cancel-{aid}")

    async def _await_ack(self, a: AwaitAck) -> Event:
        """The agent's acknowledgement, or none within `a.seconds` (a Timers timer)."""
        fut, p = self._ack, self.p
        evidence: dict[str, Any] | None = None
        if fut is not None:
            if not fut.done():
                timer = p.timers.start(a.seconds,
                                       lambda: None if fut.done() else fut.set_result(None))
                try:
                    evidence = await fut
                finally:
                    timer.cancel()
            else:
                evidence = fut.result()
        if self._unack is not None:
            self._unack()
            self._unack = None
        return AckLearned(evidence is not None, evidence, p.clock.wall())

    async def _ack_settled(self, a: AckSettled, m: GateMachine) -> None:
        rid, aid, p = self.rid or "", m.attempt_id, self.p
        if p.keep_trace(a.failure_class == str(FailureClass.COMPLETED)):
            p.spawn(p.save_trace(rid, f"attempt-{a.attempt:03d}", m, {
                "attempt_id": aid, "replica": self.replica, "failure_class": a.failure_class,
                "end": dict(a.end_trace)}), f"trace-{aid}")
        if a.record is None:
            return
        n, rec = a.attempt, a.record
        if a.revoke:
            await retrying(lambda: p.journal.revoke_fenced(rid, n, aid, rec),
                           "end the acknowledged attempt's fence", rid, aid)
        else:
            await retrying(lambda: p.journal.update_attempt(rid, n, rec),
                           "add the engine's acknowledgement", rid, aid)

    async def _resent(self, what: str, call: Callable[[], Awaitable[T]],
                      within: float | None = None) -> T:
        limit = self.cfg.etcd.resend_deadline_s
        return await resent(what, call, self.rid, self.m.attempt_id if self.m else None,
                            limit if within is None else min(limit, within))

    def _never_started(self, live: str) -> bool:
        """`live` is attempt 1 as the guard admitted it, and no gate ever ran for it."""
        s = self.m.start if self.m is not None else None
        first = s.first_admitted if s is not None else None
        return first is not None and live == first and self.p.causes.seen(NO_GATE + first)

    def _on_live_change(self, value: str | None) -> None:
        """The revocation watch: someone fenced this attempt (revoked, expired, replaced)."""
        lease, m = self.lease, self.m
        if (lease is not None and m is not None and value != m.attempt_id
                and lease.lose("revoked or replaced")):
            observer.gate_fenced(self, value)

    def _stop_timers(self) -> None:
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()


__all__ = ["GateSession", "State"]
