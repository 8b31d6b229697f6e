"""Logs, spans and metrics, derived from what the machines do: (role, transition, actions).

The sessions carry out actions and say nothing; after each event the machine consumed they
hand this module the state it left, the event, and the actions it answered with, and every
log line, span event and metric of the role is written here, once. The end of an attempt
(its log line, span events, fence metric and span end) is one function, `attempt_ended`,
whichever role ends it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, SpanKind

from ..core.errors import ErrorCode
from ..core.events import (
    Accepted,
    AckLearned,
    Action,
    AdmissionDecided,
    Admit,
    AdmitDecided,
    AnswerBody,
    CloseAttempt,
    Event,
    FailAttempt,
    Fence,
    FenceDecided,
    Finish,
    IntakeFailed,
    LeaseLost,
    LiveChanged,
    LoseLease,
    MarkPathLost,
    MarkSlow,
    NotConfirmed,
    PutCancel,
    Refuse,
    Release,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestStarted,
    ResponseBody,
    Send,
    StartTimer,
    State,
    StatusRead,
    StoreDown,
    TakeLease,
    TimerFired,
    UnreadableHandOff,
)
from ..core.failure import FailureClass
from ..core.failure import Fence as FenceKind
from ..core.families import family_for_path
from ..core.guard import (
    IntakeAction,
    IntakeAnswer,
    IntakeDown,
    IntakeEvent,
    IntakeFlow,
    PauseIntake,
)
from ..core.intake import Misrouted
from ..core.journal import Outcome
from ..core.pool import Pool
from .logs import rlog
from .session import INVALID
from .telemetry import NONE, Telemetry, end_span

if TYPE_CHECKING:
    from ..core.gate import GateMachine
    from .gate import GateSession
    from .guard import GuardSession

log = logging.getLogger("extproc")

# --- every role --------------------------------------------------------------------------


def attempt_ended(tel: Telemetry, span: Span | None, rid: str | None, aid: str, *,
                  attempt: int, released: bool, failure_class: str, fence: str,
                  cause: str | None, envoy_cause: str, model_revision: Any,
                  http_status: int | None, replica: str | None = None,
                  pool: Pool | None = None) -> None:
    """An attempt's end: its log line, its span's last event and end, the fence metric
    (by `replica`, bounded by the `pool`)."""
    rlog(log, logging.INFO, "attempt ended", rid, aid, attempt=attempt, released=released,
         failure_class=failure_class, fence=fence, cause=cause)
    if span is None:
        return
    span.add_event("lease.fenced_until_expiry" if fence == str(FenceKind.EXPIRE)
                   else "lease.revoked")
    if tel.enabled:  # a figure (and its label) only when something exports it
        tel.fences.add(1, {"kind": fence, "class": failure_class,
                           "replica": tel.labels.replica(replica, pool) if pool else NONE})
    end_span(span, None if failure_class == str(FailureClass.COMPLETED) else failure_class,
             **{"llmgw.failure_class": failure_class, "llmgw.released": released,
                "llmgw.fence": fence, "llmgw.envoy_cause": envoy_cause,
                "llmgw.model_revision": model_revision,
                "http.response.status_code": http_status or None})


# --- the gate ----------------------------------------------------------------------------

_ADMISSION = (State.GATE_AWAITING_INTAKE, State.GATE_DECIDING, State.GATE_ADMITTING)
_WRITES = {TakeLease: "attempt lease", Admit: "admission", Fence: "fence"}
# The events and actions `gate` says something about: any other is passed over by one set
# lookup, not a row of isinstance tests (no event or action type has subclasses).
_GATE_EVENTS = frozenset({AdmitDecided, FenceDecided, RequestStarted, AdmissionDecided,
                          NotConfirmed, StoreDown, LeaseLost, ResponseBody, AckLearned})
_GATE_ACTIONS = frozenset({Refuse, MarkPathLost, LoseLease, PutCancel, MarkSlow, Release,
                           FailAttempt, CloseAttempt})


def gate(s: GateSession, before: State, ev: Event, actions: list[Action]) -> None:
    """What the gate's transition from `before` on `ev` says to the operator."""
    m = s.m
    if m is None:
        return
    if type(ev) in _GATE_EVENTS:
        _gate_event(s, m, before, ev, actions)
    for a in actions:
        if type(a) in _GATE_ACTIONS:
            _gate_action(s, m, before, ev, a)


