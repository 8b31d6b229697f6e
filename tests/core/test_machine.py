"""The machine's dispatch, table-wide: every (state, event) pair of both roles' rows is a
row or a protocol violation, every row declares where it may go, and the trace budget."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from extproc.core import records
from extproc.core.events import (
    AckLearned,
    AdmissionDecided,
    AdmitDecided,
    CauseLearned,
    Event,
    Fenced,
    FenceDecided,
    IntakeCommitted,
    LeaseLost,
    LiveChanged,
    NotConfirmed,
    PassHeaders,
    ProgressWritten,
    RecordWritten,
    RequestBody,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Revoked,
    Send,
    SourceSent,
    StartTimer,
    State,
    StatusRead,
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
from extproc.core.machine import ProtocolViolation
from extproc.core.sse import encode_event

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
    ProgressWritten: ProgressWritten(),
    Fenced: Fenced(),
    LeaseLost: LeaseLost(),
    RequestHeadersSeen: RequestHeadersSeen("generation"),
    RequestBody: RequestBody(),
    RequestBodySeen: RequestBodySeen(None),
    RequestOpened: RequestOpened(True),
    StatusRead: StatusRead(None, "default"),
    NotConfirmed: NotConfirmed("etcd away"),
    LiveChanged: LiveChanged("att_other"),
    SourceSent: SourceSent(1.0),
    AckLearned: AckLearned(True, {"evidence": "engine idle"}),
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
        # The decision as written out, whether made now or found made (handle keeps each).
        for _ in range(2):
            assert m.decisions == [f"{m.state.value}:"
                                   + ",".join(type(a).__name__ for a in actions)]
            m = _machine(role, state)
            actions = m.handle(ev)
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


def streaming_guard() -> GuardMachine:
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(200, SSE)) == [PassHeaders()]
    assert m.state is State.GUARD_RESPONDING
    return m


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


def test_every_transition_declares_where_it_may_go() -> None:
    # The exhaustive pair test runs every handler; handle() refuses an undeclared arrow.
    for (role, _state, _ev), t in TABLE.items():
        assert t.next, (role, _state, _ev)
        assert t.next <= set(GATE_STATES if role == "gate" else GUARD_STATES)
