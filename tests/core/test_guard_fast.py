"""The guard's fast path for the common chunk (core.guard.streaming_chunk) against its row.

`streaming_chunk` decides a chunk in the streaming state without the table; it must be that
row for such a chunk, exactly: the same bytes out, the same actions, counts, marks, state,
trace and decisions, and a trace it wrote must replay through the table. Two machines get
the same random streams, randomly split: one through `handle` only, one through the fast
path wherever it takes the chunk (as adapters.guard runs it), `handle` otherwise.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import guard
from extproc.core.events import (
    Action,
    ProgressWritten,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    ResponseBody,
    ResponseHeaders,
    Send,
    StartTimer,
    State,
    StopTimers,
    StreamClosed,
    TimerFired,
    TimerKind,
    WriteProgress,
)
from extproc.core.guard import GuardMachine, streaming_chunk
from extproc.core.replay import event_from_record
from extproc.core.sse import DONE_EVENT, encode_event
from extproc.core.usage import UsageMode

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
PROMPT = 4


def _chunk(delta: dict[str, Any], done: int | None, *, finish: str | None = None,
           null_usage: bool = False, details: bool = True) -> bytes:
    """An event in vLLM 0.32's form (the fast path's), with its running usage if `done`."""
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                         "model": "m", "choices": [{"index": 0, "delta": delta,
                                                    "logprobs": None, "finish_reason": finish}]}
    if done is not None:
        u: dict[str, Any] = {"prompt_tokens": PROMPT, "total_tokens": PROMPT + done,
                             "completion_tokens": done}
        if details:
            u["completion_tokens_details"] = None
        c["usage"] = u
    elif null_usage:
        c["usage"] = None
    return encode_event(c)


STYLES = ("token_usage", "token_plain", "token_null_usage", "token_no_details")
KINDS = ("token", "token_usage", "token_plain", "token_null_usage", "token_no_details",
         "unicode", "bad_utf8", "escaped", "role", "comment", "crlf", "tool_call", "error",
         "malformed", "usage_only", "finish", "multiline", "event_name", "done")


def atom(kind: str, i: int, style: str = "token_usage") -> bytes:
    """Event `i` of `kind`; a "token" is in the stream's `style` (one of the token kinds)."""
    text = f"t{i}"
    if kind == "token":
        kind = style
    if kind == "token_usage":
        return _chunk({"content": text}, i)
    if kind == "token_plain":  # no usage member at all
        return _chunk({"content": text}, None)
    if kind == "token_null_usage":
        return _chunk({"content": text}, None, null_usage=True)
    if kind == "token_no_details":
        return _chunk({"content": text}, i, details=False)
    if kind == "unicode":
        return _chunk({"content": f"é中{i}"}, i)
    if kind == "bad_utf8":  # the usual shape, its content not UTF-8: malformed
        return _chunk({"content": "@@"}, i).replace(b'"@@"', b'"\xff\xfe"')
    if kind == "escaped":
        return _chunk({"content": f'"\\\n{i}'}, i)
    if kind == "role":
        return _chunk({"role": "assistant", "content": ""}, i)
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "crlf":
        return _chunk({"content": text}, i).replace(b"\n", b"\r\n")
    if kind == "tool_call":
        return _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                       "function": {"name": "f", "arguments": "{}"}}]}, i)
    if kind == "error":
        return encode_event({"error": {"message": "boom", "code": "engine_dead"}})
    if kind == "malformed":
        return b'data: {"choices": [{"delta"\n\n'
    if kind == "usage_only":
        return encode_event({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                             "created": 1, "model": "m", "choices": [],
                             "usage": {"prompt_tokens": PROMPT, "total_tokens": PROMPT + i,
                                       "completion_tokens": i}})
    if kind == "finish":
        return _chunk({}, i, finish="stop")
    if kind == "multiline":  # one event's data over two `data:` lines
        body = _chunk({"content": text}, i)[len(b"data: "):-2]
        cut = body.index(b",")
        return b"data: " + body[:cut] + b"\ndata: " + body[cut:] + b"\n\n"
    if kind == "event_name":
        return b"event: message\n" + _chunk({"content": text}, i)
    assert kind == "done"
    return DONE_EVENT


def machine(mode: UsageMode, keep: bool, budget: int) -> GuardMachine:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.trace_budget = budget
    m.handle(RequestHeadersSeen("generation", "chat"))
    m.handle(RequestBodySeen(None, mode))
    m.handle(RequestOpened(True))
    m.handle(ResponseHeaders(200, SSE))
    if keep:
        m.count_text = len
    return m


def fast_or_row(m: GuardMachine, ev: ResponseBody) -> tuple[list[Action], bool]:
    """As adapters.guard runs a chunk: the fast path's answer, else the row's."""
    out = streaming_chunk(m, ev.data, ev.end_of_stream, ev.lease_expired)
    if out is None:
        return m.handle(ev), False
    return [Send(out, False), StartTimer(TimerKind.STALL, m.stall_after_first_delta_s)], True