def _gate_event(s: GateSession, m: GateMachine, before: State, ev: Event,
                actions: list[Action]) -> None:
    rid, aid, tel = s.rid, m.attempt_id or None, s.p.tel
    if isinstance(ev, AdmitDecided | FenceDecided) and m.tries > 1:
        # Answered on a later try: what it answered (a refused fence is no confirmation).
        ok = ev.admitted if isinstance(ev, AdmitDecided) else ev.committed
        rlog(log, logging.INFO, f"{_WRITES.get(type(m.write), 'write')} "
             f"{'confirmed' if ok else 'refused'}", rid, aid, tries=m.tries)
    if isinstance(ev, RequestStarted):
        _start_span(s, ev)
    elif isinstance(ev, AdmissionDecided):
        last = s.p.budget.last
        if last is not None and (
                (ev.admitted is not None and ev.admitted.counts_as_retry)
                or (ev.error is not None
                    and ev.error.code is ErrorCode.RETRY_BUDGET_EXHAUSTED)):
            tel.budget_used.record(last.retries / max(1, last.limit))
    elif isinstance(ev, AdmitDecided) and ev.admitted:
        s.span.add_event("attempt.admitted", {"llmgw.waited_for_previous_ms":
                                              round(ev.waited_s * 1000, 2)})
        s.span.add_event("lease.granted")
        if m.attempt > 1:
            tel.retries.add(1, {"decision": "admitted",
                                "replica": tel.labels.replica(s.replica, s.p.pool)})
        rlog(log, logging.INFO, "attempt admitted", rid, aid, attempt=m.journal_attempt,
             replica=s.replica, waited_ms=round(ev.waited_s * 1000, 2),
             with_request=bool(m.start and m.start.preadmitted))
    elif isinstance(ev, NotConfirmed) and any(isinstance(a, StartTimer) for a in actions):
        rlog(log, logging.INFO, f"{_WRITES.get(type(m.write), 'write')} not confirmed; "
             "sending it again", rid, aid, error=ev.error, tries=m.tries)
    elif isinstance(ev, StoreDown | NotConfirmed):  # given up
        where = "admission" if before is State.GATE_ADMITTING else "the fence"
        if before is State.GATE_FENCING or not (m.start and m.start.preadmitted):
            rlog(log, logging.WARNING, f"journal unavailable at {where}"
                 + (": not releasing" if before is State.GATE_FENCING else ""),
                 rid, aid, error=ev.what if isinstance(ev, StoreDown) else ev.error)
    elif before is State.GATE_RELEASED and (isinstance(ev, LeaseLost) or (
            isinstance(ev, ResponseBody) and ev.lease_expired and actions
            and isinstance(actions[0], LoseLease))):
        rlog(log, logging.WARNING, "lease lost after release: dropping the rest", rid, aid)
    elif isinstance(ev, AckLearned):
        # The replica's agent and the cancel it was asked for (decision 0034).
        if ev.heard:
            ack = ev.evidence or {}
            s.span.add_event("attempt.cancel_acknowledged")
            rlog(log, logging.INFO, "the replica's agent acknowledged the cancel", rid, aid,
                 attempt=m.journal_attempt, replica=s.replica, evidence=ack.get("evidence"),
                 abort_ms=ack.get("abort_ms"), why=ack.get("why"), fence=m.settled)
        else:
            rlog(log, logging.WARNING, "no acknowledgement of the cancel from the replica's "
                 "agent: the lease's expiry fences it", rid, aid, attempt=m.journal_attempt,
                 replica=s.replica)


