"""The gate: one upstream attempt, its whole life as rows (`GateMachine.TABLE`).

Read down the rows to draw an attempt's life: it waits for its request's intake (decision
0021: every attempt, not only the first), asks core.admission, takes its lease (attempt 1,
admitted with the request) or runs the admission transaction, starts its first-delta timers,
holds the response until the first content delta is fenced in etcd, then releases it and
hands the attempt to the guard; or fails it so Envoy retries. An attempt over before its
release is ended here too: the end planned (core.records), revoked early when the end is
confirmed, Envoy's access-log word awaited when it is not, the record settled and written.
Every wait is an action out and an event in; times and ids come in on the events.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import headers as H
from . import records
from .admission import (
    Admitted,
    AttemptRequest,
    envoy_retries,
    refusal_retryable,
    retry_after_s,
)
from .config import Config
from .errors import (
    GatewayError,
    attempt_not_admitted,
    journal_unavailable,
    upstream_timeout,
    upstream_unavailable,
)
from .events import (
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
    FailAttempt,
    Fence,
    FenceDecided,
    GiveBack,
    HoldChunk,
    IntakeCommitted,
    KeepTrace,
    LeaseLost,
    LiveChanged,
    LoseLease,
    MarkPathLost,
    MarkSlow,
    MarkTimedOut,
    NotConfirmed,
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
    StopWatching,
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
from .failure import FailureClass
from .failure import Fence as FenceKind
from .families import CHAT, Family, family_for_path, family_named
from .handoff import HandOff
from .machine import Machine, T, Table, counting_decoder, stay
from .sse import EventKind, SseDecoder

S = State
W = TypeVar("W", TakeLease, Admit, Fence)

# The admission and the fence are sent again only until this long before the attempt's
# first-delta limit, so the attempt fails as "journal unavailable" (and Envoy may re-run
# it) before Envoy's per-try timeout answers for it.
FENCE_MARGIN_S = 0.25
# An unconfirmed admission or fence is sent again after a pause that doubles from the first
# to the longest, until etcd.resend_deadline_s (decision 0026).
RESEND_FIRST_PAUSE_S = 0.05
RESEND_MAX_PAUSE_S = 0.4


@dataclass(frozen=True, slots=True)
class GateParams:
    """The configuration an attempt's rows read (core.config), traced with it."""

    max_buffer: int = 4 << 20
    first_delta_s: float = 30.0
    soft_first_delta_s: float = 0.0
    max_attempts: int = 3
    total_first_delta_s: float = 90.0
    fence_wait_s: float = 5.0
    max_prompt_tokens: int = 0
    gateway_id: str = ""
    lease_ttl_s: int = 10
    cancel_ack: bool = True  # policy.uncertain_source_liveness.wait_for
    resend_deadline_s: float = 3.0  # etcd's: how long an unconfirmed write is sent again
    access_log_wait_s: float = 0.5  # how long an ended attempt waits for Envoy's word
    source_grace_s: float = 0.5  # timeouts.source_grace_s (0: off; decision 0034)

    @classmethod
    def from_config(cls, cfg: Config) -> GateParams:
        t, pol = cfg.timeouts, cfg.policy
        return cls(max_buffer=cfg.limits.max_buffered_response_bytes,
                   first_delta_s=t.first_delta_s, soft_first_delta_s=t.soft_first_delta_s,
                   max_attempts=pol.max_attempts,
                   total_first_delta_s=t.total_first_delta_s(pol.max_attempts),
                   fence_wait_s=t.fence_wait_s,
                   max_prompt_tokens=pol.retry_cost.max_prompt_tokens,
                   gateway_id=cfg.server.gateway_id, lease_ttl_s=cfg.etcd.attempt_lease_ttl_s,
                   cancel_ack=(pol.uncertain_source_liveness.wait_for
                               == "cancel_ack_or_lease_expiry"),
                   resend_deadline_s=cfg.etcd.resend_deadline_s,
                   access_log_wait_s=t.access_log_wait_s,
                   source_grace_s=t.source_grace_s)


