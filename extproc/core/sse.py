"""Incremental Server-Sent-Events decoding and exact classification of OpenAI-style chunks.

The first content delta is the delivery boundary: before it a failed upstream can be re-run
invisibly, after it only a clean terminal error is honest. So the decoder must find every event
exactly however Envoy splits the body, and the classifier must never mistake output for
non-output.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "DONE_EVENT",
    "Classifier",
    "EventKind",
    "SseDecoder",
    "SseEvent",
    "carries",
    "classify",
    "encode_event",
    "parse_event_json",
]

DONE_EVENT = b"data: [DONE]\n\n"

_DONE = b"[DONE]"
_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
# Any SSE line ending; a lone CR at the very end of a chunk is decided by the caller.
_EOL = re.compile(rb"\r\n?|\n")

# Fields that carry model output, in a streaming `delta` or a non-streaming `message`.
# `audio` is not in the brief of most servers, but it is output, and counting too much
# only moves the boundary earlier (safe), while counting too little duplicates output.
_OUTPUT_FIELDS = (
    "content",
    "tool_calls",
    "function_call",
    "reasoning_content",
    "reasoning",
    "refusal",
    "audio",
)


class EventKind(enum.Enum):
    CONTENT = "content"
    NON_CONTENT = "non_content"
    ERROR = "error"
    DONE = "done"
    MALFORMED = "malformed"


# The members the per-event paths use, as module globals: on CPython 3.11 reading
# `EventKind.CONTENT` goes through EnumType.__getattr__'s hook, about 900 instructions under
# callgrind against a global's few (decision 0041).
_CONTENT = EventKind.CONTENT
_NON_CONTENT = EventKind.NON_CONTENT
_MALFORMED = EventKind.MALFORMED


class SseEvent(NamedTuple):
    """One event (a tuple: built once per event on the hot path, so it must be cheap).

    From a decoder made with `merge_content=True`, one CONTENT value may also stand for a
    run of consecutive plain token events: `raw` is their bytes, `content_units` their
    number, `data` is empty.
    """

    kind: EventKind
    data: bytes
    raw: bytes
    content_units: int
    event: str | None = None


def _reject_constant(name: str) -> Any:
    """NaN/Infinity are not JSON; a client's strict parser would choke on them."""
    raise ValueError(f"non-standard JSON constant {name}")


