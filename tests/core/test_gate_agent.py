"""The gate's rows for the replica's agent (decision 0034), with exact actions.

The agent says when an attempt's first content left the replica (SourceSent): with response
headers in and no content within `source_grace_s`, the path is lost and the attempt fails
as the first-delta limit fails it, and the agent is asked to cancel it at the engine. An
uncertain end of an agent-fronted attempt awaits the agent's acknowledgement: heard, a
`fenced:` end is revoked (a retry runs at once); not heard, the lease's expiry as before.
Then every interleaving of the agent's word, Envoy's messages, the timers, the close and
the waits' answers, enumerated exhaustively; each run's trace replays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.core.admission import Admitted
from extproc.core.config import ConfigError, load_config
from extproc.core.errors import upstream_timeout, upstream_unavailable
from extproc.core.events import (
    AckLearned,
    AckSettled,
    Action,
    AdmissionDecided,
    AdmitDecided,
    AwaitAck,
    AwaitCause,
    CauseLearned,
    CloseAttempt,
    ContinueRequest,
    Event,
    FailAttempt,
    Fence,
    FenceDecided,
    HoldChunk,
    IntakeCommitted,
    KeepTrace,
    MarkPathLost,
    MarkTimedOut,
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
    StreamClosed,
    TimerFired,
    TimerKind,
    Watch,
    WatchSource,
)
from extproc.core.gate import GateMachine, GateParams
from extproc.core.membership import RegistrationError, parse_registration
from extproc.core.pool import FingerprintError, pool_from_config
from extproc.core.replay import record, replay
from extproc.core.sse import encode_event

from .exhaustive import Chooser, every

RID = "req_0123456789abcdefghjkmnpqrs"
WALL0 = 1_700_000_000.0
SSE = "text/event-stream"
ROLE = encode_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
CONTENT = encode_event({"choices": [{"index": 0, "delta": {"content": "a"}}]})
PARAMS = GateParams(first_delta_s=10.0, soft_first_delta_s=0.0, lease_ttl_s=10,
                    source_grace_s=0.5, gateway_id="gw")
ADMITTED = Admitted(counts_as_retry=False, fence_wait_s=5.0, deadline_s=10.0, final=False)
FINAL = Admitted(counts_as_retry=False, fence_wait_s=5.0, deadline_s=10.0, final=True)
PATH_LOST = "the replica's agent sent the first delta and none arrived within source_grace_s"
ACK = {"at": WALL0 + 3.0, "evidence": "engine_running_requests=0", "abort_ms": 41.0,
       "why": "cancel"}


def gate(agent: int = 1, params: GateParams = PARAMS,
         verdict: Admitted = ADMITTED) -> tuple[GateMachine, list[Action]]:
    """An attempt admitted to a replica (with an agent unless `agent=0`)."""
    m = GateMachine.new(RID, params=params)
    m.handle(RequestStarted(1, attempt_id="att_1", replica="10.0.0.1:8000", mono=0.0,
                            wall=WALL0))
    m.handle(IntakeCommitted(wall=WALL0, agent=agent))
    m.handle(AdmissionDecided(verdict))
    return m, m.handle(AdmitDecided(True, mono=0.0, wall=WALL0))


def holding(agent: int = 1, **kw: Any) -> GateMachine:
    m, _ = gate(agent, **kw)
    assert m.handle(ResponseHeaders(200, SSE)) == []
    assert m.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    return m


# --- the admission ------------------------------------------------------------------------


def test_an_agent_fronted_attempt_listens_for_its_word_before_it_goes_upstream() -> None:
    _, acts = gate(agent=1)
    assert acts == [Watch(), WatchSource(), StartTimer(TimerKind.FIRST_DELTA, 10.0),
                    ContinueRequest(agent=True)]


def test_without_an_agent_the_admission_answers_as_before() -> None:
    _, acts = gate(agent=0)
    assert acts == [Watch(), StartTimer(TimerKind.FIRST_DELTA, 10.0), ContinueRequest()]


# --- path lost before the first delta ------------------------------------------------------


def test_the_agents_word_and_no_content_within_the_grace_fail_the_attempt_and_cancel_it(
        ) -> None:
    m = holding()
    assert m.handle(SourceSent(WALL0 + 1.0, 1.0)) == [
        StartTimer(TimerKind.SOURCE_GRACE, 0.5)]
    assert m.handle(TimerFired(TimerKind.SOURCE_GRACE, 1.5, WALL0 + 1.5)) == [
        FailAttempt(PATH_LOST, upstream_unavailable(RID, PATH_LOST), held_chunks=1,
                    retry=True),
        MarkPathLost(failed=True), PutCancel()]
    assert m.state is State.GATE_FAILED and m.path_lost and m.cancel_sent
    # Its end is uncertain, as a timed-out attempt's: Envoy's word is awaited.
    assert m.handle(StreamClosed(1.6, WALL0 + 1.6)) == [StopTimers(), StopWatching(), RetryEnded(),
                                                       AwaitCause("att_1", 0.5)]
    (mark, close, wait) = m.handle(CauseLearned("unknown", None, False, WALL0 + 2.1))
    assert isinstance(close, CloseAttempt) and isinstance(mark, MarkTimedOut)
    assert (close.expire, close.fence, close.failure_class, close.timed_out,
            close.ack_follows) == (True, "expiry", "network_uncertain", True, True)
    assert close.record["path_lost"] is True and close.record["cancel_sent"] is True
    assert close.record["source_sent_at"] == WALL0 + 1.0
    assert close.record["lease_expires_by"] == round(WALL0 + 2.1 + 10, 3)
    assert wait == AwaitAck(10.0)  # the cancel was put already: not again
    assert m.state is State.GATE_AWAITING_ACK
    (keep, settled) = m.handle(AckLearned(True, ACK, WALL0 + 3.0))
    assert isinstance(settled, AckSettled) and settled.revoke
    # Its trace is kept once, now that the acknowledgement is settled.
    assert keep == KeepTrace("attempt-001", {
        "attempt_id": "att_1", "replica": mark.replica,
        "failure_class": "network_uncertain", "end": settled.end_trace}, False)
    assert settled.record is not None
    assert settled.record["fence"] == "revoked" and settled.record["cancel_ack"] == ACK
    assert "lease_expires_by" not in settled.record and "engine_ack" not in settled.record
    assert settled.record["ended_at"] == WALL0 + 2.1
    assert m.state is State.GATE_CLOSED
    assert m.settled == "network_uncertain/revoked/unknown"


def test_the_last_attempt_path_lost_fails_without_the_retry_mark() -> None:
    m = holding(verdict=FINAL)
    m.handle(SourceSent(WALL0 + 1.0, 1.0))
    acts = m.handle(TimerFired(TimerKind.SOURCE_GRACE, 1.5, WALL0 + 1.5))
    assert acts == [FailAttempt(PATH_LOST, upstream_unavailable(RID, PATH_LOST), 1,
                                retry=False), MarkPathLost(failed=True), PutCancel()]


def test_content_within_the_grace_goes_on_and_the_grace_timer_is_moot() -> None:
    m = holding()
    m.handle(SourceSent(WALL0 + 1.0, 1.0))
    acts = m.handle(ResponseBody(CONTENT, False))
    assert acts[0] == HoldChunk() and isinstance(acts[1], Fence)
    assert m.handle(TimerFired(TimerKind.SOURCE_GRACE, 1.5, WALL0 + 1.5)) == []
    assert m.state is State.GATE_FENCING
    acts = m.handle(FenceDecided(True))
    assert isinstance(acts[1], Release)
    # A word after the content, or after the release: nothing.
    assert m.handle(SourceSent(WALL0 + 2.0, 2.0)) == []


def test_only_the_first_word_starts_the_grace() -> None:
    m = holding()
    assert m.handle(SourceSent(WALL0 + 1.0, 1.0)) == [StartTimer(TimerKind.SOURCE_GRACE, 0.5)]
    assert m.handle(SourceSent(WALL0 + 1.2, 1.2)) == []
    assert m.source_sent_at == WALL0 + 1.0


def test_a_grace_of_zero_is_off() -> None:
    m = holding(params=GateParams(first_delta_s=10.0, soft_first_delta_s=0.0,
                                  source_grace_s=0.0))
    assert m.handle(SourceSent(WALL0 + 1.0, 1.0)) == []
    assert m.state is State.GATE_HOLDING


def test_before_the_headers_the_lost_path_is_noted_and_left_to_envoys_per_try_timeout(
        ) -> None:
    m, _ = gate()
    assert m.handle(SourceSent(WALL0 + 1.0, 1.0)) == [StartTimer(TimerKind.SOURCE_GRACE, 0.5)]
    assert m.handle(TimerFired(TimerKind.SOURCE_GRACE, 1.5, WALL0 + 1.5)) == [
        MarkPathLost(failed=False)]
    assert m.state is State.GATE_FORWARDED and not m.path_lost
    # Headers after all: the grace runs again from them.
    assert m.handle(ResponseHeaders(200, SSE)) == [StartTimer(TimerKind.SOURCE_GRACE, 0.5)]
    assert m.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    acts = m.handle(TimerFired(TimerKind.SOURCE_GRACE, 2.5, WALL0 + 2.5))
    assert isinstance(acts[0], FailAttempt) and acts[1:] == [MarkPathLost(True), PutCancel()]


def test_the_word_is_ignored_where_it_can_change_nothing() -> None:
    m = GateMachine.new(RID, params=PARAMS)
    assert m.handle(SourceSent(1.0, 1.0)) == [] and m.state is State.GATE_NEW
    m = holding()
    m.handle(ResponseBody(b"data: {\"error\": {\"message\": \"x\"}}\n\n", False))
    assert m.state is State.GATE_FAILED
    assert m.handle(SourceSent(1.0, 1.0)) == []


# --- the first-delta limit of an agent-fronted attempt ------------------------------------


def test_the_first_delta_limit_also_puts_the_cancel() -> None:
    m = holding()
    acts = m.handle(TimerFired(TimerKind.FIRST_DELTA, 10.0, WALL0 + 10.0))
    reason = "no first delta within the first-delta limit"
    assert acts == [FailAttempt(reason, upstream_unavailable(RID, reason), 1, retry=True),
                    PutCancel()]
    m = holding(verdict=FINAL)
    acts = m.handle(TimerFired(TimerKind.FIRST_DELTA, 10.0, WALL0 + 10.0))
    assert acts == [Refuse(upstream_timeout(RID, 10.0, 1)), PutCancel()]
    m = holding(agent=0)
    assert m.handle(TimerFired(TimerKind.FIRST_DELTA, 10.0, WALL0 + 10.0)) == [
        FailAttempt(reason, upstream_unavailable(RID, reason), 1, retry=True)]


# --- the acknowledgement ------------------------------------------------------------------


def _no_word(agent: int = 1, params: GateParams = PARAMS) -> tuple[GateMachine, list[Action]]:
    """Silent after its role event past the limit; Envoy says nothing in time."""
    m = holding(agent, params=params)
    m.handle(TimerFired(TimerKind.FIRST_DELTA, 10.0, WALL0 + 10.0))
    m.handle(StreamClosed(10.1, WALL0 + 10.1))
    return m, m.handle(CauseLearned("unknown", None, False, WALL0 + 10.6))


def test_no_word_and_no_acknowledgement_expire_as_before() -> None:
    m, (_, close, wait) = _no_word()
    assert isinstance(close, CloseAttempt) and close.expire and close.ack_follows
    assert wait == AwaitAck(10.0)
    (keep, settled) = m.handle(AckLearned(False, None, WALL0 + 20.6))
    assert isinstance(keep, KeepTrace) and keep.meta["end"] == close.end_trace
    assert isinstance(settled, AckSettled)
    assert (settled.record, settled.revoke) == (None, False)
    assert settled.end_trace == close.end_trace
    assert m.state is State.GATE_CLOSED and m.settled == "network_uncertain/expiry/unknown"


def test_no_word_but_the_acknowledgement_revokes_the_fence() -> None:
    m, (_, close, _) = _no_word()
    (_, settled) = m.handle(AckLearned(True, ACK, WALL0 + 11.0))
    assert isinstance(settled, AckSettled) and settled.revoke and settled.record is not None
    assert isinstance(close, CloseAttempt)
    assert {k: v for k, v in settled.record.items() if k not in ("fence", "cancel_ack")} == {
        k: v for k, v in close.record.items() if k not in ("fence", "lease_expires_by")}
    assert settled.record["cancel_ack"] == ACK and settled.end_trace["engine_ack"] == ACK


def test_with_policy_lease_expiry_the_acknowledgement_is_evidence_only() -> None:
    p = GateParams(first_delta_s=10.0, soft_first_delta_s=0.0, cancel_ack=False)
    m, (_, close, _) = _no_word(params=p)
    assert isinstance(close, CloseAttempt) and close.expire
    (_, settled) = m.handle(AckLearned(True, ACK, WALL0 + 11.0))
    assert isinstance(settled, AckSettled) and not settled.revoke
    assert settled.record is not None and settled.record["fence"] == "expiry"
    assert settled.record["engine_ack"] == ACK and "cancel_ack" not in settled.record


def test_envoys_word_revokes_and_the_acknowledgement_adds_the_engines_evidence() -> None:
    m = holding()
    m.handle(TimerFired(TimerKind.FIRST_DELTA, 10.0, WALL0 + 10.0))
    m.handle(StreamClosed(10.1, WALL0 + 10.1))
    (_, close, wait) = m.handle(CauseLearned("timeout", None, True, WALL0 + 10.2))
    assert isinstance(close, CloseAttempt) and not close.expire and close.fence == "revoked"
    assert wait == AwaitAck(10.0)
    (_, settled) = m.handle(AckLearned(True, ACK, WALL0 + 10.5))
    assert isinstance(settled, AckSettled) and not settled.revoke
    assert settled.record is not None and settled.record["engine_ack"] == ACK


def test_an_uncertain_end_the_gate_did_not_fail_still_puts_the_cancel() -> None:
    # No headers; Envoy's per-try timeout closed it and said so: the engine may decode on.
    m, _ = gate()
    assert m.handle(StreamClosed(10.3, WALL0 + 10.3)) == [
        StopTimers(), StopWatching(), RetryEnded(), AwaitCause("att_1", 0.5)]
    (close, cancel, wait) = m.handle(CauseLearned("timeout", None, True, WALL0 + 10.4))
    assert isinstance(close, CloseAttempt) and close.ack_follows
    assert close.failure_class == "network_uncertain"
    assert (cancel, wait) == (PutCancel(), AwaitAck(10.0))
    assert close.record["cancel_sent"] is True


def test_a_confirmed_end_of_an_agent_fronted_attempt_awaits_nothing() -> None:
    m = holding()
    # Over before the limit, not by the gate: revoked at once, then Envoy's word.
    acts = m.handle(StreamClosed(1.0, WALL0 + 1.0))
    assert isinstance(acts[-1], RevokeEarly)
    assert m.handle(Revoked(True)) == [AwaitCause("att_1", 0.5)]
    (keep, close) = m.handle(CauseLearned("upstream", None, True, WALL0 + 1.1))
    assert isinstance(close, CloseAttempt) and not close.ack_follows
    assert isinstance(keep, KeepTrace)  # kept with its close: no acknowledgement follows
    assert close.failure_class == "replica_dead" and m.state is State.GATE_CLOSED


def test_without_an_agent_the_uncertain_end_is_as_before() -> None:
    m, acts = _no_word(agent=0)
    (mark, keep, close) = acts
    assert isinstance(close, CloseAttempt) and close.expire and not close.ack_follows
    assert isinstance(mark, MarkTimedOut) and isinstance(keep, KeepTrace)
    assert "cancel_sent" not in close.record and "path_lost" not in close.record
    assert m.state is State.GATE_CLOSED


def test_a_trace_with_the_agents_events_replays() -> None:
    m = holding()
    m.handle(SourceSent(WALL0 + 1.0, 1.0))
    m.handle(TimerFired(TimerKind.SOURCE_GRACE, 1.5, WALL0 + 1.5))
    m.handle(StreamClosed(1.6, WALL0 + 1.6))
    m.handle(CauseLearned("unknown", None, False, WALL0 + 2.1))
    m.handle(AckLearned(True, ACK, WALL0 + 3.0))
    trace = json.loads(json.dumps(record(m, {}, 1 << 22)))
    assert [e["type"] for e in trace["events"]][-5:] == [
        "SourceSent", "TimerFired", "StreamClosed", "CauseLearned", "AckLearned"]
    res = replay(trace)
    assert res.ok, res.divergence
    # A different acknowledgement is a different decision: replay says where.
    trace["events"][-1]["heard"] = False
    assert not replay(trace).ok


# --- every interleaving -------------------------------------------------------------------


@dataclass
class Run(Chooser):
    """One game: an agent-fronted attempt after its admission, on a fake clock."""

    choices: list[int]
    at: int = 0
    m: GateMachine = field(default_factory=lambda: gate()[0])
    now: float = 0.0
    timers: dict[TimerKind, float] = field(default_factory=dict)
    envoy: list[Event] = field(default_factory=list)
    pending: Action | None = None
    closed: bool = False
    worded: bool = False
    fed: list[Event] = field(default_factory=list)
    acts: list[Action] = field(default_factory=list)
    lost_at: int | None = None  # the event that failed it as path lost

    def feed(self, ev: Event) -> None:
        self.fed.append(ev)
        for a in self.m.handle(ev):
            self.acts.append(a)
            if isinstance(a, FailAttempt) and a.reason == PATH_LOST:
                self.lost_at = len(self.fed) - 1
            if isinstance(a, Fence | RevokeEarly | AwaitCause | AwaitAck):
                assert self.pending is None
                self.pending = a
            elif isinstance(a, StartTimer):
                self.timers[a.kind] = self.now + a.seconds
            elif isinstance(a, StopTimers):
                self.timers.clear()


ANSWERS: dict[type, list[Event]] = {
    Fence: [FenceDecided(True)],
    RevokeEarly: [Revoked(True)],
    AwaitCause: [CauseLearned("timeout", None, True, WALL0 + 11),
                 CauseLearned("unknown", None, False, WALL0 + 11)],
    AwaitAck: [AckLearned(True, ACK, WALL0 + 12), AckLearned(False, None, WALL0 + 21)],
}


def _make(kind: int) -> Any:
    def make(choices: list[int]) -> Run:
        r = Run(choices)
        r.timers = {TimerKind.FIRST_DELTA: 10.0}
        r.envoy = ([ResponseHeaders(200, SSE), ResponseBody(ROLE, False),
                    ResponseBody(CONTENT, True)] if kind == 0 else
                   [ResponseHeaders(200, SSE), ResponseBody(ROLE, False)] if kind == 1
                   else [])
        return r
    return make


def play(r: Run) -> None:
    for _ in range(30):
        opts: list[str] = []
        if r.pending is not None:
            opts.append("answer")
        else:
            refused = any(isinstance(a, Refuse) for a in r.acts)
            if (r.envoy and not r.closed and not refused
                    and r.m.state in (State.GATE_FORWARDED, State.GATE_HOLDING,
                                      State.GATE_RELEASED, State.GATE_FAILED)):
                opts.append("envoy")
            if not r.worded and not r.closed:
                opts.append("word")
            if r.timers and not r.closed:
                opts.append("timer")
        if not r.closed:
            opts.append("close")
        if not opts:
            return
        what = opts[r.choose(len(opts))] if len(opts) > 1 else opts[0]
        if what == "answer":
            wait, r.pending = r.pending, None
            assert wait is not None
            answers = ANSWERS[type(wait)]
            r.feed(answers[r.choose(len(answers))] if len(answers) > 1 else answers[0])
        elif what == "envoy":
            r.feed(r.envoy.pop(0))
        elif what == "word":
            r.worded = True
            r.feed(SourceSent(WALL0 + r.now, r.now))
        elif what == "timer":
            kind, due = min(r.timers.items(), key=lambda kv: kv[1])  # the clock's order
            del r.timers[kind]
            r.now = max(r.now, due)
            r.feed(TimerFired(kind, r.now, WALL0 + r.now))
        else:
            r.closed = True
            if isinstance(r.pending, Fence):
                r.pending = None  # the stream's handler was cancelled mid-wait
            r.timers.clear()
            r.feed(StreamClosed(r.now + 0.1, WALL0 + r.now + 0.1))
    raise AssertionError("a run did not end")


def check(r: Run) -> None:
    m, acts, fed = r.m, r.acts, r.fed
    types = [type(e) for e in fed]
    lost = [a for a in acts if isinstance(a, FailAttempt) and a.reason == PATH_LOST]
    if lost:
        # Only on the agent's word, its grace run out, headers in and no content yet.
        i = r.lost_at
        assert i is not None
        ev = fed[i]
        assert isinstance(ev, TimerFired) and ev.kind is TimerKind.SOURCE_GRACE
        assert SourceSent in types[:i] and ResponseHeaders in types[:i]
        assert not any(isinstance(e, ResponseBody) and e.data == CONTENT for e in fed[:i])
        assert len(lost) == 1
    # A released attempt is the guard's: nothing of the agent's here.
    if any(isinstance(a, Release) for a in acts):
        assert not any(isinstance(a, PutCancel | AwaitAck | CloseAttempt) for a in acts)
        assert not lost
    assert sum(isinstance(a, PutCancel) for a in acts) <= 1
    closes = [a for a in acts if isinstance(a, CloseAttempt)]
    settled = [a for a in acts if isinstance(a, AckSettled)]
    assert len(closes) <= 1 and len(settled) <= 1
    # The trace is kept once per settled end: with the close, or with the acknowledgement.
    keeps = [i for i, a in enumerate(acts) if isinstance(a, KeepTrace)]
    ends = [i for i, a in enumerate(acts) if isinstance(a, AckSettled) or (
        isinstance(a, CloseAttempt) and not a.ack_follows)]
    assert [i + 1 for i in keeps] == ends
    if closes and closes[0].ack_follows:
        # The cancel was put before its acknowledgement is awaited, and the wait ends it.
        assert acts.index(next(a for a in acts if isinstance(a, PutCancel))) < acts.index(
            next(a for a in acts if isinstance(a, AwaitAck)))
        assert len(settled) == 1 and m.state is State.GATE_CLOSED
        heard = next(e for e in fed if isinstance(e, AckLearned)).heard
        # A `fenced:` end is revoked exactly when the engine acknowledged it.
        assert settled[0].revoke == (closes[0].expire and heard)
        assert (settled[0].record is not None) == heard
    elif closes:
        assert settled == [] and m.state is State.GATE_CLOSED
        assert closes[0].failure_class != "network_uncertain"
    if r.closed and r.pending is None and not any(isinstance(a, Release) for a in acts):
        assert len(closes) == 1
    trace = json.loads(json.dumps(record(m, {}, 1 << 22)))
    res = replay(trace)
    assert res.ok, res.divergence


def test_every_interleaving_with_the_agent_keeps_the_gates_promises() -> None:
    counts = []
    for kind in (0, 1, 2):
        runs = every(_make(kind), play)
        for r in runs:
            check(r)
        counts.append(len(runs))
    # Every run of each game, once (a change of the rows that adds or drops a branch shows
    # here first): streams, silent after its role event, never answers.
    assert counts == [497, 280, 28]


# --- the configuration and the pool's record of the agent ---------------------------------


def test_source_grace_is_validated_below_the_first_delta_limit() -> None:
    assert load_config({}).timeouts.source_grace_s == 0.5
    assert load_config({"timeouts": {"source_grace_s": 0}}).timeouts.source_grace_s == 0.0
    cfg = load_config({"timeouts": {"first_delta_s": 4, "soft_first_delta_s": 1,
                                    "source_grace_s": 1.5}})
    assert GateParams.from_config(cfg).source_grace_s == 1.5
    for bad in (4, 5, -0.1, "x"):
        with pytest.raises(ConfigError, match="source_grace_s"):
            load_config({"timeouts": {"first_delta_s": 4, "soft_first_delta_s": 1,
                                      "source_grace_s": bad}})


def test_the_pool_record_says_which_replicas_an_agent_fronts() -> None:
    fp = {"weights_revision": "w@1"}
    pool = pool_from_config([{"address": "10.0.0.1:8000", "fingerprint": fp,
                              "agent": {"version": 1}},
                             {"address": "10.0.0.2:8000", "fingerprint": fp}])
    assert (pool.agent_of("10.0.0.1:8000"), pool.agent_of("10.0.0.2:8000"),
            pool.agent_of("10.0.0.9:8000")) == (1, 0, 0)
    with pytest.raises(FingerprintError, match="agent"):
        pool_from_config([{"address": "10.0.0.1:8000", "fingerprint": fp,
                           "agent": {"version": 0}}])
    # A registration: the agent's version, or (the name `extproc register` wrote) none.
    rec = {"address": "10.0.0.1:8000", "fingerprint": fp, "models": []}
    assert parse_registration("10.0.0.1:8000", json.dumps(
        {**rec, "agent": {"version": 1}}).encode()).agent == 1
    assert parse_registration("10.0.0.1:8000", json.dumps(
        {**rec, "agent": "host/123"}).encode()).agent == 0
    with pytest.raises(RegistrationError, match="agent"):
        parse_registration("10.0.0.1:8000", json.dumps(
            {**rec, "agent": {"version": "one"}}).encode())
