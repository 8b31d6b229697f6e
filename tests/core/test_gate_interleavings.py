"""The gate's rows under every interleaving of Envoy's messages, etcd's answers and timers.

A small executor plays the session on a fake clock: each step either answers the wait the
machine asked for (the intake, the verdict, the lease or the admission, the fence, the early
revoke, Envoy's word; etcd may be away, or not answer a try: then the rows' resend timer
decides), or sends Envoy's next message, or fires a timer the machine started, or lets the
revocation watch speak, or closes the stream (the close's own row stops the timers and the
watch: the executor here, as the session, stops nothing by itself). Whatever the order, the
machine never refuses an event the session can feed, leaves nothing running once its stream
closed, never lets the request go upstream before its intake committed and its
admission said yes, never releases before the fence committed, answers every body message
once, ends an attempt over before release with exactly one record, and replays from its trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.admission import Admitted
from extproc.core.errors import journal_unavailable
from extproc.core.events import (
    Action,
    AdmissionDecided,
    Admit,
    AdmitDecided,
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
    IntakeCommitted,
    KeepTrace,
    LiveChanged,
    LoseLease,
    MarkTimedOut,
    NotConfirmed,
    PassChunk,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Revoked,
    RevokeEarly,
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
    Watch,
)
from extproc.core.gate import GateMachine, GateParams
from extproc.core.replay import record, replay
from extproc.core.sse import encode_event

RID = "req_0123456789abcdefghjkmnpqrs"
WALL0 = 1_700_000_000.0
ROLE = encode_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
CONTENT = encode_event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
WAITS = (AwaitIntakeCommit, Decide, TakeLease, Admit, Fence, RevokeEarly, AwaitCause)


@dataclass
class Run:
    m: GateMachine
    now: float = 0.0
    pending: Action | None = None  # the wait the session is in
    timers: dict[TimerKind, float] = field(default_factory=dict)  # kind -> due
    envoy: list[Event] = field(default_factory=list)  # Envoy's response, still to send
    closed: bool = False
    watching: bool = False  # the revocation watch, from Watch until StopWatching
    fed: list[Event] = field(default_factory=list)
    acts: list[Action] = field(default_factory=list)
    intake_ok: bool = False
    admitted: bool = False
    fence_ok: bool = False
    answered: int = 0  # body messages answered
    sent_bodies: int = 0
    admission_given_up: bool = False

    def feed(self, ev: Event) -> None:
        self.fed.append(ev)
        before = self.m.state
        acts = self.m.handle(ev)  # raises ProtocolViolation if a row is missing
        if isinstance(ev, NotConfirmed):
            # Sent again after a pause, or given up: never both, never neither.
            resend = [a for a in acts if isinstance(a, StartTimer)]
            assert len(resend) == 1 or self.m.state is not before, acts
            self.admission_given_up |= (before is State.GATE_ADMITTING and not resend)
        if isinstance(ev, LiveChanged):
            # Someone else's `live`: the permission ends while the attempt holds it.
            assert (acts == [LoseLease("revoked or replaced", ev.value)]) == (
                self.m.leased and not self.m.stream_closed and ev.value != "att_1"), acts
        for a in acts:
            self.act(a)

    def act(self, a: Action) -> None:
        self.acts.append(a)
        if isinstance(a, WAITS):
            assert self.pending is None, (self.pending, a)
            self.pending = a
        elif isinstance(a, StartTimer):
            self.timers[a.kind] = self.now + a.seconds
        elif isinstance(a, StopTimers):
            self.timers.clear()
        elif isinstance(a, Watch):
            self.watching = True
        elif isinstance(a, StopWatching):
            self.watching = False
        elif isinstance(a, ContinueRequest):
            # The healthy request refused because attempt 2 went before its intake
            # committed: never again.
            assert self.intake_ok and self.admitted
        elif isinstance(a, Release):
            assert self.fence_ok
            self.answered += a.held_chunks
        elif isinstance(a, FailAttempt):
            self.answered += a.held_chunks
        elif isinstance(a, PassChunk | DropChunk):
            assert self.m.held == 0  # in order: nothing passes while earlier ones are held
            self.answered += 1


def answers(a: Action, now: float) -> list[Event]:
    """What etcd, the admission or Envoy's access log may answer to a wait (an etcd that
    does not answer: soon after the try, or past every deadline)."""
    away = [NotConfirmed("no leader", now, now + 0.01, WALL0 + now),
            NotConfirmed("no leader", now, now + 9.0, WALL0 + now + 9)]
    if isinstance(a, AwaitIntakeCommit):
        return [IntakeCommitted(None, 0, None, False, WALL0),
                IntakeCommitted(journal_unavailable(RID), wall=WALL0)]
    if isinstance(a, Decide):
        return [AdmissionDecided(Admitted(False, 1.0, 10.0, False)),
                AdmissionDecided(Admitted(False, 1.0, 10.0, True)),
                AdmissionDecided(error=journal_unavailable(RID))]
    if isinstance(a, TakeLease | Admit):
        return [AdmitDecided(True, mono=0.5, wall=WALL0 + 0.5),
                AdmitDecided(False, "previous attempt is not fenced"),
                StoreDown("no leader", WALL0), *away]
    if isinstance(a, Fence):
        return [FenceDecided(True), FenceDecided(False), StoreDown("frozen", WALL0), *away]
    if isinstance(a, RevokeEarly):
        return [Revoked(True), Revoked(False)]
    assert isinstance(a, AwaitCause)
    return [CauseLearned("upstream", None, True, WALL0 + 9),
            CauseLearned("timeout", None, True, WALL0 + 9),
            CauseLearned("unknown", None, False, WALL0 + 9)]


def envoy_response(kind: int) -> list[Event]:
    if kind == 0:  # streams, content in its second message
        return [ResponseHeaders(200, "text/event-stream"), ResponseBody(ROLE, False),
                ResponseBody(CONTENT, False), ResponseBody(CONTENT, True)]
    if kind == 1:  # silent after its headers
        return [ResponseHeaders(200, "text/event-stream"), ResponseBody(ROLE, False)]
    if kind == 2:  # overloaded
        return [ResponseHeaders(503, "application/json", retry_after="2"),
                ResponseBody(b"{}", True)]
    return []  # never answers


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.integers(0, 3), preadmitted=st.booleans(),
       soft=st.sampled_from([0.0, 2.0]))
def test_every_interleaving_keeps_the_gates_promises(data: Any, kind: int, preadmitted: bool,
                                                     soft: float) -> None:
    r = Run(GateMachine.new(RID, params=GateParams(soft_first_delta_s=soft,
                                                   first_delta_s=10.0)))
    r.envoy = envoy_response(kind)
    replica = data.draw(st.sampled_from([None, "127.0.0.1:9001"]))
    r.feed(RequestStarted(1, attempt_id="att_1", preadmitted=preadmitted, replica=replica,
                          accepted_at=WALL0, mono=0.0, wall=WALL0))
    for _ in range(40):
        m = r.m
        choices: list[str] = []
        if r.pending is not None:
            choices.append("answer")
        else:
            # After our immediate reply Envoy resets the upstream: nothing more of it.
            refused = any(isinstance(a, Refuse) for a in r.acts)
            if r.envoy and m.state in (State.GATE_FORWARDED, State.GATE_HOLDING,
                                       State.GATE_RELEASED, State.GATE_PASSTHROUGH,
                                       State.GATE_FAILED) and not r.closed and not refused:
                choices.append("envoy")
            if r.timers and not r.closed:
                choices.append("timer")
            if r.watching:
                choices.append("watch")  # the revocation watch may speak until stopped
        if not r.closed:
            choices.append("close")  # Envoy may reset the stream at any time
        if not choices:
            break
        what = data.draw(st.sampled_from(choices))
        if what == "answer":
            assert r.pending is not None
            wait, r.pending = r.pending, None
            ev = data.draw(st.sampled_from(answers(wait, r.now)))
            if isinstance(wait, AwaitIntakeCommit):
                r.intake_ok = isinstance(ev, IntakeCommitted) and ev.error is None
            elif isinstance(wait, TakeLease | Admit):
                r.admitted = isinstance(ev, AdmitDecided) and ev.admitted
            elif isinstance(wait, Fence):
                r.fence_ok = isinstance(ev, FenceDecided) and ev.committed
            if r.closed and not isinstance(wait, RevokeEarly | AwaitCause):
                continue  # the stream's handler was cancelled mid-wait: no answer comes
            r.feed(ev)
        elif what == "envoy":
            ev = r.envoy.pop(0)
            r.sent_bodies += isinstance(ev, ResponseBody)
            r.feed(ev)
        elif what == "watch":
            r.feed(LiveChanged(data.draw(st.sampled_from(["att_other", None, "att_1"]))))
        elif what == "timer":
            kind_ = data.draw(st.sampled_from(sorted(r.timers)))
            r.now = max(r.now, r.timers.pop(kind_))
            r.feed(TimerFired(kind_, r.now, WALL0 + r.now))
        else:
            r.closed = True
            r.pending = None if not isinstance(r.pending, RevokeEarly | AwaitCause) else (
                r.pending)
            n = len(r.acts)
            r.feed(StreamClosed(r.now + 0.1, WALL0 + r.now + 0.1))
            # The close's row stops what feeds the stream before anything else it does.
            assert r.acts[n:n + 2] == [StopTimers(), StopWatching()], r.acts[n:]
    # Once closed, nothing the stream started runs on: no timer, no watch.
    assert not (r.closed and (r.timers or r.watching)), (r.timers, r.watching)
    m = r.m
    # At most one answer to the request's headers, and a refusal only of an attempt that
    # never went upstream (or its last attempt, timed out).
    answers_to_request = [a for a in r.acts if isinstance(a, ContinueRequest | Refuse)]
    assert len(answers_to_request) <= 2
    if any(isinstance(a, ContinueRequest) for a in r.acts):
        assert r.intake_ok and r.admitted
    # Unless the stream went, every body message sent got its one answer.
    held_at_end = m.held
    if not r.closed and not any(isinstance(a, Refuse) for a in r.acts):
        assert r.answered + held_at_end == r.sent_bodies
    # An attempt over before release, once its waits are answered, is closed exactly once;
    # a released one is the guard's to end.
    closes = [a for a in r.acts if isinstance(a, CloseAttempt)]
    assert len(closes) <= 1
    if any(isinstance(a, Release) for a in r.acts):
        assert closes == []
    if r.closed and r.pending is None and m.leased and not any(
            isinstance(a, Release) for a in r.acts):
        assert len(closes) == 1 and m.state is State.GATE_CLOSED
    # Its trace is kept once, just before its close (no agent here, nothing acknowledged
    # later); a first delta that never came is told to its replica's health first.
    keeps = [i for i, a in enumerate(r.acts) if isinstance(a, KeepTrace)]
    assert [i + 1 for i in keeps] == [r.acts.index(c) for c in closes]
    marks = [a for a in r.acts if isinstance(a, MarkTimedOut)]
    if closes and closes[0].timed_out and replica is not None:
        assert marks == [MarkTimedOut(replica)] and r.acts.index(marks[0]) + 1 == keeps[0]
    else:
        assert marks == []
    # An admission never confirmed is taken back (not a pre-admitted one: its lease only).
    if ((any(isinstance(e, StoreDown) for e in r.fed) or r.admission_given_up)
            and not preadmitted and not any(isinstance(a, Fence) for a in r.acts)):
        assert any(isinstance(a, UndoAdmission) for a in r.acts)
    # Its whole life, waits included, replays from its trace (stored as JSON).
    trace = json.loads(json.dumps(record(m, {}, 1 << 22)))
    res = replay(trace)
    assert res.ok, res.divergence