# One decoder instance: `json.loads(..., parse_constant=...)` would build a new one per call.
_JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_JSON_ENCODER_ASCII = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def parse_event_json(data: bytes) -> dict[str, Any] | None:
    """One event's data as a JSON object, strictly (no NaN); None if it is not one."""
    try:
        obj = _JSON_DECODER.decode(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        return None
    return obj if isinstance(obj, dict) else None


# A family's classifier (core.families): an event's data and its SSE `event:` name.
Classifier = Callable[[bytes, str | None], tuple[EventKind, int]]


def carries(value: object) -> bool:
    """Unknown shapes count as output: over-counting is safe, under-counting duplicates text."""
    if value is None:
        return False
    if isinstance(value, str | list | dict):
        return len(value) > 0
    return True


def _choice_units(choice: object) -> int:
    if not isinstance(choice, dict):
        return 0
    if carries(choice.get("text")):
        return 1
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            for field in _OUTPUT_FIELDS:
                if carries(part.get(field)):
                    return 1
    return 0


# finish_reason values that mean the generation was cut short by the server.
ABORT_REASONS = frozenset({"abort", "error"})


# The shape nearly every streamed token has (vLLM, SGLang, the demo replica): one choice,
# a non-empty `content` string and nothing else in its delta, a null finish_reason, and
# at most the engine's running usage (vLLM's field order) that the gateway asks for. A match
# is, by construction, valid JSON (strings may hold only JSON's escapes and no control
# characters; the bytes are checked to be UTF-8 first) that `classify_slow` classifies as
# CONTENT with one unit; anything else takes the slow path. tests/core/test_sse.py checks
# the two agree on generated events.
_CHARS = rb'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*'
_STR = rb'"' + _CHARS + rb'"'
_NESTR = rb'"(?=[^"])' + _CHARS + rb'"'  # non-empty
_NUM = rb"-?(?:0|[1-9][0-9]{0,15})"
# The running usage vLLM puts in a chunk when asked (core.usage), as the member it writes.
USAGE_MEMBER = (rb',"usage":\{"prompt_tokens":' + _NUM + rb',"total_tokens":' + _NUM
                + rb',"completion_tokens":' + _NUM + rb'(?:,"completion_tokens_details":null)?\}')
# Up to its content string's opening quote, and the rest (split so that a chunk whose
# first part repeats an event already matched needs only the rest matched; SseDecoder).
_FAST_HEAD = (
    rb'\{"id":' + _STR + rb',"object":"chat\.completion\.chunk","created":' + _NUM
    + rb',"model":' + _STR + rb'(?:,"system_fingerprint":(?:null|' + _STR + rb'))?'
    + rb',"choices":\[\{"index":0,"delta":\{(?:"role":"assistant",)?"content":"')
_FAST_REST = (
    rb'(?=[^"])' + _CHARS + rb'"'  # the content string's rest: non-empty
    + rb'\}(?:,"logprobs":null)?,"finish_reason":null(?:,"stop_reason":null)?\}\]'
    + rb'(?:,"usage":null|' + USAGE_MEMBER + rb')?\}')
_FAST_CONTENT = re.compile(_FAST_HEAD + _FAST_REST)
assert _FAST_CONTENT.pattern.count(b'"content":"') == 1  # where an event's head ends
# A run of such events, each a single `data: ` line and a blank line: what a guard sees in
# nearly every body message. The JSON above cannot hold a raw newline, so a run of n events
# contains exactly n blank-line separators.
_FAST_RUN = re.compile(rb"(?:data: " + _FAST_CONTENT.pattern + rb"\n\n)+")
_FAST_ONE = re.compile(rb"data: " + _FAST_CONTENT.pattern + rb"\n\n")
_FAST_ONE_REST = re.compile(_FAST_REST + rb"\n\n")
_CONTENT_KEY = b'"content":"'  # structural: a quote inside a JSON string is escaped
# `_FAST_REST` in three parts, for a chunk whose head and middle repeat an event's that
# `_FAST_ONE` matched: the content string's rest; the middle, bytes an engine repeats
# (through the usage's `"total_tokens":`, or to the event's end when it has no usage); and
# the running usage's last numbers, with the completion count as a group.
_CONTENT_REST = re.compile(rb'(?=[^"])' + _CHARS + rb'"')
_TOTAL_KEY = b'"total_tokens":'
_USAGE_AT = b',"usage":{'
_NO_USAGE = (-1, b"")
_USAGE_END = re.compile(_NUM + rb',"completion_tokens":(' + _NUM
                        + rb')(?:,"completion_tokens_details":null)?\}\}\n\n')
# The same steps in one match, for a chunk whose head and middle repeat the ones seen: as
# many bytes as the head seen has, the content string's rest as `_CONTENT_REST` has it
# (group 1), as many bytes as the middle seen has, then the usage's numbers as `_USAGE_END`
# has them (group 2; `_ONE_USAGE_END`), or nothing if the middle had no usage. The caller
# compares the head and the middle (memcmp, not sre's per-byte steps). A regex call costs
# ~1.5k instructions however little it matches (callgrind, CPython 3.11), ~0.4k more with
# a start position: one call instead of two, without one. (A plain string alone, with no
# escape, would match ~0.5k cheaper, but then every token with a newline or a quote in it
# would pay a failed match and the steps: ~5k more.)
_ONE_MATCH = rb'(?s:.{%d})(' + _CONTENT_REST.pattern.replace(b"%", b"%%") + rb')(?s:.{%d})'
# `_USAGE_END` less its rare forms (a negative number; those take the steps), in the form
# sre matches fastest (an alternation of whole ends, not an optional group): ~0.6k less.
_UNSIGNED = rb"(?:0|[1-9][0-9]{0,15})"
_ONE_USAGE_END = (_UNSIGNED + rb',"completion_tokens":(' + _UNSIGNED
                    + rb')(?:,"completion_tokens_details":null\}\}\n\n|\}\}\n\n)')
_RESTS: dict[tuple[int, int, bool], re.Pattern[bytes]] = {}


def _rest_for(head: int, mid: int, usage: bool) -> re.Pattern[bytes]:
    """`_ONE_MATCH` for a head of `head` bytes and a middle of `mid`, with the usage's end
    if `usage`; compiled once per lengths and kind (a stream learns its head and middle
    once; an engine's lengths are few)."""
    rx = _RESTS.get((head, mid, usage))
    if rx is None:
        rx = re.compile(_ONE_MATCH % (head, mid) + (_ONE_USAGE_END if usage else b""))
        if len(_RESTS) < 256:  # a few in practice; bounded regardless
            _RESTS[(head, mid, usage)] = rx
    return rx


def classify(data: bytes) -> tuple[EventKind, int]:
    """Classify one event's data field; returns the kind and its content units."""
    if _FAST_CONTENT.fullmatch(data) is not None:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return _MALFORMED, 0
        return _CONTENT, 1
    return classify_slow(data)


def classify_slow(data: bytes) -> tuple[EventKind, int]:
    """The reference classification: parse the JSON and look at every choice."""
    if data == _DONE or data.strip() == _DONE:
        return EventKind.DONE, 0
    try:
        obj = _JSON_DECODER.decode(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        return EventKind.MALFORMED, 0
    if not isinstance(obj, dict):
        return EventKind.MALFORMED, 0
    # `"error": null` is not an error report; treating it as one could hide delivered output.
    if obj.get("error") is not None:
        return EventKind.ERROR, 0
    choices = obj.get("choices")
    units = 0
    if isinstance(choices, list):
        for choice in choices:
            # vLLM ends an aborted generation (e.g. its engine stopping) with
            # finish_reason "abort" and then [DONE]: that answer is cut short, not complete.
            if isinstance(choice, dict) and choice.get("finish_reason") in ABORT_REASONS:
                return EventKind.ERROR, 0
            units += _choice_units(choice)
    if units:
        return EventKind.CONTENT, units
    return EventKind.NON_CONTENT, 0


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def encode_event(obj: object) -> bytes:
    """Serialize as one SSE event; compact JSON never contains a raw newline."""
    try:
        body = _JSON_ENCODER.encode(obj).encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: escape them rather than emit invalid UTF-8
        body = _JSON_ENCODER_ASCII.encode(obj).encode("ascii")
    return b"data: " + body + b"\n\n"


class SseDecoder:
    """Splits a byte stream into SSE events per the WHATWG rules, whatever the chunking.

    Bytes of the event being built are kept as a list of pieces, so an event that arrives in
    many small chunks costs linear, not quadratic, copying.

    With `merge_content=True` a run of usual token events at an event boundary is matched
    by one regex and returned as one CONTENT value (see SseEvent): same bytes, same units,
    same boundaries, a fraction of the per-event work. The gateway's machines only count
    and forward, so they use it; tests/core/test_sse.py checks both modes agree.
    """

    __slots__ = ("_bom_pending", "_classify", "_data", "_event", "_head", "_head_seen",
                 "_merge", "_mid_seen", "_mid_usage", "_rest", "_stop", "_tail",
                 "run_usage")

    def __init__(self, *, merge_content: bool = False,
                 classify: Classifier | None = None) -> None:
        # `classify`: another API family's event classifier (core.families); None is the
        # OpenAI chunk one, `classify` below, whose token runs alone may be merged.
        self._classify = classify
        self._merge = merge_content and classify is None
        self._stop = False  # True: spent by feed_to_first_content
        # The head (`_FAST_HEAD`'s bytes) of the last one-event chunk `whole_run` matched:
        # an engine repeats it in every token event of a stream (same id, created, model).
        self._head_seen = b""
        # And the middle of the last one that also matched the head (see _CONTENT_REST),
        # with where its usage member starts in it (-1: it has none).
        self._mid_seen = b""
        self._mid_usage = -1
        # `_rest_for` them, with the head's and the middle's lengths (None: no middle seen).
        self._rest: tuple[re.Pattern[bytes], int, int] | None = None
        # After `whole_run` found one event by head and middle: where its usage member
        # starts in the chunk (-1: none) and its completion count's bytes; else None.
        self.run_usage: tuple[int, bytes] | None = None
        self._reset()

    def _reset(self) -> None:
        # Complete lines of the unfinished event (already parsed), and the unfinished line
        # (may end in a CR awaiting its LF). Between events (nearly always, on an open
        # stream) each is the shared empty tuple, not an empty list: 112 bytes less per
        # open stream (decision 0058); a list is made when there is a piece to keep.
        self._head: list[bytes] | tuple[()] = ()
        self._tail: list[bytes] | tuple[()] = ()
        self._data: list[bytes] | tuple[()] = ()  # the unfinished event's data lines
        self._event: str | None = None
        self._bom_pending = True

    def pending(self) -> bytes:
        """Bytes fed but not yet part of a returned event."""
        return b"".join(self._head) + b"".join(self._tail)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if not chunk:
            return []
        if self._bom_pending:
            buf = b"".join(self._tail) + chunk
            self._tail = ()
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._tail = [buf]
                return []
            self._bom_pending = False
            if buf.startswith(_BOM):
                # The spec strips a leading BOM; keep it in `raw` but out of the first line.
                self._head = [_BOM]
                buf = buf[len(_BOM) :]
                if not buf:
                    return []
        elif self._tail:
            tail = self._tail
            assert isinstance(tail, list)
            if tail[-1][-1] != _CR and b"\n" not in chunk and b"\r" not in chunk:
                tail.append(chunk)
                return []
            tail.append(chunk)
            buf = b"".join(tail)
            self._tail = ()
        else:
            buf = chunk
        return self._scan(buf, final=False)

    def feed_to_first_content(self, chunk: bytes) -> list[SseEvent]:
        """Like feed, but stop at the first CONTENT event (the last one returned, if any).

        For the gate, which needs nothing after it: the rest of the chunk is not even
        parsed. A decoder that found content is spent: feeding it again is an error.
        """
        if self._stop:
            raise RuntimeError("SSE decoder used after feed_to_first_content found content")
        self._stop = True
        events = self.feed(chunk)
        self._stop = bool(events) and events[-1].kind is _CONTENT
        return events

    def finish(self) -> list[SseEvent]:
        """End of stream: an unterminated trailing event with data still counts."""
        buf = b"".join(self._tail)
        self._tail = ()
        if self._bom_pending:
            buf = b""  # only a prefix of a BOM was ever fed
        events = self._scan(buf, final=True) if buf else []
        if self._data:
            events.append(self._dispatch(b"".join(self._head)))
        self._reset()
        return events

    def _dispatch(self, raw: bytes) -> SseEvent:
        lines = self._data
        if lines:
            data = lines[0] if len(lines) == 1 else b"\n".join(lines)
            fam = self._classify
            kind, units = classify(data) if fam is None else fam(data, self._event)
            self._data = ()
        else:
            data, kind, units = b"", _NON_CONTENT, 0
        event = SseEvent(kind, data, raw, units, self._event)
        self._event = None
        return event

    def _field(self, line: bytes) -> None:
        if line[0] == 0x3A:  # ":" comment
            return
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name, value = line[:colon], line[colon + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if name == b"data":
            if data := self._data:
                assert isinstance(data, list)
                data.append(value)
            else:
                self._data = [value]
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")
        # `id`, `retry` and unknown fields do not affect classification.

    def _emit(self, buf: bytes, start: int, end: int) -> SseEvent:
        if head := self._head:
            assert isinstance(head, list)
            head.append(buf[start:end])
            raw = b"".join(head)
            self._head = ()
        else:
            raw = buf[start:end]
        return self._dispatch(raw)

    def whole_run(self, chunk: bytes) -> int:
        """The content units of `chunk` if `feed` would return it as exactly one merged run
        (the decoder holds nothing, and the chunk is a run of usual token events to its last
        byte), else 0; what it holds of the stream is left as it was either way (it only
        learns the stream's head and middle, `_learn_run`). Counting the units here and
        forwarding the chunk is then what `feed` and one CONTENT value would do.

        Most messages are one event whose head and middle repeat the last one's: then
        `_FAST_ONE` matches the whole chunk, found as `data: ` and the head seen, the
        content string's rest, the middle seen and the usage's numbers to the chunk's end
        (and `run_usage` says where its usage is). Anything else is `_learn_run`'s."""
        if self._head or self._tail or self._bom_pending or self._stop or not self._merge:
            return 0
        seen = self._head_seen
        rest = self._rest  # `_rest_for` the head and middle seen, and their lengths
        if rest is not None and (u := rest[0].fullmatch(chunk)) is not None and chunk[
                :rest[1]] == seen and chunk[(end := u.end(1)):end + rest[2]] == self._mid_seen:
            # What the steps below find, in fewer calls: the same content end (a JSON
            # string has one: its first unescaped quote), the middle there, the usage's
            # numbers after (tests/core/test_sse.py compares the two ways).
            at = self._mid_usage
            self.run_usage = _NO_USAGE if at < 0 else (end + at, u[2])
            return 1 if chunk.isascii() or _is_utf8(chunk) else 0
        if seen and chunk.startswith(seen) and (
                c := _CONTENT_REST.match(chunk, len(seen))) is not None:
            end = c.end()
            mid = self._mid_seen
            if mid and chunk.startswith(mid, end):
                at = self._mid_usage
                if at < 0:
                    if end + len(mid) == len(chunk):
                        self.run_usage = _NO_USAGE
                        return 1 if chunk.isascii() or _is_utf8(chunk) else 0
                elif (u := _USAGE_END.fullmatch(chunk, end + len(mid))) is not None:
                    self.run_usage = (end + at, u[1])
                    return 1 if chunk.isascii() or _is_utf8(chunk) else 0
        self.run_usage = None
        return self._learn_run(chunk)

    def _learn_run(self, chunk: bytes) -> int:
        """`whole_run` by the patterns themselves, learning the head and middle of a
        one-event chunk for the next."""
        seen = self._head_seen
        if seen and chunk.startswith(seen) and (
                c := _CONTENT_REST.match(chunk, len(seen))) is not None and (
                _FAST_ONE_REST.fullmatch(chunk, len(seen)) is not None):
            # A head seen, a new middle: `_FAST_ONE` matches, one event.
            end = c.end()
            at = chunk.find(_USAGE_AT, end)
            self._mid_usage = -1 if at < 0 else at - end
            self._mid_seen = chunk[end:] if at < 0 else chunk[
                end:chunk.index(_TOTAL_KEY, at) + len(_TOTAL_KEY)]
            n = len(self._mid_seen)
            self._rest = (_rest_for(len(seen), n, at >= 0), len(seen), n)
            units = 1
        else:
            run = _FAST_RUN.match(chunk)
            if run is None or run.end() != len(chunk):
                return 0
            # An event's JSON holds no raw newline: one event if the first one ends the chunk.
            units = 1 if chunk.find(b"\n") == len(chunk) - 2 else chunk.count(b"\n\n")
            if units == 1:
                self._head_seen = chunk[:chunk.find(_CONTENT_KEY) + len(_CONTENT_KEY)]
                self._mid_seen, self._rest = b"", None
        if not chunk.isascii() and not _is_utf8(chunk):
            return 0
        return units

    def _run_at(self, buf: bytes, pos: int) -> SseEvent | None:
        """A run of usual token events starting at an event boundary, as one value."""
        run = (_FAST_ONE if self._stop else _FAST_RUN).match(buf, pos)
        if run is None:
            return None
        block = buf[pos : run.end()]
        if not block.isascii() and not _is_utf8(block):
            return None  # the event-by-event way finds the malformed one
        return SseEvent(_CONTENT, b"", block, block.count(b"\n\n"))

    def _scan(self, buf: bytes, *, final: bool) -> list[SseEvent]:
        events: list[SseEvent] = []
        start = 0  # first byte of the unfinished event within buf
        pos = 0  # first byte of the next line
        n = len(buf)
        merge = self._merge
        # At an event boundary (no line of an unfinished event parsed yet: an unfinished
        # first line was in `_tail` and now starts `buf`), try a run of token events.
        stop = self._stop
        if merge and not self._head and (run := self._run_at(buf, 0)) is not None:
            if stop:
                return [run]
            events.append(run)
            start = pos = len(run.raw)
        if buf.find(b"\r", pos) < 0:
            # Common case: LF-only lines, found by C-level find.
            data = self._data
            while True:
                eol = buf.find(b"\n", pos)
                if eol < 0:
                    break
                if eol == pos:
                    pos += 1
                    events.append(self._emit(buf, start, pos))
                    if stop and events[-1].kind is _CONTENT:
                        return events
                    start = pos
                    data = self._data
                    if merge and (run := self._run_at(buf, pos)) is not None:
                        events.append(run)
                        if stop:
                            return events
                        start = pos = pos + len(run.raw)
                    continue
                if buf.startswith(b"data:", pos):
                    vstart = pos + 6 if buf[pos + 5 : pos + 6] == b" " else pos + 5
                    if data:
                        assert isinstance(data, list)
                        data.append(buf[vstart:eol])
                    else:
                        data = self._data = [buf[vstart:eol]]
                else:
                    self._field(buf[pos:eol])
                    data = self._data  # (a bare `data` line: `_field` may have made it)
                pos = eol + 1
        else:
            for match in _EOL.finditer(buf, pos):
                eol, nxt = match.span()
                if nxt == n and buf[eol] == _CR and nxt - eol == 1 and not final:
                    break  # a CR at the end may be the first half of CRLF
                if eol == pos:
                    events.append(self._emit(buf, start, nxt))
                    if stop and events[-1].kind is _CONTENT:
                        return events
                    start = nxt
                else:
                    self._field(buf[pos:eol])
                pos = nxt
        if final:
            if pos < n:
                self._field(buf[pos:])
            pos = n
        if pos > start:
            if head := self._head:
                assert isinstance(head, list)
                head.append(buf[start:pos])
            else:
                self._head = [buf[start:pos]]
        if pos < n:
            self._tail = [buf[pos:]]  # (`feed` took the tail into `buf`: it is empty)
        return events