def state_of(m: GuardMachine) -> dict[str, Any]:
    d = {f.name: getattr(m, f.name) for f in fields(m) if f.name not in ("decoder",)}
    d["marks"] = list(m.marks)
    d["decoder"] = (m.decoder.pending(), m.decoder._data, m.decoder._event,
                    m.decoder._bom_pending)
    return d


@st.composite
def chunked(draw: st.DrawFn) -> tuple[list[bytes], bool, list[bool]]:
    # Mostly usual tokens, so that runs of one-event messages (what the decoder learns a
    # stream's head and middle from, then uses) are common.
    kinds = draw(st.lists(st.sampled_from(KINDS + ("token",) * 16), max_size=24))
    style = draw(st.sampled_from(STYLES))
    data = b"".join(atom(k, i, style) for i, k in enumerate(kinds))
    # Cuts at event boundaries (one or several events per message), anywhere, and empty
    # chunks.
    bounds = [0]
    for k, i in zip(kinds, itertools.count()):
        bounds.append(bounds[-1] + len(atom(k, i, style)))
    # How often a boundary is cut, per stream: from never (one message) to always.
    often = draw(st.integers(0, 10))
    at_bounds = draw(st.lists(st.integers(0, 9), min_size=len(bounds), max_size=len(bounds)))
    cuts = [b for b, x in zip(bounds, at_bounds, strict=True) if x < often] + draw(
        st.lists(st.integers(0, len(data)), max_size=4))
    edges = sorted([0, *cuts, len(data)])
    chunks = [data[a:b] for a, b in itertools.pairwise(edges)]
    # Now and then the lease runs out with a chunk.
    expired = draw(st.lists(st.integers(0, 9).map(lambda x: x == 0), min_size=len(chunks),
                            max_size=len(chunks)))
    return chunks, draw(st.booleans()), expired


@settings(max_examples=400, deadline=None)
@given(got=chunked(), mode=st.sampled_from(list(UsageMode)), keep=st.booleans(),
       budget=st.sampled_from([0, 400, 1500, 4000, 1 << 40]))
def test_the_fast_path_is_the_row(got: tuple[list[bytes], bool, list[bool]], mode: UsageMode,
                                  keep: bool, budget: int) -> None:
    chunks, eos, expired = got
    both_ways(chunks, eos, expired, mode, keep, budget)


@settings(max_examples=200, deadline=None)
@given(style=st.sampled_from(STYLES), mode=st.sampled_from(list(UsageMode)),
       lead=st.integers(1, 6), tail=st.lists(st.sampled_from(KINDS), max_size=6),
       group=st.integers(1, 3), budget=st.sampled_from([0, 2000, 1 << 40]))
def test_long_runs_of_one_event_messages_then_anything(
        style: str, mode: UsageMode, lead: int, tail: list[str], group: int,
        budget: int) -> None:
    """What the decoder learns a stream's head and middle from: a run of one-event messages,
    then messages of `group` events (the learned head and middle start them), then any
    events one per message."""
    singles = [atom("token", i, style) for i in range(lead + 3)]
    groups = [b"".join(atom("token", 100 + 10 * j + k, style) for k in range(group))
              for j in range(3)]
    rest = [atom(k, 200 + i, style) for i, k in enumerate(tail)]
    chunks = singles + groups + rest + singles
    both_ways(chunks, True, [False] * len(chunks), mode, False, budget)


