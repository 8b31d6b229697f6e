"""The API families (core.families): one decoder and one machine, the family as data.

Each family's classification, exactly; any chunking gives the same events; the gate fences
at the family's first content event and fails an attempt on its in-band error; the guard
ends a delivered stream with the family's own terminal event, carrying our fields, and
never invents a `[DONE]`, a `response.completed` or a `message_stop`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.errors import decode_interrupted, upstream_unavailable
from extproc.core.events import (
    FailAttempt,
    Fence,
    Fenced,
    FenceDecided,
    Finish,
    HoldChunk,
    Release,
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
)
from extproc.core.families import (
    CHAT,
    COMPLETIONS,
    FAMILIES,
    GENERATION_PATHS,
    MESSAGES,
    RESPONSES,
    Family,
    classify_messages,
    classify_responses,
    family_for_path,
    family_named,
)
from extproc.core.gate import GateMachine
from extproc.core.guard import GuardMachine
from extproc.core.journal import Outcome
from extproc.core.replay import record, replay
from extproc.core.sse import EventKind, SseDecoder, parse_event_json

from .gate_drive import admit

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
C, N, E, D, M = (EventKind.CONTENT, EventKind.NON_CONTENT, EventKind.ERROR, EventKind.DONE,
                 EventKind.MALFORMED)


def typed(obj: dict[str, Any], name: str | None = None) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return b"event: " + (name or obj["type"]).encode() + b"\ndata: " + data + b"\n\n"


# --- Responses: the stream the demo replica (and vLLM) sends --------------------------------

_RESP = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m",
         "status": "in_progress", "output": [], "error": None}


def responses_head() -> list[bytes]:
    return [
        typed({"type": "response.created", "sequence_number": 0, "response": _RESP}),
        typed({"type": "response.in_progress", "sequence_number": 1, "response": _RESP}),
        typed({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
               "item": {"type": "message", "id": "msg_1", "status": "in_progress",
                        "role": "assistant", "content": []}}),
        typed({"type": "response.content_part.added", "sequence_number": 3, "item_id": "msg_1",
               "output_index": 0, "content_index": 0,
               "part": {"type": "output_text", "text": "", "annotations": []}}),
    ]


def responses_delta(i: int, text: str) -> bytes:
    return typed({"type": "response.output_text.delta", "sequence_number": 4 + i,
                  "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text})


def responses_tail(n: int) -> list[bytes]:
    done = {**_RESP, "status": "completed"}
    return [typed({"type": "response.output_text.done", "sequence_number": 4 + n,
                   "text": "x"}),
            typed({"type": "response.completed", "sequence_number": 5 + n, "response": done})]


def messages_head() -> list[bytes]:
    return [
        typed({"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": "m", "stop_reason": None, "usage": {"input_tokens": 2,
                                                         "output_tokens": 0}}}),
        typed({"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}),
    ]


def messages_delta(i: int, text: str) -> bytes:
    return typed({"type": "content_block_delta", "index": 0,
                  "delta": {"type": "text_delta", "text": text}})


def messages_tail(n: int) -> list[bytes]:
    return [typed({"type": "content_block_stop", "index": 0}),
            typed({"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                                      "stop_sequence": None},
                   "usage": {"output_tokens": n}}),
            typed({"type": "message_stop"})]


SHAPES = {
    "responses": (RESPONSES, responses_head, responses_delta, responses_tail),
    "messages": (MESSAGES, messages_head, messages_delta, messages_tail),
}


def _kinds(fam: Family, stream: bytes) -> list[tuple[EventKind, int]]:
    dec = fam.decoder()
    return [(e.kind, e.content_units) for e in dec.feed(stream) + dec.finish()]


# --- the family table -------------------------------------------------------------------


def test_paths_and_names() -> None:
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses",
                                "/v1/messages"} == GENERATION_PATHS
    assert family_for_path("/v1/responses?x=1") is RESPONSES
    assert family_for_path("/v1/messages") is MESSAGES
    assert family_for_path("/v1/completions") is COMPLETIONS
    assert family_for_path("/v1/chat/completions") is CHAT
    for f in FAMILIES:
        assert family_named(f.name) is f
    with pytest.raises(ValueError, match="unknown API family"):
        family_named("nope")
    assert [f.has_done for f in FAMILIES] == [True, True, False, False]


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_head_is_not_content_and_every_delta_is(name: str) -> None:
    fam, head, delta, tail = SHAPES[name]
    stream = b"".join(head()) + delta(0, "a") + delta(1, "b") + b"".join(tail(2))
    kinds = _kinds(fam, stream)
    assert kinds[: len(head())] == [(N, 0)] * len(head())
    assert kinds[len(head()): len(head()) + 2] == [(C, 1), (C, 1)]
    assert kinds[-1] == (D, 0)
    assert all(k is N for k, _ in kinds[len(head()) + 2: -1])


@pytest.mark.parametrize(("obj", "want"), [
    ({"type": "response.created", "response": _RESP}, N),
    ({"type": "response.queued", "response": _RESP}, N),
    ({"type": "response.output_text.delta", "delta": "hi"}, C),
    ({"type": "response.output_text.delta", "delta": ""}, N),
    ({"type": "response.refusal.delta", "delta": "no"}, C),
    ({"type": "response.reasoning_text.delta", "delta": "hmm"}, C),
    ({"type": "response.reasoning_summary_text.delta", "delta": "s"}, C),
    # A tool call is output: the item that names it, and every arguments delta.
    ({"type": "response.output_item.added",
      "item": {"type": "function_call", "name": "f", "call_id": "c", "arguments": ""}}, C),
    ({"type": "response.function_call_arguments.delta", "delta": "{\"a\""}, C),
    ({"type": "response.output_item.added", "item": {"type": "reasoning", "summary": []}}, N),
    ({"type": "response.output_item.added", "item": {"type": "message", "content": []}}, N),
    ({"type": "response.content_part.added", "part": {"type": "output_text", "text": ""}}, N),
    ({"type": "response.content_part.added", "part": {"type": "output_text", "text": "x"}}, C),
    ({"type": "response.output_text.done", "text": "whole"}, N),
    ({"type": "response.function_call_arguments.done", "arguments": "{}"}, N),
    ({"type": "response.output_item.done", "item": {"type": "message"}}, N),
    ({"type": "response.completed", "response": {**_RESP, "status": "completed"}}, D),
    ({"type": "response.completed", "response": {**_RESP, "status": "incomplete"}}, D),
    ({"type": "response.incomplete", "response": {**_RESP, "status": "incomplete"}}, D),
    # vLLM ends an aborted generation with response.completed, status cancelled.
    ({"type": "response.completed", "response": {**_RESP, "status": "cancelled"}}, E),
    ({"type": "response.failed", "response": {**_RESP, "status": "failed"}}, E),
    ({"type": "error", "code": "server_error", "message": "boom"}, E),
    ({"error": {"message": "boom"}}, E),
    ({"type": "response.web_search_call.searching"}, C),  # unknown: counted as output
])
def test_responses_classification(obj: dict[str, Any], want: EventKind) -> None:
    data = json.dumps(obj).encode()
    assert classify_responses(data, None)[0] is want
    assert classify_responses(data, None)[1] == (1 if want is C else 0)


@pytest.mark.parametrize(("obj", "want"), [
    ({"type": "message_start", "message": {"content": []}}, N),
    ({"type": "ping"}, N),
    ({"type": "content_block_start", "content_block": {"type": "text", "text": ""}}, N),
    ({"type": "content_block_start", "content_block": {"type": "thinking", "thinking": ""}}, N),
    # A tool_use block names its tool: that is output, its first event a delivery.
    ({"type": "content_block_start",
      "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}}, C),
    ({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}, C),
    ({"type": "content_block_delta", "delta": {"type": "text_delta", "text": ""}}, N),
    ({"type": "content_block_delta",
      "delta": {"type": "input_json_delta", "partial_json": "{\"a\""}}, C),
    ({"type": "content_block_delta",
      "delta": {"type": "input_json_delta", "partial_json": ""}}, N),
    ({"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "h"}}, C),
    ({"type": "content_block_stop", "index": 0}, N),
    ({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, N),
    ({"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {}}, N),
    # vLLM: an aborted generation has no stop reason.
    ({"type": "message_delta", "delta": {"stop_reason": None}}, E),
    ({"type": "message_stop"}, D),
    ({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, E),
    ({"type": "citations_delta_of_the_future"}, C),  # unknown: counted as output
])
def test_messages_classification(obj: dict[str, Any], want: EventKind) -> None:
    data = json.dumps(obj).encode()
    assert classify_messages(data, None)[0] is want


def test_the_sse_event_name_is_used_when_the_json_has_no_type() -> None:
    assert classify_messages(b'{"error2":1}', "message_stop") == (D, 0)
    assert classify_responses(b'{"delta":"x"}', "response.output_text.delta") == (C, 1)
    assert classify_responses(b'{"x":1}', "error") == (E, 0)


@pytest.mark.parametrize("fn", [classify_responses, classify_messages])
@pytest.mark.parametrize("data", [b"{", b"[1]", b"\xff", b'{"a": NaN}', b"", b"null"])
def test_malformed(fn: Any, data: bytes) -> None:
    assert fn(data, None) == (M, 0)


# --- one decoder: chunking never changes what a family sees ------------------------------


@st.composite
def _family_stream(draw: st.DrawFn) -> tuple[str, bytes, int]:
    name = draw(st.sampled_from(sorted(SHAPES)))
    _, head, delta, tail = SHAPES[name]
    texts = draw(st.lists(st.text(min_size=1, max_size=6), min_size=0, max_size=6))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    parts = head() + [delta(i, t) for i, t in enumerate(texts)] + tail(len(texts))
    stream = b"".join(parts).replace(b"\n", eol)
    return name, stream, len(texts)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_chunking_gives_the_same_events(data: st.DataObject) -> None:
    name, stream, n = data.draw(_family_stream())
    fam = SHAPES[name][0]
    whole = _kinds(fam, stream)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    dec = fam.decoder()
    got = []
    prev = 0
    for c in [*cuts, len(stream)]:
        got += [(e.kind, e.content_units) for e in dec.feed(stream[prev:c])]
        prev = c
    got += [(e.kind, e.content_units) for e in dec.finish()]
    assert got == whole
    assert sum(u for _, u in whole) == n
    assert whole[-1] == (D, 0)


def test_chat_keeps_its_fast_path_and_other_families_do_not_merge() -> None:
    assert CHAT.classify is None and CHAT.decoder()._merge is True
    assert RESPONSES.decoder()._merge is False and MESSAGES.decoder()._merge is False
    # A Responses stream through the chat classifier would be wrong: each event is JSON
    # without `choices`, so all of it would count as non-content.
    stream = b"".join(responses_head()) + responses_delta(0, "a")
    assert [e.kind for e in SseDecoder().feed(stream)] == [N] * 5
    assert _kinds(RESPONSES, stream)[-1] == (C, 1)


# --- the terminal event, in each family's shape -------------------------------------------


def test_responses_terminal_event() -> None:
    err = decode_interrupted(RID, 3)
    first = parse_event_json(b'{"type":"response.created","sequence_number":0,'
                             b'"response":{"id":"resp_1","object":"response","status":'
                             b'"in_progress","output":[],"model":"m"}}')
    assert first is not None
    raw = RESPONSES.terminal(err, json.dumps(first).encode(),
                             b'{"type":"response.output_text.delta","sequence_number":6}')
    assert raw.startswith(b"event: response.failed\ndata: ") and raw.endswith(b"\n\n")
    assert b"[DONE]" not in raw and raw.count(b"\n\n") == 1
    ev = json.loads(raw.split(b"data: ", 1)[1])
    assert ev["type"] == "response.failed" and ev["sequence_number"] == 7
    assert ev["response"]["id"] == "resp_1" and ev["response"]["model"] == "m"
    assert ev["response"]["status"] == "failed"
    assert ev["response"]["error"] == err.body()["error"]
    assert ev["response"]["error"]["code"] == "upstream_decode_interrupted"
    assert ev["response"]["error"]["delivered_output_tokens"] == 3
    # Nothing known of the stream: still a well-formed failed response.
    bare = json.loads(RESPONSES.terminal(err, b"", b"").split(b"data: ", 1)[1])
    assert bare["response"]["id"] == f"resp_{RID}" and "sequence_number" not in bare


def test_messages_terminal_event() -> None:
    err = decode_interrupted(RID, 2)
    raw = MESSAGES.terminal(err, b"", b"")
    assert raw.startswith(b"event: error\ndata: ") and raw.count(b"\n\n") == 1
    ev = json.loads(raw.split(b"data: ", 1)[1])
    assert ev == {"type": "error", "error": {
        "type": "api_error", "message": err.message, "code": "upstream_decode_interrupted",
        "request_id": RID, "partial_output": True, "retryable": False,
        "delivered_output_tokens": 2}}
    assert json.loads(MESSAGES.error_json(upstream_unavailable(RID, "x")))["type"] == "error"


def test_chat_terminal_event_is_unchanged() -> None:
    err = decode_interrupted(RID, 2)
    assert CHAT.terminal(err, b"", b"") == err.sse_bytes()
    assert COMPLETIONS.terminal(err, b"x", b"y").endswith(b"data: [DONE]\n\n")


# --- the machines, per family ---------------------------------------------------------------


def guard(fam: Family) -> GuardMachine:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.handle(RequestHeadersSeen("generation", fam.name))
    m.handle(RequestBodySeen(None))
    m.handle(RequestOpened(True))
    m.handle(ResponseHeaders(200, SSE))
    return m


def gate(fam: Family) -> GateMachine:
    m = GateMachine.new(RID)
    admit(m, 1, family=fam.name)
    m.handle(ResponseHeaders(200, SSE))
    return m


def _terminal_of(acts: list[Any]) -> dict[str, Any]:
    send = next(a for a in acts if isinstance(a, Send))
    assert send.end_of_stream
    name, data = send.data.split(b"\ndata: ", 1)
    return {"event": name.removeprefix(b"event: ").decode(), **json.loads(data)}


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_gate_holds_the_head_and_fences_at_the_first_delta(name: str) -> None:
    fam, head, delta, _ = SHAPES[name]
    m = gate(fam)
    for ev in head():
        assert m.handle(ResponseBody(ev, False)) == [HoldChunk()]
    hold, fence = m.handle(ResponseBody(delta(0, "a"), False))
    assert hold == HoldChunk() and isinstance(fence, Fence)
    _, rel = m.handle(FenceDecided(True))
    assert isinstance(rel, Release) and (rel.held_chunks, rel.hand_off) == (len(head()) + 1,
                                                                            True)


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_gate_fails_an_in_band_error_before_the_first_delta(name: str) -> None:
    fam, head, _, _ = SHAPES[name]
    m = gate(fam)
    m.handle(ResponseBody(b"".join(head()), False))
    err = (typed({"type": "error", "code": "server_error", "message": "x"}) if name == "responses"
           else typed({"type": "error", "error": {"type": "api_error", "message": "x"}}))
    acts = m.handle(ResponseBody(err, False))
    assert isinstance(acts[0], FailAttempt) and acts[0].held_chunks == 2
    assert acts[0].reason == "in-band error event before the first delta"
    assert m.state is State.GATE_FAILED


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_guard_replaces_an_in_band_error_after_delivery(name: str) -> None:
    fam, head, delta, _ = SHAPES[name]
    m = guard(fam)
    m.handle(ResponseBody(b"".join(head()) + delta(0, "a") + delta(1, "b"), False))
    assert m.delivered == 2
    err = (typed({"type": "response.failed", "sequence_number": 6,
                  "response": {**_RESP, "status": "failed"}}) if name == "responses"
           else typed({"type": "error", "error": {"type": "api_error", "message": "x"}}))
    acts = m.handle(ResponseBody(delta(2, "c") + err, False))
    assert m.delivered == 3 and m.state is State.GUARD_TERMINATED
    fin, send = acts[:2]  # the record's write is started before the bytes go out
    assert isinstance(fin, Finish) and isinstance(send, Send)
    assert send.data.startswith(delta(2, "c"))
    t = _terminal_of([Send(send.data[len(delta(2, "c")):], True)])
    if name == "responses":
        assert t["event"] == "response.failed" and t["sequence_number"] == 7
        assert t["response"]["id"] == "resp_1"
        error = t["response"]["error"]
    else:
        assert t["event"] == "error" and t["type"] == "error"
        error = t["error"]
    # Three content events counted, the engine gave no count: said so (decision 0018).
    assert error == {**decode_interrupted(RID, 3, False).body()["error"],
                     **({"type": "api_error"} if name == "messages" else {})}
    assert b"[DONE]" not in send.data and b"message_stop" not in send.data
    assert b"response.completed" not in send.data
    assert [fin, *acts[2:]] == [Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 3,
                                       "in-band error", exact=False), StopTimers()]


@pytest.mark.parametrize("name", ["responses", "messages"])
@pytest.mark.parametrize("how", ["stall", "fenced"])
def test_guard_ends_a_stalled_or_fenced_stream_in_the_family_shape(name: str, how: str) -> None:
    fam, head, delta, _ = SHAPES[name]
    m = guard(fam)
    acts = m.handle(ResponseBody(b"".join(head()) + delta(0, "a"), False))
    assert acts[-1] == StartTimer(TimerKind.STALL, 15.0)
    # An incomplete event is never sent before ours.
    m.handle(ResponseBody(delta(1, "b")[:20], False))
    acts = m.handle(TimerFired(TimerKind.STALL) if how == "stall" else Fenced())
    t = _terminal_of(acts)
    error = t["response"]["error"] if name == "responses" else t["error"]
    assert error["code"] == "upstream_decode_interrupted"
    assert error["delivered_output_tokens"] == 1 and error["partial_output"] is True
    assert error["retryable"] is False and error["request_id"] == RID
    if name == "responses":
        assert t["sequence_number"] == 5  # after the last event sent (the delta, 4)
    assert m.finished is not None and m.finished.cause == how


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_guard_completes_at_the_family_terminal_event(name: str) -> None:
    fam, head, delta, tail = SHAPES[name]
    m = guard(fam)
    stream = b"".join(head()) + delta(0, "a") + b"".join(tail(1))
    acts = m.handle(ResponseBody(stream, False))
    assert acts == [Send(stream, False), StopTimers()]
    assert m.done_seen
    # Bytes after the terminal event never reach the client; a reset now is no failure.
    assert m.handle(ResponseBody(delta(1, "late"), False)) == [StopTimers()]  # nothing sent
    m.handle(StreamClosed())
    # Messages' message_delta reports the engine's count (1); Responses' tail here has no
    # usage: its content event is counted (decision 0018).
    exact = name == "messages"
    assert m.finished == Finish(Outcome.COMPLETED, 1, "reset after [DONE]", exact=exact,
                                source="engine" if exact else "events")


@pytest.mark.parametrize(("fam", "good", "bad"), [
    (RESPONSES, {"object": "response", "status": "completed", "usage": {"output_tokens": 5}},
     {"object": "response", "status": "failed", "error": {"code": "server_error"}}),
    (MESSAGES, {"type": "message", "content": [], "usage": {"output_tokens": 5}},
     {"type": "error", "error": {"type": "api_error", "message": "x"}}),
    (CHAT, {"choices": [], "usage": {"completion_tokens": 5}}, {"error": {"message": "x"}}),
])
def test_non_streaming_bodies(fam: Family, good: dict[str, Any], bad: dict[str, Any]) -> None:
    assert fam.body_ok(good) and not fam.body_ok(bad)
    assert fam.output_tokens(good) == 5 and fam.output_tokens(bad) is None
    g = GateMachine.new(RID)
    admit(g, 1, family=fam.name)
    g.handle(ResponseHeaders(200, "application/json"))
    acts = g.handle(ResponseBody(json.dumps(bad).encode(), True))
    assert isinstance(acts[0], FailAttempt) and acts[0].reason == "error body with status 200"
    gm = GuardMachine.new(RID, 15.0)
    gm.family = fam
    gm.handle(ResponseHeaders(200, "application/json"))
    gm.handle(ResponseBody(json.dumps(good).encode(), True))
    assert gm.delivered == 5
    assert gm.delivered_tokens() == (5, True, "engine")


@pytest.mark.parametrize("name", ["responses", "messages"])
def test_a_family_trace_replays(name: str) -> None:
    fam, head, delta, _ = SHAPES[name]
    m = guard(fam)
    m.handle(ResponseBody(b"".join(head()) + delta(0, "a"), False))
    m.handle(TimerFired(TimerKind.STALL))
    m.handle(StreamClosed())
    assert replay(record(m, {}, 1 << 20)).ok
    g = gate(fam)
    g.handle(ResponseBody(b"".join(head()) + delta(0, "a"), False))
    g.handle(FenceDecided(True))
    assert replay(record(g, {}, 1 << 20)).ok
