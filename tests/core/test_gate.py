"""The gate's rows: an attempt's whole life, its waits included, with exact actions."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core import headers as H
from extproc.core.admission import Admitted, AttemptRequest
from extproc.core.errors import ErrorCode, GatewayError, journal_unavailable
from extproc.core.events import (
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
    MarkSlow,
    MarkTimedOut,
    NotConfirmed,
    Overloaded,
    PassChunk,
    PassHeaders,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    RetryEnded,
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
    UndoFence,
    Watch,
)
from extproc.core.gate import (
    FENCE_MARGIN_S,
    GateMachine,
    GateParams,
    request_started,
)
from extproc.core.machine import ProtocolViolation
from extproc.core.replay import record, replay
from extproc.core.sse import DONE_EVENT, EventKind, encode_event

from .gate_drive import ADMITTED, FINAL, admit
from .sse_streams import Stream, assert_replays, decode, streams

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
WALL0 = 1_700_000_000.0


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


# --- the response: hold, fence, release -------------------------------------------------


def admitted_gate(max_buffer: int = 4 << 20) -> GateMachine:
    g = GateMachine.new(RID, max_buffer=max_buffer)
    acts = admit(g, attempt=2)
    assert g.state is State.GATE_FORWARDED and g.attempt == 2
    assert names(acts) == ["Watch", "StartTimer", "ContinueRequest"]
    return g


def names(acts: list[Any]) -> list[str]:
    return [type(a).__name__ for a in acts]


def released(acts: list[Any], held: int, hand_off: bool) -> bool:
    """The fence's yes: the timers stop, the held messages go, the hand-off's record."""
    stop, rel = acts
    return (stop == StopTimers() and isinstance(rel, Release) and rel.held_chunks == held
            and rel.hand_off is hand_off and rel.facts is not None)


HOLD_FENCE = ["HoldChunk", "Fence"]


def _assert_unavailable(a: Any, held: int) -> None:
    assert isinstance(a, FailAttempt)
    assert a.held_chunks == held
    assert a.error.code is ErrorCode.UPSTREAM_UNAVAILABLE
    assert a.error.http_status == 503
    assert a.error.retryable is True
    assert a.error.partial_output is False
    assert a.error.request_id == RID
    body = json.loads(a.error.json_bytes())
    assert body["error"]["code"] == "upstream_unavailable"


def test_gate_happy_path_holds_until_fenced_then_releases_in_order() -> None:
    g = admitted_gate()
    assert g.handle(ResponseHeaders(200, "text/event-stream; charset=utf-8")) == []
    assert g.state is State.GATE_HOLDING and g.streaming
    assert g.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    assert g.handle(ResponseBody(EMPTY + USAGE, False)) == [HoldChunk()]
    assert names(g.handle(ResponseBody(content("Hel"), False))) == HOLD_FENCE
    assert g.state is State.GATE_FENCING
    # A body message that arrives while the fence transaction runs is held as well.
    assert g.handle(ResponseBody(content("lo"), False)) == [HoldChunk()]
    # Not ended yet: the gate hands the attempt to the guard and leaves the stream.
    assert released(g.handle(FenceDecided(True)), 4, True)
    assert g.state is State.GATE_RELEASED
    assert g.handle(ResponseBody(content("!"), False)) == [PassChunk()]
    assert g.handle(ResponseBody(ERROR, False)) == [PassChunk()]  # the guard handles it
    assert g.handle(ResponseBody(FINISH + DONE_EVENT, True)) == [PassChunk()]
    # Released: the guard ends it; the gate only stops its timers.
    assert g.handle(StreamClosed()) == [StopTimers(), StopWatching()]
    assert g.state is State.GATE_CLOSED
    assert g.handle(StreamClosed()) == []


def test_gate_content_split_across_chunks_fences_only_when_complete() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    ev = content("Hello")
    assert g.handle(ResponseBody(ev[:9], False)) == [HoldChunk()]
    assert g.handle(ResponseBody(ev[9:-1], False)) == [HoldChunk()]
    assert names(g.handle(ResponseBody(ev[-1:], False))) == HOLD_FENCE
    assert released(g.handle(FenceDecided(True)), 3, True)


def test_gate_fence_lost_fails_the_attempt_and_drops_the_rest() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert g.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    assert names(g.handle(ResponseBody(content("x"), False))) == HOLD_FENCE
    acts = g.handle(FenceDecided(False))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=2)
    assert "fence" in acts[0].reason
    assert g.state is State.GATE_FAILED
    assert g.handle(ResponseBody(content("y"), False)) == [DropChunk()]
    assert g.handle(ResponseBody(DONE_EVENT, True)) == [DropChunk()]
    # Failed on purpose with a 503 (the fence said no): confirmed, no word needed.
    stop, unwatch, ended, keep, close = g.handle(StreamClosed())
    assert (stop, unwatch, ended) == (StopTimers(), StopWatching(), RetryEnded())
    assert isinstance(close, CloseAttempt) and close.record["upstream_finished"] is True
    assert keep == KeepTrace("attempt-002", {
        "attempt_id": "att_2", "replica": None, "failure_class": close.failure_class,
        "end": close.end_trace}, False)


@pytest.mark.parametrize("bad", [ERROR, MALFORMED, b"data: [1, 2]\n\n", b"data: \n\n"],
                         ids=["error", "malformed", "non-object", "empty-data"])
def test_gate_error_or_malformed_before_content_fails(bad: bytes) -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert g.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    # Even with content after it in the same message: the bad event came first.
    acts = g.handle(ResponseBody(bad + content("late"), False))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=2)
    assert g.state is State.GATE_FAILED
    assert g.handle(ResponseBody(content("x"), True)) == [DropChunk()]


def test_gate_content_before_error_in_one_message_is_fenced() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert names(g.handle(ResponseBody(content("a") + ERROR, False))) == HOLD_FENCE


def test_gate_done_without_content_is_an_empty_complete_answer() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert g.handle(ResponseBody(ROLE + FINISH, False)) == [HoldChunk()]
    assert g.handle(ResponseBody(DONE_EVENT, False)) == [HoldChunk()]
    assert names(g.handle(ResponseBody(b"", True))) == HOLD_FENCE
    # The whole response is held already: nothing left to hand off.
    assert released(g.handle(FenceDecided(True)), 3, False)
    assert g.handle(StreamClosed()) == [StopTimers(), StopWatching()]


def test_gate_done_and_end_of_stream_in_one_message() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert names(g.handle(ResponseBody(ROLE + DONE_EVENT, True))) == HOLD_FENCE


def test_gate_end_of_stream_without_content_or_done_fails() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    assert g.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    acts = g.handle(ResponseBody(FINISH, True))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=2)


def test_gate_empty_200_headers_only_fails() -> None:
    g = admitted_gate()
    acts = g.handle(ResponseHeaders(200, SSE, end_of_stream=True))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=0)


@pytest.mark.parametrize("status", [400, 429, 500, 503, 201])
def test_gate_non_200_passes_through(status: int) -> None:
    g = admitted_gate()
    # Envoy retries a 5xx or 429 only when the gate marks it, never on the last attempt.
    assert g.handle(ResponseHeaders(status, "application/json")) == [
        PassHeaders(retry=status >= 500 or status == 429)]
    assert g.state is State.GATE_PASSTHROUGH
    assert g.handle(ResponseBody(b'{"error":', False)) == [PassChunk()]
    assert g.handle(ResponseBody(b'{"message":"busy"}}', True)) == [PassChunk()]
    *_, close = g.handle(StreamClosed())
    # The replica answered: its end is confirmed, no word from Envoy needed.
    assert isinstance(close, CloseAttempt) and close.record["http_status"] == status
    assert close.fence == "revoked" and close.cause == "n/a"


def test_gate_non_streaming_fences_only_at_end_of_stream() -> None:
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"completion_tokens": 1}}).encode()
    g = admitted_gate()
    assert g.handle(ResponseHeaders(200, "application/json")) == []
    assert not g.streaming
    # Each part alone would be an SSE-looking or JSON-looking fragment: nothing decides early.
    assert g.handle(ResponseBody(body[:10], False)) == [HoldChunk()]
    assert g.handle(ResponseBody(body[10:30], False)) == [HoldChunk()]
    assert names(g.handle(ResponseBody(body[30:], True))) == HOLD_FENCE
    assert released(g.handle(FenceDecided(True)), 3, False)


@pytest.mark.parametrize("body", [
    b'{"choices": [', b"not json", b'["a list"]', b'{"error": {"message": "oom"}}', b"",
], ids=["truncated", "garbage", "list", "error-object", "empty"])
def test_gate_non_streaming_bad_body_fails(body: bytes) -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, "application/json"))
    assert g.handle(ResponseBody(body[:3], False)) == [HoldChunk()]
    acts = g.handle(ResponseBody(body[3:], True))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=2)


def test_gate_non_streaming_deeply_nested_body_fails_cleanly() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, "application/json"))
    acts = g.handle(ResponseBody(b"[" * 100_000 + b"]" * 100_000, True))
    assert len(acts) == 1 and isinstance(acts[0], FailAttempt)


def test_gate_body_bigger_than_buffer_before_first_delta_fails() -> None:
    g = admitted_gate(max_buffer=200)
    g.handle(ResponseHeaders(200, SSE))
    assert len(ROLE) < 200
    assert g.handle(ResponseBody(ROLE, False)) == [HoldChunk()]
    # This message carries content, but the buffer limit is checked first.
    acts = g.handle(ResponseBody(USAGE + content("x" * 150), False))
    assert len(acts) == 1
    _assert_unavailable(acts[0], held=2)
    assert "buffer" in acts[0].reason
    assert g.handle(ResponseBody(content("y"), False)) == [DropChunk()]


def test_gate_buffer_limit_counts_bytes_exactly() -> None:
    data = content("abc")
    g = admitted_gate(max_buffer=len(data))
    g.handle(ResponseHeaders(200, SSE))
    assert names(g.handle(ResponseBody(data, False))) == HOLD_FENCE


def test_gate_admission_refused() -> None:
    err = GatewayError(code=ErrorCode.RETRY_BUDGET_EXHAUSTED, message="no budget",
                       http_status=503, request_id=RID)
    g = GateMachine.new(RID)
    g.handle(RequestStarted(3, attempt_id="att_3"))
    g.handle(IntakeCommitted())
    assert g.handle(AdmissionDecided(error=err)) == [Refuse(err)]
    assert g.state is State.GATE_CLOSED
    # Never leased: nothing to end but the budget's count.
    assert g.handle(StreamClosed()) == [StopTimers(), StopWatching(), RetryEnded()]
    assert g.handle(StreamClosed()) == []
    with pytest.raises(ProtocolViolation):
        g.handle(ResponseHeaders(200, SSE))


def test_gate_stream_closed_mid_hold_and_mid_fence_is_not_released() -> None:
    for body, eos, state in ((ROLE, False, "gate_holding"), (content("a"), True,
                                                             "gate_fencing")):
        g = admitted_gate()
        g.handle(ResponseHeaders(200, SSE))
        g.handle(ResponseBody(body, eos))
        assert g.state == state
        # Before the limit, not failed by us: a confirmed end, revoked at once.
        stop, unwatch, ended, revoke = g.handle(StreamClosed(mono=1.0, wall=WALL0 + 1.0))
        assert (stop, unwatch, ended) == (StopTimers(), StopWatching(), RetryEnded())
        assert isinstance(revoke, RevokeEarly) and revoke.record["failure_class"] == "pending"
        assert g.state is State.GATE_REVOKING


def test_gate_drop_records_the_upstream_end() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    g.handle(ResponseBody(ERROR, False))
    assert g.handle(ResponseBody(b"", True)) == [DropChunk()]
    # An in-band error, failed on purpose: no word needed, its end is written at once.
    *_, close = g.handle(StreamClosed())
    assert isinstance(close, CloseAttempt) and close.record["upstream_finished"] is True


def test_a_lost_lease_after_release_drops_the_rest() -> None:
    m = GateMachine.new(RID)
    admit(m)
    m.handle(ResponseHeaders(200, SSE))
    m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', False))
    m.handle(FenceDecided(True))
    assert m.state is State.GATE_RELEASED
    assert m.handle(ResponseBody(b"x", False)) == [PassChunk()]
    assert m.handle(LeaseLost()) == []
    assert m.handle(ResponseBody(b"y", False)) == [DropChunk()]
    assert m.handle(ResponseBody(b"", True)) == [DropChunk()]
    # Replayable: the loss is an event in the trace, the drops are its decisions.
    assert [e["type"] for e in m.trace][-3:] == ["LeaseLost", "ResponseBody", "ResponseBody"]


def test_the_chunk_that_finds_the_lease_run_out_ends_it_once_after_release() -> None:
    # The session's lease check is the chunk's own field: the row ends the permission
    # (LoseLease) and drops the rest; said once, then only drops.
    m = GateMachine.new(RID)
    admit(m)
    m.handle(ResponseHeaders(200, SSE))
    m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', False))
    m.handle(FenceDecided(True))
    assert m.handle(ResponseBody(b"x", False, lease_expired=True)) == [
        LoseLease("expired locally"), DropChunk()]
    assert m.handle(ResponseBody(b"", True, lease_expired=True)) == [DropChunk()]
    assert m.trace[-2]["lease_expired"] is True


def test_a_lease_run_out_before_release_is_ended_and_the_chunk_handled_as_ever() -> None:
    # Before the release the fence itself checks the lease; the permission ends at once.
    m = admitted_gate()
    m.handle(ResponseHeaders(200, SSE))
    assert m.handle(ResponseBody(ROLE, False, lease_expired=True)) == [
        LoseLease("expired locally"), HoldChunk()]
    p = admitted_gate()
    p.handle(ResponseHeaders(400, "application/json"))
    assert p.handle(ResponseBody(b"{}", True, lease_expired=True)) == [
        LoseLease("expired locally"), PassChunk()]




# --- the admission: every wait a row -----------------------------------------------------


def started(attempt: int = 1, preadmitted: bool = False, offset: int = 0,
            accepted_at: float | None = WALL0, params: GateParams | None = None
            ) -> GateMachine:
    g = GateMachine.new(RID, params=params)
    acts = g.handle(RequestStarted(attempt, attempt_id=f"att_{attempt}", attempt_offset=offset,
                                   preadmitted=preadmitted, replica="127.0.0.1:9001",
                                   want_fingerprint="fp-a", prompt_tokens=12,
                                   accepted_at=accepted_at, mono=5.0, wall=WALL0 + 0.5))
    # Every attempt waits for its request's intake, not only the first (decision 0021).
    assert acts == [AwaitIntakeCommit()] and g.state is State.GATE_AWAITING_INTAKE
    return g


@pytest.mark.parametrize("preadmitted", [True, False])
def test_an_intake_that_failed_refuses_the_attempt_and_gives_nothing_back(
        preadmitted: bool) -> None:
    g = started(preadmitted=preadmitted)
    err = journal_unavailable(RID)
    # The request was never recorded: there is no `live` to give back.
    assert g.handle(IntakeCommitted(err, wall=WALL0 + 1)) == [Refuse(err)]
    assert g.state is State.GATE_CLOSED


@pytest.mark.parametrize("pool", [True, False])
def test_the_committed_intake_asks_the_admission_with_what_the_process_knows(
        pool: bool) -> None:
    g = started(attempt=2, offset=3)
    [d] = g.handle(IntakeCommitted(None, reached_count=1, replica_fingerprint="fp-b",
                                   pool_enabled=pool, wall=WALL0 + 2.25))
    p = GateParams()
    assert d == Decide(AttemptRequest(
        request_id=RID, attempt=2, max_attempts=p.max_attempts, reached_before=True,
        reached_count=1, elapsed_s=2.25, total_first_delta_s=p.total_first_delta_s,
        first_delta_s=p.first_delta_s, fence_wait_s=p.fence_wait_s,
        want_fingerprint="fp-a" if pool else None, replica_fingerprint="fp-b",
        replica="127.0.0.1:9001", prompt_tokens=12, max_prompt_tokens=0, attempt_id="att_2"))
    assert g.state is State.GATE_DECIDING


def test_a_refused_verdict_gives_a_preadmitted_attempt_1_back() -> None:
    g = started(preadmitted=True)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    err = GatewayError(ErrorCode.NO_COMPATIBLE_REPLICA, "no", 503, request_id=RID)
    give, refuse = g.handle(AdmissionDecided(error=err))
    assert isinstance(give, GiveBack) and give.attempt == 1
    assert give.record["refused"] == "no_compatible_replica" and give.record["ended_at"] == (
        WALL0 + 1)
    assert refuse == Refuse(err) and g.state is State.GATE_CLOSED


def test_a_preadmitted_attempt_takes_its_lease_then_goes_upstream_with_its_timers() -> None:
    g = started(preadmitted=True, params=GateParams(soft_first_delta_s=2.0))
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    assert g.handle(AdmissionDecided(ADMITTED)) == [TakeLease()]
    assert g.handle(AdmitDecided(True, mono=6.0, wall=WALL0 + 1.5)) == [
        Watch(), StartTimer(TimerKind.SOFT_FIRST_DELTA, 2.0),
        StartTimer(TimerKind.FIRST_DELTA, ADMITTED.deadline_s), ContinueRequest()]
    assert g.state is State.GATE_FORWARDED and g.leased


def test_a_later_attempt_runs_the_admission_transaction_within_its_deadline() -> None:
    g = started(attempt=2, offset=1)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    verdict = Admitted(counts_as_retry=True, fence_wait_s=3.0, deadline_s=20.0, final=False)
    [a] = g.handle(AdmissionDecided(verdict))
    assert isinstance(a, Admit)
    assert (a.attempt, a.fence_wait_s, a.first_attempt) == (3, 3.0, 2)
    assert a.deadline_s == 20.0 - FENCE_MARGIN_S
    assert a.record["attempt_id"] == "att_2" and a.record["started_at"] == WALL0 + 1
    # It waited 4 s for the previous attempt's fence: its own limit is what is left.
    acts = g.handle(AdmitDecided(True, "admitted", waited_s=4.0, mono=10.0))
    assert acts[1] == StartTimer(TimerKind.FIRST_DELTA, 16.0)
    # The fence is never sent past the limit.
    g.handle(ResponseHeaders(200, SSE))
    _, fence = g.handle(ResponseBody(content("a"), False))
    assert isinstance(fence, Fence) and fence.until_mono == 10.0 + 16.0 - FENCE_MARGIN_S


@pytest.mark.parametrize(("reason", "retryable"), [
    ("first delta already sent: no second attempt", False),
    ("attempt 2 was already admitted", False),
    # Nothing ran for these: a repeat of the key may run the request.
    ("previous attempt is not fenced (lease still live)", True),
    ("unknown request (no journal record)", True),
])
def test_the_journal_refusing_gives_the_reason(reason: str, retryable: bool) -> None:
    g = started(attempt=2)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    g.handle(AdmissionDecided(ADMITTED))
    [r] = g.handle(AdmitDecided(False, reason))
    assert isinstance(r, Refuse) and r.error.code is ErrorCode.ATTEMPT_NOT_ADMITTED
    assert r.error.message == reason and r.error.retryable is retryable


@pytest.mark.parametrize("preadmitted", [True, False])
def test_etcd_away_at_admission_fails_closed_and_takes_back_what_may_apply(
        preadmitted: bool) -> None:
    g = started(preadmitted=preadmitted)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    g.handle(AdmissionDecided(ADMITTED))
    acts = g.handle(StoreDown("no leader", wall=WALL0 + 3))
    # A transaction never confirmed may apply late: taken back. A pre-admitted attempt's
    # `live` (from the intake) is given back instead.
    assert names(acts) == (["GiveBack", "Refuse"] if preadmitted
                           else ["UndoAdmission", "Refuse"])
    assert acts[-1].error.code is ErrorCode.JOURNAL_UNAVAILABLE
    assert g.state is State.GATE_CLOSED


def test_etcd_away_at_the_fence_fails_the_attempt_and_takes_the_fence_back() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    g.handle(ResponseBody(content("a"), False))
    undo, fail = g.handle(StoreDown("frozen"))
    assert isinstance(undo, UndoFence) and undo.facts.attempt_id == "att_2"
    assert isinstance(fail, FailAttempt) and fail.held_chunks == 1 and fail.retry


# --- an unconfirmed write, sent again by the rows (decision 0026) --------------------------


@pytest.mark.parametrize("preadmitted", [True, False])
def test_an_unconfirmed_admission_is_sent_again_after_growing_pauses_then_given_up(
        preadmitted: bool) -> None:
    g = started(attempt=1 if preadmitted else 2, preadmitted=preadmitted)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    [write] = g.handle(AdmissionDecided(ADMITTED))
    assert isinstance(write, TakeLease if preadmitted else Admit)
    # The first try went out at 10.0: etcd.resend_deadline_s (3 s) from then, at most.
    t, pauses = 10.0, []
    while True:
        acts = g.handle(NotConfirmed("no leader", 10.0 if g.tries == 1 else t, t + 0.2,
                                     WALL0 + t))
        if not (len(acts) == 1 and isinstance(acts[0], StartTimer)):
            break
        assert acts[0].kind is TimerKind.RESEND and g.state is State.GATE_ADMITTING
        pauses.append(acts[0].seconds)
        t += 0.2 + acts[0].seconds
        # The pause over: the same write, once more (its record and credential unchanged).
        assert g.handle(TimerFired(TimerKind.RESEND, t, WALL0 + t)) == [write]
    assert pauses == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert names(acts) == (["GiveBack", "Refuse"] if preadmitted
                           else ["UndoAdmission", "Refuse"])
    assert acts[-1].error.code is ErrorCode.JOURNAL_UNAVAILABLE
    assert g.state is State.GATE_CLOSED and g.tries == 7


def test_an_unconfirmed_admission_confirmed_on_a_later_try_goes_upstream() -> None:
    g = started(attempt=2)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    [write] = g.handle(AdmissionDecided(ADMITTED))
    assert g.handle(NotConfirmed("no leader", 10.0, 10.5)) == [
        StartTimer(TimerKind.RESEND, 0.05)]
    # A first-delta timer cannot be running yet; another kind is nothing here.
    assert g.handle(TimerFired(TimerKind.SOFT_FIRST_DELTA, 10.52)) == []
    assert g.handle(TimerFired(TimerKind.RESEND, 10.55)) == [write]
    assert names(g.handle(AdmitDecided(True, mono=11.0))) == [
        "Watch", "StartTimer", "ContinueRequest"]
    assert g.tries == 2 and g.state is State.GATE_FORWARDED


def test_the_admissions_resend_stops_at_its_own_deadline_before_etcds() -> None:
    g = started(attempt=2)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    short = Admitted(counts_as_retry=False, fence_wait_s=0.0, deadline_s=0.5, final=True)
    g.handle(AdmissionDecided(short))
    # 0.5 s less the margin from the first try (at 10.0): 10.25, not 13.0.
    assert names(g.handle(NotConfirmed("away", 10.0, 10.15))) == ["StartTimer"]
    g.handle(TimerFired(TimerKind.RESEND, 10.2))
    assert names(g.handle(NotConfirmed("away", 10.2, 10.21))) == ["UndoAdmission", "Refuse"]


def test_an_unconfirmed_fence_is_sent_again_until_the_attempts_limit_then_taken_back() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    _, fence = g.handle(ResponseBody(content("a"), False))
    assert isinstance(fence, Fence)
    sent = fence.until_mono - 0.3  # the attempt's limit comes before etcd's deadline
    assert g.handle(NotConfirmed("frozen", sent, sent + 0.1)) == [
        StartTimer(TimerKind.RESEND, 0.05)]
    assert g.handle(ResponseBody(b"more", False)) == [HoldChunk()]  # held meanwhile
    assert g.handle(TimerFired(TimerKind.SOFT_FIRST_DELTA, sent + 0.12)) == [MarkSlow()]
    assert g.handle(TimerFired(TimerKind.RESEND, sent + 0.15)) == [fence]
    undo, fail = g.handle(NotConfirmed("frozen", sent + 0.15, sent + 0.26))
    assert isinstance(undo, UndoFence) and isinstance(fail, FailAttempt)
    assert fail.held_chunks == 2 and g.state is State.GATE_FAILED


def test_a_confirmed_fence_after_a_resend_releases() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    g.handle(ResponseBody(content("a"), False))
    g.handle(NotConfirmed("frozen", 1.0, 1.1))
    g.handle(TimerFired(TimerKind.RESEND, 1.2))
    assert released(g.handle(FenceDecided(True)), held=1, hand_off=True)


# --- the revocation watch ----------------------------------------------------------------


def test_someone_elses_live_ends_the_permission_while_the_attempt_holds_it() -> None:
    g = admitted_gate()
    assert g.handle(LiveChanged("att_other")) == [LoseLease("revoked or replaced", "att_other")]
    assert g.handle(LiveChanged(None)) == [LoseLease("revoked or replaced", None)]
    assert g.handle(LiveChanged("att_2")) == []  # its own admission, seen late
    assert g.state is State.GATE_FORWARDED  # the fence transaction checks `live` itself
    g.handle(StreamClosed(1.0, WALL0 + 1))
    assert g.handle(LiveChanged(None)) == []  # its own end


def test_before_its_admission_an_attempt_has_no_permission_to_lose() -> None:
    g = started(attempt=2)
    assert g.handle(LiveChanged("att_other")) == []


# --- the headers, read ---------------------------------------------------------------------


def test_attempt_1s_headers_carry_its_id_and_credential_a_later_attempt_mints_its_id() -> None:
    minted = iter(["att_new"])
    hd = {H.REQUEST_ID: RID, H.ENVOY_ATTEMPT_COUNT: "1", H.PREADMITTED: "att_pre",
          H.ATTEMPT_SECRET: "s3cret", H.ACCEPTED_AT: "1700000000.250000",
          H.ATTEMPT_OFFSET: "2", H.PROMPT_TOKENS: "40", H.FINGERPRINT: "fp-a",
          ":path": "/v1/completions"}
    got = request_started(hd, "127.0.0.1:9001", lambda: next(minted), 3.0, WALL0 + 3)
    assert got == (RequestStarted(
        1, "completions", attempt_id="att_pre", attempt_offset=2, preadmitted=True,
        first_admitted="att_pre", replica="127.0.0.1:9001", want_fingerprint="fp-a",
        prompt_tokens=40, accepted_at=1700000000.25, mono=3.0, wall=WALL0 + 3), "s3cret")
    # Envoy's attempt 2 of the same request: its own id, no credential of attempt 1's.
    got = request_started({**hd, H.ENVOY_ATTEMPT_COUNT: "2"}, None, lambda: next(minted),
                          4.0, WALL0 + 4)
    assert got is not None
    ev, secret = got
    assert (ev.attempt, ev.attempt_id, ev.preadmitted, ev.first_admitted, secret) == (
        2, "att_new", False, "att_pre", None)


def test_headers_that_do_not_parse_read_as_their_defaults() -> None:
    hd = {H.REQUEST_ID: RID, H.ENVOY_ATTEMPT_COUNT: "x", H.ACCEPTED_AT: "soon",
          H.ATTEMPT_OFFSET: "-3", H.PROMPT_TOKENS: ""}
    got = request_started(hd, None, lambda: "att_m", 0.0, WALL0)
    assert got is not None
    ev, _ = got
    assert (ev.attempt, ev.accepted_at, ev.attempt_offset, ev.prompt_tokens, ev.family) == (
        1, None, 0, 0, "chat")
    assert request_started({":path": "/v1/models"}, None, lambda: "att_m", 0.0, WALL0) is None


@pytest.mark.parametrize(("first", "live", "no_gate", "want"), [
    ("att_pre", "att_pre", True, True),  # attempt 1 never reached a gate: taken over
    ("att_pre", "att_pre", False, False),  # it may still be running
    ("att_pre", "att_other", True, False),  # another attempt holds the request
    (None, "att_pre", True, False),
])
def test_the_admission_takes_live_over_only_from_an_attempt_1_no_gate_ran_for(
        first: str | None, live: str, no_gate: bool, want: bool) -> None:
    g = GateMachine.new(RID)
    g.handle(RequestStarted(2, attempt_id="att_2", first_admitted=first))
    assert g.never_started(live, lambda a: a == first and no_gate) is want


# --- the first-delta timers --------------------------------------------------------------


def test_the_soft_limit_marks_the_attempt_slow_and_changes_nothing() -> None:
    g = admitted_gate()
    assert g.handle(TimerFired(TimerKind.SOFT_FIRST_DELTA)) == [MarkSlow()]
    assert g.state is State.GATE_FORWARDED and g.facts().slow


def test_the_hard_limit_fails_a_holding_attempt_so_envoy_retries() -> None:
    g = admitted_gate()
    g.handle(ResponseHeaders(200, SSE))
    g.handle(ResponseBody(ROLE, False))
    [fail] = g.handle(TimerFired(TimerKind.FIRST_DELTA, 35.0, WALL0 + 35))
    assert isinstance(fail, FailAttempt) and fail.retry and fail.held_chunks == 1
    assert g.timed_out and g.state is State.GATE_FAILED
    # A timer after release (or a late one) changes nothing.
    g2 = admitted_gate()
    g2.handle(ResponseHeaders(200, SSE))
    g2.handle(ResponseBody(content("a"), False))
    g2.handle(FenceDecided(True))
    assert g2.handle(TimerFired(TimerKind.FIRST_DELTA)) == []


def test_the_hard_limit_of_the_last_attempt_ends_the_request_with_upstream_timeout() -> None:
    g = GateMachine.new(RID)
    admit(g, attempt=3, verdict=FINAL, accepted_at=WALL0)
    # No headers yet: nothing to answer with a 503; the last attempt ends here.
    [r] = g.handle(TimerFired(TimerKind.FIRST_DELTA, 40.0, WALL0 + 41.5))
    assert isinstance(r, Refuse) and r.error.code is ErrorCode.UPSTREAM_TIMEOUT
    assert "41.5" in r.error.message
    # Not the last: Envoy's per-try timeout answers for it.
    g = admitted_gate()
    assert g.handle(TimerFired(TimerKind.FIRST_DELTA)) == []


def test_an_overloaded_replica_is_said_so_with_its_retry_after() -> None:
    g = GateMachine.new(RID)
    g.handle(RequestStarted(1, attempt_id="att_1", replica="127.0.0.1:9001"))
    g.handle(IntakeCommitted())
    g.handle(AdmissionDecided(ADMITTED))
    g.handle(AdmitDecided(True))
    assert g.handle(ResponseHeaders(429, "application/json", retry_after="7")) == [
        Overloaded(7.0), PassHeaders(retry=True)]


# --- the gate machine at its deadline (moved from test_health_admission) ----------------


def gate_in(state: str, final: bool) -> GateMachine:
    m = GateMachine.new("req_1", 1 << 20)
    admit(m, attempt=2, verdict=FINAL if final else ADMITTED, accepted_at=1000.0)
    if state == "holding":
        m.handle(ResponseHeaders(200, "text/event-stream"))
    return m


@pytest.mark.parametrize(("state", "final"), list(itertools.product(["forwarded", "holding"],
                                                                     [False, True])))
def test_first_delta_deadline(state: str, final: bool) -> None:
    m = gate_in(state, final)
    acts = m.handle(TimerFired(TimerKind.FIRST_DELTA, 12.5, 1012.5))
    if final:
        # Nothing left to retry with: our error goes to the client (never retried).
        (a,) = acts
        assert isinstance(a, Refuse) and a.error.code is ErrorCode.UPSTREAM_TIMEOUT
        assert a.error.http_status == 504 and "12.5 s" in a.error.message
        assert m.state is State.GATE_FAILED
    elif state == "holding":
        (a,) = acts
        assert isinstance(a, FailAttempt)  # 503 to the router: retry elsewhere
    else:
        assert acts == []  # no headers to answer: Envoy's per-try timeout ends it
        assert m.state is State.GATE_FORWARDED
    *_, end = m.handle(StreamClosed(13.0, 1013.0))
    timed_out = final or state == "holding"
    # A timed-out end is uncertain: Envoy's word is awaited before it is settled.
    # Not timed out, ended before the limit: confirmed, revoked at once.
    assert isinstance(end, AwaitCause if timed_out else RevokeEarly)
    assert m.timed_out is timed_out



# --- the attempt's end -------------------------------------------------------------------


def holding(**kw: Any) -> GateMachine:
    g = started(**kw)
    g.handle(IntakeCommitted(wall=WALL0 + 1))
    g.handle(AdmissionDecided(ADMITTED))
    g.handle(AdmitDecided(True, mono=5.0))
    g.handle(ResponseHeaders(200, SSE))
    g.handle(ResponseBody(ROLE, False))
    return g


def test_a_confirmed_early_end_is_revoked_then_settled_from_envoys_word() -> None:
    g = holding()
    *_, revoke = g.handle(StreamClosed(mono=7.0, wall=WALL0 + 7))
    assert isinstance(revoke, RevokeEarly) and revoke.record["ended_at"] == WALL0 + 7
    assert g.handle(Revoked(True)) == [AwaitCause("att_1", 0.5)]
    assert g.state is State.GATE_AWAITING_WORD
    [keep, close] = g.handle(CauseLearned("upstream", None, True, WALL0 + 7.01))
    assert isinstance(close, CloseAttempt) and close.update_only and not close.expire
    assert isinstance(keep, KeepTrace) and keep.meta["replica"] == "127.0.0.1:9001"
    assert close.record["ended_at"] == WALL0 + 7 and close.fence == "revoked"
    assert close.cause == "upstream" and g.state is State.GATE_CLOSED


def test_an_unconfirmed_revoke_leaves_the_end_to_the_record_write() -> None:
    g = holding()
    g.handle(StreamClosed(mono=7.0, wall=WALL0 + 7))
    g.handle(Revoked(False))
    [_, close] = g.handle(CauseLearned("upstream", None, True, WALL0 + 8))
    assert isinstance(close, CloseAttempt) and not close.update_only
    assert close.record["ended_at"] == WALL0 + 8


def test_a_timed_out_attempt_without_envoys_word_is_fenced_until_its_lease_expires() -> None:
    g = holding()
    g.handle(TimerFired(TimerKind.FIRST_DELTA, 40.0, WALL0 + 40))
    *_, wait = g.handle(StreamClosed(mono=40.1, wall=WALL0 + 40.1))
    assert wait == AwaitCause("att_1", 0.5)
    # Its replica's health hears of the first delta that never came, before its close.
    [mark, keep, close] = g.handle(CauseLearned("unknown", None, False, WALL0 + 41))
    assert mark == MarkTimedOut("127.0.0.1:9001") and isinstance(keep, KeepTrace)
    assert isinstance(close, CloseAttempt) and close.expire and close.timed_out
    assert close.fence == "expiry" and close.cause == "unknown"
    assert close.record["lease_expires_by"] == round(WALL0 + 41 + GateParams().lease_ttl_s, 3)


def test_every_end_is_a_row_of_the_trace() -> None:
    g = holding()
    g.handle(StreamClosed(mono=7.0, wall=WALL0 + 7))
    g.handle(Revoked(True))
    g.handle(CauseLearned("client", None, True, WALL0 + 7))
    assert [e["type"] for e in g.trace][-3:] == ["StreamClosed", "Revoked", "CauseLearned"]
    assert g.decisions[-1] == "gate_closed:KeepTrace,CloseAttempt"


def test_replay_decides_the_whole_life_again_waits_included() -> None:
    g = holding(preadmitted=True)
    g.handle(TimerFired(TimerKind.FIRST_DELTA, 40.0, WALL0 + 40))
    g.handle(StreamClosed(mono=40.1, wall=WALL0 + 40.1))
    g.handle(CauseLearned("timeout", None, True, WALL0 + 40.2))
    trace = json.loads(json.dumps(record(g, {}, 1 << 20)))
    types = [e["type"] for e in trace["events"]]
    assert types[:4] == ["RequestStarted", "IntakeCommitted", "AdmissionDecided",
                         "AdmitDecided"]
    assert types[-3:] == ["TimerFired", "StreamClosed", "CauseLearned"]
    assert replay(trace).ok
    # A tampered wait (the admission said no) is a divergence, found where it happened.
    bad = json.loads(json.dumps(trace))
    bad["events"][3]["admitted"] = False
    r = replay(bad)
    assert not r.ok and r.steps == 4 and "AdmitDecided" in (r.divergence or "")
    # So is Envoy's word: an entry that never came settles another fence.
    bad = json.loads(json.dumps(trace))
    bad["events"][-1]["heard"] = False
    r = replay(bad)
    assert (not r.ok and "final state" not in (r.divergence or "x")) or not r.ok
    # A format-1 gate trace was decided by an older core, outside the machine.
    assert not replay({**trace, "format": 1}).ok


# --- random streams, randomly split: the invariants hold ---------------------------------


@dataclass
class GateRun:
    gate: GateMachine
    answers: int = 0  # body messages answered (released, failed, passed, dropped)
    fed: int = 0
    decisions: int = 0  # Release + FailAttempt
    released: bool = False
    failed: FailAttempt | None = None


def run_gate(s: Stream, committed: bool, fence_delay: int, max_buffer: int) -> GateRun:
    g = GateMachine.new(RID, max_buffer=max_buffer)
    admit(g, 1)
    assert g.handle(ResponseHeaders(200, SSE)) == []
    run = GateRun(g)
    pending_fence: int | None = None
    fed_bytes = b""

    def account(actions: list[Any], eos_fed: bool) -> None:
        for a in actions:
            if isinstance(a, Release | FailAttempt):
                run.decisions += 1
                run.answers += a.held_chunks
                if isinstance(a, Release):
                    # (a) never released before a content event (or a complete empty answer)
                    seen = decode(fed_bytes, final=eos_fed)
                    kinds = [e.kind for e in seen]
                    assert EventKind.CONTENT in kinds or (eos_fed and EventKind.DONE in kinds)
                    run.released = True
                else:
                    run.failed = a
            elif isinstance(a, PassChunk | DropChunk):
                # In order: nothing may be passed while earlier messages are still held.
                assert g.held == 0
                run.answers += 1

    for idx, chunk in enumerate(s.chunks):
        eos = s.eos and idx == len(s.chunks) - 1
        fed_bytes += chunk
        run.fed += 1
        acts = g.handle(ResponseBody(chunk, eos))
        account(acts, eos)
        if any(isinstance(a, Fence) for a in acts):
            assert pending_fence is None
            pending_fence = fence_delay
        if pending_fence is not None:
            if pending_fence == 0:
                account(g.handle(FenceDecided(committed)), s.eos)
                pending_fence = None
            else:
                pending_fence -= 1
    if pending_fence is not None:
        account(g.handle(FenceDecided(committed)), s.eos)
    end = g.handle(StreamClosed())
    # Released: the guard ends it. Otherwise its end is planned here (a row of its own).
    assert (end == [StopTimers(), StopWatching()]) is run.released
    if run.failed is None:
        assert g.ended == s.eos
    return run


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=streams(), committed=st.booleans(), fence_delay=st.integers(0, 3),
       max_buffer=st.one_of(st.just(4 << 20), st.integers(1, 600)))
def test_gate_invariants(s: Stream, committed: bool, fence_delay: int, max_buffer: int) -> None:
    run = run_gate(s, committed, fence_delay, max_buffer)
    # (b) at most one decision
    assert run.decisions <= 1
    # (c) every body message gets exactly one answer, once the attempt has an outcome
    if s.eos:
        assert run.decisions == 1
        assert run.answers == run.fed
    else:
        assert run.answers + (0 if run.decisions else run.gate.held) == run.fed
    # The oracle: the first decisive event decides.
    events = decode(s.data, final=s.eos)
    decisive = next((e.kind for e in events if e.kind in (
        EventKind.CONTENT, EventKind.ERROR, EventKind.MALFORMED)), None)
    # (d) an error or a malformed event ahead of all content fails the attempt
    if decisive in (EventKind.ERROR, EventKind.MALFORMED):
        assert run.failed is not None and not run.released
    if max_buffer == 4 << 20:
        if decisive is EventKind.CONTENT or (
                decisive is None and s.eos and any(e.kind is EventKind.DONE for e in events)):
            assert run.released == committed
            assert (run.failed is not None) == (not committed)
        elif decisive is None and s.eos:
            assert run.failed is not None and "without content" in run.failed.reason
        elif decisive is None:
            assert run.decisions == 0
    if run.failed is not None:
        assert run.failed.error.code is ErrorCode.UPSTREAM_UNAVAILABLE
        assert run.failed.error.retryable
    assert_replays(run.gate)


def test_replay_of_a_refused_attempt() -> None:
    g = GateMachine.new(RID)
    g.handle(RequestStarted(3, attempt_id="att_3"))
    g.handle(IntakeCommitted())
    err = GatewayError(code=ErrorCode.RETRY_BUDGET_EXHAUSTED, message="no", http_status=503,
                       request_id=RID)
    g.handle(AdmissionDecided(error=err))
    g.handle(StreamClosed())
    assert_replays(g)
    assert g.decisions == ["gate_awaiting_intake:AwaitIntakeCommit", "gate_deciding:Decide",
                           "gate_closed:Refuse", "gate_closed:StopTimers,StopWatching,RetryEnded"]


def test_replay_rejects_a_trace_out_of_order() -> None:
    g = GateMachine.new(RID)
    try:
        g.handle(FenceDecided(True))
    except ProtocolViolation:
        pass
    else:  # pragma: no cover
        raise AssertionError("FenceDecided in gate_new must be a protocol violation")
    assert g.trace == []