@dataclass(slots=True)
class GateMachine(Machine):
    """One attempt: its admission, its hold until the first delta is fenced, its end."""

    attempt: int = 0  # Envoy's count (the policy's)
    params: GateParams = field(default_factory=GateParams)
    max_buffer: int = 4 << 20
    streaming: bool = False
    family: Family = CHAT
    decoder: SseDecoder = field(default_factory=counting_decoder)
    held: int = 0  # body messages received and not yet answered
    buffered: bytearray = field(default_factory=bytearray)  # non-streaming body so far
    body_bytes: int = 0
    saw_content: bool = False
    saw_done: bool = False
    ended: bool = False  # upstream sent end_of_stream
    timed_out: bool = False  # failed by the first-delta limit: liveness uncertain
    lease_lost: bool = False  # after release: publish nothing more
    # The attempt, as its request headers, the intake and the admission said.
    start: RequestStarted | None = None
    admitted: Admitted | None = None
    leased: bool = False  # `live` is this attempt's: its end must be written
    intake_refused: bool = False  # the request was never recorded: nothing to give back
    started_mono: float = 0.0
    admitted_mono: float = 0.0
    started_wall: float = 0.0
    waited_for_previous_s: float = 0.0
    replica_fingerprint: str | None = None
    model_revision: str | None = None
    http_status: int = 0
    slow: bool = False
    failed_on_purpose: bool = False
    # The attempt's end, while it is being settled (not released).
    end_facts: records.EndFacts | None = None
    end_plan: records.EndPlan | None = None
    ended_at: float = 0.0
    stream_closed: bool = False
    settled: str | None = None  # "class/fence/cause" once its end is settled (replay's)
    # The conditioned write in flight (TakeLease, Admit or Fence) and its resends.
    write: TakeLease | Admit | Fence | None = None
    tries: int = 0
    give_up: float = 0.0
    pause: float = RESEND_FIRST_PAUSE_S
    # The replica's agent (decision 0034): its version (0: no agent, and none of this runs).
    agent: int = 0
    source_sent_at: float | None = None  # the agent said the first content left the replica
    path_lost: bool = False  # failed for it: liveness uncertain, as a timed-out attempt
    path_lost_noted: bool = False  # no headers yet when its grace ran out: only noted
    cancel_sent: bool = False  # the agent was asked to stop the attempt at the engine
    end_entry: str | None = None  # Envoy's word as the end was settled (for the ack's)
    end_settled: records.Settled | None = None

    @classmethod
    def new(cls, request_id: str, max_buffer: int = 4 << 20,
            params: GateParams | None = None) -> GateMachine:
        p = params or GateParams(max_buffer=max_buffer)
        return cls(request_id=request_id, state=State.GATE_NEW, role="gate",
                   max_buffer=p.max_buffer, params=p)

    @property
    def journal_attempt(self) -> int:
        """The journal's number of this attempt: the re-run's offset plus Envoy's count."""
        return (self.start.attempt_offset if self.start else 0) + self.attempt

    @property
    def attempt_id(self) -> str:
        return self.start.attempt_id if self.start else ""

    @property
    def final(self) -> bool:
        """No attempt that counts comes after this one (decision 0024)."""
        return self.admitted is None or self.admitted.final

    def facts(self) -> records.AttemptFacts:
        s = self.start
        return records.AttemptFacts(
            attempt=self.journal_attempt, attempt_id=self.attempt_id,
            replica=s.replica if s else None, gateway_id=self.params.gateway_id,
            started_at=self.started_wall, waited_for_previous_s=self.waited_for_previous_s,
            model_revision=self.replica_fingerprint or self.model_revision, slow=self.slow)

    def _unavailable(self, reason: str) -> GatewayError:
        return upstream_unavailable(self.request_id, reason)

    def fail(self, reason: str) -> list[Action]:
        held = self.held
        self.held = 0
        self.state = State.GATE_FAILED
        self.failed_on_purpose = True
        return [FailAttempt(reason=reason, error=self._unavailable(reason), held_chunks=held,
                            retry=envoy_retries(503, self.final))]

    def cancel(self) -> list[Action]:
        """Ask the replica's agent to stop the attempt at the engine (once; agent only)."""
        if not self.agent or self.cancel_sent:
            return []
        self.cancel_sent = True
        return [PutCancel()]

    def agent_facts(self) -> dict[str, Any]:
        """What the attempt's record says of the agent's word (nothing without an agent)."""
        out: dict[str, Any] = {}
        if self.source_sent_at is not None:
            out["source_sent_at"] = self.source_sent_at
        if self.path_lost or self.path_lost_noted:
            out["path_lost"] = True
        if self.cancel_sent:
            out["cancel_sent"] = True
        return out

    def _fence(self) -> Fence:
        # Never sent past the attempt's own first-delta limit (less the margin).
        deadline = (self.admitted.deadline_s if self.admitted is not None
                    else self.params.first_delta_s)
        until = self.admitted_mono + max(0.0, deadline - self.waited_for_previous_s)
        return self._send(Fence(self.facts(), until - FENCE_MARGIN_S))

    def _send(self, w: W) -> W:
        """A conditioned write's first try (its resends follow from NotConfirmed)."""
        self.write, self.tries, self.pause = w, 1, RESEND_FIRST_PAUSE_S
        return w

    def hand_off(self, a: Release, lease_id: int) -> tuple[HandOff, str]:
        """The released attempt's frozen record, with a snapshot of this trace (kept in this
        process only), and its header form."""
        from .replay import snapshot  # replay reads this module's machine

        assert a.facts is not None
        ho = HandOff.from_record(a.facts.base(), lease_id, snapshot(self))
        return ho, ho.header()

    def error_body(self, a: FailAttempt, i: int) -> bytes:
        """What the `i`th held body message of a failed attempt is replaced with: the
        error's JSON in the family's shape, then nothing."""
        return self.family.error_json(a.error) if i == 0 else b""

    def never_started(self, live: str, no_gate_ran: Callable[[str], bool]) -> bool:
        """The admission may take `live` over from attempt 1 as the guard admitted it when
        no gate ever ran for it (Envoy's entry says so: its connection was refused)."""
        first = self.start.first_admitted if self.start is not None else None
        return first is not None and live == first and no_gate_ran(first)


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def request_started(hd: Mapping[str, str], replica: str | None, mint: Callable[[], str],
                    mono: float, wall: float) -> tuple[RequestStarted, str | None] | None:
    """An attempt's request headers as the gate's first event, with the attempt's
    credential if it came with them; None: not a journaled request (nothing to gate)."""
    rid = hd.get(H.REQUEST_ID)
    if not rid:
        return None
    envoy_attempt = _int(hd.get(H.ENVOY_ATTEMPT_COUNT), 1)
    first = hd.get(H.PREADMITTED) or None
    # Attempt 1 was admitted by the guard with the request, with its credential; a later
    # attempt never takes either: it gets its own id and, at admission, secret.
    pre = first if envoy_attempt == 1 else None
    try:
        accepted_at: float | None = float(hd.get(H.ACCEPTED_AT, ""))
    except ValueError:
        accepted_at = None
    return RequestStarted(
        envoy_attempt, family_for_path(hd.get(":path", "")).name,
        attempt_id=pre or mint(),
        # Set by our guard only (a client's is stripped), decision 0027.
        attempt_offset=max(0, _int(hd.get(H.ATTEMPT_OFFSET), 0)),
        preadmitted=pre is not None, first_admitted=first, replica=replica,
        want_fingerprint=hd.get(H.FINGERPRINT), prompt_tokens=_int(hd.get(H.PROMPT_TOKENS), 0),
        accepted_at=accepted_at, mono=mono, wall=wall), (
        hd.get(H.ATTEMPT_SECRET) or None if pre is not None else None)


