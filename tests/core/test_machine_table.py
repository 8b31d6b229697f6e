"""The transition table, exhaustively, and the gate and guard scenarios with exact actions."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from extproc.core import records
from extproc.core.errors import ErrorCode, GatewayError, decode_interrupted
from extproc.core.events import (
    AdmissionDecided,
    AdmitDecided,
    AnswerBody,
    AwaitCause,
    AwaitIntake,
    CauseLearned,
    Event,
    Fenced,
    FenceDecided,
    Finish,
    IntakeCommitted,
    LeaseLost,
    OpenIntake,
    PassHeaders,
    RecordWritten,
    Refuse,
    RegisterIntake,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Revoked,
    Send,
    StartTimer,
    State,
    StopTimers,
    StoreDown,
    StreamClosed,
    TimerFired,
    TimerKind,
)
from extproc.core.gate import (
    GATE_TABLE,
    GateMachine,
)
from extproc.core.guard import (
    GUARD_TABLE,
    GuardMachine,
)
from extproc.core.journal import Outcome
from extproc.core.machine import ProtocolViolation
from extproc.core.sse import DONE_EVENT, EventKind, SseDecoder, encode_event

from .gate_drive import ADMITTED

RID = "req_0123456789abcdefghjkmnpqrs"
# Both roles' rows, keyed as (role, state, event type).
TABLE = {**{("gate", s, e): t for (s, e), t in GATE_TABLE.items()},
         **{("guard", s, e): t for (s, e), t in GUARD_TABLE.items()}}
SSE = "text/event-stream"
STALL = 15.0


def _delta(delta: dict[str, Any], **extra: Any) -> bytes:
    return encode_event({"id": "c1", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, **extra}]})


ROLE = _delta({"role": "assistant", "content": ""})
EMPTY = _delta({})
FINISH = _delta({}, finish_reason="stop")
USAGE = encode_event({"id": "c1", "choices": [],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
ERROR = encode_event({"error": {"message": "CUDA error: device lost", "type": "server_error",
                                "code": "engine_dead"}})
MALFORMED = b'data: {"choices": [\n\n'


def content(text: str) -> bytes:
    return _delta({"content": text})


# --- the table, exhaustively ----------------------------------------------------------------

EVENT_TYPES: tuple[type, ...] = get_args(Event)
GATE_STATES = [s for s in State if s.value.startswith("gate_")]
GUARD_STATES = [s for s in State if s.value.startswith("guard_")]

CANONICAL: dict[type, Any] = {
    RequestStarted: RequestStarted(1),
    IntakeCommitted: IntakeCommitted(),
    AdmissionDecided: AdmissionDecided(ADMITTED),
    StoreDown: StoreDown("etcd away"),
    TimerFired: TimerFired(TimerKind.FIRST_DELTA),
    Revoked: Revoked(True),
    AdmitDecided: AdmitDecided(True),
    ResponseHeaders: ResponseHeaders(200, SSE),
    ResponseBody: ResponseBody(b"", False),
    FenceDecided: FenceDecided(True),
    StreamClosed: StreamClosed(),
    CauseLearned: CauseLearned("client"),
    RecordWritten: RecordWritten(True),
    Fenced: Fenced(),
    LeaseLost: LeaseLost(),
    RequestHeadersSeen: RequestHeadersSeen("generation"),
    RequestBodySeen: RequestBodySeen(None),
    RequestOpened: RequestOpened(True),
}


def _machine(role: str, state: State) -> GateMachine | GuardMachine:
    m: GateMachine | GuardMachine
    m = GateMachine.new(RID) if role == "gate" else GuardMachine.new(RID, STALL)
    if isinstance(m, GateMachine):
        # What every gate state past the first has: its start, and once ending its plan.
        m.start = RequestStarted(1, attempt_id="att_1")
        m.end_facts = records.EndFacts(False, False, False, False, 0, 0.0, 30.0)
        m.end_plan = records.plan_end(m.end_facts)
    m.state = state
    return m


def test_event_union_is_fully_covered_by_the_canonical_events() -> None:
    assert set(EVENT_TYPES) == set(CANONICAL)
    assert len(GATE_STATES) + len(GUARD_STATES) == len(State)


def test_table_keys_are_well_formed() -> None:
    for role, state, ev_type in TABLE:
        assert role in ("gate", "guard")
        assert state in (GATE_STATES if role == "gate" else GUARD_STATES), (role, state)
        assert ev_type in EVENT_TYPES, ev_type


ALL_PAIRS = [("gate", s, t) for s in GATE_STATES for t in EVENT_TYPES] + [
    ("guard", s, t) for s in GUARD_STATES for t in EVENT_TYPES]
CROSS_PAIRS = [("gate", s, t) for s in GUARD_STATES for t in EVENT_TYPES] + [
    ("guard", s, t) for s in GATE_STATES for t in EVENT_TYPES]


def _id(p: tuple[str, State, type]) -> str:
    return f"{p[0]}-{p[1].value}-{p[2].__name__}"


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=[_id(p) for p in ALL_PAIRS])
def test_every_pair_is_in_the_table_or_a_protocol_violation(
        pair: tuple[str, State, type]) -> None:
    role, state, ev_type = pair
    m = _machine(role, state)
    ev = CANONICAL[ev_type]
    if pair in TABLE:
        actions = m.handle(ev)
        assert isinstance(actions, list)
        assert len(m.trace) == 1 and m.trace[0]["type"] == ev_type.__name__
        assert len(m.decisions) == 1
    else:
        with pytest.raises(ProtocolViolation, match=ev_type.__name__):
            m.handle(ev)
        # A refused event leaves no mark: nothing recorded, no state change.
        assert m.state is state
        assert m.trace == [] and m.decisions == []


@pytest.mark.parametrize("pair", CROSS_PAIRS, ids=[_id(p) for p in CROSS_PAIRS])
def test_a_machine_in_the_other_roles_state_always_raises(
        pair: tuple[str, State, type]) -> None:
    role, state, ev_type = pair
    m = _machine(role, state)
    with pytest.raises(ProtocolViolation):
        m.handle(CANONICAL[ev_type])


def test_forwarded_and_request_events_are_never_guard_transitions() -> None:
    # The guard is driven by response events only.
    for state in GUARD_STATES:
        for ev_type in (RequestStarted, AdmitDecided, FenceDecided, IntakeCommitted,
                        AdmissionDecided, StoreDown, Revoked):
            assert ("guard", state, ev_type) not in TABLE


# --- guard scenarios ----------------------------------------------------------------------


def streaming_guard() -> GuardMachine:
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(200, SSE)) == [PassHeaders()]
    assert m.state is State.GUARD_RESPONDING
    return m


def terminal(delivered: int, exact: bool | None = None) -> bytes:
    """Our terminal event; a count of events is exact only when it is 0 (decision 0018)."""
    return decode_interrupted(RID, delivered, delivered == 0 if exact is None else exact
                              ).sse_bytes()


def test_terminal_event_bytes_are_the_client_contract() -> None:
    events = SseDecoder().feed(terminal(37))
    assert [e.kind for e in events] == [EventKind.ERROR, EventKind.DONE]
    err = json.loads(events[0].data)["error"]
    assert err["code"] == "upstream_decode_interrupted"
    assert err["message"] == "Generation was interrupted after part of the answer was sent"
    assert err["request_id"] == RID
    assert err["partial_output"] is True
    assert err["retryable"] is False
    assert err["delivered_output_tokens"] == 37


def test_guard_counts_content_units_and_completes() -> None:
    m = streaming_guard()
    assert m.handle(ResponseBody(ROLE, False)) == [Send(ROLE, False)]
    assert m.delivered == 0 and m.state is State.GUARD_RESPONDING
    assert m.handle(ResponseBody(content("Hel"), False)) == [
        Send(content("Hel"), False), StartTimer(TimerKind.STALL, STALL)]
    assert m.state is State.GUARD_STREAMING
    two = encode_event({"choices": [{"index": 0, "delta": {"content": "a"}},
                                    {"index": 1, "delta": {"content": "b"}}]})
    assert m.handle(ResponseBody(two + EMPTY, False)) == [
        Send(two + EMPTY, False), StartTimer(TimerKind.STALL, STALL)]
    assert m.delivered == 3
    tail = FINISH + USAGE + DONE_EVENT
    assert m.handle(ResponseBody(tail, True)) == [Send(tail, True), StopTimers()]
    assert m.state is State.GUARD_COMPLETE
    assert m.handle(StreamClosed()) == [
        StopTimers(), Finish(Outcome.COMPLETED, 3, None, exact=False)]
    assert m.finished == Finish(Outcome.COMPLETED, 3, None, exact=False)
    assert m.handle(StreamClosed()) == []


def test_guard_error_after_delivery_is_replaced_by_our_terminal_event() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a"), False))
    acts = m.handle(ResponseBody(content("b") + ERROR + content("c"), False))
    fin = Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "in-band error", exact=False)
    assert acts == [Send(content("b") + terminal(2), True), StopTimers(), fin]
    assert m.state is State.GUARD_TERMINATED
    sent = b"".join(a.data for a in acts if isinstance(a, Send))
    assert b"engine_dead" not in sent and b"CUDA" not in sent
    # Whatever comes afterwards goes nowhere.
    assert m.handle(ResponseBody(content("d") + DONE_EVENT, True)) == []
    assert m.handle(TimerFired(TimerKind.STALL)) == []
    assert m.handle(StreamClosed()) == []
    assert m.state is State.GUARD_CLOSED
    assert m.finished == fin
    assert m.handle(CauseLearned("upstream")) == []


def test_guard_malformed_after_delivery_terminates() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(content("a"), False))
    acts = m.handle(ResponseBody(MALFORMED, False))
    assert acts == [Send(terminal(1), True), StopTimers(),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 1, "malformed event", exact=False)]


def test_guard_stall_before_delivery_does_nothing() -> None:
    m = streaming_guard()
    assert m.handle(TimerFired(TimerKind.STALL)) == []
    m.handle(ResponseBody(ROLE, False))
    assert m.handle(TimerFired(TimerKind.STALL)) == []
    assert m.state is State.GUARD_RESPONDING and m.finished is None


def test_guard_stall_after_delivery_ends_the_stream() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a") + content("b"), False))
    acts = m.handle(TimerFired(TimerKind.STALL))
    assert acts == [Send(terminal(2), True),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "stall", exact=False)]
    assert m.state is State.GUARD_TERMINATED
    assert m.handle(ResponseBody(content("late"), False)) == []


def test_guard_fenced_attempt_ends_the_stream_at_once() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a") + content("b"), False))
    acts = m.handle(Fenced())
    assert acts == [Send(terminal(2), True), StopTimers(),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "fenced", exact=False)]
    assert m.state is State.GUARD_TERMINATED
    assert m.handle(ResponseBody(content("late"), False)) == []
    assert m.handle(Fenced()) == []


def test_guard_fenced_before_any_content_still_publishes_nothing() -> None:
    m = streaming_guard()
    acts = m.handle(Fenced())
    assert acts == [Send(terminal(0), True), StopTimers(),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 0, "fenced")]


def test_guard_fenced_after_done_changes_nothing() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(content("a") + FINISH + DONE_EVENT, False))
    assert m.handle(Fenced()) == []
    assert m.state is State.GUARD_RESPONDING or m.state is State.GUARD_STREAMING


def test_trace_budget_bounds_what_is_recorded_not_what_is_handled() -> None:
    m = streaming_guard()
    m.trace_budget = 64 + len(content("a"))
    n0 = len(m.trace)
    m.handle(ResponseBody(content("a"), False))
    assert len(m.trace) == n0 + 1 and not m.trace_truncated
    acts = m.handle(ResponseBody(content("b"), False))
    assert acts == [Send(content("b"), False), StartTimer(TimerKind.STALL, STALL)]
    assert len(m.trace) == n0 + 1 and len(m.decisions) == n0 + 1 and m.trace_truncated
    assert m.delivered == 2


def test_guard_incomplete_fragment_is_not_sent_at_stall() -> None:
    m = streaming_guard()
    nxt = content("FRAGMENT")
    acts = m.handle(ResponseBody(content("a") + nxt[:15], False))
    assert acts == [Send(content("a"), False), StartTimer(TimerKind.STALL, STALL)]
    [send, _fin] = m.handle(TimerFired(TimerKind.STALL))
    assert send == Send(terminal(1), True)
    assert nxt[:15] not in send.data


def test_guard_stream_closed_mid_stream_awaits_the_cause() -> None:
    for cause, outcome in [("client", Outcome.CLIENT_DISCONNECTED),
                           ("upstream", Outcome.UPSTREAM_DECODE_INTERRUPTED),
                           ("unknown", Outcome.UPSTREAM_DECODE_INTERRUPTED),
                           ("timeout", Outcome.UPSTREAM_DECODE_INTERRUPTED)]:
        m = streaming_guard()
        m.handle(ResponseBody(content("a") + content("b"), False))
        assert m.handle(StreamClosed()) == [StopTimers(), AwaitCause()]
        assert m.state is State.GUARD_AWAIT_CAUSE
        # Envoy's entry says it sent every byte the guard handed it (decision 0025).
        sent = len(content("a") + content("b"))
        assert m.handle(CauseLearned(cause, sent)) == [Finish(outcome, 2, cause, exact=False)]
        assert m.state is State.GUARD_CLOSED
        assert m.handle(CauseLearned(cause, sent)) == []


def test_guard_stream_closed_before_delivery() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE, False))
    assert m.handle(StreamClosed()) == [StopTimers(), AwaitCause()]
    assert m.handle(CauseLearned("upstream")) == [Finish(Outcome.UPSTREAM_FAILED, 0, "upstream")]
    m = streaming_guard()
    m.handle(StreamClosed())
    assert m.handle(CauseLearned("client")) == [
        Finish(Outcome.CLIENT_DISCONNECTED, 0, "client")]
    m = GuardMachine.new(RID, STALL)
    assert m.handle(StreamClosed()) == [StopTimers(), AwaitCause()]


def test_guard_non_200_completes_as_upstream_failed() -> None:
    m = GuardMachine.new(RID, STALL)
    m.handle(ResponseHeaders(503, "application/json", ours=True))  # the gate's own 503
    body = b'{"error":{"code":"upstream_unavailable"}}'
    assert m.handle(ResponseBody(body, True)) == [Send(body, True)]
    assert m.handle(StreamClosed()) == [
        StopTimers(), Finish(Outcome.UPSTREAM_FAILED, 0, "http 503")]


def test_guard_headers_only_response() -> None:
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(204, "", end_of_stream=True)) == [PassHeaders()]
    assert m.state is State.GUARD_COMPLETE


def test_guard_non_streaming_counts_completion_tokens() -> None:
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "hi there"}}],
                       "usage": {"completion_tokens": 7}}).encode()
    m = GuardMachine.new(RID, STALL)
    m.handle(ResponseHeaders(200, "application/json"))
    assert m.handle(ResponseBody(body[:5], False)) == [Send(body[:5], False)]
    assert m.handle(ResponseBody(body[5:], True)) == [Send(body[5:], True)]
    assert m.handle(StreamClosed()) == [StopTimers(), Finish(
        Outcome.COMPLETED, 7, None, exact=True, source="engine")]


def test_the_guard_request_phase_is_in_the_table() -> None:
    err = GatewayError(ErrorCode.INVALID_REQUEST_BODY, "bad", 400, request_id=RID)
    for kind, body, opened, end in [
            ("generation", None, True, State.GUARD_WAITING),
            ("generation", None, False, State.GUARD_ASIDE),   # a repeat, or etcd down
            ("generation", err, None, State.GUARD_ASIDE),     # a body we cannot run
            ("passthrough", None, None, State.GUARD_ASIDE),
            ("status", None, None, State.GUARD_ASIDE)]:
        m = GuardMachine.new(RID, STALL, at_request=True)
        assert m.state is State.GUARD_NEW and not m.accepted
        m.handle(RequestHeadersSeen(kind))
        if kind == "generation":
            acts = m.handle(RequestBodySeen(body))
            assert acts == ([Refuse(err)] if body is not None else [
                OpenIntake(), RegisterIntake(), AnswerBody(), AwaitIntake()])
            if opened is not None:
                m.handle(RequestOpened(opened))
        assert m.state is end and m.accepted is (end is State.GUARD_WAITING)
        # Closing before the intake finished records nothing.
        if not m.accepted:
            assert m.handle(StreamClosed()) == [] and m.state is State.GUARD_CLOSED


def opening_guard() -> GuardMachine:
    m = GuardMachine.new(RID, STALL, at_request=True)
    m.handle(RequestHeadersSeen("generation"))
    m.handle(RequestBodySeen(None))
    assert m.state is State.GUARD_OPENING
    return m


def test_a_stream_closed_during_its_intake_is_finished_if_the_intake_commits() -> None:
    # The intake commits after the stream closed: the record is ours to finish, from
    # Envoy's cause, or a repeat of its key would be "in progress" for as long as we live.
    m = opening_guard()
    assert m.handle(StreamClosed()) == [] and m.state is State.GUARD_LEFT_OPENING
    assert not m.accepted
    assert m.handle(StreamClosed()) == [] and m.state is State.GUARD_LEFT_OPENING
    assert m.handle(RequestOpened(True)) == [AwaitCause()]
    assert m.state is State.GUARD_AWAIT_CAUSE
    assert m.handle(CauseLearned("client")) == [
        Finish(Outcome.CLIENT_DISCONNECTED, 0, "client", True, "events")]
    assert m.state is State.GUARD_CLOSED
    # Envoy ended the stream for another reason: nothing was delivered, nothing ran.
    m = opening_guard()
    m.handle(StreamClosed())
    m.handle(RequestOpened(True))
    assert m.handle(CauseLearned("unknown")) == [
        Finish(Outcome.UPSTREAM_FAILED, 0, "unknown", True, "events")]


def test_a_stream_closed_during_an_intake_that_fails_records_nothing() -> None:
    m = opening_guard()
    m.handle(StreamClosed())
    assert m.handle(RequestOpened(False)) == [] and m.state is State.GUARD_CLOSED


def test_every_transition_declares_where_it_may_go() -> None:
    # The exhaustive pair test runs every handler; handle() refuses an undeclared arrow.
    for (role, _state, _ev), t in TABLE.items():
        assert t.next, (role, _state, _ev)
        assert t.next <= set(GATE_STATES if role == "gate" else GUARD_STATES)


def test_guard_puts_a_replicas_own_5xx_in_our_shape_and_leaves_ours() -> None:
    # The last attempt's replica answered 500 with the engine's own JSON: the client gets
    # our error with the request id (docs/errors.md), status kept.
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(500, "application/json")) == [PassHeaders()]
    (sent,) = m.handle(ResponseBody(b'{"object":"error","message":"boom","code":500}', True))
    assert isinstance(sent, Send) and sent.end_of_stream
    err = json.loads(sent.data)["error"]
    assert err["request_id"] == RID and err["code"] == "upstream_unavailable"
    assert err["retryable"] is True and "upstream status 500" in err["message"]
    # An error the processor wrote itself (x-gateway-error) passes as it is.
    ours = b'{"error":{"code":"journal_unavailable","request_id":"' + RID.encode() + b'"}}'
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(503, "application/json", ours=True)) == [PassHeaders()]
    (sent,) = m.handle(ResponseBody(ours, True))
    assert isinstance(sent, Send) and sent.data == ours
