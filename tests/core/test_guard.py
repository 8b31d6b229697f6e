"""The guard's rows for the intake order (decision 0021), the take-over of a hand-off and a
response that is not (yet) ours; then every interleaving of the intake's answer, Envoy's
response messages, the stream's close and Envoy's word on why it ended; the intake
transaction's own rows; the response path with exact actions (what the client gets, the
stall timer, the fence, the record's write); random streams, randomly split, and the
invariants that hold for all of them.

Pure: no I/O, no sleeps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core import guard as G
from extproc.core.errors import (
    ErrorCode,
    GatewayError,
    bad_request,
    body_required,
    decode_interrupted,
    journal_unavailable,
    request_in_progress,
)
from extproc.core.events import (
    Accepted,
    Action,
    AnswerBody,
    AnswerHeaders,
    AnswerStatus,
    AwaitCause,
    AwaitIntake,
    AwaitLateIntake,
    CauseLearned,
    CloseIntake,
    CloseTool,
    Event,
    Fenced,
    Finish,
    IntakeFailed,
    LookUpStatus,
    LoseLease,
    OpenIntake,
    PassAside,
    PassBody,
    PassHeaders,
    PassRequest,
    ProgressWritten,
    ReadBody,
    RecordWritten,
    Refuse,
    RegisterIntake,
    RequestBody,
    RequestBodySeen,
    RequestEnded,
    RequestHeadersSeen,
    RequestOpened,
    ResponseBody,
    ResponseHeaders,
    Send,
    StartTimer,
    StartToolCall,
    State,
    StatusRead,
    StopTimers,
    StopWatching,
    StreamClosed,
    TakeOver,
    TimerFired,
    TimerKind,
    UnreadableHandOff,
    WriteProgress,
)
from extproc.core.guard import (
    INTAKE_MAX_PAUSE_S,
    GuardMachine,
    IntakeAction,
    IntakeAnswer,
    IntakeDown,
    IntakeFlow,
    IntakePauseOver,
    IntakeStart,
    IntakeState,
    IntakeWritten,
    PauseIntake,
    Reopen,
    ReopenAnswered,
    SettleView,
    TakeBackIntake,
    UndoReopenLater,
    ViewSettled,
    WriteIntake,
)
from extproc.core.handoff import HandOff
from extproc.core.journal import JournalView, Outcome, tenant_digest
from extproc.core.machine import ProtocolViolation
from extproc.core.replay import event_from_record, record, replay
from extproc.core.sse import DONE_EVENT, EventKind, SseDecoder, encode_event

from .exhaustive import Chooser, every
from .sse_streams import UPSTREAM_ERROR_MARK, Stream, assert_replays, decode, streams, texts

RID = "req_0123456789abcdefghjkmnpqrs"

# The close's actions from trace format 5 on (core.replay): absent from older traces.
FORMAT_5 = ("StopWatching", "CloseIntake", "AwaitLateIntake", "CloseTool")
# What a close does before its end: stop what feeds the stream, close its intake.
CLOSING = (StopTimers, StopWatching, CloseIntake, AwaitLateIntake)
SSE = "text/event-stream"
HANDOFF = '{"attempt":1,"attempt_id":"att_x","lease_id":7}'
REFUSED = request_in_progress(RID, "prefill")


def body_seen(keyed: bool) -> tuple[GuardMachine, list[Action]]:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    assert m.handle(RequestHeadersSeen("generation")) == [AnswerHeaders()]
    return m, m.handle(RequestBodySeen(None, keyed=keyed))


def test_a_key_less_body_goes_on_while_its_intake_commits_and_gates_wait_for_it() -> None:
    m, acts = body_seen(keyed=False)
    assert acts == [OpenIntake(), RegisterIntake(), AnswerBody(), AwaitIntake()]
    assert m.state is State.GUARD_OPENING
    assert m.handle(RequestOpened(True)) == [Accepted()]
    assert m.state is State.GUARD_WAITING and m.accepted


def test_a_keyed_body_waits_for_its_intake_before_going_on() -> None:
    m, acts = body_seen(keyed=True)
    assert acts == [OpenIntake(), AwaitIntake()]
    assert m.handle(RequestOpened(True)) == [Accepted(), AnswerBody()]
    assert m.state is State.GUARD_WAITING


def test_a_keyed_repeat_is_answered_by_the_guard() -> None:
    m, _ = body_seen(keyed=True)
    assert m.handle(RequestOpened(False, REFUSED)) == [Refuse(REFUSED)]
    assert m.state is State.GUARD_ASIDE and not m.accepted


def test_a_key_less_intake_that_fails_is_answered_by_its_gate() -> None:
    err = journal_unavailable(RID)
    m, _ = body_seen(keyed=False)
    assert m.handle(RequestOpened(False, err)) == [IntakeFailed(err)]
    assert m.state is State.GUARD_ASIDE
    # The gate's error comes back through the guard's response path, untouched.
    assert m.handle(ResponseHeaders(503, "application/json", ours=True)) == [PassAside()]
    assert m.handle(ResponseBody(b"{}", True)) == [Send(b"{}", True)]
    # Its intake read, if failed: no more offered to its gates, and ended for the budget.
    assert m.handle(StreamClosed()) == [StopTimers(), CloseIntake(), RequestEnded()]


def test_envoy_s_own_reply_to_a_failed_key_less_intake_is_answered_with_its_error() -> None:
    # No gate ran (every attempt refused before one did): Envoy's reply says no replica
    # answered, but nothing was recorded; the client gets the intake's error instead, as a
    # gate would have given it (the chaos slice's record_missing: 503 upstream_unavailable
    # for a request whose lookup is 404).
    err = journal_unavailable(RID)
    m, _ = body_seen(keyed=False)
    assert m.handle(RequestOpened(False, err)) == [IntakeFailed(err)]
    assert m.handle(ResponseHeaders(503, "application/json", envoy_reply=True)) == [
        PassHeaders(as_json=True)]
    want = m.family.error_json(err)
    assert json.loads(want)["error"]["code"] == "journal_unavailable"
    assert m.handle(ResponseBody(b'{"error":{"code":"upstream_unavailable"', False)) == [
        Send(want, False)]
    assert m.handle(ResponseBody(b"}}", True)) == [Send(b"", True)]
    assert m.state is State.GUARD_ASIDE
    # Envoy's reply to a request whose intake did not fail goes on as it came.
    m, _ = body_seen(keyed=False)
    assert m.handle(ResponseHeaders(503, "application/json", envoy_reply=True)) == [
        PassAside()]
    assert m.handle(ResponseBody(b"x", True)) == [Send(b"x", True)]


def test_the_released_attempt_is_taken_over_before_its_headers_go_on() -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    assert m.handle(ResponseHeaders(200, SSE, handoff=HANDOFF)) == [
        TakeOver(HandOff.from_header(HANDOFF)), PassHeaders()]
    assert m.released_id == "att_x"


def test_an_unreadable_hand_off_is_taken_over_as_nothing() -> None:
    # The row reads the header once: the session owns nothing, the observer says why.
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    assert m.handle(ResponseHeaders(200, SSE, handoff="{not json")) == [
        UnreadableHandOff(), PassHeaders()]
    assert m.released_id is None
    # A format-3 trace recorded it as TakeOver (of None): it replays as that.
    m.handle(StreamClosed())
    rec = record(m, {}, 1 << 20)
    old = {**rec, "format": 3, "decisions": [
        d.replace("UnreadableHandOff", "TakeOver") for d in without(
            rec["decisions"], "RequestEnded", *FORMAT_5)]}
    assert replay(rec).ok and replay(old).ok and not replay({**old, "format": 4}).ok


def test_a_body_is_read_only_where_a_generation_awaits_it() -> None:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    assert m.handle(RequestHeadersSeen("generation", "chat", None, False)) == [AnswerHeaders()]
    assert m.handle(RequestBody()) == [ReadBody()]
    aside = GuardMachine.new(RID, 15.0, at_request=True)
    aside.handle(RequestHeadersSeen("passthrough", "chat", None, False))
    assert aside.handle(RequestBody()) == [PassBody()]


def test_envoys_own_5xx_is_answered_as_our_json_error() -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    assert m.handle(ResponseHeaders(503, "text/plain", envoy_reply=True)) == [
        PassHeaders(as_json=True)]
    (send,) = m.handle(ResponseBody(b"no healthy upstream", True))
    assert isinstance(send, Send) and b'"error"' in send.data


def _finish_of(acts: list[Action]) -> Finish:
    [fin] = [a for a in acts if isinstance(a, Finish)]
    return fin


def test_a_finish_says_whether_any_release_could_have_reached_the_client() -> None:
    # Decision 0057: a response that is not a 200 carries no attempt's release, so a
    # `delivery` the journal holds then never left Envoy.
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    m.handle(ResponseHeaders(503, "text/plain", envoy_reply=True))
    acts = m.handle(ResponseBody(b"upstream connect error", True)) + m.handle(StreamClosed())
    assert _finish_of(acts).nothing_released
    m = streaming_guard()
    acts = m.handle(ResponseBody(ROLE + content("a") + DONE_EVENT, True))
    acts += m.handle(StreamClosed())
    assert not _finish_of(acts).nothing_released
    # A 200 whose content never came (reset before Envoy wrote a delta) still left.
    m = streaming_guard()
    acts = m.handle(StreamClosed()) + m.handle(CauseLearned("upstream"))
    assert not _finish_of(acts).nothing_released
    m = streaming_guard()
    acts = m.handle(StreamClosed()) + m.handle(CauseLearned("upstream", 0, status=200))
    assert not _finish_of(acts).nothing_released
    # Envoy's entry says the client got its own 502: the 200 the guard passed never left
    # (an upstream reset while Envoy still held it), so neither did the release.
    m = streaming_guard()
    acts = m.handle(StreamClosed()) + m.handle(CauseLearned("upstream", 303, status=502))
    fin = _finish_of(acts)
    assert fin.nothing_released and fin.outcome is Outcome.UPSTREAM_FAILED
    assert fin.delivered_output_tokens == 0


def test_content_the_guard_passed_under_a_200_envoy_replaced_was_not_delivered() -> None:
    # The chaos harness (soak seed 22, a `reset-after-deltas` replica): the guard passed
    # the role and a first delta, then the upstream reset while Envoy still held the 200,
    # and Envoy answered the client its own 502. The record said
    # `upstream_decode_interrupted`, 1 token delivered, `retryable: false`, and a repeat of
    # the key was refused with it, while the client had read nothing and been told
    # `retryable: true`. What the client got was Envoy's reply: nothing delivered.
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a") + content("b"), False))
    assert m.delivered == 2
    acts = m.handle(StreamClosed()) + m.handle(CauseLearned("upstream", 303, status=502))
    fin = _finish_of(acts)
    assert fin.nothing_released and fin.outcome is Outcome.UPSTREAM_FAILED
    assert (fin.delivered_output_tokens, fin.cause) == (0, "upstream")
    assert fin.bound is None


@pytest.mark.parametrize("status,handoff", [(200, None), (503, HANDOFF), (429, None)])
def test_no_take_over_without_a_released_attempt(status: int, handoff: str | None) -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    acts = m.handle(ResponseHeaders(status, SSE, handoff=handoff))
    assert not any(isinstance(a, TakeOver) for a in acts)


def streaming(m: GuardMachine) -> list[Action]:
    assert m.handle(ResponseHeaders(200, SSE)) == [PassHeaders()]
    return m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', False))


def test_the_stall_watchdog_is_a_timer_row() -> None:
    m = GuardMachine.new(RID, 15.0)
    acts = streaming(m)
    # Started (again) with every chunk past the first delta, as the gate's limits are.
    assert acts[-1] == StartTimer(TimerKind.STALL, 15.0)
    [fin, send] = m.handle(TimerFired(TimerKind.STALL, 15.0))
    assert isinstance(send, Send) and send.end_of_stream
    assert isinstance(fin, Finish) and fin.cause == "stall"
    assert m.state is State.GUARD_TERMINATED
    # The stream's end stops what is left (a checkpoint, had one started); a late one
    # changes nothing.
    assert m.handle(StreamClosed()) == [StopTimers()]
    assert m.handle(TimerFired(TimerKind.STALL, 30.0)) == []


def test_an_open_stream_holds_no_empty_kept_list_or_body_buffer() -> None:
    """A streaming request keeps no event text without a tokenizer and buffers no body:
    both stay the shared empties, not a list and a bytearray per open stream (decision
    0058); with a tokenizer the text is kept, and a whole answer is buffered."""
    m = GuardMachine.new(RID, 15.0)
    streaming(m)
    m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', False))
    assert m.delivered == 2 and m.kept == () and m.body == b"" and type(m.body) is bytes
    k = GuardMachine.new(RID, 15.0)
    k.count_text = len
    streaming(k)
    raw = b'data: {"choices":[{"delta":{"content":"bc"}}]}\n\n'
    k.handle(ResponseBody(raw, False))
    assert type(k.kept) is list and k.kept[-1] == raw and len(k.kept) == k.delivered == 2
    assert k.delivered_tokens() == (len("a") + len("bc"), False, "tokenizer")


def test_the_delivered_count_is_checkpointed_on_a_timer_row() -> None:
    m = GuardMachine.new(RID, 15.0, progress_every=2.0)
    acts = streaming(m)
    # The first delta starts the checkpoint timer once; every chunk moves the stall timer.
    assert acts[1:] == [StartTimer(TimerKind.CHECKPOINT, 2.0), StartTimer(TimerKind.STALL, 15.0)]
    assert StartTimer(TimerKind.CHECKPOINT, 2.0) not in m.handle(ResponseBody(
        b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', False))
    assert m.handle(TimerFired(TimerKind.CHECKPOINT, 2.0)) == [
        WriteProgress(2), StartTimer(TimerKind.CHECKPOINT, 2.0)]
    # One write at a time: unanswered, the next tick writes nothing but ticks on while
    # more went out than was written.
    m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"c"}}]}\n\n', False))
    assert m.handle(TimerFired(TimerKind.CHECKPOINT, 4.0)) == [
        StartTimer(TimerKind.CHECKPOINT, 2.0)]
    assert m.handle(ProgressWritten()) == []
    assert m.handle(TimerFired(TimerKind.CHECKPOINT, 6.0)) == [
        WriteProgress(3), StartTimer(TimerKind.CHECKPOINT, 2.0)]
    assert m.handle(ProgressWritten()) == []
    # Nothing new: the tick arms no other (an idle stream is not woken, decision 0053) ...
    assert m.handle(TimerFired(TimerKind.CHECKPOINT, 8.0)) == [] and m.checkpoint_off
    # ... a chunk of no content arms none either; the next content event does.
    assert m.handle(ResponseBody(b": keep-alive\n\n", False)) == [
        Send(b": keep-alive\n\n", False), StartTimer(TimerKind.STALL, 15.0)]
    acts = m.handle(ResponseBody(b'data: {"choices":[{"delta":{"content":"d"}}]}\n\n', False))
    assert acts[1:] == [StartTimer(TimerKind.CHECKPOINT, 2.0), StartTimer(TimerKind.STALL, 15.0)]
    assert not m.checkpoint_off
    assert m.handle(TimerFired(TimerKind.CHECKPOINT, 12.0))[0] == WriteProgress(4)
    assert m.state is State.GUARD_STREAMING
    # Never without an interval; a late answer after the end changes nothing.
    assert not any(isinstance(a, StartTimer) and a.kind is TimerKind.CHECKPOINT
                   for a in streaming(GuardMachine.new(RID, 15.0)))
    m.handle(StreamClosed())
    assert m.handle(ProgressWritten()) == []


def test_the_records_write_answers_the_machine() -> None:
    m = GuardMachine.new(RID, 15.0)
    streaming(m)
    with pytest.raises(ProtocolViolation):  # no Finish yet: no write to answer
        m.handle(RecordWritten(True))
    acts = m.handle(StreamClosed())
    assert acts == [StopTimers(), AwaitCause()]
    [fin] = m.handle(CauseLearned("client", None))
    assert isinstance(fin, Finish) and m.recorded is None
    assert m.handle(RecordWritten(False)) == []
    assert m.recorded is False and m.state is State.GUARD_CLOSED
    assert event_from_record(m.trace[-1]) == RecordWritten(False)


def test_a_response_that_is_not_a_request_of_ours_passes_and_is_not_traced() -> None:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.handle(RequestHeadersSeen("passthrough"))
    assert m.handle(ResponseHeaders(200, "application/json", handoff=HANDOFF)) == [PassAside()]
    assert m.handle(ResponseBody(b"x" * 100, True)) == [Send(b"x" * 100, True)]
    assert len(m.trace) == 1  # the headers' classification only


def test_the_new_fields_survive_a_trace() -> None:
    m, _ = body_seen(keyed=True)
    m.handle(RequestOpened(False, REFUSED))
    evs = [event_from_record(r) for r in m.trace]
    assert evs[1] == RequestBodySeen(None, keyed=True)
    opened = evs[2]
    assert isinstance(opened, RequestOpened) and opened.error is not None
    assert (opened.error.code, opened.error.http_status) == (REFUSED.code, REFUSED.http_status)
    m2, _ = body_seen(keyed=False)
    m2.handle(RequestOpened(True))
    m2.handle(ResponseHeaders(200, SSE, handoff=HANDOFF))
    assert event_from_record(m2.trace[-1]) == ResponseHeaders(200, SSE, handoff=HANDOFF)


# --- properties: every interleaving -----------------------------------------------------


@dataclass
class Run(Chooser):
    keyed: bool
    accept: bool
    choices: list[int]
    # Envoy's own reply (every attempt refused before a gate ran) instead of the released
    # attempt's stream.
    envoy: bool = False
    at: int = 0
    log: list[tuple[Event, list[Action]]] = field(default_factory=list)


def play(run: Run) -> GuardMachine:
    """After the body: the intake's answer, Envoy's response (headers, two body messages)
    and the stream's close come in any order; Envoy's word comes when it is awaited, and
    after the close the intake's answer only if the close awaits it (AwaitLateIntake: the
    session feeds nothing else of a closed stream)."""
    m, acts = body_seen(run.keyed)
    run.log.append((RequestBodySeen(None, keyed=run.keyed), acts))
    answered = closed = awaiting_cause = late = False
    headers = bodies = 0
    while True:
        options: list[Event] = []
        if not answered and (late or not closed):
            options.append(RequestOpened(True) if run.accept else RequestOpened(False, REFUSED))
        if not closed:
            if not headers:
                options.append(ResponseHeaders(503, "application/json", envoy_reply=True)
                               if run.envoy else ResponseHeaders(200, SSE, handoff=HANDOFF))
            elif bodies < 2:
                options.append(ResponseBody(ENVOY_503 if run.envoy else b"", bodies == 1))
            options.append(StreamClosed())
        if awaiting_cause:
            options.append(CauseLearned("client", 0))
        if not options:
            break
        ev = options[run.choose(len(options))]
        if isinstance(ev, RequestOpened):
            answered = True
        elif isinstance(ev, ResponseHeaders):
            headers = 1
        elif isinstance(ev, ResponseBody):
            bodies += 1
        elif isinstance(ev, StreamClosed):
            closed = True
        elif isinstance(ev, CauseLearned):
            awaiting_cause = False
        acts = m.handle(ev)
        awaiting_cause = awaiting_cause or any(isinstance(a, AwaitCause) for a in acts)
        late = late or AwaitLateIntake() in acts
        run.log.append((ev, acts))
    return m


ENVOY_503 = b'{"error":{"code":"upstream_unavailable"}}'


def every_run() -> list[Run]:
    runs: list[Run] = []
    for keyed in (False, True):
        for accept in (False, True):
            for envoy in (False, True):
                runs += every(lambda c, k=keyed, a=accept, e=envoy: Run(k, a, c, envoy=e),
                              play)
    return runs


RUNS = every_run()


def actions(r: Run) -> list[Action]:
    return [a for _, acts in r.log for a in acts]


def test_every_interleaving_has_a_row() -> None:
    assert len(RUNS) > 50  # each completed: no (state, event) pair without a row


def test_the_body_goes_on_once_and_a_keyed_one_only_after_its_intake_accepted() -> None:
    for r in RUNS:
        acts = actions(r)
        assert acts.count(OpenIntake()) == 1
        bodies = [i for i, a in enumerate(acts) if isinstance(a, AnswerBody)]
        if not r.keyed:
            # Before the wait, after the gates can find the intake to wait for.
            assert bodies == [2] and acts[:4] == [OpenIntake(), RegisterIntake(), AnswerBody(),
                                                  AwaitIntake()], r.choices
            continue
        assert RegisterIntake() not in acts
        opened = [i for i, (ev, _) in enumerate(r.log) if isinstance(ev, RequestOpened)]
        closed_first = any(isinstance(ev, StreamClosed) for ev, _ in r.log[:opened[0]])
        if r.accept and not closed_first:
            assert len(bodies) == 1 and isinstance(acts[bodies[0] - 1], Accepted), r.choices
        else:
            assert bodies == [], r.choices


def test_every_run_ends_its_request_for_the_retry_budget_once_at_its_streams_end() -> None:
    # The body was read for an intake in every run: whatever came first, the stream's end
    # (and only it) ends the request, once, before what else that end decides.
    for r in RUNS:
        ends = [(ev, acts) for ev, acts in r.log if RequestEnded() in acts]
        assert len(ends) == 1, r.choices
        ev, acts = ends[0]
        end = [a for a in acts if not isinstance(a, CLOSING)]
        assert isinstance(ev, StreamClosed) and end[0] == RequestEnded(), r.choices
        # And no chunk with nothing in it is a Send (the two bodies here are empty).
        assert not any(isinstance(a, Send) and not (a.data or a.end_of_stream)
                       for a in actions(r)), r.choices


def test_the_close_stops_the_stream_and_closes_its_intake_first_whatever_the_order() -> None:
    # What the session did by itself before it fed the close is the close's row: first
    # the timers, the released attempt's watch (if one was taken over), then the intake:
    # offered to the gates no more once answered, awaited after the close while in flight.
    # The intake's answer is heard once in every run: after the close only because the row
    # awaited it.
    for r in RUNS:
        [i] = [i for i, (ev, _) in enumerate(r.log) if isinstance(ev, StreamClosed)]
        before = [a for _, acts in r.log[:i] for a in acts]
        answered = any(isinstance(ev, RequestOpened) for ev, _ in r.log[:i])
        took_over = any(isinstance(a, TakeOver) for a in before)
        want = [StopTimers(), *([StopWatching()] if took_over else []),
                CloseIntake() if answered else AwaitLateIntake()]
        acts = r.log[i][1]
        assert acts[:len(want)] == want and not any(
            isinstance(a, CLOSING) for a in acts[len(want):]), r.choices
        assert sum(isinstance(ev, RequestOpened) for ev, _ in r.log) == 1, r.choices
        later = [a for _, acts in r.log[i + 1:] for a in acts]
        assert not any(isinstance(a, CLOSING) for a in later), r.choices


def test_the_tool_route_hears_the_close_last() -> None:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    assert m.handle(RequestHeadersSeen("tool")) == [StartToolCall()]
    assert m.handle(StreamClosed()) == [StopTimers(), CloseTool()]
    assert m.handle(StreamClosed()) == []  # closed once
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.handle(RequestHeadersSeen("passthrough"))
    assert m.handle(StreamClosed()) == [StopTimers()]


def test_a_refused_intake_is_answered_once_by_the_right_role() -> None:
    for r in RUNS:
        acts = actions(r)
        if r.accept:
            assert not any(isinstance(a, (Refuse, IntakeFailed)) for a in acts), r.choices
            continue
        closed_first = isinstance(next(ev for ev, _ in r.log if isinstance(
            ev, (RequestOpened, StreamClosed))), StreamClosed)
        refuse = [a for a in acts if isinstance(a, Refuse)]
        failed = [a for a in acts if isinstance(a, IntakeFailed)]
        if closed_first:
            assert refuse == failed == [], r.choices  # nobody left to answer
        elif r.keyed:
            assert refuse == [Refuse(REFUSED)] and failed == [], r.choices
        else:
            assert failed == [IntakeFailed(REFUSED)] and refuse == [], r.choices
        assert not any(isinstance(a, (Accepted, Finish, TakeOver)) for a in acts), r.choices


def test_envoy_s_reply_after_a_failed_key_less_intake_carries_its_error() -> None:
    # Whatever the order: Envoy's reply that reaches the guard after the intake failed is
    # answered with the intake's error (nothing recorded, no gate ran); before the answer
    # (the session awaits the intake before reading on, so only the model has this order)
    # or to any other request it goes on as it came.
    seen = 0
    for r in RUNS:
        if not r.envoy:
            continue
        failed = accepted = replaced = False
        for ev, acts in r.log:
            failed = failed or IntakeFailed(REFUSED) in acts
            accepted = accepted or Accepted() in acts
            if isinstance(ev, ResponseHeaders):
                # Accepted first: a request of ours, Envoy's 503 in our error's shape too.
                want = [PassHeaders(as_json=True)] if failed or accepted else [PassAside()]
                assert acts == want, r.choices
                replaced = failed
                seen += failed
            elif isinstance(ev, ResponseBody) and replaced:
                error = GuardMachine.new(RID, 15.0).family.error_json(REFUSED)
                first = not any(isinstance(a, Send) and a.data == error
                                for _, earlier in r.log[:r.log.index((ev, acts))]
                                for a in earlier)
                assert acts == [Send(error if first else b"", ev.end_of_stream)], r.choices
    assert seen > 0


def test_an_accepted_request_is_finished_exactly_once_whatever_the_order() -> None:
    for r in RUNS:
        finishes = [a for a in actions(r) if isinstance(a, Finish)]
        assert len(finishes) == (1 if r.accept else 0), r.choices
        if finishes and not any(isinstance(a, TakeOver) for a in actions(r)):
            # No released attempt was ours: nothing reached the client from it.
            assert finishes[0].delivered_output_tokens == 0, r.choices


def test_only_an_accepted_request_takes_over_and_stamps_its_headers() -> None:
    # (Or, with our error's shape, one whose key-less intake failed: Envoy's own reply.)
    for r in RUNS:
        accepted = failed = False
        for ev, acts in r.log:
            accepted = accepted or Accepted() in acts or (
                isinstance(ev, RequestOpened) and ev.accepted)
            failed = failed or IntakeFailed(REFUSED) in acts
            for a in acts:
                if isinstance(a, TakeOver):
                    assert accepted and isinstance(ev, ResponseHeaders), r.choices
                if isinstance(a, PassHeaders):
                    assert (accepted or (failed and r.envoy and a.as_json)) and isinstance(
                        ev, ResponseHeaders), r.choices
            if isinstance(ev, ResponseHeaders) and not r.envoy:
                assert acts in ([PassAside()], [PassHeaders()],
                                [TakeOver(HandOff.from_header(HANDOFF)), PassHeaders()]), \
                    r.choices
        if any(isinstance(a, TakeOver) for a in actions(r)):
            # The attempt taken over ends with the request: its record is settled.
            assert [a.outcome for a in actions(r) if isinstance(a, Finish)] in (
                [Outcome.CLIENT_DISCONNECTED], [Outcome.COMPLETED],
                [Outcome.UPSTREAM_FAILED]), r.choices


def test_a_trace_re_decides_the_same_way() -> None:
    for r in RUNS[::5]:
        m = GuardMachine.new(RID, 15.0, at_request=True)
        m.handle(RequestHeadersSeen("generation"))
        assert [m.handle(ev) for ev, _ in r.log] == [acts for _, acts in r.log], r.choices


# --- the intake transaction itself (IntakeFlow) -----------------------------------------

AID1 = "att_" + "1" * 26
DIGEST = "sha256:" + "a" * 64
META = {"model": "m", "stream": True, "max_attempts": 2, "request_digest": DIGEST}
RESEND_S = 1.0


def flow(key: str | None = "k-1") -> IntakeFlow:
    return IntakeFlow(RID, AID1, DIGEST, key, RESEND_S, "gw-1", "envoy-1")


def ended_view(outcome: str, delivered: bool = False) -> JournalView:
    return JournalView(request_id=RID, meta=META,
                       attempts=({"attempt": 1, "attempt_id": "att_old"},),
                       delivery={"at": 1.0} if delivered else None,
                       outcome={"outcome": outcome, "delivered_output_tokens": 0,
                                "cause": "http 503", "finished_at": 5.0})


OWN = JournalView(request_id=RID, meta=META, attempts=({"attempt": 1, "attempt_id": AID1},),
                  live_attempt_id=AID1)
DONE = ended_view("completed", delivered=True)  # answered from the journal
RERUNNABLE = ended_view("upstream_failed")  # ended with nothing delivered: runs again


def test_a_new_request_is_recorded_in_one_transaction() -> None:
    f = flow()
    assert f.handle(IntakeStart(0.0)) == [WriteIntake()]
    assert f.handle(IntakeWritten(None)) == [IntakeAnswer(None)]
    assert f.state is IntakeState.DONE


def test_a_lost_answer_is_sent_again_and_our_own_record_confirms_it() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    assert f.handle(IntakeDown("no leader", 0.1)) == [PauseIntake(0.05)]
    assert f.handle(IntakePauseOver()) == [WriteIntake()]
    assert f.handle(IntakeWritten(OWN)) == [IntakeAnswer(None)]
    assert f.confirmed_own and f.tries == 2


def test_an_intake_unconfirmed_past_the_resend_deadline_is_taken_back() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    pauses, now = [], 0.0
    acts = f.handle(IntakeDown("away", now))
    while isinstance(acts[0], PauseIntake):
        pauses.append(acts[0].seconds)
        now += acts[0].seconds + 0.01
        assert f.handle(IntakePauseOver()) == [WriteIntake()]
        acts = f.handle(IntakeDown("away", now))
    assert pauses[:4] == [0.05, 0.1, 0.2, 0.4] and max(pauses) == INTAKE_MAX_PAUSE_S
    assert acts == [TakeBackIntake(AID1), IntakeAnswer(journal_unavailable(RID))]
    assert sum(pauses) < RESEND_S


def test_a_repeat_is_answered_from_the_settled_record() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    assert f.handle(IntakeWritten(DONE)) == [SettleView(DONE)]
    (a,) = f.handle(ViewSettled(DONE, 9.0))
    assert isinstance(a, IntakeAnswer) and a.error is not None
    assert str(a.error.code) == "request_already_completed"


def test_a_record_gone_when_settled_is_ours_to_create_no_more_but_new() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    f.handle(IntakeWritten(DONE))
    assert f.handle(ViewSettled(None, 9.0)) == [IntakeAnswer(None)]


def test_a_repeat_that_runs_again_is_re_opened_with_its_next_attempt() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    f.handle(IntakeWritten(RERUNNABLE))
    (reopen,) = f.handle(ViewSettled(RERUNNABLE, 9.0))
    assert isinstance(reopen, Reopen)
    n, aid, rec = reopen.first
    assert (n, aid, rec["attempt"], rec["admitted_at"]) == (2, AID1, 2, 9.0)
    assert reopen.history[0] == 1 and reopen.history[1]["reopened_at"] == 9.0
    assert reopen.history[1]["next_envoy_request_id"] == "envoy-1"
    (a,) = f.handle(ReopenAnswered(None))
    assert isinstance(a, IntakeAnswer) and a.error is None
    assert a.rerun is not None and (a.rerun.run, a.rerun.first_attempt) == (2, 2)


def test_a_re_open_that_keeps_losing_the_race_is_in_progress() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    f.handle(IntakeWritten(RERUNNABLE))
    f.handle(ViewSettled(RERUNNABLE, 9.0))
    assert f.handle(ReopenAnswered(RERUNNABLE)) == [SettleView(RERUNNABLE)]
    assert isinstance(f.handle(ViewSettled(RERUNNABLE, 9.1))[0], Reopen)
    f.handle(ReopenAnswered(RERUNNABLE))
    (a,) = f.handle(ViewSettled(RERUNNABLE, 9.2))
    assert a == IntakeAnswer(request_in_progress(RID, "done"))


def test_a_re_open_without_an_answer_is_taken_back_later() -> None:
    f = flow()
    f.handle(IntakeStart(0.0))
    f.handle(IntakeWritten(RERUNNABLE))
    (reopen,) = f.handle(ViewSettled(RERUNNABLE, 9.0))
    assert isinstance(reopen, Reopen)
    assert f.handle(IntakeDown("away", 1.0)) == [
        UndoReopenLater(reopen.history, (2, AID1)), IntakeAnswer(journal_unavailable(RID))]


def test_an_intake_flow_pair_with_no_row_is_a_protocol_violation() -> None:
    f = flow()
    with pytest.raises(ProtocolViolation):
        f.handle(IntakePauseOver())


@dataclass
class IntakeRun(Chooser):
    choices: list[int]
    at: int = 0
    mono: float = 0.0
    log: list[tuple[object, list[IntakeAction]]] = field(default_factory=list)


def play_intake(r: IntakeRun) -> IntakeFlow:
    """etcd answers every step any way it can; timers fire after their pause."""
    f = flow()
    pending: list[object] = [IntakeStart(0.0)]
    while pending:
        ev = pending.pop()
        acts = f.handle(ev)  # type: ignore[arg-type]
        r.log.append((ev, acts))
        for a in acts:
            if isinstance(a, WriteIntake):
                r.mono += 0.1
                opts: list[object] = [IntakeWritten(None), IntakeWritten(OWN),
                                      IntakeWritten(DONE), IntakeWritten(RERUNNABLE),
                                      IntakeDown("away", r.mono)]
            elif isinstance(a, SettleView):
                opts = [ViewSettled(a.view, 9.0), ViewSettled(None, 9.0),
                        IntakeDown("away", r.mono)]
            elif isinstance(a, Reopen):
                opts = [ReopenAnswered(None), ReopenAnswered(RERUNNABLE),
                        IntakeDown("away", r.mono)]
            elif isinstance(a, PauseIntake):
                r.mono += a.seconds
                pending.append(IntakePauseOver())
                continue
            else:
                continue
            pending.append(opts[r.choose(len(opts))])
    return f


def every_intake_run() -> list[IntakeRun]:
    return every(IntakeRun, play_intake)


INTAKE_RUNS = every_intake_run()


def test_every_intake_ends_with_one_answer_and_takes_back_what_may_apply() -> None:
    assert len(INTAKE_RUNS) > 50
    for r in INTAKE_RUNS:
        acts = [a for _, aa in r.log for a in aa]
        answers = [a for a in acts if isinstance(a, IntakeAnswer)]
        assert len(answers) == 1 and acts[-1] is answers[0], r.choices
        (ans,) = answers
        evs = [ev for ev, _ in r.log]
        last_ev = r.log[-1][0]
        down_writing = isinstance(last_ev, IntakeDown) and not any(
            isinstance(a, (SettleView, Reopen)) for a in acts)
        # Taken back exactly when the intake itself gave up unconfirmed.
        assert (TakeBackIntake(AID1) in acts) == down_writing, r.choices
        if TakeBackIntake(AID1) in acts:
            assert ans.error == journal_unavailable(RID), r.choices
        # A re-run only when a re-open answered that it applied; its take-back only when
        # one got no answer.
        assert (ans.rerun is not None) == (ReopenAnswered(None) in evs), r.choices
        undo = [a for a in acts if isinstance(a, UndoReopenLater)]
        assert len(undo) <= 1 and (not undo or ans.error == journal_unavailable(RID))
        if undo:
            assert any(isinstance(a, Reopen) for a in acts), r.choices
        # A new request is never answered with a repeat's error, nor a repeat let in.
        if not any(isinstance(ev, IntakeWritten) and ev.existing in (DONE, RERUNNABLE)
                   for ev in evs):
            assert ans.rerun is None, r.choices
        if ans.error is None and ans.rerun is None:
            assert not any(isinstance(ev, ViewSettled) and ev.view is DONE for ev in evs)


def test_the_intakes_resends_stay_within_their_deadline() -> None:
    for r in INTAKE_RUNS:
        paused = sum(a.seconds for _, aa in r.log for a in aa if isinstance(a, PauseIntake))
        assert paused < RESEND_S, r.choices


# --- the response path, with exact actions --------------------------------------------

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


CONTENT_A = content("a")
TRACES = Path(__file__).parent / "traces"  # traces older cores recorded



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
    assert acts == [fin, Send(content("b") + terminal(2), True), StopTimers()]
    assert m.state is State.GUARD_TERMINATED
    sent = b"".join(a.data for a in acts if isinstance(a, Send))
    assert b"engine_dead" not in sent and b"CUDA" not in sent
    # Whatever comes afterwards goes nowhere.
    assert m.handle(ResponseBody(content("d") + DONE_EVENT, True)) == []
    assert m.handle(TimerFired(TimerKind.STALL)) == []
    assert m.handle(StreamClosed()) == [StopTimers()]
    assert m.state is State.GUARD_CLOSED
    assert m.finished == fin
    assert m.handle(CauseLearned("upstream")) == []


def test_guard_malformed_after_delivery_terminates() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(content("a"), False))
    acts = m.handle(ResponseBody(MALFORMED, False))
    assert acts == [Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 1, "malformed event", exact=False),
                    Send(terminal(1), True), StopTimers()]


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
    assert acts == [Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "stall", exact=False),
                    Send(terminal(2), True)]
    assert m.state is State.GUARD_TERMINATED
    assert m.handle(ResponseBody(content("late"), False)) == []


def test_guard_fenced_attempt_ends_the_stream_at_once() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a") + content("b"), False))
    acts = m.handle(Fenced("revoked or replaced"))
    assert acts == [LoseLease("revoked or replaced"),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "fenced", exact=False),
                    Send(terminal(2), True), StopTimers()]
    assert m.state is State.GUARD_TERMINATED and m.lease_lost
    assert m.handle(ResponseBody(content("late"), False, lease_expired=True)) == []
    assert m.handle(Fenced()) == []  # said once, whoever noticed it again


def test_guard_fenced_before_any_content_still_publishes_nothing() -> None:
    m = streaming_guard()
    acts = m.handle(Fenced())
    assert acts == [LoseLease("expired locally"),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 0, "fenced"),
                    Send(terminal(0), True), StopTimers()]


def test_guard_fenced_after_done_changes_nothing() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(content("a") + FINISH + DONE_EVENT, False))
    assert m.handle(Fenced()) == [LoseLease("expired locally")]  # the lease still ends
    assert m.handle(Fenced()) == []
    assert m.state is State.GUARD_RESPONDING or m.state is State.GUARD_STREAMING



def test_guard_incomplete_fragment_is_not_sent_at_stall() -> None:
    m = streaming_guard()
    nxt = content("FRAGMENT")
    acts = m.handle(ResponseBody(content("a") + nxt[:15], False))
    assert acts == [Send(content("a"), False), StartTimer(TimerKind.STALL, STALL)]
    [_fin, send] = m.handle(TimerFired(TimerKind.STALL))
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
        # Closing before the intake finished records nothing; a body read for an intake
        # (refused by it) ends the request for the retry budget all the same.
        if not m.accepted:
            read = kind == "generation" and body is None
            assert m.handle(StreamClosed()) == [StopTimers(), *(
                [CloseIntake(), RequestEnded()] if read else [])]
            assert m.state is State.GUARD_CLOSED


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
    # Its answer still counts: awaited after the close.
    assert m.handle(StreamClosed()) == [StopTimers(), AwaitLateIntake(), RequestEnded()]
    assert m.state is State.GUARD_LEFT_OPENING and not m.accepted
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



def test_guard_puts_a_replicas_own_5xx_in_our_shape_and_leaves_ours() -> None:
    # The last attempt's replica answered 500 with the engine's own JSON: the client gets
    # our error with the request id (docs/errors.md), status kept.
    m = GuardMachine.new(RID, STALL)
    assert m.handle(ResponseHeaders(500, "application/json")) == [PassHeaders(as_json=True)]
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


# --- random streams, randomly split: the invariants hold ---------------------------------


@dataclass
class GuardRun:
    guard: GuardMachine
    sends: list[Send]
    finishes: list[Finish]


def run_guard(s: Stream, stalls: list[bool], cause: str) -> GuardRun:
    m = GuardMachine.new(RID, STALL)
    m.handle(ResponseHeaders(200, SSE))
    sends: list[Send] = []
    finishes: list[Finish] = []

    def account(actions: list[Any]) -> None:
        # The record's write is started before any of its batch's bytes go out (Envoy may
        # close the stream, and cancel the handler, once our last bytes are written).
        fins = [i for i, a in enumerate(actions) if isinstance(a, Finish)]
        assert all(i < j for i in fins for j, a in enumerate(actions) if isinstance(a, Send))
        for a in actions:
            if isinstance(a, Send):
                # After the stream was ended, nothing more is sent.
                assert not (sends and sends[-1].end_of_stream)
                sends.append(a)
            elif isinstance(a, Finish):
                finishes.append(a)
            elif isinstance(a, AwaitCause):
                account(m.handle(CauseLearned(cause)))

    for idx, chunk in enumerate(s.chunks):
        eos = s.eos and idx == len(s.chunks) - 1
        account(m.handle(ResponseBody(chunk, eos)))
        if idx < len(stalls) and stalls[idx]:
            account(m.handle(TimerFired(TimerKind.STALL)))
    account(m.handle(StreamClosed()))
    assert m.state is State.GUARD_CLOSED
    return GuardRun(m, sends, finishes)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=streams(), stalls=st.lists(st.booleans(), max_size=10),
       cause=st.sampled_from(["client", "upstream", "unknown"]))
def test_guard_invariants(s: Stream, stalls: list[bool], cause: str) -> None:
    run = run_guard(s, stalls, cause)
    m = run.guard
    # A Send always carries something: bytes, or the stream's end.
    assert all(x.data or x.end_of_stream for x in run.sends)
    sent = b"".join(x.data for x in run.sends)
    out = decode(sent)
    fed = decode(s.data, final=s.eos)
    # Content goes out in the order it came, each once: a prefix of what was fed.
    sent_texts = texts(out)
    assert sent_texts == texts(fed)[: len(sent_texts)]
    assert len(set(sent_texts)) == len(sent_texts)
    # `delivered` is exactly what the client got.
    assert m.delivered == sum(e.content_units for e in out if e.kind is EventKind.CONTENT)
    # One terminal record, with that count.
    assert len(run.finishes) == 1
    assert run.finishes[0].delivered_output_tokens == m.delivered
    # After the first content, no upstream error is ever forwarded; an error there is ours,
    # it is final (only [DONE] after it) and it ends the stream.
    first = next((i for i, e in enumerate(out) if e.kind is EventKind.CONTENT), None)
    if first is not None:
        assert UPSTREAM_ERROR_MARK not in b"".join(e.raw for e in out[first:])
        errs = [i for i, e in enumerate(out) if i > first and e.kind in (
            EventKind.ERROR, EventKind.MALFORMED)]
        if errs:
            assert len(errs) == 1
            i = errs[0]
            assert [e.kind for e in out[i:]] == [EventKind.ERROR, EventKind.DONE]
            assert out[i].raw + out[i + 1].raw == decode_interrupted(
                RID, m.delivered, False).sse_bytes()  # events counted: not exact
            assert run.sends[-1].end_of_stream
            assert run.finishes[0].outcome is Outcome.UPSTREAM_DECODE_INTERRUPTED
    # Oracle for streams without stalls that ended normally.
    # Nothing after `[DONE]` reaches the client: its answer is complete by then.
    done_at = next((i for i, e in enumerate(fed) if e.kind is EventKind.DONE), None)
    if done_at is not None:
        fed = fed[: done_at + 1]
    if s.eos and not any(stalls[: len(s.chunks)]):
        bad_after = next((i for i, e in enumerate(fed) if e.kind in (
            EventKind.ERROR, EventKind.MALFORMED) and any(
                x.kind is EventKind.CONTENT for x in fed[:i])), None)
        if bad_after is None:
            assert sent == (s.data if done_at is None else b"".join(e.raw for e in fed))
            assert run.finishes[0] == Finish(Outcome.COMPLETED, m.delivered, None,
                                             exact=m.delivered == 0)
        else:
            prefix = b"".join(e.raw for e in fed[:bad_after])
            assert sent == prefix + decode_interrupted(RID, m.delivered,
                                                       m.delivered == 0).sse_bytes()
    assert_replays(m)


@settings(max_examples=100, deadline=None)
@given(s=streams())
def test_guard_output_does_not_depend_on_chunking(s: Stream) -> None:
    whole = Stream(s.kinds, [s.data], s.eos)
    a = run_guard(s, [], "upstream")
    b = run_guard(whole, [], "upstream")
    assert b"".join(x.data for x in a.sends) == b"".join(x.data for x in b.sends)
    assert a.finishes == b.finishes


# --- the request phase's answers, and the chunk's lease check (trace format 3) ------------


@pytest.mark.parametrize(("kind", "error", "want"), [
    ("passthrough", None, [PassRequest()]),
    ("status", None, [LookUpStatus()]),
    ("tool", None, [StartToolCall()]),
    ("rejected", bad_request(ErrorCode.INVALID_HEADER, "no", status=405), "refuse"),
    ("misrouted", bad_request(ErrorCode.TOOL_ROUTE_NOT_HERE, "no", status=404), "refuse"),
])
def test_headers_that_are_not_a_generation_are_answered_by_their_row(
        kind: str, error: GatewayError | None, want: Any) -> None:
    m = GuardMachine.new(RID, STALL, at_request=True)
    acts = m.handle(RequestHeadersSeen(kind, error=error))
    assert acts == ([Refuse(error)] if want == "refuse" else want)
    assert m.state is State.GUARD_ASIDE and m.trace_budget == 0
    assert m.handle(RequestBody()) == [PassBody()]  # its body, if any, is not read


def test_a_generation_whose_headers_end_it_is_refused_body_required() -> None:
    m = GuardMachine.new(RID, STALL, at_request=True)
    assert m.handle(RequestHeadersSeen("generation", end_of_stream=True)) == [
        Refuse(body_required(RID))]
    assert m.state is State.GUARD_ASIDE


def test_a_status_lookup_is_answered_from_the_record_of_its_own_tenant_only() -> None:
    view = JournalView(request_id=RID, meta={**META, "tenant": tenant_digest("default")},
                       attempts=())
    for ev, want in [(StatusRead(view, "default"), [AnswerStatus(view)]),
                     (StatusRead(view, "someone-else"), ErrorCode.REQUEST_NOT_FOUND),
                     (StatusRead(None, "default"), ErrorCode.REQUEST_NOT_FOUND),
                     (StatusRead(None, "default", "etcd away"), ErrorCode.JOURNAL_UNAVAILABLE)]:
        m = GuardMachine.new(RID, STALL, at_request=True)
        m.handle(RequestHeadersSeen("status"))
        acts = m.handle(ev)
        if isinstance(want, list):
            assert acts == want
        else:
            [refuse] = acts
            assert isinstance(refuse, Refuse) and refuse.error.code is want
            assert refuse.error.request_id == RID


def test_a_chunk_past_the_leases_local_expiry_ends_the_stream_once() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a"), False))
    acts = m.handle(ResponseBody(content("b"), False, lease_expired=True))
    assert acts == [LoseLease("expired locally"),
                    Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 1, "fenced", exact=False),
                    Send(terminal(1), True), StopTimers()]
    assert m.handle(ResponseBody(content("c"), False, lease_expired=True)) == []
    assert m.handle(Fenced("revoked or replaced")) == []
    assert event_from_record(m.trace[-3]) == ResponseBody(content("b"), False, True)
    assert "lease_expired" not in m.trace[-4]  # the hot path's record stays as it was
    assert replay(record(m, {}, 1 << 20)).ok


def test_a_whole_answer_past_the_leases_expiry_still_goes_out() -> None:
    m = GuardMachine.new(RID, STALL)
    m.handle(ResponseHeaders(200, "application/json"))
    acts = m.handle(ResponseBody(b"{}", True, lease_expired=True))
    assert acts == [LoseLease("expired locally"), Send(b"{}", True)]


def test_a_format_2_guard_trace_replays_without_the_new_answers() -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    m.handle(ResponseHeaders(200, SSE, handoff=HANDOFF))
    m.handle(ResponseBody(ROLE + content("a"), False))
    m.handle(Fenced())
    m.handle(StreamClosed())
    rec = record(m, {}, 1 << 20)
    assert rec["format"] == 6 and replay(rec).ok
    # As a format-2 core recorded it: no AnswerHeaders, no LoseLease, no RequestEnded, a
    # bare Fenced, none of the close's rows.
    old = {**rec, "format": 2,
           "decisions": without(rec["decisions"], "AnswerHeaders", "LoseLease", "RequestEnded",
                                *FORMAT_5),
           "events": [{"type": "Fenced"} if e["type"] == "Fenced" else e
                      for e in rec["events"]]}
    assert old["decisions"] != rec["decisions"] and replay(old).ok
    assert not replay({**old, "format": 3}).ok


def without(decisions: list[str], *names: str) -> list[str]:
    """Decisions as an older core recorded them: without the actions `names`."""
    out = []
    for d in decisions:
        state, _, acts = d.partition(":")
        out.append(state + ":" + ",".join(a for a in acts.split(",") if a and a not in names))
    return out


def test_a_stream_end_ends_the_request_for_the_retry_budget_once() -> None:
    # Accepted, answered, closed: RequestEnded once, first after the close's stops,
    # whatever else the end says.
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    m.handle(ResponseHeaders(200, "application/json"))
    m.handle(ResponseBody(b"{}", True))
    assert m.handle(StreamClosed())[:3] == [StopTimers(), CloseIntake(), RequestEnded()]
    assert RequestEnded() not in m.handle(StreamClosed())
    # No body read for an intake (a pass-through, the tool route): nothing to end.
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.handle(RequestHeadersSeen("passthrough"))
    assert m.handle(StreamClosed()) == [StopTimers()]


def test_a_chunk_with_nothing_to_forward_is_no_send() -> None:
    m = streaming_guard()
    assert m.handle(ResponseBody(ROLE + CONTENT_A[:7], False)) == [Send(ROLE, False)]
    assert m.handle(ResponseBody(CONTENT_A[7:12], False)) == []  # still incomplete
    acts = m.handle(ResponseBody(CONTENT_A[12:], False))
    assert acts[0] == Send(CONTENT_A, False)
    assert Send(b"", False) not in m.handle(ResponseBody(b"", False))
    assert m.handle(ResponseBody(b"", True))[0] == Send(b"", True)  # the end is said


def test_format_3_traces_recorded_before_these_rows_replay() -> None:
    # Recorded by the core of 8dddcaf (tests/core/traces): the gate's close without
    # MarkTimedOut and KeepTrace, the agent's acknowledgement without KeepTrace, the guard's
    # end without RequestEnded and with a Send for each chunk that forwarded nothing.
    for name in ("gate_timed_out", "gate_agent_ack", "guard_stream"):
        trace = json.loads((TRACES / f"format3_{name}.json").read_text())
        assert trace["format"] == 3
        assert replay(trace).ok, (name, replay(trace).divergence)
        # Read as today's format they differ: the old decisions are what is compared.
        assert not replay({**trace, "format": 4}).ok


def test_a_finish_says_whether_the_upstreams_answer_was_whole() -> None:
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a") + DONE_EVENT, False))
    [_, fin] = m.handle(StreamClosed())
    assert isinstance(fin, Finish) and fin.upstream_finished  # reset after [DONE]
    m = streaming_guard()
    m.handle(ResponseBody(ROLE + content("a"), False))
    fin = m.handle(TimerFired(TimerKind.STALL))[0]
    assert isinstance(fin, Finish) and not fin.upstream_finished


@dataclass
class ReferenceMarks:
    """Decision 0025's delivery marks, written the plain way (a list of 4-tuples, folded
    and cut as the decision says): what GuardMachine's packed marks must answer."""
    max_buffer: int
    fold_at: int  # marks held when folding is considered
    sent: int = 0
    marks: list[tuple[int, int, int, int]] = field(default_factory=list)
    floor: tuple[int, int, int, int] = (0, 0, -1, 0)

    def sent_downstream(self, n: int) -> None:
        self.sent += n
        if len(self.marks) >= self.fold_at:
            old = [mk for mk in self.marks if mk[0] < self.sent - self.max_buffer]
            if old:
                self.floor = old[-1]
                self.marks = self.marks[len(old):]

    def cut_to(self, body_bytes: int, delivered: int, et: int | None, kept: int
               ) -> tuple[int, int | None, int, bool]:
        """(delivered, engine_tokens, len(kept), an upper bound) once Envoy says it sent
        `body_bytes`."""
        if body_bytes >= self.sent or (body_bytes > 0 and (
                not self.marks or body_bytes >= self.marks[-1][0])):
            return delivered, et, kept, False
        if body_bytes <= 0:  # nothing went out: none delivered, exactly, folded or not
            return 0, None, 0, False
        within = [mk for mk in self.marks if mk[0] <= body_bytes]
        end, units, e, k = within[-1] if within else self.floor
        return units, None if e < 0 else e, k, end > body_bytes


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(
    st.sampled_from([1, 7, 120, 4000, 1 << 31, 1 << 40]),  # bytes an event (32 bits, not)
    st.integers(0, 3),                                    # content units
    st.one_of(st.none(), st.integers(0, 1 << 33)),        # the engine's count
    st.booleans(),                                        # kept
    st.integers(0, 3)), max_size=60),                     # events before bytes go out
    max_buffer=st.sampled_from([50, 5000, 1 << 33]), kept_at=st.integers(1, 6),
    cut=st.integers(0, 100), counted=st.booleans(), keeping=st.booleans())