GateFn = Callable[[GateMachine, Any], list[Action]]


# --- the admission: intake, verdict, lease or transaction ------------------------------


def _gate_start(m: GateMachine, ev: RequestStarted) -> list[Action]:
    m.attempt = ev.attempt
    m.start = ev
    m.started_mono = ev.mono
    if ev.family != m.family.name:
        m.family = family_named(ev.family)
        m.decoder = m.family.decoder()
    # Nothing goes upstream before the request and attempt 1 are recorded (decision 0021).
    # Every attempt waits, not only the first: when attempt 1 never reached a gate
    # (connection refused), Envoy's attempt 2 can come before the commit.
    m.state = State.GATE_AWAITING_INTAKE
    return [AwaitIntakeCommit()]


def _refuse(m: GateMachine, err: GatewayError, wall: float) -> list[Action]:
    m.state = State.GATE_CLOSED
    acts: list[Action] = []
    if m.start is not None and m.start.preadmitted and not m.intake_refused:
        # The guard admitted it with the request: give `live` back.
        n = m.journal_attempt  # 1, or a re-run's first (decision 0027)
        acts.append(GiveBack(n, records.refused_first_attempt(
            m.attempt_id, m.start.replica, wall, str(err.code), n)))
    acts.append(Refuse(err))
    return acts


def _gate_intake(m: GateMachine, ev: IntakeCommitted) -> list[Action]:
    if ev.error is not None:
        m.intake_refused = True
        return _refuse(m, ev.error, ev.wall)
    s = m.start
    assert s is not None
    p = m.params
    m.replica_fingerprint = ev.replica_fingerprint
    m.agent = ev.agent
    m.started_wall = ev.wall  # the admission's start, after the intake
    elapsed = max(0.0, ev.wall - s.accepted_at) if s.accepted_at is not None else 0.0
    m.state = State.GATE_DECIDING
    return [Decide(AttemptRequest(
        request_id=m.request_id, attempt=m.attempt, max_attempts=p.max_attempts,
        reached_before=ev.reached_count > 0, reached_count=ev.reached_count,
        elapsed_s=elapsed, total_first_delta_s=p.total_first_delta_s,
        first_delta_s=p.first_delta_s, fence_wait_s=p.fence_wait_s,
        want_fingerprint=s.want_fingerprint if ev.pool_enabled else None,
        replica_fingerprint=ev.replica_fingerprint, replica=s.replica,
        prompt_tokens=s.prompt_tokens, max_prompt_tokens=p.max_prompt_tokens,
        attempt_id=m.attempt_id))]


def _gate_decided(m: GateMachine, ev: AdmissionDecided) -> list[Action]:
    if ev.admitted is None:
        assert ev.error is not None
        return _refuse(m, ev.error, m.started_wall)
    m.admitted = ev.admitted
    m.state = State.GATE_ADMITTING
    if m.start is not None and m.start.preadmitted:
        # Admitted in the guard's intake transaction; the live key hangs on the process
        # lease (granted already, or granted now if another process admitted it).
        return [m._send(TakeLease())]
    return [m._send(Admit(m.journal_attempt, m.facts().admission(), ev.admitted.fence_wait_s,
                          (m.start.attempt_offset if m.start else 0) + 1,
                          ev.admitted.deadline_s - FENCE_MARGIN_S))]


def _gate_admitted(m: GateMachine, ev: AdmitDecided) -> list[Action]:
    if not ev.admitted:
        return _refuse(m, attempt_not_admitted(m.request_id, ev.reason,
                                               refusal_retryable(ev.reason)), ev.wall)
    m.leased = True
    m.waited_for_previous_s = ev.waited_s
    m.admitted_mono = ev.mono
    m.state = State.GATE_FORWARDED
    p = m.params
    deadline = m.admitted.deadline_s if m.admitted is not None else p.first_delta_s
    acts: list[Action] = [Watch()]
    if m.agent:
        acts.append(WatchSource())  # registered before the request goes upstream
    if p.soft_first_delta_s > 0:
        acts.append(StartTimer(TimerKind.SOFT_FIRST_DELTA, p.soft_first_delta_s))
    acts += [StartTimer(TimerKind.FIRST_DELTA, max(0.0, deadline - ev.waited_s)),
             ContinueRequest(bool(m.agent))]
    return acts