def _gate_action(s: GateSession, m: GateMachine, before: State, ev: Event,
                 a: Action) -> None:
    rid, aid, tel = s.rid, m.attempt_id or None, s.p.tel
    if isinstance(a, Refuse) and before in _ADMISSION:
        code = str(a.error.code)
        if not isinstance(ev, StoreDown | NotConfirmed):
            rlog(log, logging.WARNING, "attempt refused", rid, aid,
                 attempt=m.journal_attempt, code=code, reason=a.error.message,
                 replica=s.replica)
        s.span.add_event("attempt.refused", {"llmgw.reason": code})
        replica = tel.labels.replica(s.replica, s.p.pool)
        tel.refusals.add(1, {"code": code, "replica": replica})
        if m.attempt > 1:
            tel.retries.add(1, {"decision": "refused", "reason": code, "replica": replica})
        end_span(s.span, code)
    elif isinstance(a, MarkPathLost):
        s.span.add_event("attempt.path_lost", {"llmgw.failed": a.failed})
        rlog(log, logging.WARNING,
             "path lost: the replica's agent sent the first delta and none arrived"
             + ("" if a.failed else " (no response headers yet: Envoy's per-try timeout "
                "ends it)"), rid, aid, attempt=m.journal_attempt, replica=s.replica,
             source_grace_s=m.params.source_grace_s, source_sent_at=m.source_sent_at)
    elif isinstance(a, LoseLease) and isinstance(ev, LiveChanged):
        # The revocation watch: someone fenced the attempt (revoked, expired, replaced);
        # said by the call that ends the permission, as its owner will take it.
        if s.lease is not None and not s.lease.revoked:
            rlog(log, logging.WARNING, "attempt fenced: its lease was revoked or replaced",
                 rid, aid, live=a.live)
    elif isinstance(a, PutCancel):
        rlog(log, logging.INFO, "asked the replica's agent to cancel the attempt", rid, aid,
             attempt=m.journal_attempt, replica=s.replica)
    elif isinstance(a, MarkSlow):
        rlog(log, logging.INFO,
             "first delta slower than the soft expectation (not a failure)", rid, aid,
             soft_first_delta_s=m.params.soft_first_delta_s, replica=s.replica)
    elif isinstance(a, Release):
        s.span.add_event("first_delta.fenced", {"llmgw.held_chunks": a.held_chunks})
        rlog(log, logging.INFO, "first delta fenced: released", rid, aid,
             attempt=m.journal_attempt, replica=s.replica, held_chunks=a.held_chunks,
             ttfd_ms=round((s.p.clock.monotonic() - m.started_mono) * 1000, 2))
        s.span.add_event("attempt.handed_off")
    elif isinstance(a, FailAttempt):
        s.span.add_event("attempt.failed", {"llmgw.reason": a.reason})
        rlog(log, logging.WARNING, "attempt failed before first delta", rid, aid,
             attempt=m.journal_attempt, replica=s.replica, reason=a.reason)
    elif isinstance(a, CloseAttempt):
        attempt_ended(tel, s.span, rid, m.attempt_id, attempt=a.attempt, released=False,
                      failure_class=a.failure_class, fence=a.fence, cause=a.cause,
                      envoy_cause=a.cause, model_revision=a.record.get("model_revision"),
                      http_status=m.http_status, replica=s.replica, pool=s.p.pool)


def _start_span(s: GateSession, ev: RequestStarted) -> None:
    tel = s.p.tel
    if not tel.tracing:  # no attributes to gather for a span that records nothing
        s.span = tel.unrecorded()
        return
    parent = tel.parent_from({"traceparent": s.parent_tp} if s.parent_tp else s.md)
    host, _, port = (ev.replica or "").rpartition(":")
    s.span = tel.start("llm.attempt", parent, SpanKind.CLIENT, {
        "llmgw.request_id": s.rid, "llmgw.attempt_id": ev.attempt_id,
        "llmgw.attempt": ev.attempt_offset + ev.attempt, "llmgw.envoy_attempt": ev.attempt,
        "server.address": host or None, "server.port": int(port) if port.isdigit() else None,
        "llmgw.fingerprint": s.p.pool.fingerprint_of(ev.replica or "")})


# --- the guard ---------------------------------------------------------------------------

# Outcomes whose cause the guard's own terminal event stated.
_INJECTED = ("stall", "in-band error", "malformed event")


