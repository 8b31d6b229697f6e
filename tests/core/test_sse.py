"""The decoder must see the same events however the body is split, and classify them exactly."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.sse import (
    DONE_EVENT,
    EventKind,
    SseDecoder,
    SseEvent,
    classify,
    encode_event,
)

C, N, E, D, M = (
    EventKind.CONTENT,
    EventKind.NON_CONTENT,
    EventKind.ERROR,
    EventKind.DONE,
    EventKind.MALFORMED,
)


def _chunk(delta: dict[str, object], **extra: object) -> dict[str, object]:
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, **extra}],
    }


def _decode_all(stream: bytes, sizes: list[int] | None = None) -> list[SseEvent]:
    dec = SseDecoder()
    events: list[SseEvent] = []
    if sizes is None:
        events += dec.feed(stream)
    else:
        pos = 0
        for size in sizes:
            events += dec.feed(stream[pos : pos + size])
            pos += size
        events += dec.feed(stream[pos:])
    return events + dec.finish()


# --- classification -------------------------------------------------------------------------


def test_vllm_stream_exact() -> None:
    objs = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({}, finish_reason="stop"),
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    stream = b"".join(encode_event(o) for o in objs) + DONE_EVENT
    dec = SseDecoder()
    events = dec.feed(stream)
    assert [(e.kind, e.content_units) for e in events] == [
        (N, 0),
        (C, 1),
        (C, 1),
        (N, 0),
        (N, 0),
        (D, 0),
    ]
    assert [json.loads(e.data) for e in events[:-1]] == objs
    assert events[-1].data == b"[DONE]"
    assert b"".join(e.raw for e in events) == stream
    assert dec.pending() == b""
    assert dec.finish() == []


@pytest.mark.parametrize(
    "delta",
    [
        {"content": "x"},
        {"content": " "},
        {"role": "assistant", "content": "hi"},
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
        {"function_call": {"name": "f"}},
        {"function_call": {"arguments": "{}"}},
        {"reasoning_content": "think"},
        {"reasoning": "think"},
        {"refusal": "no"},
        {"content": None, "reasoning_content": "r"},
        {"content": [{"type": "text", "text": "x"}]},
    ],
)
def test_content_deltas(delta: dict[str, object]) -> None:
    assert classify(json.dumps(_chunk(delta)).encode()) == (C, 1)


def test_other_content_shapes() -> None:
    completion = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    assert classify(json.dumps(completion).encode()) == (C, 1)
    full = {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}}]}
    assert classify(json.dumps(full).encode()) == (C, 1)
    calls = {"choices": [{"message": {"content": None, "tool_calls": [{"id": "c"}]}}]}
    assert classify(json.dumps(calls).encode()) == (C, 1)
    multi = {"choices": [{"delta": {"content": "a"}}, {"delta": {"role": "x"}}, {"text": "b"}]}
    assert classify(json.dumps(multi).encode()) == (C, 2)
    escaped = b'{"choices":[{"delta":{"\\u0063ontent":"\\u00e9"}}]}'
    assert classify(escaped) == (C, 1)


@pytest.mark.parametrize(
    "obj",
    [
        _chunk({"role": "assistant"}),
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": None}),
        _chunk({"tool_calls": []}),
        _chunk({"tool_calls": None, "reasoning_content": None, "refusal": None}),
        _chunk({"function_call": {}}),
        _chunk({"reasoning": ""}),
        _chunk({}, finish_reason="stop"),
        _chunk({"content": ""}, finish_reason="length"),
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}},
        {"choices": ["not a dict", 3, None]},
        {"choices": {"delta": {"content": "x"}}},
        {},
        {"error": None, "choices": []},
    ],
)
def test_non_content(obj: object) -> None:
    assert classify(json.dumps(obj).encode()) == (N, 0)


def test_error_and_done() -> None:
    err = {"error": {"message": "boom", "type": "internal", "code": 500}}
    assert classify(json.dumps(err).encode()) == (E, 0)
    assert classify(b'{"error": "x", "choices": [{"delta": {"content": "y"}}]}') == (E, 0)
    for done in (b"[DONE]", b" [DONE]", b"[DONE] \t", b"\n[DONE]\n"):
        assert classify(done) == (D, 0)
    assert classify(b"[done]") == (M, 0)
    assert classify(b"[DONE]x") == (M, 0)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b" ",
        b"garbage",
        b"{",
        b'{"choices": []',
        b"[1,2]",
        b'"str"',
        b"42",
        b"null",
        b"NaN",
        b'{"x": NaN}',
        b'{"x": Infinity}',
        b'{"choices":[{"delta":{"content":"\xff"}}]}',
        b"\xc3",
        b"\xef\xbb\xbf{}",
        b'{"a": "raw\x01control"}',
        b'{"a": 1} {"b": 2}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_malformed(data: bytes) -> None:
    assert classify(data) == (M, 0)


def test_malformed_in_stream() -> None:
    stream = b'data: {"choices":[{"delta":{"content":"\xe9"}}]}\n\ndata: [1,2]\n\n'
    events = SseDecoder().feed(stream)
    assert [e.kind for e in events] == [M, M]


def test_encode_event() -> None:
    assert encode_event({"a": [1, "é"], "b": None}) == 'data: {"a":[1,"é"],"b":null}\n\n'.encode()
    assert encode_event({"s": "\ud800"}) == b'data: {"s":"\\ud800"}\n\n'
    with pytest.raises(ValueError):
        encode_event({"x": float("nan")})
    assert DONE_EVENT == b"data: [DONE]\n\n"
    assert SseDecoder().feed(DONE_EVENT)[0].kind is D


# --- framing --------------------------------------------------------------------------------


def test_comments_and_fields() -> None:
    stream = (
        b": keep-alive\n\n"
        b'event: message\nid: 7\nretry: 100\n: note\ndata: {"choices":[]}\n\n'
        b'event: error\ndata:{"error":{"message":"x"}}\n\n'
        b"id: 8\n\n"
        b"Data: ignored\nunknown: x\ndata\n\n"
    )
    dec = SseDecoder()
    events = dec.feed(stream)
    assert [(e.kind, e.data, e.event) for e in events] == [
        (N, b"", None),
        (N, b'{"choices":[]}', "message"),
        (E, b'{"error":{"message":"x"}}', "error"),
        (N, b"", None),
        (M, b"", None),
    ]
    assert events[0].raw == b": keep-alive\n\n"
    assert b"".join(e.raw for e in events) == stream


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_endings(eol: bytes) -> None:
    stream = (
        b": c"
        + eol
        + b'data: {"choices":[{"delta":{"content":"a"}}]}'
        + eol
        + eol
        + b"event: x"
        + eol
        + b"data: [DONE]"
        + eol
        + eol
    )
    for sizes in (None, [1] * len(stream)):
        events = _decode_all(stream, sizes)
        assert [(e.kind, e.event) for e in events] == [(C, None), (D, "x")]
        assert b"".join(e.raw for e in events) == stream


def test_multiline_data_and_space_rules() -> None:
    stream = b'data: {"choices":\ndata:[{"delta":\r\ndata:  {"content": "x"}}]}\r\rdata:  two\n\n'
    events = SseDecoder().feed(stream)
    assert events[0].data == b'{"choices":\n[{"delta":\n {"content": "x"}}]}'
    assert (events[0].kind, events[0].content_units) == (C, 1)
    assert events[1].data == b" two"


def test_cr_at_chunk_end_waits_for_lf() -> None:
    dec = SseDecoder()
    assert dec.feed(b"data: [DONE]\r") == []
    assert dec.feed(b"\n\r") == []  # the CRLF ended the data line; the lone CR is undecided
    assert dec.pending() == b"data: [DONE]\r\n\r"
    events = dec.feed(b"\n")
    assert [e.raw for e in events] == [b"data: [DONE]\r\n\r\n"]
    assert dec.feed(b"data: x\r") == []
    events = dec.feed(b"\r")  # a lone CR followed by CR: the first CR ended the line
    assert events == []
    assert dec.pending() == b"data: x\r\r"
    events = dec.finish()  # the final CR is now known to be a line end: a blank line
    assert [(e.kind, e.raw) for e in events] == [(M, b"data: x\r\r")]


def test_finish() -> None:
    dec = SseDecoder()
    assert dec.feed(b'data: {"choices":[{"text":"a"}]}') == []
    events = dec.finish()
    assert [(e.kind, e.raw) for e in events] == [(C, b'data: {"choices":[{"text":"a"}]}')]
    dec = SseDecoder()
    dec.feed(b"data: [DONE]\n")
    assert [e.kind for e in dec.finish()] == [D]
    dec = SseDecoder()
    assert dec.feed(b"data: [DONE]\n\n: trailing comm") != []
    assert dec.finish() == []  # no data: discarded
    assert dec.pending() == b""
    dec = SseDecoder()
    dec.feed(b"event: e\nid: 1\n")
    assert dec.finish() == []
    # The decoder is reusable after finish().
    assert [e.kind for e in dec.feed(DONE_EVENT)] == [D]


def test_bom() -> None:
    stream = b"\xef\xbb\xbfdata: [DONE]\n\n"
    for sizes in (None, [1] * len(stream), [2, 2]):
        events = _decode_all(stream, sizes)
        assert [(e.kind, e.raw) for e in events] == [(D, stream)]
    dec = SseDecoder()
    assert dec.feed(b"\xef\xbb") == []
    assert dec.pending() == b"\xef\xbb"
    assert dec.finish() == []
    # Only at the very start of the stream.
    events = SseDecoder().feed(b"data: [DONE]\n\n\xef\xbb\xbfdata: [DONE]\n\n")
    assert [(e.kind, e.data) for e in events] == [(D, b"[DONE]"), (N, b"")]


def test_every_two_way_split() -> None:
    stream = (
        b': hi\r\ndata: {"choices":[{"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
        b'data: {"choices":[{"delta":{"content":"\xc3\xa9\xe2\x82\xac"}}]}\r\r'
        b'event: x\ndata: {"error":{}}\n\ndata: [DONE]\r\n\r\n'
    )
    whole = _decode_all(stream)
    assert [e.kind for e in whole] == [N, C, E, D]
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1, 7):
            assert _decode_all(stream, [i, j - i]) == whole


# --- property tests -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expected:
    kind: EventKind
    data: bytes
    units: int
    event: str | None


_text = st.text(min_size=1, max_size=8)
_label = st.text(alphabet=st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=6)


@st.composite
def _payload(draw: st.DrawFn) -> tuple[list[bytes], EventKind, int]:
    """Data lines plus their expected classification."""
    choice = draw(st.integers(0, 7))
    obj: object
    if choice == 0:
        field = draw(st.sampled_from(["content", "reasoning_content", "reasoning", "refusal"]))
        obj, kind, units = _chunk({field: draw(_text)}), C, 1
    elif choice == 1:
        flags = draw(st.lists(st.booleans(), min_size=1, max_size=4))
        choices = [
            {"index": i, "delta": {"content": draw(_text)} if f else {"role": "assistant"}}
            for i, f in enumerate(flags)
        ]
        obj, units = {"choices": choices}, sum(flags)
        kind = C if units else N
    elif choice == 2:
        obj, kind, units = (
            draw(
                st.sampled_from(
                    [
                        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1"}}]}),
                        _chunk({"function_call": {"name": "f"}}),
                        {"choices": [{"index": 0, "text": "t"}]},
                    ]
                )
            ),
            C,
            1,
        )
    elif choice == 3:
        obj = draw(
            st.sampled_from(
                [
                    _chunk({"role": "assistant", "content": ""}),
                    _chunk({"content": None}),
                    _chunk({"tool_calls": []}),
                    _chunk({}, finish_reason="stop"),
                    {"choices": [], "usage": {"total_tokens": 3}},
                ]
            )
        )
        kind, units = N, 0
    elif choice == 4:
        obj, kind, units = {"error": {"message": draw(_text), "code": 500}}, E, 0
    elif choice == 5:
        pad = draw(st.sampled_from(["", " ", "\t", "  "]))
        return [(pad + "[DONE]" + pad).encode()], D, 0
    elif choice == 6:
        lines = draw(
            st.sampled_from(
                [[b"garbage"], [b"[1,2]"], [b'"str"'], [b"\xff\xfe"], [b""], [b"{", b"}x"]]
            )
        )
        return lines, M, 0
    else:
        obj, kind, units = _chunk({"content": draw(_text)}), C, 1
        # Pretty-printed JSON spread over several data lines, some with leading spaces.
        text = json.dumps(obj, indent=draw(st.integers(0, 2)), ensure_ascii=draw(st.booleans()))
        return [line.encode() for line in text.split("\n")], kind, units
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()))
    return [text.encode()], kind, units


@st.composite
def _stream(draw: st.DrawFn) -> tuple[bytes, list[_Expected]]:
    out: list[bytes] = []
    expected: list[_Expected] = []
    last_eol = b""

    def line(body: bytes) -> None:
        nonlocal last_eol
        eols = [b"\n", b"\r\n", b"\r"]
        if not body and last_eol == b"\r":
            eols = [b"\r\n", b"\r"]  # a bare LF here would merge into the previous CR
        last_eol = draw(st.sampled_from(eols))
        out.append(body + last_eol)

    for _ in range(draw(st.integers(0, 6))):
        event: str | None = None
        if draw(st.integers(0, 4)):
            data_lines, kind, units = draw(_payload())
            data = b"\n".join(data_lines)
        else:
            data_lines, kind, units, data = [], N, 0, b""
        merged = []
        for value in data_lines:
            sep = b" " if value[:1] == b" " or draw(st.booleans()) else b""
            merged.append(b"data:" + sep + value)
        # Comments and non-data fields may sit anywhere among the data lines.
        extras: list[bytes] = []
        if draw(st.booleans()):
            extras.append(b":" + draw(_label).encode())
        if draw(st.booleans()):
            event = draw(_label)
            extras.append(b"event: " + event.encode())
        if draw(st.booleans()):
            extras.append(b"id: " + draw(_label).encode())
        if draw(st.booleans()):
            extras.append(b"retry: " + str(draw(st.integers(0, 9999))).encode())
        for ln in extras:
            merged.insert(draw(st.integers(0, len(merged))), ln)
        for ln in merged:
            line(ln)
        line(b"")
        expected.append(_Expected(kind, data, units, event))
    return b"".join(out), expected


@st.composite
def _splits(draw: st.DrawFn, length: int) -> list[int]:
    if draw(st.integers(0, 4)) == 0:
        return [1] * length
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=20)))
    return [b - a for a, b in zip([0, *cuts], cuts, strict=False)]


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_split_gives_same_events(data: st.DataObject) -> None:
    stream, expected = data.draw(_stream())
    sizes = data.draw(_splits(len(stream)))

    whole = SseDecoder()
    reference = whole.feed(stream)
    reference += whole.finish()
    got = [_Expected(e.kind, e.data, e.content_units, e.event) for e in reference]
    assert got == expected
    assert b"".join(e.raw for e in reference) == stream

    dec = SseDecoder()
    events: list[SseEvent] = []
    fed = 0
    for size in [*sizes, len(stream) - sum(sizes)]:
        events += dec.feed(stream[fed : fed + size])
        fed += size
        assert b"".join(e.raw for e in events) + dec.pending() == stream[:fed]
    events += dec.finish()
    assert events == reference


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_truncated_stream_finish_matches(data: st.DataObject) -> None:
    stream, _ = data.draw(_stream())
    cut = data.draw(st.integers(0, len(stream)))
    prefix = stream[:cut]
    sizes = data.draw(_splits(len(prefix)))
    assert _decode_all(prefix, sizes) == _decode_all(prefix)


@settings(max_examples=300, deadline=None)
@given(noise=st.binary(max_size=200), data=st.data())
def test_arbitrary_bytes_split_invariant(noise: bytes, data: st.DataObject) -> None:
    sizes = data.draw(_splits(len(noise)))
    dec = SseDecoder()
    events: list[SseEvent] = []
    fed = 0
    for size in [*sizes, len(noise) - sum(sizes)]:
        events += dec.feed(noise[fed : fed + size])
        fed += size
        assert b"".join(e.raw for e in events) + dec.pending() == noise[:fed]
    assert events + dec.finish() == _decode_all(noise)


def test_an_aborted_finish_is_an_interruption_not_a_complete_answer() -> None:
    # vLLM's last chunk when its engine aborts a request: it must not pass for complete.
    data = (b'{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
            b'"delta":{},"finish_reason":"abort"}]}')
    assert classify(data) == (EventKind.ERROR, 0)
    ok = data.replace(b'"abort"', b'"length"')
    assert classify(ok) == (EventKind.NON_CONTENT, 0)


# --- the fast path agrees with the reference classification ---------------------------------

from extproc.core.sse import _FAST_CONTENT, classify_slow  # noqa: E402

_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", " ", "\\", '"', "\n", "\u2028", "\ud800", "é", "\x00", "\x1f"]),
)


def _render_str(s: str, data: st.DataObject, canonical: bool = False) -> bytes:
    """A JSON string literal, sometimes hand-broken (raw controls, bad escapes)."""
    how = data.draw(st.sampled_from(["json", "ascii"] if canonical else
                                    ["json", "ascii", "raw", "bad-escape", "latin1"]))
    if how == "json":
        return json.dumps(s, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if how == "ascii":
        return json.dumps(s).encode()
    if how == "raw":
        return b'"' + s.encode("utf-8", "surrogatepass") + b'"'
    if how == "bad-escape":
        return b'"' + s.encode("utf-8", "surrogatepass") + b'\\x"'
    return b'"' + s.encode("latin-1", "replace") + b'\xff"'


@given(data=st.data())
@settings(max_examples=1500)
def test_fast_path_agrees_with_the_reference(data: st.DataObject) -> None:
    # Half the examples are well-formed token events (the fast path's domain), half anything.
    canon = data.draw(st.booleans())

    def pick(canonical: list[bytes], other: list[bytes]) -> bytes:
        return data.draw(st.sampled_from(canonical if canon else canonical + other))

    content = _render_str(data.draw(_TEXT), data, canon)
    parts = [b'{"id":' + _render_str(data.draw(_TEXT), data, canon),
             b',"object":"chat.completion.chunk"',
             b',"created":' + pick([b"0", b"1700000000", b"-1"],
                                   [b"01", b"1e3", b"99999999999999999999"]),
             b',"model":' + _render_str(data.draw(_TEXT), data, canon)]
    if data.draw(st.booleans()):
        parts.append(b',"system_fingerprint":null')
    delta = pick([b'{"content":' + content + b"}",
                  b'{"role":"assistant","content":' + content + b"}"],
                 [b'{"content":' + content + b',"tool_calls":[]}', b"{}"])
    finish = pick([b"null"], [b'"stop"', b'"abort"', b'"error"'])
    choice = b'{"index":0,"delta":' + delta
    if data.draw(st.booleans()):
        choice += b',"logprobs":null'
    choice += b',"finish_reason":' + finish
    if data.draw(st.booleans()):
        choice += b',"stop_reason":null'
    choice += b"}"
    parts.append(b',"choices":[' + choice + b"]")
    tail = pick([b"", b',"usage":null'], [b',"error":null', b',"error":{"message":"x"}', b","])
    event = b"".join(parts) + tail + b"}"
    if not canon and data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(event)))
        event = event[:cut]
    assert classify(event) == classify_slow(event), event


def test_fast_path_takes_the_usual_token_event() -> None:
    usual = (b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
             b'"model":"m","choices":[{"index":0,"delta":{"content":" sierra"},'
             b'"logprobs":null,"finish_reason":null}]}')
    assert _FAST_CONTENT.fullmatch(usual) is not None
    assert classify(usual) == classify_slow(usual) == (EventKind.CONTENT, 1)
    # Invalid UTF-8 inside the content: the regex matches, the bytes check refuses it.
    bad = usual.replace(b" sierra", b"\xff")
    assert classify(bad) == classify_slow(bad) == (EventKind.MALFORMED, 0)


# --- merged runs of token events (the machines' decoder) -------------------------------------


def _token_event(data: st.DataObject) -> bytes:
    """A usual token event, sometimes broken in ways only the reference path may judge."""
    content = _render_str(data.draw(_TEXT), data, data.draw(st.booleans()))
    role = data.draw(st.sampled_from([b"", b'"role":"assistant",']))
    body = (b'{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1700000000,'
            b'"model":"m","choices":[{"index":0,"delta":{' + role + b'"content":' + content
            + b'},"finish_reason":null}]}')
    sep = data.draw(st.sampled_from([b"data: ", b"data: ", b"data:"]))
    end = data.draw(st.sampled_from([b"\n\n", b"\n\n", b"\r\n\r\n", b"\n\n\n"]))
    return sep + body + end


def _mixed_stream(data: st.DataObject, parts: int, run: int) -> bytes:
    """Runs of usual token events (mostly) between arbitrary streams of any event kind."""
    out: list[bytes] = []
    for _ in range(data.draw(st.integers(0, parts))):
        if data.draw(st.integers(0, 3)):
            out += [_token_event(data) for _ in range(data.draw(st.integers(1, run)))]
        else:
            out.append(data.draw(_stream())[0])
    return b"".join(out)


def _normalized(events: list[SseEvent]) -> list[tuple[EventKind, int, bytes, bytes, str | None]]:
    """Consecutive CONTENT events folded into one: what merging may change, nothing more."""
    out: list[tuple[EventKind, int, bytes, bytes, str | None]] = []
    for e in events:
        if e.kind is EventKind.CONTENT and out and out[-1][0] is EventKind.CONTENT:
            k, units, raw, _, _ = out[-1]
            out[-1] = (k, units + e.content_units, raw + e.raw, b"", None)
        elif e.kind is EventKind.CONTENT:
            out.append((e.kind, e.content_units, e.raw, b"", None))
        else:
            out.append((e.kind, e.content_units, e.raw, e.data, e.event))
    return out


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_merged_runs_agree_with_the_event_by_event_decoder(data: st.DataObject) -> None:
    bom = b"\xef\xbb\xbf" if data.draw(st.integers(0, 9)) == 0 else b""
    stream = bom + _mixed_stream(data, parts=8, run=6)
    sizes = data.draw(_splits(len(stream)))
    plain, merging = SseDecoder(), SseDecoder(merge_content=True)
    fed = 0
    for size in [*sizes, len(stream) - sum(sizes)]:
        piece = stream[fed : fed + size]
        fed += size
        # Per feed, not only in total: both hand out exactly the complete events so far.
        assert _normalized(merging.feed(piece)) == _normalized(plain.feed(piece))
        assert merging.pending() == plain.pending()
    assert _normalized(merging.finish()) == _normalized(plain.finish())


def test_a_run_of_token_events_is_one_value() -> None:
    ev = (b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
          b'"choices":[{"index":0,"delta":{"content":"hi \\u00e9 \xc3\xa9"},'
          b'"finish_reason":null}]}\n\n')
    done = b"data: [DONE]\n\n"
    dec = SseDecoder(merge_content=True)
    got = dec.feed(ev * 9 + done + ev[:20])
    assert [(e.kind, e.content_units, e.raw) for e in got] == [
        (EventKind.CONTENT, 9, ev * 9), (EventKind.DONE, 0, done)]
    assert dec.pending() == ev[:20]
    # The unfinished first line waits in the decoder and starts the next run.
    got = dec.feed(ev[20:] + ev * 2)
    assert [(e.kind, e.content_units, e.raw) for e in got] == [(EventKind.CONTENT, 3, ev * 3)]
    # A line already parsed (the `data:` line of a split event): that event the
    # event-by-event way, then a run again; also after any other kind of event.
    assert dec.feed(ev[:-1]) == []
    got = dec.feed(b"\n" + ev * 2 + b": comment\n\n" + ev * 3)
    assert [(e.kind, e.content_units, e.data != b"") for e in got] == [
        (EventKind.CONTENT, 1, True), (EventKind.CONTENT, 2, False),
        (EventKind.NON_CONTENT, 0, False), (EventKind.CONTENT, 3, False)]
    # Invalid UTF-8 inside a run is never merged: the reference path calls it malformed.
    bad = ev.replace(b"hi", b"h\xff")
    got = SseDecoder(merge_content=True).feed(ev + bad + ev)
    assert [(e.kind, e.content_units) for e in got] == [
        (EventKind.CONTENT, 1), (EventKind.MALFORMED, 0), (EventKind.CONTENT, 1)]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_feed_to_first_content_is_feed_cut_at_the_first_content(data: st.DataObject) -> None:
    stream = _mixed_stream(data, parts=5, run=4)
    sizes = data.draw(_splits(len(stream)))
    plain, gate = SseDecoder(), SseDecoder(merge_content=True)
    expected = _normalized(plain.feed(stream) + plain.finish())
    upto = next((i for i, e in enumerate(expected) if e[0] is EventKind.CONTENT), None)
    got: list[SseEvent] = []
    fed = 0
    for size in [*sizes, len(stream) - sum(sizes)]:
        got += gate.feed_to_first_content(stream[fed : fed + size])
        fed += size
        if got and got[-1].kind is EventKind.CONTENT:
            with pytest.raises(RuntimeError):
                gate.feed_to_first_content(b"data: x\n\n")
            break
    else:
        got += gate.finish()
    if upto is None:
        assert _normalized(got) == expected
    else:
        # The events before the first content exactly; then that content event itself
        # (its run may be cut to its first event).
        assert _normalized(got[:-1]) == expected[:upto]
        assert got[-1].kind is EventKind.CONTENT and got[-1].content_units >= 1
        assert expected[upto][2].startswith(got[-1].raw)


# --- whole_run's one-match step against the steps it stands for ------------------------------


def _usual_message(data: st.DataObject, style: list[bytes]) -> bytes:
    """A one-event message in vLLM's form (what `whole_run` learns a stream's head and
    middle from): the stream's `style` (head, role, logprobs, usage's form), now and then
    another, a content and usage numbers drawn anew, sometimes broken in ways only the
    step-by-step path may judge."""
    if data.draw(st.integers(0, 3)) == 0:  # one of its parts as another stream has it
        i = data.draw(st.integers(0, len(style) - 1))
        style = [*style[:i], _style(data)[i], *style[i + 1:]]
    head, role, logprobs, prompt, details = style
    content = _render_str(data.draw(_TEXT), data, data.draw(st.integers(0, 5)) > 0)
    num = st.sampled_from([b"0", b"7", b"12", b"1234567"] * 4
                          + [b"-3", b"01", b"99999999999999999", b""])
    if prompt == b"":
        usage = b""
    elif prompt == b"null":
        usage = b',"usage":null'
    else:
        usage = (b',"usage":{"prompt_tokens":' + prompt + b',"total_tokens":' + data.draw(num)
                 + b',"completion_tokens":' + data.draw(num) + details + b"}")
    msg = (b"data: " + head + b'"delta":{' + role + b'"content":' + content + b"}"
           + logprobs + b',"finish_reason":null}]' + usage + b"}\n\n")
    how = data.draw(st.integers(0, 19))
    if how == 0:
        return msg[: data.draw(st.integers(0, len(msg)))]
    if how == 1:
        return msg + data.draw(st.sampled_from([b"\n", b"x", msg]))
    return msg


def _style(data: st.DataObject) -> list[bytes]:
    return [data.draw(st.sampled_from([b'{"id":"c7","object":"chat.completion.chunk",'
                                       b'"created":1,"model":"m","choices":[{"index":0,',
                                       b'{"id":"c8","object":"chat.completion.chunk",'
                                       b'"created":1,"model":"m","choices":[{"index":0,'])),
            data.draw(st.sampled_from([b"", b'"role":"assistant",'])),
            data.draw(st.sampled_from([b"", b',"logprobs":null'])),
            data.draw(st.sampled_from([b"", b"null", b"4", b"5", b"40", b"41"])),
            data.draw(st.sampled_from([b"", b',"completion_tokens_details":null',
                                       b',"x":1']))]


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_whole_run_one_match_is_the_steps_it_replaces(data: st.DataObject) -> None:
    """`whole_run` with its learned one-match regex (`_rest`) and without it (the regex
    steps alone: head, content string, middle, usage's end) answer every message alike:
    the units, where the usage is, and what they learn."""
    fast, steps = SseDecoder(merge_content=True), SseDecoder(merge_content=True)
    first = b'data: {"id":"c7","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    fast.feed(first)
    steps.feed(first)
    style = _style(data)
    for _ in range(data.draw(st.integers(1, 12))):
        msg = _usual_message(data, style)
        steps._rest = None  # the step-by-step way only
        want = steps.whole_run(msg)
        got = fast.whole_run(msg)
        assert (got, fast.run_usage) == (want, steps.run_usage), msg
        assert (fast._head_seen, fast._mid_seen, fast._mid_usage) == (
            steps._head_seen, steps._mid_seen, steps._mid_usage)


def test_whole_run_one_match_takes_the_usual_message() -> None:
    """Not vacuous: after one message the stream's head and middle are known, and the next
    usual message is found by the one match, its usage where the steps find it."""
    def msg(content: bytes, n: int) -> bytes:
        return (b'data: {"id":"c7","object":"chat.completion.chunk","created":1,"model":"m",'
                b'"choices":[{"index":0,"delta":{"content":"' + content + b'"},'
                b'"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":4,'
                b'"total_tokens":' + str(4 + n).encode() + b',"completion_tokens":'
                + str(n).encode() + b',"completion_tokens_details":null}}\n\n')
    dec = SseDecoder(merge_content=True)
    dec.feed(b'data: {"id":"c7","choices":[]}\n\n')
    assert dec.whole_run(msg(b"a", 1)) == 1 and dec.whole_run(msg(b"b", 2)) == 1
    assert dec._rest is not None
    m = msg(b"hello", 13)
    u = dec._rest[0].fullmatch(m)
    assert u is not None and u[2] == b"13"
    assert dec.whole_run(m) == 1 and dec.run_usage == (m.index(b',"usage":'), b"13")
    # An escaped content string too; a negative count is the steps' alone, alike.
    e = msg(b'say \\"hi\\"\\n', 14)
    assert dec._rest[0].fullmatch(e) is not None
    assert dec.whole_run(e) == 1 and dec.run_usage == (e.index(b',"usage":'), b"14")
    n = msg(b"x", -1)
    assert dec._rest[0].fullmatch(n) is None
    assert dec.whole_run(n) == 1 and dec.run_usage == (n.index(b',"usage":'), b"-1")


def test_between_events_a_decoder_holds_no_lists() -> None:
    """An open stream's decoder sits between events nearly all the time: its unfinished
    event's lines, line and data are then the shared empty tuple, not three empty lists
    (decision 0058: 168 bytes an open stream); a split event still builds its own."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    for merge in (False, True):
        d = SseDecoder(merge_content=merge)
        assert [e.kind for e in d.feed(role)] == [EventKind.NON_CONTENT]
        assert (d._head, d._tail, d._data) == ((), (), ())
        assert d.feed(role[:20]) == [] and d.pending() == role[:20]
        assert d.feed(role[20:-2] + b"\n") == [] and d._data == [role[6:-2]]
        assert d.feed(b"data\n") == [] and d._data == [role[6:-2], b""]  # a bare data line
        events = d.feed(b"\n")
        assert [(e.kind, e.data, e.raw) for e in events] == [
            (EventKind.NON_CONTENT, role[6:-2] + b"\n", role[:-1] + b"data\n\n")]
        assert (d._head, d._tail, d._data) == ((), (), ())