def _gate_admission_down(m: GateMachine, ev: StoreDown) -> list[Action]:
    err = journal_unavailable(m.request_id, "the attempt could not be fenced, so nothing "
                                            "was run")
    if m.start is not None and m.start.preadmitted:
        return _refuse(m, err, ev.wall)  # the lease could not be had: give attempt 1 back
    # The admission may still apply when etcd wakes: take it back once it can.
    return [UndoAdmission(m.journal_attempt), *_refuse(m, err, ev.wall)]


# --- a conditioned write sent again while etcd does not answer (decision 0026) -----------


def _gate_unconfirmed(m: GateMachine, ev: NotConfirmed) -> list[Action]:
    """Sent again after a pause (each try goes to the member in use, which moves on when
    one fails) until the resend deadline, or the attempt's own limit if that comes first:
    an election costs a wait, not the attempt. Then the write is given up (StoreDown)."""
    w = m.write
    if m.tries == 1:
        limit = ev.sent_mono + m.params.resend_deadline_s
        if isinstance(w, Admit):
            limit = min(limit, ev.sent_mono + w.deadline_s)
        elif isinstance(w, Fence):
            limit = min(limit, w.until_mono)
        m.give_up = limit
    if ev.mono + m.pause < m.give_up:
        pause, m.pause = m.pause, min(m.pause * 2, RESEND_MAX_PAUSE_S)
        return [StartTimer(TimerKind.RESEND, pause)]
    down = StoreDown(ev.error, ev.wall)
    if m.state is State.GATE_FENCING:
        return _gate_fence_down(m, down)
    return _gate_admission_down(m, down)


def _gate_resend(m: GateMachine, ev: TimerFired) -> list[Action]:
    """The pause is over: the same write, once more (a timer of another kind: nothing)."""
    if ev.kind is not TimerKind.RESEND or m.write is None:
        return _gate_fencing_timer(m, ev) if m.state is State.GATE_FENCING else []
    m.tries += 1
    return [m.write]


# --- the response: hold, fence, release --------------------------------------------------


def _gate_headers(m: GateMachine, ev: ResponseHeaders) -> list[Action]:
    m.http_status = ev.status
    m.model_revision = ev.model_revision
    acts: list[Action] = []
    if ev.status in (429, 503) and m.start is not None and m.start.replica:
        # Overloaded, not dead: tried after the others until its Retry-After.
        wait = retry_after_s(ev.retry_after, m.params.first_delta_s)
        if wait:
            acts.append(Overloaded(wait))
    if ev.status != 200:
        # The provider's own answer (a 400 with its reason, a 429, a 5xx): pass it through
        # untouched; the gate's retry mark decides, and the client gets the provider's body.
        m.state = State.GATE_PASSTHROUGH
        return [*acts, PassHeaders(envoy_retries(ev.status, m.final))]
    m.streaming = ev.content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
    m.state = State.GATE_HOLDING
    if ev.end_of_stream:
        return m.fail("empty 200 response")
    if m.path_lost_noted and m.params.source_grace_s > 0:
        # The agent's content was already overdue before the headers came: its grace runs
        # again from the headers (they prove the path carries something).
        return [StartTimer(TimerKind.SOURCE_GRACE, m.params.source_grace_s)]
    return []


def _gate_body_holding(m: GateMachine, ev: ResponseBody) -> list[Action]:
    m.held += 1
    m.body_bytes += len(ev.data)
    m.ended = ev.end_of_stream
    if m.body_bytes > m.max_buffer:
        return m.fail("response exceeded the gateway's buffer before the first delta")
    if m.streaming:
        # Only what comes before the first content matters here (the guard parses the
        # released bytes itself): the decoder stops there.
        events = m.decoder.feed_to_first_content(ev.data)
        if ev.end_of_stream and not (events and events[-1].kind is EventKind.CONTENT):
            events += m.decoder.finish()
        for e in events:
            if e.kind is EventKind.CONTENT:
                m.saw_content = True
                break
            if e.kind is EventKind.ERROR:
                return m.fail("in-band error event before the first delta")
            if e.kind is EventKind.MALFORMED:
                return m.fail("malformed event before the first delta")
            if e.kind is EventKind.DONE:
                m.saw_done = True
        if m.saw_content or (ev.end_of_stream and m.saw_done):
            # An answer with no content that ended with [DONE] is a complete empty answer.
            m.state = State.GATE_FENCING
            return [HoldChunk(), m._fence()]
        if ev.end_of_stream:
            return m.fail("stream ended without content or [DONE]")
        return [HoldChunk()]
    # Non-streaming: the "first delta" is the complete, valid body.
    m.buffered += ev.data
    if not ev.end_of_stream:
        return [HoldChunk()]
    try:
        obj = json.loads(bytes(m.buffered))
    except (ValueError, RecursionError):
        return m.fail("malformed JSON body")
    if not m.family.body_ok(obj):
        return m.fail("error body with status 200")
    m.state = State.GATE_FENCING
    return [HoldChunk(), m._fence()]