def guard(s: GuardSession, ev: Event, actions: list[Action]) -> None:
    """What the guard's transition on `ev` says to the operator (called before the actions
    are carried out, so a span a body answer carries exists by then)."""
    m = s.m
    if m is None:
        return
    for a in actions:
        if type(a) is Send:  # the hot path: once per chunk
            if not s.first_delta_evented and m.delivered > 0 and (a.data or a.end_of_stream):
                s.first_delta_evented = True
                s.span.add_event("first_delta.delivered")
                _first_delta(s)
        elif isinstance(a, AnswerBody):
            _guard_span(s)
        elif isinstance(a, Accepted):
            _guard_span(s)
            _guard_accepted(s)
        elif isinstance(a, IntakeFailed):
            # The gate gives the client this error; nothing ran.
            end_span(s.span, str(a.error.code))
            s.span = INVALID
        elif isinstance(a, Finish):
            if isinstance(ev, TimerFired):
                rlog(log, logging.WARNING, "upstream silent after first delta: ending stream",
                     s.rid, None, delivered_output_tokens=m.delivered)
            _guard_finished(s, a)
        elif isinstance(a, LoseLease):
            rlog(log, logging.WARNING, "attempt fenced: its lease was revoked or replaced",
                 s.rid, m.released_id)
        elif isinstance(a, UnreadableHandOff):
            rlog(log, logging.ERROR, "unreadable attempt hand-off", s.rid, None)
        elif isinstance(a, Refuse):
            _guard_refused(s, ev, a)


def _guard_refused(s: GuardSession, ev: Event, a: Refuse) -> None:
    """The request phase's refusals, each said once, as the intake decided them."""
    code = str(a.error.code)
    s.p.tel.refusals.add(1, {"code": code, "replica": NONE})
    if isinstance(ev, RequestHeadersSeen) and ev.kind == "misrouted":
        v = s.verdict
        rlog(log, logging.WARNING, "request refused: wrong listener for its path", None, None,
             code=code, path=v.path if isinstance(v, Misrouted) else None,
             tools_listener=s.tools_listener)
    elif isinstance(ev, RequestHeadersSeen) and ev.kind == "rejected":
        rlog(log, logging.INFO, "request rejected", a.error.request_id, None, code=code)
    elif (isinstance(ev, RequestBodySeen) and ev.error is not None
          and ev.error.code is not ErrorCode.NO_COMPATIBLE_REPLICA):
        rlog(log, logging.INFO, "request body rejected", s.rid, None, code=code)
    elif isinstance(ev, StatusRead) and ev.down is not None:
        rlog(log, logging.WARNING, "journal unavailable", a.error.request_id, None,
             error=ev.down)


def _guard_span(s: GuardSession) -> None:
    if s.span is not INVALID or s.gen is None or s.kept is None:
        return
    k = s.kept
    gen, tel = s.gen, s.p.tel
    if not tel.tracing:  # no attributes to gather for a span that records nothing
        s.span = tel.unrecorded()
        return
    s.span = tel.start("llm.request", tel.parent_from(s.md), SpanKind.SERVER, {
        "llmgw.request_id": s.rid or "", "gen_ai.request.model": k.model,
        "gen_ai.operation.name": family_for_path(gen.path).operation,
        "http.request.method": "POST", "url.path": gen.path,
        "llmgw.stream": k.stream, "llmgw.fingerprint": k.fingerprint,
        "llmgw.gateway_id": s.cfg.server.gateway_id})


def _guard_accepted(s: GuardSession) -> None:
    k = s.kept
    assert k is not None
    rlog(log, logging.INFO, "request accepted", s.rid, None, stream=k.stream,
         model=k.model, fingerprint=k.fingerprint)
    s.span.add_event("request.accepted")
    if s.rerun is not None:
        s.span.add_event("request.rerun", {"llmgw.run": s.rerun.run,
                                           "llmgw.first_attempt": s.rerun.first_attempt})