def test_the_packed_marks_answer_as_plain_ones_would(
        steps: list[tuple[int, int, int | None, bool, int]], max_buffer: int, kept_at: int,
        cut: int, counted: bool, keeping: bool) -> None:
    """Random streams of content events (offsets and counts below and beyond 32 bits),
    folds considered at several sizes: at every step the machine's marks, floor and then
    a cut anywhere in the stream answer exactly as the reference does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(G, "_MARKS_FOLD", G.MARK_STRIDE * kept_at)
        mp.setattr(G, "_NARROW_FOLD", 2 * kept_at)
        m = GuardMachine.new(RID, STALL, max_buffer=max_buffer)
        ref = ReferenceMarks(max_buffer, kept_at)
        pending = 0
        wide = False
        for size, units, count, keep, flush in steps:
            # Streams with no engine count or no kept text at all (narrow marks) too.
            et = count if counted else None
            keep = keep and keeping
            m.delivered += units
            m.engine_tokens = et
            if keep:
                m.keep(b"x")
            pending += size
            m.mark(m.sent + pending)
            ref.marks.append((m.sent + pending, m.delivered, -1 if et is None else et,
                              len(m.kept)))
            if flush == 0:
                m.sent_downstream(pending)
                ref.sent_downstream(pending)
                pending = 0
            # Narrow until an event has an engine count or kept text, wide from then on.
            wide = wide or et is not None or bool(m.kept)
            assert m.marks_wide is wide
            assert plain_marks(m) == ref.marks
            assert m.floor == ref.floor and m.sent == ref.sent
        m.sent_downstream(pending)
        ref.sent_downstream(pending)
        body_bytes = m.sent * cut // 100
        want = ref.cut_to(body_bytes, m.delivered, m.engine_tokens, len(m.kept))
        before = m.delivered
        m.cut_to(body_bytes)
        assert (m.delivered, m.engine_tokens, len(m.kept), m.bound == "upper") == want
        assert m.withheld == (before - m.delivered if want[0] != before else 0)
        # 32-bit numbers turn 64-bit only when a number does not fit them.
        big = any(n >= 1 << 31 for mk in [*ref.marks, ref.floor] for n in mk)
        assert m.marks.typecode == "q" or not big


def plain_marks(m: GuardMachine) -> list[tuple[int, int, int, int]]:
    """The machine's marks as 4-tuples, whatever their width."""
    if m.marks_wide:
        mk = m.marks
        return [(mk[i], mk[i + 1], mk[i + 2], mk[i + 3]) for i in range(0, len(mk), 4)]
    return [(m.marks[i], m.marks[i + 1], -1, 0) for i in range(0, len(m.marks), 2)]