def _gate_body_fencing(m: GateMachine, ev: ResponseBody) -> list[Action]:
    m.held += 1
    m.ended = ev.end_of_stream
    return [HoldChunk()]


def _gate_fence(m: GateMachine, ev: FenceDecided) -> list[Action]:
    if not ev.committed:
        # Another attempt holds the request, or our lease is gone: never publish.
        return m.fail("fence lost: this attempt is no longer the live one")
    held = m.held
    m.held = 0
    m.state = State.GATE_RELEASED
    m.decoder = SseDecoder()  # the guard parses from here on; the gate only passes bytes
    # From here the guard owns the attempt: its timers end, its record goes with the hand-off.
    return [StopTimers(), Release(held_chunks=held, hand_off=not m.ended, facts=m.facts())]


def _gate_fence_down(m: GateMachine, ev: StoreDown) -> list[Action]:
    # Not confirmed: never release. The transaction may still apply when etcd wakes: take
    # it back once it can.
    return [UndoFence(m.facts()), *m.fail("fence lost: this attempt is no longer the live one")]




# --- the first-delta timers ------------------------------------------------------------


def _waited(m: GateMachine, ev: TimerFired) -> float:
    s = m.start
    w = (ev.wall - s.accepted_at if s is not None and s.accepted_at is not None
         else ev.mono - m.started_mono)
    return round(w, 3)


def _gate_first_delta_timeout(m: GateMachine, ev: TimerFired) -> list[Action]:
    # Headers (maybe a role event) came, no content within the limit: fail the attempt so
    # the router retries, or, with nothing left to retry with, end the request cleanly.
    # The replica may be partitioned or stuck: liveness uncertain (docs/fencing.md).
    m.timed_out = True
    if m.final:
        return _gate_timed_out_final(m, ev)
    return m.fail("no first delta within the first-delta limit") + m.cancel()


def _gate_timed_out_final(m: GateMachine, ev: TimerFired) -> list[Action]:
    # An ImmediateResponse from the upstream filter is never retried by the router: the
    # client gets our error at once, whether or not the replica ever sent headers.
    m.timed_out = True
    m.held = 0
    m.state = State.GATE_FAILED
    return [Refuse(upstream_timeout(m.request_id, _waited(m, ev), m.attempt)), *m.cancel()]


def _gate_forwarded_timeout(m: GateMachine, ev: TimerFired) -> list[Action]:
    # No response headers: nothing to answer with a 503. Envoy's per-try timeout (the
    # same limit, a moment later) resets the attempt and retries; the last attempt ends here.
    if m.final:
        return _gate_timed_out_final(m, ev)
    return []


def _gate_timer(m: GateMachine, ev: TimerFired) -> list[Action]:
    """A timer in a state where only the hard limit matters."""
    if ev.kind is TimerKind.SOFT_FIRST_DELTA:
        return _gate_soft(m, ev)
    if ev.kind is TimerKind.SOURCE_GRACE:
        return _gate_source_grace(m, ev)
    if m.state is State.GATE_HOLDING:
        return _gate_first_delta_timeout(m, ev)
    return _gate_forwarded_timeout(m, ev)


def _gate_soft(m: GateMachine, ev: TimerFired) -> list[Action]:
    # Slow is not dead: record it, change nothing (only first_delta_s fails over).
    if m.state in (State.GATE_FORWARDED, State.GATE_HOLDING, State.GATE_FENCING):
        m.slow = True
        return [MarkSlow()]
    return []


def _gate_fencing_timer(m: GateMachine, ev: TimerFired) -> list[Action]:
    # Content came: the agent's word is answered; only the soft limit still notes slowness.
    if ev.kind is TimerKind.SOURCE_GRACE:
        return []
    return _gate_soft(m, ev)


# --- the replica's agent: the first content left the replica (decision 0034) -------------


def _gate_source_sent(m: GateMachine, ev: SourceSent) -> list[Action]:
    # Positive evidence, not slowness: the replica sent its first content. If it does not
    # arrive within the grace, the path between the replica and Envoy is lost.
    if m.source_sent_at is not None or m.saw_content:
        return []
    m.source_sent_at = ev.at
    g = m.params.source_grace_s
    return [StartTimer(TimerKind.SOURCE_GRACE, g)] if g > 0 else []


def _gate_source_grace(m: GateMachine, ev: TimerFired) -> list[Action]:
    if m.saw_content:
        return []
    if m.state is State.GATE_FORWARDED:
        # No response headers: the gate has nothing to answer with a 503, and a gate's
        # ImmediateResponse is never retried by Envoy. Noted; Envoy's per-try timeout ends
        # it (docs/failure-classes.md).
        m.path_lost_noted = True
        return [MarkPathLost(failed=False)]
    # Headers came and the content the agent sent did not: fail it as the first-delta
    # limit does (liveness uncertain: the replica may go on decoding), and cancel it there.
    m.path_lost = True
    return [*m.fail("the replica's agent sent the first delta and none arrived within "
                    "source_grace_s"), MarkPathLost(failed=True), *m.cancel()]


