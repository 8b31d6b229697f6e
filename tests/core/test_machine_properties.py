"""Random SSE streams, randomly split, fed to the gate and the guard: the invariants hold."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.errors import ErrorCode, GatewayError, decode_interrupted
from extproc.core.events import (
    AdmissionDecided,
    AwaitCause,
    CauseLearned,
    DropChunk,
    FailAttempt,
    Fence,
    FenceDecided,
    Finish,
    IntakeCommitted,
    PassChunk,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Send,
    State,
    StopTimers,
    StreamClosed,
    TimerFired,
    TimerKind,
)
from extproc.core.gate import GateMachine
from extproc.core.guard import GuardMachine
from extproc.core.journal import Outcome
from extproc.core.machine import ProtocolViolation
from extproc.core.replay import event_from_record
from extproc.core.sse import DONE_EVENT, EventKind, SseDecoder, SseEvent, encode_event

from .gate_drive import admit

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
STALL = 15.0
UPSTREAM_ERROR_MARK = b"engine_dead"

KINDS = ("role", "content", "content2", "empty", "comment", "usage", "error", "malformed",
         "done")


def _delta(delta: dict[str, Any], **extra: Any) -> bytes:
    return encode_event({"id": "c", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, **extra}]})


def atom(kind: str, i: int) -> bytes:
    if kind == "role":
        return _delta({"role": "assistant", "content": ""})
    if kind == "content":
        return _delta({"content": f"t{i}"})
    if kind == "content2":  # two choices: two content units in one event
        return encode_event({"choices": [{"index": 0, "delta": {"content": f"t{i}a"}},
                                         {"index": 1, "delta": {"content": f"t{i}b"}}]})
    if kind == "empty":
        return _delta({}, finish_reason=None)
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "usage":
        return encode_event({"choices": [], "usage": {"completion_tokens": i}})
    if kind == "error":
        return encode_event({"error": {"message": "boom", "code": "engine_dead"}})
    if kind == "malformed":
        return b'data: {"choices": [{"delta"\n\n'
    assert kind == "done"
    return DONE_EVENT


@dataclass
class Stream:
    kinds: list[str]
    chunks: list[bytes]
    eos: bool  # the last chunk carries end_of_stream (else the stream is cut)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    kinds = draw(st.lists(st.sampled_from(KINDS), max_size=14))
    data = b"".join(atom(k, i) for i, k in enumerate(kinds))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    eos = draw(st.booleans()) or draw(st.booleans())  # mostly complete streams
    return Stream(kinds, chunks, eos)


def decode(data: bytes, final: bool = True) -> list[SseEvent]:
    d = SseDecoder()
    return d.feed(data) + (d.finish() if final else [])


def texts(events: list[SseEvent]) -> list[str]:
    out: list[str] = []
    for e in events:
        if e.kind is EventKind.CONTENT:
            for ch in json.loads(e.data)["choices"]:
                out.append(ch["delta"]["content"])
    return out


# --- replay -------------------------------------------------------------------------------

def replay(m: GateMachine | GuardMachine) -> GateMachine | GuardMachine:
    fresh: GateMachine | GuardMachine
    if isinstance(m, GateMachine):
        fresh = GateMachine.new(m.request_id, params=m.params)
    else:
        fresh = GuardMachine.new(m.request_id, m.stall_after_first_delta_s, m.max_buffer)
    # The trace must survive being stored as JSON.
    for rec in json.loads(json.dumps(m.trace)):
        fresh.handle(event_from_record(rec))
    return fresh


def assert_replays(m: GateMachine | GuardMachine) -> None:
    fresh = replay(m)
    assert fresh.decisions == m.decisions
    assert fresh.state is m.state
    assert fresh.trace == m.trace


# --- the gate -----------------------------------------------------------------------------


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
    assert (end == [StopTimers()]) is run.released
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


# --- the guard ----------------------------------------------------------------------------


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
                           "gate_closed:Refuse", "gate_closed:StopTimers,RetryEnded"]


def test_replay_rejects_a_trace_out_of_order() -> None:
    g = GateMachine.new(RID)
    try:
        g.handle(FenceDecided(True))
    except ProtocolViolation:
        pass
    else:  # pragma: no cover
        raise AssertionError("FenceDecided in gate_new must be a protocol violation")
    assert g.trace == []