def test_old_marks_fold_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream's marks folded (decision 0025's bounded memory), on both paths."""
    monkeypatch.setattr(guard, "_MARKS_FOLD", guard.MARK_STRIDE * 2)  # 2 marks held
    monkeypatch.setattr(guard, "_NARROW_FOLD", 2 * 2)
    chunks = [atom("token", i) for i in range(12)]
    row, _ = both_ways(chunks, False, [False] * len(chunks), UsageMode.STRIP_ALL, False,
                          1 << 40, max_buffer=300)
    assert row.floor != (0, 0, -1, 0) and len(row.marks) < 4 * len(chunks)


def both_ways(chunks: list[bytes], eos: bool, expired: list[bool], mode: UsageMode,
              keep: bool, budget: int, max_buffer: int = 4 << 20
              ) -> tuple[GuardMachine, GuardMachine]:
    row, fast = machine(mode, keep, budget), machine(mode, keep, budget)
    row.max_buffer = fast.max_buffer = max_buffer
    for i, data in enumerate(chunks):
        ev = ResponseBody(data, eos and i == len(chunks) - 1, expired[i])
        want = row.handle(ev)
        assert fast_or_row(fast, ev)[0] == want
        assert state_of(fast) == state_of(row)
    row.handle(StreamClosed())
    fast.handle(StreamClosed())
    assert state_of(fast) == state_of(row)
    # The fast path's trace replays through the table to the same decisions and state.
    fresh = GuardMachine.new(RID, 15.0, at_request=True)
    fresh.count_text = fast.count_text  # the adapter's, not traced
    for rec in json.loads(json.dumps(fast.trace)):
        fresh.handle(event_from_record(rec))
    assert fresh.decisions == fast.decisions
    if not fast.trace_truncated:
        assert fresh.state is fast.state
        assert (fresh.delivered, fresh.engine_tokens, fresh.sent) == (
            fast.delivered, fast.engine_tokens, fast.sent)
        if max_buffer == 4 << 20:  # (replay's machine has the default)
            assert list(fresh.marks) == list(fast.marks)
    return row, fast


def test_the_fast_path_takes_the_common_chunk_and_counts_it() -> None:
    """Not vacuous: the usual chunk (one event, several) goes the fast way, stripped of the
    usage the gateway asked for, counted, its running count read."""
    m = machine(UsageMode.STRIP_ALL, False, 1 << 40)
    first = m.handle(ResponseBody(_chunk({"role": "assistant", "content": "a"}, 1), False))
    assert m.state is State.GUARD_STREAMING and isinstance(first[0], Send)
    acts, took = fast_or_row(m, ResponseBody(_chunk({"content": "b"}, 2), False))
    assert took and acts[0] == Send(_chunk({"content": "b"}, None), False)
    assert (m.delivered, m.engine_tokens) == (2, 2)
    two = _chunk({"content": "c"}, 3) + _chunk({"content": "d"}, 5)
    acts, took = fast_or_row(m, ResponseBody(two, False))
    assert took and acts[0] == Send(_chunk({"content": "c"}, None)
                                    + _chunk({"content": "d"}, None), False)
    assert (m.delivered, m.engine_tokens, m.sent) == (4, 5, len(b"".join(
        _chunk(d, None) for d in ({"role": "assistant", "content": "a"}, {"content": "b"},
                                  {"content": "c"}, {"content": "d"}))))
    # What it does not take: a lease gone, the stream's end, a partial event, [DONE].
    for ev in (ResponseBody(_chunk({"content": "e"}, 6), False, True),
               ResponseBody(_chunk({"content": "e"}, 6), True),
               ResponseBody(_chunk({"content": "e"}, 6)[:-1], False),
               ResponseBody(DONE_EVENT, False)):
        assert streaming_chunk(m, ev.data, ev.end_of_stream, ev.lease_expired) is None
    assert m.decisions[-1] == "guard_streaming:Send,StartTimer"


@settings(max_examples=300, deadline=None)
@given(got=chunked(), mode=st.sampled_from(list(UsageMode)), between=st.lists(
    st.lists(st.sampled_from(["tick", "written"]), max_size=4), max_size=30))
def test_checkpoint_ticks_between_chunks_on_both_paths(
        got: tuple[list[bytes], bool, list[bool]], mode: UsageMode,
        between: list[list[str]]) -> None:
    """The CHECKPOINT timer run as the adapter runs it (a tick only while armed, one write
    answered at a time) between chunks taken by the fast path or the row: both machines
    decide and hold the same, and the timer is armed exactly while a count not yet written
    went out (decision 0053: a tick with nothing to write arms none, the next content event
    does)."""
    chunks, eos, _ = got
    row, fast = machine(mode, False, 1 << 40), machine(mode, False, 1 << 40)
    row.progress_every = fast.progress_every = 2.0
    armed = inflight = False
    for i, data in enumerate(chunks):
        ev = ResponseBody(data, eos and i == len(chunks) - 1, False)
        want = row.handle(ev)
        acts, _ = fast_or_row(fast, ev)
        assert acts == want
        for a in acts:
            if isinstance(a, StopTimers):
                armed = False
            elif isinstance(a, StartTimer) and a.kind is TimerKind.CHECKPOINT:
                armed = True
        for what in between[i] if i < len(between) else []:
            if what == "tick" and armed:
                tick = TimerFired(TimerKind.CHECKPOINT, 2.0 * i)
                acts = row.handle(tick)
                assert fast.handle(tick) == acts
                armed = StartTimer(TimerKind.CHECKPOINT, 2.0) in acts
                if any(isinstance(a, WriteProgress) for a in acts):
                    inflight = True
                elif row.delivered == row.progress_sent:
                    assert not armed  # nothing new to write: no tick after it
            elif what == "written" and inflight:
                assert row.handle(ProgressWritten()) == fast.handle(ProgressWritten()) == []
                inflight = False
        assert state_of(fast) == state_of(row)
        if fast.state is State.GUARD_STREAMING and not fast.done_seen:
            assert armed is not fast.checkpoint_off
            # Content forwarded since the last write always has a tick coming.
            assert armed or fast.delivered == fast.progress_sent, i


def test_text_kept_from_mid_stream_widens_the_marks_on_both_paths() -> None:
    """Narrow marks (no engine count, no kept text) turn wide at the first event with kept
    text, whichever path takes it (decision 0053)."""
    chunks = [atom("token", i) for i in range(6)]
    row, fast = machine(UsageMode.OFF, False, 1 << 40), machine(UsageMode.OFF, False, 1 << 40)
    for i, data in enumerate(chunks):
        if i == 3:
            row.count_text = fast.count_text = len
        ev = ResponseBody(data, False)
        assert fast_or_row(fast, ev)[0] == row.handle(ev)
        assert state_of(fast) == state_of(row)
    assert fast.marks_wide and len(fast.marks) == 4 * len(chunks)
    assert list(fast.marks[2::4]) == [-1] * 6 and list(fast.marks[3::4]) == [0] * 3 + [1, 2, 3]
