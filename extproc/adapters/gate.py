"""The gate: the upstream ext_proc stream of one attempt.

It asks the core whether the attempt may run (`core.admission.decide`), runs the admission
transaction, holds the response headers until the first content delta, fences it in etcd,
releases and hands the attempt to the guard; or fails it so Envoy retries, and closes its
record as `core.records` plans. Decisions come from `core.machine.GateMachine`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry.trace import Span, SpanKind

from ..core import headers as H
from ..core import records
from ..core.admission import (
    RETRY_HEADER,
    Admitted,
    AttemptRequest,
    decide,
    envoy_retries,
    retry_after_s,
)
from ..core.credentials import digest
from ..core.errors import (
    ErrorCode,
    GatewayError,
    attempt_not_admitted,
    journal_unavailable,
)
from ..core.events import (
    Action,
    Admit,
    AdmitDecided,
    ContinueRequest,
    DropChunk,
    EndAttempt,
    Event,
    FailAttempt,
    Fence,
    FenceDecided,
    FirstDeltaTimeout,
    HoldChunk,
    LeaseLost,
    PassChunk,
    PassHeaders,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    State,
    StreamClosed,
)
from ..core.failure import FailureClass
from ..core.failure import Fence as FenceKind
from ..core.families import family_for_path
from ..core.gate import GateMachine
from ..core.handoff import HandOff, TraceSnapshot
from ..core.replay import snapshot
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from .causes import NO_GATE
from .leases import UNDO_SETTLE_S, AttemptLease, StoreUnavailable
from .logs import rlog
from .session import INVALID, HandedOff, Messages, Processor, Session, log, retrying
from .telemetry import TRACEPARENT_HEADER, end_span

T = TypeVar("T")
# The admission and the fence are sent again only until this long before the attempt's
# first-delta limit, so the attempt fails as "journal unavailable" (and Envoy may re-run
# it) before Envoy's per-try timeout answers for it.
FENCE_MARGIN_S = 0.25

# Test-only: proves the fault sweep can fail (docs/sweep.md). Logged loudly at start-up.
UNSAFE_RELEASE_WITHOUT_FENCE = os.environ.get("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE") == "1"


# --- gate ----------------------------------------------------------------------------


class GateSession(Session):
    __slots__ = (
        "_hard_deadline",
        "_hard_timer",
        "_soft_timer",
        "_unwatch",
        "accepted_at",
        "admitted",
        "aid",
        "attempt",
        "attempt_offset",
        "envoy_attempt",
        "failed_on_purpose",
        "first_admitted",
        "http_status",
        "intake_refused",
        "lease",
        "m",
        "model_revision",
        "parent_tp",
        "preadmitted",
        "prompt_tokens",
        "replica",
        "secret",
        "slow",
        "started_at",
        "started_wall",
        "waited_for_previous_s",
        "want_fingerprint",
    )

    def __init__(self, proc: Processor, ctx: Messages) -> None:
        self.detach = False
        self.p = proc
        self.cfg = proc.cfg
        self.ctx = ctx
        self.m: GateMachine | None = None
        self.rid: str | None = None
        self.aid: str | None = None
        self.attempt = 0  # the journal's number: attempt_offset + envoy_attempt
        self.envoy_attempt = 0  # Envoy's x-envoy-attempt-count (from 1 per HTTP request)
        self.attempt_offset = 0  # a re-run's: the attempts of the runs before (0027)
        self.replica: str | None = None
        self.lease: AttemptLease | None = None
        self.preadmitted: str | None = None  # attempt 1's id, admitted by the guard
        # This attempt's credential (decision 0028): attempt 1's from the guard, any other's
        # minted here. Sent upstream only; never logged, never in the hand-off.
        self.secret: str | None = None
        self.first_admitted: str | None = None  # the same, as later attempts see it
        self.model_revision: str | None = None
        self.started_at = 0.0
        self._hard_deadline = float("inf")  # loop time of the first-delta limit
        self.started_wall = 0.0
        self.closed = False
        self.http_status = 0
        self.failed_on_purpose = False
        self.slow = False
        self.waited_for_previous_s = 0.0
        self._unwatch: Callable[[], None] | None = None
        self._soft_timer: asyncio.TimerHandle | None = None
        self._hard_timer: asyncio.TimerHandle | None = None
        self.lock = asyncio.Lock()
        self.want_fingerprint: str | None = None
        self.prompt_tokens = 0
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.parent_tp: str | None = None
        self.accepted_at: float | None = None  # wall clock, from the guard
        self.admitted: Admitted | None = None
        self.intake_refused = False  # attempt 1's request was never recorded

    async def on_closed(self) -> None:
        for timer in (self._soft_timer, self._hard_timer):
            if timer is not None:
                timer.cancel()
        if self.aid is not None and (self.m is None or self.m.state is not State.GATE_RELEASED):
            # Over before release (failed, or refused after the budget admitted it): a
            # re-prefill stops counting in the budget. A released one ends with its request.
            self.p.budget.retry_ended(self.aid)
        if self.m is not None:
            for a in self.m.handle(StreamClosed()):
                if isinstance(a, EndAttempt):
                    self.p.spawn(self.end(a), f"gate-end-{self.aid}")

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
            try:
                self.envoy_attempt = int(hd.get(H.ENVOY_ATTEMPT_COUNT, "1"))
            except ValueError:
                self.envoy_attempt = 1
            try:
                # Set by our guard only (a client's is stripped): a repeat that runs again
                # numbers its attempts after the last one recorded (decision 0027).
                self.attempt_offset = max(0, int(hd.get(H.ATTEMPT_OFFSET, "0")))
            except ValueError:
                self.attempt_offset = 0
            self.attempt = self.attempt_offset + self.envoy_attempt
            attrs = codec.attributes(msg)
            self.replica = str(attrs.get("upstream.address") or "") or None
            self.want_fingerprint = hd.get(H.FINGERPRINT)
            self.parent_tp = hd.get(TRACEPARENT_HEADER)
            self.first_admitted = hd.get(H.PREADMITTED) or None
            if self.envoy_attempt == 1:
                self.preadmitted = self.first_admitted
                if self.preadmitted is not None:
                    # Minted by the guard with attempt 1 (its digest in the intake). A later
                    # attempt never takes it: it mints its own at its admission.
                    self.secret = hd.get(H.ATTEMPT_SECRET) or None
            try:
                self.prompt_tokens = int(hd.get(H.PROMPT_TOKENS, "0"))
            except ValueError:
                self.prompt_tokens = 0
            try:
                self.accepted_at = float(hd.get(H.ACCEPTED_AT, ""))
            except ValueError:
                self.accepted_at = None
            self.m = GateMachine.new(rid, self.cfg.limits.max_buffered_response_bytes)
            # The machine counts Envoy's attempts (max_attempts is per HTTP request);
            # records, logs and spans name the journal's (self.attempt).
            await self.feed(RequestStarted(self.envoy_attempt,
                                           family_for_path(hd.get(":path", "")).name))
        elif which == "response_headers":
            hd = codec.headers_dict(msg.response_headers.headers)
            if self.m is not None and UNSAFE_RELEASE_WITHOUT_FENCE:
                # Test-only sabotage (docs/sweep.md): release at once, no hold, no fence.
                # The fault sweep must catch what this breaks; never set it in production.
                self.m = None
            if self.m is None:
                await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
                return
            self.model_revision = hd.get("x-model-revision")
            self.http_status = int(hd.get(":status", "0") or 0)
            if self.http_status in (429, 503) and self.replica:
                # Overloaded, not dead: tried after the others until its Retry-After.
                wait = retry_after_s(hd.get("retry-after"), self.cfg.timeouts.first_delta_s)
                if wait:
                    self.p.health.overloaded(self.replica, self.p.clock.monotonic() + wait)
            await self.feed(ResponseHeaders(int(hd.get(":status", "0") or 0),
                                            hd.get("content-type", ""),
                                            msg.response_headers.end_of_stream))
        elif which == "response_body":
            if self.m is None:
                await self.write(codec.continue_response_body())
                return
            m, lease = self.m, self.lease
            if (m.state is State.GATE_RELEASED and not m.lease_lost and lease is not None
                    and not lease.valid()):
                rlog(log, logging.WARNING, "lease lost after release: dropping the rest",
                     self.rid, self.aid)
                await self.feed(LeaseLost())
            await self.feed(ResponseBody(msg.response_body.body,
                                         msg.response_body.end_of_stream))
        elif which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_trailers":
            await self.write(codec.trailers_response())
        elif which == "request_trailers":
            await self.write(codec.request_trailers_response())

    async def feed(self, ev: Event) -> None:
        assert self.m is not None
        queue = [ev]
        while queue:
            for a in self.m.handle(queue.pop(0)):
                nxt = await self.act(a)
                if nxt is not None:
                    queue.append(nxt)

    async def act(self, a: Action) -> Event | None:
        rid = self.rid or ""
        if isinstance(a, HoldChunk):
            return None
        if isinstance(a, PassChunk):
            await self.write(codec.continue_response_body())
            return None
        if isinstance(a, PassHeaders):
            # Only the gate may say which attempt the guard owns, never the replica.
            await self.write(codec.continue_response_headers(
                self._retry(self.http_status), remove=(H.HANDOFF,)))
            return None
        if isinstance(a, DropChunk):
            await self.write(codec.replace_response_body(b""))
            return None
        if isinstance(a, Fence):
            return FenceDecided(await self.fence())
        if isinstance(a, Release):
            for timer in (self._soft_timer, self._hard_timer):
                if timer is not None:
                    timer.cancel()
            self.span.add_event("first_delta.fenced", {"llmgw.held_chunks": a.held_chunks})
            rlog(log, logging.INFO, "first delta fenced: released", rid, self.aid,
                 attempt=self.attempt, replica=self.replica, held_chunks=a.held_chunks,
                 ttfd_ms=round((self.p.clock.monotonic() - self.started_at) * 1000, 2))
            # From here the guard owns the attempt: it sees the rest of the response, its end,
            # and writes the attempt's record with the request's outcome (one etcd txn).
            # Registered before the headers go out: the guard looks for it when they arrive.
            self.span.add_event("attempt.handed_off")
            if self.aid is not None and self.m is not None:
                self.p.handoffs.put(self.aid, HandedOff(self.span, self.handoff(snapshot(self.m))))
                self.span = INVALID
            await self.write(codec.continue_response_headers(
                {H.ATTEMPT_ID: self.aid or "", H.HANDOFF: self.handoff().header()}))
            for _ in range(a.held_chunks):
                await self.write(codec.continue_response_body())
            if a.hand_off:
                self.detach = True
            return None
        if isinstance(a, FailAttempt):
            self.failed_on_purpose = True
            self.span.add_event("attempt.failed", {"llmgw.reason": a.reason})
            rlog(log, logging.WARNING, "attempt failed before first delta", rid, self.aid,
                 attempt=self.attempt, replica=self.replica, reason=a.reason)
            await self.write(codec.fail_attempt_headers(rid, self._retry(503),
                                                        str(a.error.code)))
            for i in range(a.held_chunks):
                body = self.m.family.error_json(a.error) if self.m is not None else b""
                await self.write(codec.replace_response_body(body if i == 0 else b""))
            return None
        if isinstance(a, ContinueRequest):
            self.p.mark_reached(rid)
            # The attempt offset stays: a removal here holds for Envoy's later attempts of
            # the request too, whose gates need it (decision 0027).
            # The attempt's own secret replaces whatever an earlier attempt's request carried
            # (an upstream filter's mutation stays on Envoy's later attempts).
            if self.secret is not None:
                await self.write(codec.continue_request_headers(
                    {H.ATTEMPT_ID: self.aid or "", H.ATTEMPT_SECRET: self.secret},
                    remove=(H.PREADMITTED,)))
            else:
                await self.write(codec.continue_request_headers(
                    {H.ATTEMPT_ID: self.aid or ""}, remove=(H.PREADMITTED, H.ATTEMPT_SECRET)))
            return None
        if isinstance(a, Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid}))
            return None
        if isinstance(a, Admit):
            return await self.admit(a.attempt)
        return None

    def _retry(self, status: int) -> dict[str, str]:
        """The header asking Envoy to retry this response, unless the attempt is the last
        that counts (decision 0024)."""
        final = self.admitted is None or self.admitted.final
        return {RETRY_HEADER: "1"} if envoy_retries(status, final) else {}

    def facts(self) -> records.AttemptFacts:
        return records.AttemptFacts(
            attempt=self.attempt, attempt_id=self.aid or "", replica=self.replica,
            gateway_id=self.cfg.server.gateway_id, started_at=self.started_wall,
            waited_for_previous_s=self.waited_for_previous_s,
            model_revision=self.p.pool.fingerprint_of(self.replica or "") or self.model_revision,
            slow=self.slow)

    def handoff(self, trace: TraceSnapshot | None = None) -> HandOff:
        return HandOff.from_record(self.facts().base(),
                                   self.lease.lease_id if self.lease else 0, trace)

    async def admit(self, attempt: int) -> AdmitDecided:
        rid = self.rid or ""
        self.aid = self.preadmitted or self.p.ids.attempt_id()
        self.started_at = self.p.clock.monotonic()
        tel = self.p.tel
        parent = tel.parent_from({"traceparent": self.parent_tp} if self.parent_tp
                                 else self.md)
        host, _, port = (self.replica or "").rpartition(":")
        self.span = tel.start("llm.attempt", parent, SpanKind.CLIENT, {
            "llmgw.request_id": rid, "llmgw.attempt_id": self.aid,
            "llmgw.attempt": self.attempt, "llmgw.envoy_attempt": attempt,
            "server.address": host or None, "server.port": int(port) if port.isdigit() else None,
            "llmgw.fingerprint": self.p.pool.fingerprint_of(self.replica or "")})
        res = await self._admit(attempt)
        if res.admitted:
            self.span.add_event("attempt.admitted",
                                {"llmgw.waited_for_previous_ms":
                                 round(self.waited_for_previous_s * 1000, 2)})
            self.span.add_event("lease.granted")
            if attempt > 1:
                tel.retries.add(1, {"decision": "admitted"})
        else:
            if self.preadmitted is not None and not self.intake_refused:
                # The guard admitted it with the request: give `live` back.
                aid, store = self.aid or "", self.p.journal
                code = str(res.error.code) if res.error else "unknown"
                n = self.attempt  # 1, or a re-run's first (decision 0027)
                rec = records.refused_first_attempt(aid, self.replica, self.p.clock.wall(), code,
                                                    n)
                self.p.spawn(retrying(lambda: store.end_attempt(rid, n, aid, rec, False),
                                      "give back a refused attempt", rid, aid),
                             f"gate-refused-{aid}")
            code = str(res.error.code) if res.error else "unknown"
            self.span.add_event("attempt.refused", {"llmgw.reason": code})
            if attempt > 1:
                tel.retries.add(1, {"decision": "refused", "reason": code})
            end_span(self.span, code)
        return res

    async def _admit(self, attempt: int) -> AdmitDecided:
        """`attempt`: Envoy's count (the policy's); `n`: the journal's (decision 0027)."""
        rid = self.rid or ""
        aid = self.aid or ""
        n = self.attempt
        opening = self.p.intakes.get(rid)
        if opening is not None:
            # The guard let the body go on while its intake commits (decision 0021):
            # nothing goes upstream before the request and attempt 1 are recorded. Every
            # attempt waits, not only the first: when attempt 1 never reached a gate
            # (connection refused), Envoy's attempt 2 can come before the commit.
            err = await asyncio.shield(opening)
            if err is not None:
                self.intake_refused = True
                return self._refused(err)
        cfg, pool = self.cfg, self.p.pool
        t = cfg.timeouts
        elapsed = (max(0.0, self.p.clock.wall() - self.accepted_at) if self.accepted_at is not None
                   else 0.0)
        verdict = decide(AttemptRequest(
            request_id=rid, attempt=attempt, max_attempts=cfg.policy.max_attempts,
            reached_before=rid in self.p.reached, reached_count=self.p.reached.get(rid, 0),
            elapsed_s=elapsed,
            total_first_delta_s=t.total_first_delta_s(cfg.policy.max_attempts),
            first_delta_s=t.first_delta_s, fence_wait_s=t.fence_wait_s,
            want_fingerprint=self.want_fingerprint if pool.enabled else None,
            replica_fingerprint=pool.fingerprint_of(self.replica or ""),
            replica=self.replica, prompt_tokens=self.prompt_tokens,
            max_prompt_tokens=cfg.policy.retry_cost.max_prompt_tokens, attempt_id=aid),
            self.p.budget, self.p.clock.monotonic())
        last = self.p.budget.last
        if isinstance(verdict, GatewayError):
            if verdict.code is ErrorCode.RETRY_BUDGET_EXHAUSTED and last is not None:
                self.p.tel.budget_used.record(last.retries / max(1, last.limit))
            return self._refused(verdict)
        if verdict.counts_as_retry and last is not None:
            self.p.tel.budget_used.record(last.retries / max(1, last.limit))
        self.admitted = verdict
        self.started_wall = self.p.clock.wall()
        record = self.facts().admission()
        if self.preadmitted is not None:
            # Admitted in the guard's intake transaction; the live key hangs on the process
            # lease (granted already, or granted now if another process admitted it).
            try:
                self.lease = await self._resent("attempt lease", self.p.journal.attempt_lease)
            except StoreUnavailable as e:
                return AdmitDecided(False, self._journal_down(e))
            return self._admitted(0.0)
        # The admission makes it live with its own credential (decision 0028).
        self.secret = self.p.ids.attempt_secret()
        cred = digest(self.secret)
        try:
            until = asyncio.get_running_loop().time() + verdict.deadline_s - FENCE_MARGIN_S
            res = await self._resent("admission", lambda: self.p.journal.admit_attempt(
                rid, n, aid, record, verdict.fence_wait_s, self._never_started,
                first_attempt=self.attempt_offset + 1, credential=cred), until=until)
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "journal unavailable at admission", rid, self.aid,
                 error=str(e))
            self.p.spawn(retrying(lambda: self.p.journal.undo_admission(rid, n, aid),
                                  "undo an unconfirmed admission", rid, aid,
                                  settle_s=UNDO_SETTLE_S),
                         f"gate-undo-admit-{aid}")
            return AdmitDecided(False, self._journal_down(e))
        if not res.admitted:
            return self._refused(attempt_not_admitted(rid, res.reason))
        self.lease = res.lease
        return self._admitted(res.waited_s)

    async def _resent(self, what: str, call: Callable[[], Awaitable[T]],
                      until: float | None = None) -> T:
        """A conditioned write that knows its own earlier try (the admission: `live` is this
        attempt; the fence: `delivery` names it) is sent again while etcd does not answer,
        each try to the member in use (which moves on when one fails), until
        etcd.resend_deadline_s (decision 0026): an election or a frozen member costs a wait,
        not the attempt."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.cfg.etcd.resend_deadline_s
        if until is not None:
            give_up = min(give_up, until)  # never past the attempt's first-delta limit
        pause, tries = 0.05, 0
        while True:
            tries += 1
            try:
                res = await call()
            except StoreUnavailable as e:
                if loop.time() + pause >= give_up:
                    raise
                rlog(log, logging.INFO, f"{what} not confirmed; sending it again", self.rid,
                     self.aid, error=str(e), tries=tries)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.4)
                continue
            if tries > 1:
                rlog(log, logging.INFO, f"{what} confirmed", self.rid, self.aid, tries=tries)
            return res

    def _never_started(self, live: str) -> bool:
        """`live` is attempt 1 as the guard admitted it, and no gate ever ran for it."""
        first = self.first_admitted
        return first is not None and live == first and self.p.causes.seen(NO_GATE + first)

    def _journal_down(self, e: Exception) -> GatewayError:
        return journal_unavailable(self.rid, "the attempt could not be fenced, so nothing "
                                             "was run")

    def _admitted(self, waited_s: float) -> AdmitDecided:
        rid, attempt = self.rid or "", self.attempt
        self.waited_for_previous_s = waited_s
        self._unwatch = self.p.journal.on_live_change(rid, self._on_live_change, self.aid)
        soft = self.cfg.timeouts.soft_first_delta_s
        loop = asyncio.get_running_loop()
        if soft > 0:
            self._soft_timer = loop.call_later(soft, self._on_soft_limit)
        deadline = (self.admitted.deadline_s if self.admitted is not None
                    else self.cfg.timeouts.first_delta_s)
        self._hard_deadline = loop.time() + max(0.0, deadline - waited_s)
        self._hard_timer = loop.call_later(
            max(0.0, deadline - waited_s),
            lambda: self.p.spawn(self._on_first_delta_limit(), f"gate-limit-{self.aid}"))
        rlog(log, logging.INFO, "attempt admitted", rid, self.aid, attempt=attempt,
             replica=self.replica, waited_ms=round(waited_s * 1000, 2),
             with_request=self.preadmitted is not None)
        return AdmitDecided(True)

    def _on_live_change(self, value: str | None) -> None:
        """The revocation watch: someone fenced this attempt (revoked, expired, replaced)."""
        lease = self.lease
        if lease is not None and value != self.aid and not lease.revoked:
            lease.revoked = True
            rlog(log, logging.WARNING, "attempt fenced: its lease was revoked or replaced",
                 self.rid, self.aid, live=value)

    async def _on_first_delta_limit(self) -> None:
        async with self.lock:
            if self.m is None or self.closed:
                return
            waited = (self.p.clock.wall() - self.accepted_at if self.accepted_at is not None
                      else self.p.clock.monotonic() - self.started_at)
            final = self.admitted.final if self.admitted is not None else False
            await self.feed(FirstDeltaTimeout(final=final, waited_s=round(waited, 3)))

    def _on_soft_limit(self) -> None:
        # Slow is not dead: record it, change nothing (only first_delta_s fails over).
        self.slow = True
        rlog(log, logging.INFO, "first delta slower than the soft expectation (not a failure)",
             self.rid, self.aid, soft_first_delta_s=self.cfg.timeouts.soft_first_delta_s,
             replica=self.replica)

    def _refused(self, err: GatewayError) -> AdmitDecided:
        rlog(log, logging.WARNING, "attempt refused", self.rid, self.aid, attempt=self.attempt,
             code=str(err.code), reason=err.message, replica=self.replica)
        return AdmitDecided(False, err)

    async def fence(self) -> bool:
        rid = self.rid or ""
        if self.lease is None or not self.lease.valid():
            return False
        record = self.facts().fence(self.p.clock.wall())
        try:
            return await self._resent("fence", lambda: self.p.journal.fence_first_delta(
                rid, self.aid or "", record), until=self._hard_deadline - FENCE_MARGIN_S)
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "journal unavailable at the fence: not releasing", rid,
                 self.aid, error=str(e))
            # The transaction may still apply when etcd wakes: take it back once it can.
            self.p.spawn(retrying(lambda: self.p.journal.undo_fence(rid, record),
                                  "undo an unconfirmed fence", rid, self.aid,
                                  settle_s=UNDO_SETTLE_S),
                         f"gate-undo-fence-{self.aid}")
            return False

    async def end(self, a: EndAttempt) -> None:
        """Classify how the attempt ended, fence it accordingly, and close its record."""
        rid = self.rid or ""
        if self._unwatch is not None:
            self._unwatch()
        if self.aid is None or self.lease is None:
            return
        if a.released:
            # Handed to the guard at release: it ends the attempt with the request.
            return
        aid, attempt, store = self.aid, self.attempt, self.p.journal
        facts = records.EndFacts(
            released=False, upstream_finished=a.upstream_finished, timed_out=a.timed_out,
            failed_on_purpose=self.failed_on_purpose, http_status=self.http_status,
            elapsed_s=self.p.clock.monotonic() - self.started_at,
            first_delta_s=self.cfg.timeouts.first_delta_s)
        plan = records.plan_end(facts)
        base = self.facts().base()
        if plan.revoke_now:
            self.lease.revoked = True
            # `ended_at` is when `live` went: what any overlap check needs.
            ended_at = self.p.clock.wall()
            pending = records.pending_revoke(base, ended_at)
            revoked = await retrying(
                lambda: store.end_attempt(rid, attempt, aid, pending, False),
                "fence the ended attempt", rid, aid)
            if not revoked:  # never confirmed: the lease will lapse by itself
                plan = records.EndPlan(False, False, plan.needs_cause)
        entry = None
        if plan.needs_cause:
            # Envoy's per-attempt access-log entry says reset (dead) vs timeout (uncertain),
            # and that Envoy has closed the attempt at all.
            entry = await self.p.causes.wait_entry(aid, self.cfg.timeouts.access_log_wait_s)
        cancel_ack = (self.cfg.policy.uncertain_source_liveness.wait_for
                      == "cancel_ack_or_lease_expiry")
        done = records.settle_end(facts, plan, entry, cancel_ack)
        cls, fence = done.failure_class, done.fence
        if a.timed_out and self.replica:
            self.p.health.first_delta_timed_out(self.replica, self.p.clock.monotonic())
        record = records.attempt_end(base, facts, done,
                                     ended_at if plan.revoke_now else self.p.clock.wall(),
                                     self.cfg.etcd.attempt_lease_ttl_s)
        rlog(log, logging.INFO, "attempt ended", rid, aid, attempt=attempt,
             released=False, failure_class=str(cls), fence=str(fence), cause=done.cause)
        self.span.add_event("lease.revoked" if fence is FenceKind.REVOKE
                            else "lease.fenced_until_expiry")
        self.p.tel.fences.add(1, {"kind": str(fence), "class": str(cls)})
        end_span(self.span, None if cls is FailureClass.COMPLETED else str(cls),
                 **{"llmgw.failure_class": str(cls), "llmgw.released": False,
                    "llmgw.fence": str(fence), "llmgw.envoy_cause": done.cause,
                    "llmgw.model_revision": record.get("model_revision"),
                    "http.response.status_code": self.http_status or None})
        if self.m is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.p.spawn(self.p.save_trace(rid, f"attempt-{attempt:03d}", self.m, {
                "attempt_id": aid, "replica": self.replica,
                "failure_class": str(cls),
                # The end plan's inputs and verdict: `extproc replay` decides it again.
                "end": records.end_trace(facts, entry, cancel_ack, done)}), f"trace-{aid}")
        self.lease.revoked = True
        if plan.revoke_now:
            await retrying(lambda: store.update_attempt(rid, attempt, record),
                           "close the attempt record", rid, aid)
            return
        # Confirmed end (the replica closed, answered, the client left, or Envoy closed an
        # uncertain one): `live` is deleted, so a retry may start now. Unknown
        # (policy.uncertain_source_liveness): the replica may still be decoding and may
        # still publish; fenced now, a retry is admitted only once the fence's lease
        # expires. etcd may be briefly away: retried for a bounded time, so the record does
        # not keep an attempt without its end (found by the fault sweep).
        await retrying(lambda: store.end_attempt(rid, attempt, aid, record,
                                                 fence is FenceKind.EXPIRE),
                       "fence the ended attempt", rid, aid)