def _guard_finished(s: GuardSession, f: Finish) -> None:
    m, tel = s.m, s.p.tel
    assert m is not None
    if m.withheld:
        # Forwarded by us, never written by Envoy: the stream was gone first.
        rlog(log, logging.WARNING, "content the guard forwarded never reached the client",
             s.rid, m.released_id, withheld_content_events=m.withheld, handed_bytes=m.sent)
    rlog(log, logging.INFO, "request finished", s.rid, None, outcome=str(f.outcome),
         delivered_output_tokens=f.delivered_output_tokens, cause=f.cause,
         delivered_output_tokens_source=f.source, delivered_output_tokens_bound=f.bound)
    if f.cause in _INJECTED:
        s.span.add_event("terminal_error.injected", {"llmgw.cause": f.cause})
    if f.outcome is Outcome.CLIENT_DISCONNECTED:
        s.span.add_event("client.gone")
    if tel.enabled:  # figures (and their labels) only when something exports them
        model, replica, semconv = _request_labels(s)
        if f.outcome is Outcome.UPSTREAM_DECODE_INTERRUPTED:
            tel.interruptions.add(1, {"cause": f.cause or "unknown", "model": model,
                                      "replica": replica})
        tel.outcomes.add(1, {"outcome": str(f.outcome), "model": model})
        if s.kept is not None:  # accepted: the request's figures (a refusal has none)
            took = s.p.clock.wall() - s.kept.created_at
            done = semconv if f.outcome is Outcome.COMPLETED else {
                **semconv, "error.type": str(f.outcome)}
            tel.duration.record(max(0.0, took), done)
            tel.tokens.record(f.delivered_output_tokens,
                              {**semconv, "gen_ai.token.type": "output"})
    end_span(s.span, None if f.outcome is Outcome.COMPLETED else str(f.outcome),
             **{"llmgw.outcome": str(f.outcome), "llmgw.cause": f.cause,
                "gen_ai.usage.output_tokens": f.delivered_output_tokens,
                "llmgw.delivered_output_tokens_exact": f.exact,
                "llmgw.delivered_output_tokens_source": f.source,
                "llmgw.delivered_output_tokens_bound": f.bound,
                "llmgw.first_delta_sent": m.delivered > 0,
                "http.response.status_code": m.status})


def _request_labels(s: GuardSession) -> tuple[str, str, dict[str, str]]:
    """The request's bounded `model` and `replica` (the attempt that delivered; `none`
    before one did), and the same as the GenAI conventions' attributes."""
    tel, pool = s.p.tel, s.p.pool
    k = s.kept
    ho = s.released.handoff if s.released is not None else None
    model = tel.labels.model(k.model if k else None, pool)
    replica = tel.labels.replica(ho.replica if ho else None, pool)
    op = family_for_path(s.gen.path).operation if s.gen is not None else NONE
    return model, replica, {"gen_ai.operation.name": op, "gen_ai.request.model": model,
                            "server.address": replica}


def _first_delta(s: GuardSession) -> None:
    """The first delta went downstream: the request's time to it, and what failover cost.
    Only figures and a span attribute: nothing to do when neither is exported (the labels
    are not even learnt, as no figure will ever carry them)."""
    k = s.kept
    if k is None or not s.p.tel.enabled:
        return
    tel, ho = s.p.tel, s.released.handoff if s.released is not None else None
    start = k.created_at
    model, replica, semconv = _request_labels(s)
    if k.stream:  # the conventions: streaming calls only
        took = max(0.0, s.p.clock.wall() - start)
        tel.ttfc.record(took, semconv)
        s.span.set_attribute("gen_ai.response.time_to_first_chunk", round(took, 6))
    if ho is None:
        return
    # Attempts of this run (a re-run's numbers go on from the runs before, decision 0027).
    n = ho.attempt - (s.rerun.attempt_offset if s.rerun is not None else 0)
    labels = {"model": model, "replica": replica}
    tel.attempts.record(max(1, n), labels)
    if n > 1:
        tel.added.record(max(0.0, ho.started_at - start), labels)


def guard_intake(flow: IntakeFlow, ev: IntakeEvent, acts: list[IntakeAction]) -> None:
    """The intake's log lines, derived from what its flow decided."""
    rid, aid = flow.request_id, flow.attempt_id
    for a in acts:
        if isinstance(a, PauseIntake) and isinstance(ev, IntakeDown):
            rlog(log, logging.INFO, "intake not confirmed; sending it again", rid, aid,
                 error=ev.error, tries=flow.tries)
        elif isinstance(a, IntakeAnswer):
            if a.error is None and flow.confirmed_own:
                rlog(log, logging.INFO, "intake confirmed by its own record", rid, aid,
                     tries=flow.tries)
            if isinstance(ev, IntakeDown):
                rlog(log, logging.WARNING, "journal unavailable", rid, None, error=ev.error)
            elif a.error is not None and flow.view is not None:
                view = flow.view
                rlog(log, logging.INFO, "repeat of a known request", rid, None,
                     code=str(a.error.code), outcome=view.outcome_value, runs=view.runs)
            if a.rerun is not None:
                r = a.rerun
                rlog(log, logging.INFO, "repeat runs the request again", rid, aid,
                     run=r.run, attempt=r.first_attempt, ended=r.outcome.get("outcome"),
                     ended_cause=r.outcome.get("cause"))