def _gate_ignore(m: GateMachine, ev: Any) -> list[Action]:
    return []


def _gate_pass(m: GateMachine, ev: ResponseBody) -> list[Action]:
    if ev.end_of_stream:
        m.ended = True
    if m.lease_lost:
        # The guard's watchdog (or its own fence check) ends the stream for the client with
        # the terminal error; nothing more of this attempt goes out.
        return [DropChunk()]
    return [PassChunk()]


def _gate_lease_lost(m: GateMachine, ev: LeaseLost) -> list[Action]:
    # A trace kept before the chunk carried the lease's answer (`lease_expired`).
    m.lease_lost = True
    return []


def _expiring(row: GateFn) -> GateFn:
    """A body row that first hears the lease port's answer with the chunk: a lease run
    out locally ends the permission (`LoseLease`, idempotent at its owner); after the
    release the rest of the response is dropped, said once."""
    def expiring(m: GateMachine, ev: ResponseBody) -> list[Action]:
        if not ev.lease_expired or m.lease_lost:
            return row(m, ev)
        if m.state is State.GATE_RELEASED:
            m.lease_lost = True
        return [LoseLease("expired locally"), *row(m, ev)]
    return expiring


def _gate_drop(m: GateMachine, ev: ResponseBody) -> list[Action]:
    if ev.end_of_stream:
        m.ended = True
    return [DropChunk()]


def _gate_live(m: GateMachine, ev: LiveChanged) -> list[Action]:
    """The revocation watch: someone fenced this attempt (revoked, expired, replaced). Its
    permission ends at once; a released attempt drops the rest at its next message."""
    if m.leased and not m.stream_closed and ev.value != m.attempt_id:
        return [LoseLease("revoked or replaced", ev.value)]
    return []




# --- the attempt's end -------------------------------------------------------------------


def _gate_closed(m: GateMachine, ev: StreamClosed) -> list[Action]:
    prev = m.state
    m.stream_closed = True
    # First, nothing fed by the stream runs on: its timers, the watch on `live` (our own
    # revoke below would be heard as a fence), the agent's word.
    acts: list[Action] = [StopTimers(), StopWatching()]
    if m.start is not None and prev is not State.GATE_RELEASED:
        acts.append(RetryEnded())
    if prev is State.GATE_RELEASED or not m.leased:
        # Released: the guard ends it with the request. Never leased: nothing to end.
        m.state = State.GATE_CLOSED
        return acts
    f = records.EndFacts(
        released=False, upstream_finished=m.ended, timed_out=m.timed_out or m.path_lost,
        failed_on_purpose=m.failed_on_purpose, http_status=m.http_status,
        elapsed_s=ev.mono - m.started_mono, first_delta_s=m.params.first_delta_s)
    plan = records.plan_end(f)
    m.end_facts, m.end_plan, m.ended_at = f, plan, ev.wall
    if plan.revoke_now:
        # `ended_at` is when `live` went: what any overlap check needs.
        m.state = State.GATE_REVOKING
        return [*acts, RevokeEarly(m.journal_attempt,
                                   records.pending_revoke(m.facts().base(), ev.wall))]
    return acts + _await_word_or_settle(m, ev.wall)


def _await_word_or_settle(m: GateMachine, wall: float) -> list[Action]:
    assert m.end_plan is not None
    if m.end_plan.needs_cause:
        # Envoy's per-attempt access-log entry says reset (dead) vs timeout (uncertain),
        # and that Envoy has closed the attempt at all.
        m.state = State.GATE_AWAITING_WORD
        return [AwaitCause(m.attempt_id, m.params.access_log_wait_s)]
    return _settle(m, None, wall)


def _gate_revoked(m: GateMachine, ev: Revoked) -> list[Action]:
    assert m.end_plan is not None
    if not ev.confirmed:  # never confirmed: the lease will lapse by itself
        m.end_plan = records.EndPlan(False, False, m.end_plan.needs_cause)
    return _await_word_or_settle(m, m.ended_at)


def _gate_word(m: GateMachine, ev: CauseLearned) -> list[Action]:
    return _settle(m, ev.cause if ev.heard else None, ev.wall)


def _settle(m: GateMachine, entry: str | None, wall: float) -> list[Action]:
    f, plan = m.end_facts, m.end_plan
    assert f is not None and plan is not None
    p = m.params
    done = records.settle_end(f, plan, entry, p.cancel_ack)
    ended_at = m.ended_at if plan.revoke_now else wall
    if not plan.revoke_now:
        m.ended_at = ended_at
    # An uncertain end of an agent-fronted replica: the agent is asked to stop it at the
    # engine (if the gate did not ask already), and its acknowledgement awaited (0034).
    ack = bool(m.agent) and (m.cancel_sent
                             or done.failure_class is FailureClass.NETWORK_UNCERTAIN)
    cancel = m.cancel() if ack else []
    record = {**records.attempt_end(m.facts().base(), f, done, ended_at, p.lease_ttl_s),
              **m.agent_facts()}
    m.state = State.GATE_CLOSED
    m.settled = f"{done.failure_class}/{done.fence}/{done.cause}"
    m.end_entry, m.end_settled = entry, done
    # Confirmed end (the replica closed, answered, the client left, or Envoy closed an
    # uncertain one): `live` is deleted, so a retry may start now. Unknown
    # (policy.uncertain_source_liveness): the replica may still be decoding and may still
    # publish; fenced now, a retry is admitted only once the fence's lease expires, or
    # once the replica's agent acknowledges the cancel.
    timed_out, replica = m.timed_out or m.path_lost, m.start.replica if m.start else None
    close = CloseAttempt(
        m.journal_attempt, record, expire=done.fence is FenceKind.EXPIRE,
        update_only=plan.revoke_now, failure_class=str(done.failure_class),
        fence=str(done.fence), cause=done.cause, timed_out=timed_out,
        end_trace=records.end_trace(f, entry, p.cancel_ack, done), ack_follows=ack)
    # A first delta that never came counts against its replica's health; the trace is kept
    # now, or with the agent's acknowledgement when one is awaited (_gate_ack).
    acts: list[Action] = [MarkTimedOut(replica)] if timed_out and replica else []
    if not ack:
        acts.append(KeepTrace(*attempt_trace(close, m.attempt_id, replica)))
    acts.append(close)
    if ack:
        m.state = State.GATE_AWAITING_ACK
        # Bounded by the fence's own lease: past it the marker is gone by itself.
        acts += [*cancel, AwaitAck(float(p.lease_ttl_s))]
    return acts


def _gate_ack(m: GateMachine, ev: AckLearned) -> list[Action]:
    f, plan = m.end_facts, m.end_plan
    assert f is not None and plan is not None
    p = m.params
    first = m.end_settled or records.settle_end(f, plan, m.end_entry, p.cancel_ack)
    m.state = State.GATE_CLOSED
    replica = m.start.replica if m.start else None
    if not ev.heard:
        settled = AckSettled(m.journal_attempt, None, False, str(first.failure_class),
                             records.end_trace(f, m.end_entry, p.cancel_ack, first))
        return [KeepTrace(*attempt_trace(settled, m.attempt_id, replica)), settled]
    done = records.settle_end(f, plan, m.end_entry, p.cancel_ack, dict(ev.evidence or {}))
    record = {**records.attempt_end(m.facts().base(), f, done, m.ended_at, p.lease_ttl_s),
              **m.agent_facts()}
    m.settled = f"{done.failure_class}/{done.fence}/{done.cause}"
    # The engine let go and the agent stops a fenced attempt's bytes at the source: the
    # `fenced:` marker may go now, and a retry run at once.
    settled = AckSettled(m.journal_attempt, record, done.fenced_by_ack,
                         str(done.failure_class),
                         records.end_trace(f, m.end_entry, p.cancel_ack, done))
    return [KeepTrace(*attempt_trace(settled, m.attempt_id, replica)), settled]


def word(heard: tuple[str, int, int] | None, wall: float) -> CauseLearned:
    """Envoy's per-attempt word (its cause and the body bytes it sent, or None: nothing
    within the wait) as the gate's event: the cause only."""
    return CauseLearned(heard[0] if heard else "unknown", None, heard is not None, wall)


def _gate_closed_again(m: GateMachine, ev: StreamClosed) -> list[Action]:
    if m.stream_closed or m.start is None:
        return []
    # Refused (never leased): its stream's end ends nothing but its count in the budget.
    m.stream_closed = True
    return [StopTimers(), StopWatching(), RetryEnded()]


def attempt_trace(a: CloseAttempt | AckSettled, attempt_id: str, replica: str | None
                  ) -> tuple[str, dict[str, Any], bool]:
    """An ended attempt's trace as it is kept (at its close, or once the agent's
    acknowledgement is settled): its name, its meta, with the end plan's inputs and verdict
    (`extproc replay` decides it again), and whether it completed (a completed attempt's
    trace is kept only if every trace is)."""
    return f"attempt-{a.attempt:03d}", {
        "attempt_id": attempt_id, "replica": replica, "failure_class": a.failure_class,
        "end": dict(a.end_trace)}, a.failure_class == str(FailureClass.COMPLETED)


def admission_decided(verdict: Admitted | GatewayError) -> AdmissionDecided:
    """The admission port's verdict as the event the deciding row reads."""
    if isinstance(verdict, Admitted):
        return AdmissionDecided(verdict, None)
    return AdmissionDecided(None, verdict)


_OPEN = (S.GATE_NEW, S.GATE_AWAITING_INTAKE, S.GATE_DECIDING, S.GATE_ADMITTING,
         S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING, S.GATE_RELEASED,
         S.GATE_PASSTHROUGH, S.GATE_FAILED)
_ENDING = (S.GATE_REVOKING, S.GATE_AWAITING_WORD, S.GATE_AWAITING_ACK)
_UNLEASED = (S.GATE_NEW, S.GATE_AWAITING_INTAKE, S.GATE_DECIDING, S.GATE_ADMITTING,
             S.GATE_RELEASED)
_LEASED = (S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING, S.GATE_PASSTHROUGH,
           S.GATE_FAILED)

GATE_TABLE: Table = {
    # --- the admission
    (S.GATE_NEW, RequestStarted): T(_gate_start, S.GATE_AWAITING_INTAKE),
    (S.GATE_AWAITING_INTAKE, IntakeCommitted): T(_gate_intake, S.GATE_DECIDING, S.GATE_CLOSED),
    (S.GATE_DECIDING, AdmissionDecided): T(_gate_decided, S.GATE_ADMITTING, S.GATE_CLOSED),
    (S.GATE_ADMITTING, AdmitDecided): T(_gate_admitted, S.GATE_FORWARDED, S.GATE_CLOSED),
    # A format-2 trace's: the session then resent the write itself and fed StoreDown only
    # once it gave up. Now every unanswered try is NotConfirmed and the rows decide.
    (S.GATE_ADMITTING, StoreDown): T(_gate_admission_down, S.GATE_CLOSED),
    (S.GATE_ADMITTING, NotConfirmed): T(_gate_unconfirmed, S.GATE_ADMITTING, S.GATE_CLOSED),
    (S.GATE_ADMITTING, TimerFired): T(_gate_resend, S.GATE_ADMITTING),
    # --- the response
    (S.GATE_FORWARDED, ResponseHeaders): T(_gate_headers, S.GATE_PASSTHROUGH,
                                           S.GATE_HOLDING, S.GATE_FAILED),
    (S.GATE_HOLDING, ResponseBody): T(_expiring(_gate_body_holding), S.GATE_HOLDING, S.GATE_FENCING,
                                      S.GATE_FAILED),
    (S.GATE_FENCING, ResponseBody): T(_expiring(_gate_body_fencing), S.GATE_FENCING),
    (S.GATE_FENCING, FenceDecided): T(_gate_fence, S.GATE_RELEASED, S.GATE_FAILED),
    (S.GATE_FENCING, StoreDown): T(_gate_fence_down, S.GATE_FAILED),
    (S.GATE_FENCING, NotConfirmed): T(_gate_unconfirmed, S.GATE_FENCING, S.GATE_FAILED),
    (S.GATE_RELEASED, ResponseBody): T(_expiring(_gate_pass), S.GATE_RELEASED),
    (S.GATE_PASSTHROUGH, ResponseBody): T(_expiring(_gate_pass), S.GATE_PASSTHROUGH),
    (S.GATE_FAILED, ResponseBody): T(_expiring(_gate_drop), S.GATE_FAILED),
    (S.GATE_RELEASED, LeaseLost): T(_gate_lease_lost, S.GATE_RELEASED),
    # Before release the fence transaction itself checks the lease; after the end, moot.
    **stay(_gate_ignore, tuple(s for s in _OPEN + _ENDING + (S.GATE_CLOSED,)
                               if s is not S.GATE_RELEASED), LeaseLost),
    # --- the first-delta timers (started at admission, stopped at release or close)
    (S.GATE_HOLDING, TimerFired): T(_gate_timer, S.GATE_HOLDING, S.GATE_FAILED),
    (S.GATE_FORWARDED, TimerFired): T(_gate_timer, S.GATE_FORWARDED, S.GATE_FAILED),
    # Fencing (etcd txn in flight): the fence's resend, or too late to matter (the soft
    # one still notes a slow attempt); released or over: too late to matter.
    (S.GATE_FENCING, TimerFired): T(_gate_resend, S.GATE_FENCING),
    **stay(_gate_ignore, (S.GATE_RELEASED, S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED,
                          *_ENDING), TimerFired),
    # --- the end
    # Never leased, or released (the guard ends it): nothing more here.
    **{(st, StreamClosed): T(_gate_closed, S.GATE_CLOSED) for st in _UNLEASED},
    # Over before release: revoked at once if the end is confirmed, else Envoy's word.
    **{(st, StreamClosed): T(_gate_closed, S.GATE_CLOSED, S.GATE_REVOKING,
                             S.GATE_AWAITING_WORD, S.GATE_AWAITING_ACK) for st in _LEASED},
    (S.GATE_REVOKING, Revoked): T(_gate_revoked, S.GATE_AWAITING_WORD, S.GATE_CLOSED,
                                  S.GATE_AWAITING_ACK),
    (S.GATE_AWAITING_WORD, CauseLearned): T(_gate_word, S.GATE_CLOSED, S.GATE_AWAITING_ACK),
    (S.GATE_AWAITING_ACK, AckLearned): T(_gate_ack, S.GATE_CLOSED),
    # --- the replica's agent (decision 0034): its word that the first content left it
    (S.GATE_FORWARDED, SourceSent): T(_gate_source_sent, S.GATE_FORWARDED),
    (S.GATE_HOLDING, SourceSent): T(_gate_source_sent, S.GATE_HOLDING),
    **stay(_gate_ignore, tuple(s for s in _OPEN + _ENDING + (S.GATE_CLOSED,)
                               if s not in (S.GATE_FORWARDED, S.GATE_HOLDING)), SourceSent),
    **stay(_gate_closed_again, (S.GATE_CLOSED, *_ENDING), StreamClosed),
    # The revocation watch, whenever it speaks (it is cancelled at the stream's end).
    **stay(_gate_live, (*_OPEN, *_ENDING, S.GATE_CLOSED), LiveChanged),
}
GateMachine.TABLE = GATE_TABLE
