"""The guard: the logical request downstream, from its headers to its recorded outcome.

Its data, its handlers and its rows (`GuardMachine.TABLE`); read down the rows to draw a
request's life.
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

from . import headers as H
from . import records
from .config import Config
from .errors import (
    GatewayError,
    body_required,
    decode_interrupted,
    journal_unavailable,
    request_in_progress,
    request_not_found,
    upstream_unavailable,
)
from .events import (
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
from .families import CHAT, Family, family_named
from .handoff import HandOff
from .intake import (
    Generation,
    Prepared,
    Verdict,
    body_headers,
    kind_of,
    own_intake,
    prepare_intake,
    read_headers,
    request_id_of,
)
from .journal import JournalView, Outcome, Rerun, answer_repeat, tenant_digest
from .machine import (
    TRACE_RECORD_COST,
    Machine,
    ProtocolViolation,
    T,
    Table,
    chunk_record,
    counting_decoder,
    decided,
    stay,
)
from .pool import Pool
from .sse import EventKind, SseDecoder, SseEvent
from .usage import UsageMode, take_run_usage, take_usage

S = State


@dataclass(slots=True)
class GuardMachine(Machine):
    """The logical request downstream: count what the client got, end it honestly."""

    stall_after_first_delta_s: float = 15.0
    streaming: bool = False
    family: Family = CHAT
    decoder: SseDecoder = field(default_factory=counting_decoder)
    delivered: int = 0  # content units forwarded downstream
    # The engine's running completion count as of the last event forwarded (None: a
    # content event came without one, so it no longer says what the client has).
    usage_mode: UsageMode = UsageMode.OFF
    engine_tokens: int | None = None
    # A tokenizer for the request's model (adapters.tokenizer), and the forwarded content
    # events it re-encodes when the engine gave no count; set by the adapter, not traced.
    count_text: Callable[[str], int] | None = None
    # (The shared empty tuple until the first is kept, `keep`: most streams keep none, and
    # an open stream holds no empty list for it; decision 0058.)
    kept: list[bytes] | tuple[()] = ()
    uncounted: bool = False  # a whole (non-streaming) answer that reported no usage
    # Families whose terminal event refers to the stream (Responses): the data of its first
    # event and of the last one forwarded (references, not copies).
    first_data: bytes = b""
    last_data: bytes = b""
    status: int = 0
    # A non-streaming body (bounded); empty bytes until its first piece (no bytearray per
    # open stream).
    body: bytearray | bytes = b""
    max_buffer: int = 4 << 20
    finished: Finish | None = None
    recorded: bool | None = None  # Finish's write: landed, or never answered (None: not yet)
    # The delivered count checkpointed every `progress_every` seconds while streaming (0:
    # never): the count last written, and whether a write is still unanswered.
    progress_every: float = 0.0
    progress_sent: int = 0
    progress_inflight: bool = False
    # The CHECKPOINT timer is not armed: its last tick found nothing new to write, and the
    # next content event forwarded arms it again (decision 0053; an idle stream is not woken).
    checkpoint_off: bool = False
    # Replay of a trace older than format 6: a tick that writes nothing arms the next one,
    # as the cores that recorded it did (never set on a live machine).
    idle_ticks: bool = False
    done_seen: bool = False  # `[DONE]` forwarded: the client has a complete answer
    keyed: bool = False  # its intake is answered before its body goes on (decision 0021)
    intake_read: bool = False  # its body was read for an intake (RequestEnded at its end)
    # Envoy's own plain-text 5xx (e.g. no healthy upstream, overflow): replaced by our JSON
    # error so every client sees the same contract.
    replaced_error: bytes | None = None
    # A key-less intake that failed after its body went on (IntakeFailed): its gate answers
    # the client with it, and when no gate could (every attempt refused or reset before
    # one ran), Envoy's own reply is answered with it here (nothing was recorded).
    intake_error: GatewayError | None = None
    # Delivery is what left toward the client (decision 0025): `sent` is the body bytes of a
    # stream handed to Envoy so far; `marks` holds, per content event forwarded, MARK_STRIDE
    # numbers: the offset just past its last byte, then `delivered`, `engine_tokens` (-1:
    # none) and len(`kept`) as of that event. Marks more than `max_buffer` bytes behind
    # `sent` are folded into `floor` (bounded memory on a long stream). Decision 0053: until
    # a content event has an engine count or kept text (`marks_wide`), only the first two
    # numbers are held (the others are -1 and 0); 32-bit numbers while every one fits,
    # 64-bit from the first that does not (`add_marks`). 8 bytes an event on a usual stream.
    sent: int = 0
    marks: array[int] = field(default_factory=lambda: array("i"))
    marks_wide: bool = False
    floor: tuple[int, int, int, int] = (0, 0, -1, 0)
    bound: str | None = None  # "upper": Envoy did not say what it sent (see Finish)
    withheld: int = 0  # content units the guard forwarded that Envoy never sent
    lease_lost: bool = False  # the released attempt's permission ended (LoseLease, once)
    released_id: str | None = None  # the attempt the gate handed over (TakeOver)
    tool_route: bool = False  # the tool route serves the stream (StartToolCall)

    @classmethod
    def new(cls, request_id: str, stall_after_first_delta_s: float,
            max_buffer: int = 4 << 20, at_request: bool = False,
            progress_every: float = 0.0) -> GuardMachine:
        """At the request's headers (`at_request`, as the guard runs it), or already
        accepted and waiting for the response (tests of the response path)."""
        state = State.GUARD_NEW if at_request else State.GUARD_WAITING
        return cls(request_id=request_id, state=state, role="guard", initial_state=state,
                   stall_after_first_delta_s=stall_after_first_delta_s, max_buffer=max_buffer,
                   progress_every=progress_every)

    @classmethod
    def at_request(cls, request_id: str, cfg: Config, trace_budget: int) -> GuardMachine:
        """A request's machine, at its headers, with the limits its configuration sets."""
        t = cfg.timeouts
        m = cls.new(request_id, t.stall_after_first_delta_s,
                    cfg.limits.max_buffered_response_bytes, at_request=True,
                    progress_every=t.progress_interval_s)
        m.trace_budget = trace_budget
        return m

    @property
    def accepted(self) -> bool:
        """A logical request of ours, past its intake."""
        return self.state not in REQUEST_PHASE

    def delivered_tokens(self) -> tuple[int, bool, str]:
        """What the client received, in tokens: (count, exact, source); decision 0018."""
        if self.delivered == 0:  # nothing reached the client (or a whole answer said 0)
            return 0, not self.uncounted, "events" if self.engine_tokens is None else "engine"
        exact = self.bound != "upper"  # an upper bound is never called exact
        if self.engine_tokens is not None:
            return self.engine_tokens, exact, "engine"
        if self.count_text is not None and isinstance(kept := self.kept, list) and kept:
            return self.count_text(self.family.text_of(kept)), False, "tokenizer"
        return self.delivered, False, "events"

    def keep(self, raw: bytes) -> None:
        """One more forwarded content event's bytes for `count_text`."""
        if isinstance(kept := self.kept, list):
            kept.append(raw)
        else:
            self.kept = [raw]

    def mark(self, end: int) -> None:
        """A content event forwarded: its last byte ends at body offset `end`."""
        et = self.engine_tokens
        # (fromlist: half of extend's cost with a tuple, measured)
        if self.marks_wide:
            mark = [end, self.delivered, -1 if et is None else et, len(self.kept)]
        elif et is None and not self.kept:
            mark = [end, self.delivered]
        else:
            self.add_marks([end, self.delivered, -1 if et is None else et, len(self.kept)])
            return
        try:
            self.marks.fromlist(mark)
        except OverflowError:
            self.add_marks(mark)

    def add_marks(self, numbers: list[int]) -> None:
        """One mark: 2 numbers while the marks are narrow, else 4 (4 make them wide: every
        mark held so far gets its -1 and 0); the marks become 64-bit, for the rest of the
        stream, once a number does not fit 32 bits (a fromlist that fails adds nothing)."""
        marks = self.marks
        if len(numbers) == MARK_STRIDE and not self.marks_wide:
            self.marks_wide = True
            if marks:
                wide = array(marks.typecode, [-1, 0] * (len(marks) // 2) * 2)
                wide[0::4] = marks[0::2]
                wide[1::4] = marks[1::2]
                self.marks = marks = wide
        try:
            marks.fromlist(numbers)
        except OverflowError:
            self.marks = marks = array("q", marks)
            marks.fromlist(numbers)

    def sent_downstream(self, n: int) -> None:
        """`n` more body bytes handed to Envoy; old marks folded once far enough behind."""
        self.sent += n
        marks = self.marks
        wide = self.marks_wide
        if len(marks) >= (_MARKS_FOLD if wide else _NARROW_FOLD):
            stride = MARK_STRIDE if wide else 2
            keep_from = self.sent - self.max_buffer
            i = 0
            while i < len(marks) and marks[i] < keep_from:
                i += stride
            if i:
                j = i - stride
                self.floor = ((marks[j], marks[j + 1], marks[j + 2], marks[j + 3]) if wide
                              else (marks[j], marks[j + 1], -1, 0))
                del marks[:i]

    def cut_to(self, body_bytes: int | None) -> None:
        """Envoy says it sent `body_bytes` of the body (None: it did not say): the counts
        become those of the content events whose last byte is within it."""
        if body_bytes is None:
            if self.delivered > 0:
                self.bound = "upper"
            return
        if body_bytes >= self.sent:
            return  # every byte forwarded went out
        if body_bytes <= 0:  # nothing went out: exactly none, folded counts or not
            self.withheld, self.delivered, self.engine_tokens = self.delivered, 0, None
            self.bound = None
            if isinstance(k := self.kept, list):
                del k[:]
            return
        marks = self.marks
        stride = MARK_STRIDE if self.marks_wide else 2
        ends = marks[0::stride]
        if not ends or body_bytes >= ends[-1]:
            return  # every content event forwarded went out
        i = bisect_right(ends, body_bytes)
        if i:
            j = (i - 1) * stride
            end, units = marks[j], marks[j + 1]
            et, kept = (marks[j + 2], marks[j + 3]) if self.marks_wide else (-1, 0)
        else:
            end, units, et, kept = self.floor
            if end > body_bytes:
                self.bound = "upper"  # folded away: the oldest count kept is the bound
        self.withheld = self.delivered - units
        self.delivered = units
        self.engine_tokens = None if et < 0 else et
        if isinstance(k := self.kept, list):
            del k[kept:]

    def _terminal(self) -> bytes:
        """The family's terminal event: our error, in the stream's own shape."""
        n, exact, _ = self.delivered_tokens()
        return self.family.terminal(decode_interrupted(self.request_id, n, exact),
                                    self.first_data, self.last_data)

    def _finish(self, outcome: Outcome, cause: str | None) -> Finish:
        n, exact, source = self.delivered_tokens()
        self.finished = Finish(outcome=outcome, delivered_output_tokens=n, cause=cause,
                               exact=exact, source=source,
                               bound=self.bound if n > 0 else None,
                               upstream_finished=self.done_seen
                               or outcome is Outcome.COMPLETED,
                               nothing_released=self.status != 200)
        return self.finished


# GuardMachine.marks: numbers per content event; events kept before folding is considered.
MARK_STRIDE = 4
MARKS_KEPT = 4096
# The numbers held when folding is considered, wide marks and narrow (2 an event).
_MARKS_FOLD, _NARROW_FOLD = MARK_STRIDE * MARKS_KEPT, 2 * MARKS_KEPT


GuardFn = Callable[[GuardMachine, Any], list[Action]]


def _guard_headers(m: GuardMachine, ev: ResponseHeaders) -> list[Action]:
    m.status = ev.status
    m.streaming = ev.content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
    m.state = State.GUARD_RESPONDING
    if ev.status >= 500 and not ev.ours and not ev.end_of_stream:
        # Envoy's own local reply (no host answered, or its per-try timeout on the last
        # attempt), or a replica's own 5xx on the last attempt: our error shape, with the
        # request id, instead of its plain text or the engine's own JSON.
        who = "gateway" if ev.envoy_reply else "upstream"
        m.replaced_error = m.family.error_json(upstream_unavailable(
            m.request_id, f"{who} status {ev.status}", ev.status))
    if ev.end_of_stream:
        m.state = State.GUARD_COMPLETE
    answer = PassHeaders(as_json=m.replaced_error is not None)
    if ev.status == 200 and ev.handoff:
        # The gate released its attempt to us: its end, record and fence are ours now.
        ho = HandOff.from_header(ev.handoff)
        if ho is None:
            return [UnreadableHandOff(), answer]  # nothing to own
        m.released_id = ho.attempt_id
        return [TakeOver(ho), answer]
    return [answer]


# The members the per-chunk paths read, as module globals: on CPython 3.11 reading an enum
# member through its class takes EnumType's __getattr__ hook, ~900 instructions under
# callgrind against a global's few (decision 0041).
_U_OFF, _U_KEEP = UsageMode.OFF, UsageMode.KEEP
_K_CONTENT, _K_NON_CONTENT, _K_DONE = EventKind.CONTENT, EventKind.NON_CONTENT, EventKind.DONE
_K_ERROR, _K_MALFORMED = EventKind.ERROR, EventKind.MALFORMED
_S_STREAMING, _S_COMPLETE = State.GUARD_STREAMING, State.GUARD_COMPLETE
_S_TERMINATED = State.GUARD_TERMINATED
_T_STALL, _T_CHECKPOINT = TimerKind.STALL, TimerKind.CHECKPOINT


def _sse_forward(m: GuardMachine, events: list[SseEvent], end: bool) -> list[Action]:
    out = bytearray()
    ctx = m.family.wants_context
    mode = m.usage_mode
    usage = mode is not _U_OFF  # only a family with running usage gets another mode
    final_count = m.family.final_count
    keep = m.count_text is not None
    for e in events:
        if m.done_seen:
            continue  # nothing after `[DONE]` reaches the client: its answer is complete
        if ctx and e.data:
            # What the family's terminal event refers to (the first event, the last one
            # forwarded); the event replaced below never counts as forwarded.
            if not m.first_data:
                m.first_data = e.data
            if e.kind is not _K_ERROR and e.kind is not _K_MALFORMED:
                m.last_data = e.data
        if e.kind is _K_DONE:
            m.done_seen = True
            out += e.raw
            if final_count is not None and (n := final_count(e.data)) is not None:
                m.engine_tokens = n
        elif e.kind is _K_CONTENT:
            if usage:
                raw, m.engine_tokens = take_usage(mode, e)
                out += raw
            else:
                out += e.raw
                m.engine_tokens = None  # output the last count did not include
            if keep:
                m.keep(e.raw)
            m.delivered += e.content_units
            m.mark(m.sent + len(out))
        elif e.kind in (_K_ERROR, _K_MALFORMED) and m.delivered > 0:
            # Replace their error (or garbage) with our terminal event; never forward it.
            out += m._terminal()
            m.state = _S_TERMINATED
            m.sent_downstream(len(out))
            return [m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED,
                              "in-band error" if e.kind is _K_ERROR else "malformed event"),
                    Send(bytes(out), True), StopTimers()]
        elif usage and e.kind is _K_NON_CONTENT:
            raw, n = take_usage(mode, e)
            out += raw
            if n is not None:
                m.engine_tokens = n
        elif final_count is not None and e.kind is _K_NON_CONTENT and m.delivered:
            out += e.raw
            if (n := final_count(e.data)) is not None:
                m.engine_tokens = n
        else:
            out += e.raw
    m.sent_downstream(len(out))
    acts = _send(bytes(out), end)
    if end:
        m.state = _S_COMPLETE
        acts.append(StopTimers())
    elif m.done_seen:
        acts.append(StopTimers())  # complete answer: silence now is no interruption
    elif m.delivered > 0:
        if m.state is not _S_STREAMING and m.progress_every > 0:
            acts.append(StartTimer(_T_CHECKPOINT, m.progress_every))
        elif m.checkpoint_off and m.delivered > m.progress_sent:
            # Content again after a tick that found nothing to write: the next tick.
            m.checkpoint_off = False
            acts.append(StartTimer(_T_CHECKPOINT, m.progress_every))
        m.state = _S_STREAMING
        acts.append(StartTimer(_T_STALL, m.stall_after_first_delta_s))
    return acts


def _guard_body(m: GuardMachine, ev: ResponseBody) -> list[Action]:
    if ev.lease_expired and not m.lease_lost:
        # The lease ran out locally (checked with each chunk): said once, acted on once.
        acts = _guard_fenced(m, Fenced("expired locally"))
        if m.state is _S_TERMINATED:
            return acts  # the chunk came after our end: never forwarded
        return acts + _guard_chunk(m, ev)
    return _guard_chunk(m, ev)


def _guard_chunk(m: GuardMachine, ev: ResponseBody) -> list[Action]:
    if m.status == 200 and m.streaming:
        events = m.decoder.feed(ev.data)
        if ev.end_of_stream:
            events += m.decoder.finish()
        # Only complete events are forwarded; an incomplete one waits in the decoder for
        # its rest, so a terminal event can never land in the middle of theirs.
        return _sse_forward(m, events, ev.end_of_stream)
    if m.replaced_error is not None:
        data, m.replaced_error = m.replaced_error, b""
        if ev.end_of_stream:
            m.state = _S_COMPLETE
        return _send(data, ev.end_of_stream)
    # Non-streaming or an error status: pass bytes through; count once complete.
    if m.status == 200 and len(m.body) <= m.max_buffer:
        if m.body:
            m.body += ev.data
        else:
            m.body = bytearray(ev.data)
    if ev.end_of_stream:
        m.state = _S_COMPLETE
        if m.status == 200:
            n = _output_tokens(m.family, bytes(m.body))
            # A whole answer went out: its usage is the engine's count; without one,
            # nothing says how many tokens it held (0, not exact).
            m.delivered, m.engine_tokens, m.uncounted = n or 0, n, n is None
    return _send(ev.data, ev.end_of_stream)


def _send(data: bytes, end: bool) -> list[Action]:
    """The chunk's bytes downstream; nothing at all when there is nothing to forward and
    the stream goes on (a chunk whose events are not complete yet, an emptied one)."""
    return [Send(data, end)] if data or end else []


# What the streaming row decides for a chunk that is whole token events: the bytes, and
# the stall timer moved (`_sse_forward`'s last branch).
_STREAMING_CHUNK = decided(State.GUARD_STREAMING, (Send, StartTimer))
_CHUNK_RECORD = chunk_record(b"", False, False)  # its "data" replaced per chunk


def streaming_chunk(m: GuardMachine, data: bytes, end_of_stream: bool,
                    lease_expired: bool) -> bytes | None:
    """The common chunk, decided without the table: in the streaming state, not the
    stream's end, the lease valid, and the chunk whole usual token events that the
    decoder would return as one merged run. Returns the bytes to send (the row's Send;
    its StartTimer(STALL, stall_after_first_delta_s) is the caller's to run after it), or
    None: feed ResponseBody to `handle`, which decides everything else.

    It is the row (GUARD_STREAMING, ResponseBody) for such a chunk, in fewer steps: the
    same trace record and decision, so a trace it wrote replays through the table, and
    the same counts, marks and bytes (tests/core/test_guard_fast.py compares both paths).
    """
    if (m.state is not _S_STREAMING or end_of_stream or lease_expired or m.done_seen
            or m.checkpoint_off or m.status != 200 or not m.streaming):
        return None  # (checkpoint_off: the table's row arms the checkpoint again)
    dec = m.decoder
    units = dec.whole_run(data)
    if not units:
        return None
    if m.trace_budget > 0:
        m.trace_budget -= TRACE_RECORD_COST + len(data)
        # chunk_record(data, False, False) and the row's decision, built here: a call less,
        # and a copy of the record's keys costs less than building them anew
        rec = _CHUNK_RECORD.copy()
        rec["data"] = data.decode("latin-1")
        m.trace.append(rec)
        m.decisions.append(_STREAMING_CHUNK)
    else:
        m.trace_truncated = True
    mode = m.usage_mode
    if mode is _U_OFF:
        out, et = data, None  # output the last count did not include
    elif (found := dec.run_usage) is None:
        out, et = take_run_usage(mode, data, units)
    elif (at := found[0]) < 0:  # the decoder saw where its usage is: none
        out, et = data, None
    else:  # take_found_usage(mode, data, at, found[1]), inlined
        et = int(found[1]) if found[1].isdigit() else None
        out = data if mode is _U_KEEP else data[:at] + b"}\n\n"
    m.engine_tokens = et
    if m.count_text is not None:
        m.keep(data)
    kept = m.kept
    m.delivered = delivered = m.delivered + units
    # m.mark(m.sent + len(out)) and m.sent_downstream(len(out)), inlined (a call each)
    m.sent = sent = m.sent + len(out)
    marks = m.marks
    if m.marks_wide:
        try:
            marks.fromlist([sent, delivered, -1 if et is None else et, len(kept)])
        except OverflowError:  # (a try costs nothing on 3.11 until it raises)
            m.add_marks([sent, delivered, -1 if et is None else et, len(kept)])
            marks = m.marks
        if len(marks) >= _MARKS_FOLD:
            m.sent_downstream(0)  # folds old marks
    elif et is None and not kept:  # narrow marks (decision 0053)
        try:
            marks.fromlist([sent, delivered])
        except OverflowError:
            m.add_marks([sent, delivered])
            marks = m.marks
        if len(marks) >= _NARROW_FOLD:
            m.sent_downstream(0)
    else:
        m.add_marks([sent, delivered, -1 if et is None else et, len(kept)])
        if len(m.marks) >= _MARKS_FOLD:
            m.sent_downstream(0)
    return out


def _output_tokens(family: Family, body: bytes) -> int | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return family.output_tokens(obj)


def _guard_stall(m: GuardMachine, ev: TimerFired) -> list[Action]:
    if m.delivered == 0 or m.done_seen:
        return []  # before delivery, stalls belong to Envoy's per-try timeout (retryable)
    # An incomplete event fragment still in the decoder is never sent: the terminal event
    # must parse cleanly on its own.
    m.state = State.GUARD_TERMINATED
    end = m._terminal()
    m.sent_downstream(len(end))
    return [m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "stall"), Send(end, True)]


def _guard_timer(m: GuardMachine, ev: TimerFired) -> list[Action]:
    if ev.kind is TimerKind.CHECKPOINT:
        return _guard_checkpoint(m, ev)
    return _guard_stall(m, ev)


def _guard_checkpoint(m: GuardMachine, ev: TimerFired) -> list[Action]:
    # Now and then the delivered count is recorded, in case this process dies mid-stream
    # (one write at a time; none when nothing more went out). A tick that finds nothing
    # more arms no other: the next content event does (`_sse_forward`; decision 0053).
    if m.delivered <= m.progress_sent and not m.idle_ticks:
        m.checkpoint_off = True
        return []
    acts: list[Action] = [StartTimer(TimerKind.CHECKPOINT, m.progress_every)]
    if m.delivered > m.progress_sent and not m.progress_inflight:
        m.progress_sent, m.progress_inflight = m.delivered, True
        acts.insert(0, WriteProgress(m.delivered))
    return acts


def _guard_progress_written(m: GuardMachine, ev: ProgressWritten) -> list[Action]:
    m.progress_inflight = False
    return []


def _guard_fenced(m: GuardMachine, ev: Fenced) -> list[Action]:
    # Whoever noticed it first (the revocation watch, a chunk's lease check), once.
    if m.lease_lost:
        return []
    m.lease_lost = True
    lose: list[Action] = [LoseLease(ev.why or "expired locally")]
    if (m.state not in (State.GUARD_RESPONDING, State.GUARD_STREAMING) or m.done_seen
            or not (m.status == 200 and m.streaming)):
        return lose  # a complete answer (or a whole non-streaming body) is already out
    # Like a stall, but the cause is known: this attempt may not publish another byte.
    m.state = State.GUARD_TERMINATED
    end = m._terminal()
    m.sent_downstream(len(end))
    return [*lose, m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "fenced"), Send(end, True),
            StopTimers()]


def _guard_body_after_end(m: GuardMachine, ev: ResponseBody) -> list[Action]:
    # Bytes after we ended the stream are never forwarded: the stream is over for the client.
    return _guard_fenced(m, Fenced("expired locally")) if ev.lease_expired else []


def _guard_closed(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    acts = _closing(m)
    acts += _closed_how(m)
    return acts


def _closed_how(m: GuardMachine) -> list[Action]:
    if m.state is State.GUARD_COMPLETE:
        m.state = State.GUARD_CLOSED
        ok = m.status == 200
        return [m._finish(Outcome.COMPLETED if ok else Outcome.UPSTREAM_FAILED,
                          None if ok else f"http {m.status}")]
    if m.state is State.GUARD_TERMINATED:
        m.state = State.GUARD_CLOSED
        return []
    if m.done_seen:
        # `[DONE]` reached the client before the reset: its answer is complete.
        m.state = State.GUARD_CLOSED
        return [m._finish(Outcome.COMPLETED, "reset after [DONE]")]
    # Ended without an end of stream: the client left, or the upstream was reset.
    m.state = State.GUARD_AWAIT_CAUSE
    return [AwaitCause()]


# The close's actions have no fields: one shared instance each (an end costs less).
_STOP_TIMERS, _STOP_WATCHING, _CLOSE_INTAKE = StopTimers(), StopWatching(), CloseIntake()
_REQUEST_ENDED = RequestEnded()


def _closing(m: GuardMachine) -> list[Action]:
    """What the stream's close does first, in every state: nothing fed by the stream
    runs on (its timers, the released attempt's watch), and an intake that answered
    is offered to the request's gates no more (one still in flight: _guard_closed_opening);
    then the request ends for the retry budget (`_ended`)."""
    acts: list[Action] = [_STOP_TIMERS]
    if m.released_id is not None:
        acts.append(_STOP_WATCHING)
    if m.intake_read:
        acts += (_CLOSE_INTAKE, _REQUEST_ENDED)
    return acts


def _guard_cause(m: GuardMachine, ev: CauseLearned) -> list[Action]:
    m.state = State.GUARD_CLOSED
    if ev.status and ev.status != 200 and m.status == 200:
        # Envoy answered the client itself (an upstream reset while the released headers
        # were still ours to pass): what the client got is its reply, and no release left
        # (decision 0057), nor any content the guard passed under that 200 (its body bytes
        # are Envoy's reply's).
        m.status = ev.status
        m.cut_to(0)
    # What the client got is what Envoy sent, not what we handed it (decision 0025): a
    # reset can destroy the stream with our last chunks still unwritten.
    if m.status == 200 and m.streaming:
        m.cut_to(ev.body_bytes)
    if ev.cause == "client":
        return [m._finish(Outcome.CLIENT_DISCONNECTED, "client")]
    if m.delivered > 0:
        if ev.cause == "unknown":
            return [m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "unknown")]
        return [m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, ev.cause)]
    return [m._finish(Outcome.UPSTREAM_FAILED, ev.cause)]


def word(heard: tuple[str, int, int] | None) -> CauseLearned:
    """Envoy's downstream word (its cause, the body bytes it sent and the response status
    the client got, or None: nothing within the wait) as the guard's event."""
    if heard is None:
        return CauseLearned("unknown", None)
    return CauseLearned(heard[0], heard[1], status=heard[2] or None)


def _guard_cause_late(m: GuardMachine, ev: CauseLearned) -> list[Action]:
    return []


def _guard_recorded(m: GuardMachine, ev: RecordWritten) -> list[Action]:
    # The terminal record's write is settled: it landed, or the record shows no outcome
    # (its lease's expiry and a later repeat settle it).
    m.recorded = ev.landed
    return []


def _guard_stall_ignored(m: GuardMachine, ev: TimerFired) -> list[Action]:
    return []


# --- guard: the request's intake ------------------------------------------------------


REQUEST_PHASE = frozenset({State.GUARD_NEW, State.GUARD_AWAITING_BODY, State.GUARD_OPENING,
                           State.GUARD_LEFT_OPENING, State.GUARD_ASIDE})


# What the headers of a request that is not ours (or not yet) are answered with.
_ASIDE_ANSWER: dict[str, Callable[[], Action]] = {
    "status": LookUpStatus, "tool": StartToolCall, "passthrough": PassRequest}


def _guard_request_headers(m: GuardMachine, ev: RequestHeadersSeen) -> list[Action]:
    if ev.family != m.family.name:
        m.family = family_named(ev.family)
        m.decoder = m.family.decoder()
    if ev.kind == "generation" and not ev.end_of_stream:
        m.state = State.GUARD_AWAITING_BODY
        return [AnswerHeaders()]
    m.state = State.GUARD_ASIDE
    if ev.kind == "generation":
        return [Refuse(body_required(m.request_id))]  # headers that ended the request
    m.trace_budget = 0  # not a request of ours: what passes by is not traced
    if ev.error is not None:
        return [Refuse(ev.error)]  # refused by the intake ("rejected", "misrouted")
    m.tool_route = ev.kind == "tool"
    answer = _ASIDE_ANSWER.get(ev.kind)
    return [answer()] if answer is not None else []


def _guard_status(m: GuardMachine, ev: StatusRead) -> list[Action]:
    if ev.down is not None:
        return [Refuse(journal_unavailable(m.request_id))]
    view = ev.view
    if view is None or view.meta.get("tenant") != tenant_digest(ev.tenant):
        # Another tenant's request is indistinguishable from a missing one.
        return [Refuse(request_not_found(m.request_id))]
    return [AnswerStatus(view)]


@dataclass(frozen=True, slots=True)
class HeadersRead:
    """What a request's headers start: its machine, what core.intake read of them (kept by
    the session for the rows' later actions), the machine's first event, and for a
    generation the request and Envoy's id for it (None at the end of the stream)."""

    machine: GuardMachine
    verdict: Verdict
    event: RequestHeadersSeen
    generation: Generation | None
    envoy_request_id: str | None


def request_started(hd: Mapping[str, str], end_of_stream: bool, cfg: Config, tools: bool,
                    mint: Callable[[], str], trace_budget: int) -> HeadersRead:
    """The guard's request headers read (core.intake; ids come in by `mint`)."""
    v = read_headers(hd, cfg, tools, mint)
    kind, family, error = kind_of(v)
    gen = v if isinstance(v, Generation) else None
    return HeadersRead(GuardMachine.at_request(request_id_of(v), cfg, trace_budget), v,
                       RequestHeadersSeen(kind, family, error, end_of_stream), gen,
                       None if gen is None or end_of_stream else hd.get(H.ENVOY_REQUEST_ID))


def read_body(m: GuardMachine, body: bytes, cfg: Config, gen: Generation,
              envoy_request_id: str | None, *, pool: Pool,
              order_hosts: Callable[[list[str]], list[str]], new_attempt_id: Callable[[], str],
              wall: float, tokenizers: Mapping[str, Callable[[str], int]]
              ) -> tuple[Prepared | None, RequestBodySeen]:
    """A generation's body (ReadBody) prepared for its intake by core.intake, and the event
    that says so; the machine counts the stream's text with the model's tokenizer (none:
    the replica's usage counts it). What the process knows (the pool's view, the hosts'
    order, an attempt id, the time, the tokenizers) comes in."""
    prep = prepare_intake(body, cfg, gen, pool=pool, order_hosts=order_hosts,
                          new_attempt_id=new_attempt_id, wall=wall,
                          envoy_request_id=envoy_request_id)
    if isinstance(prep, GatewayError):
        return None, RequestBodySeen(prep)
    m.count_text = tokenizers.get(prep.meta.model or "") if prep.meta.stream else None
    return prep, RequestBodySeen(None, prep.meta.usage_mode,
                                 keyed=gen.idempotency_key is not None)


def body_answer(prep: Prepared, *, secret: str | None, rerun: Rerun | None,
                traceparent: str | None) -> tuple[dict[str, str], dict[str, Any] | None]:
    """What the body's answer (AnswerBody) sets for attempt 1's gate: core.intake's."""
    return body_headers(prep, secret=secret, rerun=rerun, traceparent=traceparent)


def body_answered(prep: Prepared) -> None:
    """The body's answer was written: the body it carried upstream is held no longer
    (core.intake's RequestMeta.answered, decision 0055)."""
    if prep.meta.upstream_body is not None:
        prep.meta.answered()


def _guard_read_body(m: GuardMachine, ev: RequestBody) -> list[Action]:
    return [ReadBody()]  # a generation's body: read, then answered as RequestBodySeen


def _guard_pass_body(m: GuardMachine, ev: RequestBody) -> list[Action]:
    return [PassBody()]  # any other body goes on unread


def _guard_request_body(m: GuardMachine, ev: RequestBodySeen) -> list[Action]:
    if ev.error is not None:
        m.state = State.GUARD_ASIDE
        return [Refuse(ev.error)]
    m.usage_mode = ev.usage
    m.keyed, m.intake_read = ev.keyed, True
    m.state = State.GUARD_OPENING
    if ev.keyed:
        # A keyed request may be a repeat: its answer is ours to give, before routing.
        return [OpenIntake(), AwaitIntake()]
    # A fresh id cannot be a repeat: the body goes on while the intake commits, and every
    # gate of the request waits for the commit before its attempt goes upstream.
    return [OpenIntake(), RegisterIntake(), AnswerBody(), AwaitIntake()]


def _guard_opened(m: GuardMachine, ev: RequestOpened) -> list[Action]:
    if ev.accepted:
        m.state = State.GUARD_WAITING
        return [Accepted(), AnswerBody()] if m.keyed else [Accepted()]
    m.state = State.GUARD_ASIDE
    if ev.error is None:
        return []
    # Keyed: the repeat's answer (or the journal's trouble) is ours to give. Key-less: the
    # body went on already; its gate gives the client this error, and nothing ran.
    if m.keyed:
        return [Refuse(ev.error)]
    m.intake_error = ev.error
    return [IntakeFailed(ev.error)]


def _guard_pass_aside(m: GuardMachine, ev: ResponseHeaders) -> list[Action]:
    if (m.intake_error is not None and ev.envoy_reply and not ev.ours and ev.status >= 500
            and not ev.end_of_stream):
        # Its intake failed and no gate answered (Envoy gave up on every attempt before
        # one ran): the client gets the intake's error, as from a gate, not Envoy's word
        # that no replica answered, which a lookup of a request never recorded would
        # contradict (404).
        m.replaced_error = m.family.error_json(m.intake_error)
        return [PassHeaders(as_json=True)]
    # Not a request of ours (or not yet: an answer Envoy made before the intake was):
    # its response goes on as it came.
    return [PassAside()]


def _guard_send_aside(m: GuardMachine, ev: ResponseBody) -> list[Action]:
    if m.replaced_error is not None:  # Envoy's reply to a failed intake: its error instead
        data, m.replaced_error = m.replaced_error, b""
        return _send(data, ev.end_of_stream)
    return _send(ev.data, ev.end_of_stream)


def _guard_closed_early(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    # Before the intake (or refused by it) there is no record to finish; the tool route,
    # if it served the stream, hears the close last.
    m.state = State.GUARD_CLOSED
    return _closing(m) + ([CloseTool()] if m.tool_route else [])


def _guard_closed_opening(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    # The intake goes on (its own task): what it answers, after the close, decides
    # whether there is a record to finish. The request is over for the retry budget all
    # the same.
    m.state = State.GUARD_LEFT_OPENING
    return [_STOP_TIMERS, AwaitLateIntake(), *_ended(m)]


def _ended(m: GuardMachine) -> list[Action]:
    """The stream's end ends a request whose body was read for its intake: it, and with
    it its re-prefills (the released one too), stop counting in the retry budget."""
    return [_REQUEST_ENDED] if m.intake_read else []


def _guard_opened_after_close(m: GuardMachine, ev: RequestOpened) -> list[Action]:
    if not ev.accepted:
        m.state = State.GUARD_CLOSED
        return []
    # Recorded, with nobody left to answer: finish it as any stream that ended without an
    # end, from Envoy's own cause (a record left open would answer every repeat of its key
    # with request_in_progress for as long as this process lives).
    m.state = State.GUARD_AWAIT_CAUSE
    return [AwaitCause()]


# States where a response is not (yet) of a request of ours.
_ASIDE_STATES = (S.GUARD_NEW, S.GUARD_AWAITING_BODY, S.GUARD_OPENING, S.GUARD_ASIDE)

GUARD_TABLE: Table = {
    (S.GUARD_NEW, RequestHeadersSeen): T(_guard_request_headers, S.GUARD_AWAITING_BODY,
                                              S.GUARD_ASIDE),
    (S.GUARD_AWAITING_BODY, RequestBody): T(_guard_read_body, S.GUARD_AWAITING_BODY),
    **stay(_guard_pass_body, tuple(st for st in S if st.startswith("guard_")
                                   and st is not S.GUARD_AWAITING_BODY), RequestBody),
    (S.GUARD_AWAITING_BODY, RequestBodySeen): T(_guard_request_body, S.GUARD_OPENING,
                                                     S.GUARD_ASIDE),
    (S.GUARD_OPENING, RequestOpened): T(_guard_opened, S.GUARD_WAITING, S.GUARD_ASIDE),
    (S.GUARD_ASIDE, StatusRead): T(_guard_status, S.GUARD_ASIDE),
    **stay(_guard_pass_aside, _ASIDE_STATES, ResponseHeaders),
    # Envoy's own answer that came before the intake committed, headers passed aside
    # above: its body passes too (the stream's close then finishes the record).
    **stay(_guard_send_aside, (*_ASIDE_STATES, S.GUARD_WAITING), ResponseBody),
    **{(st, StreamClosed): T(_guard_closed_early, S.GUARD_CLOSED) for st in (
        S.GUARD_NEW, S.GUARD_AWAITING_BODY, S.GUARD_ASIDE)},
    (S.GUARD_OPENING, StreamClosed): T(_guard_closed_opening, S.GUARD_LEFT_OPENING),
    (S.GUARD_LEFT_OPENING, RequestOpened): T(_guard_opened_after_close,
                                                  S.GUARD_AWAIT_CAUSE, S.GUARD_CLOSED),
    (S.GUARD_LEFT_OPENING, StreamClosed): T(lambda m, ev: [], S.GUARD_LEFT_OPENING),
    (S.GUARD_WAITING, ResponseHeaders): T(_guard_headers, S.GUARD_RESPONDING,
                                               S.GUARD_COMPLETE),
    (S.GUARD_RESPONDING, ResponseBody): T(_guard_body, S.GUARD_RESPONDING,
                                               S.GUARD_STREAMING, S.GUARD_COMPLETE,
                                               S.GUARD_TERMINATED),
    (S.GUARD_STREAMING, ResponseBody): T(_guard_body, S.GUARD_STREAMING,
                                              S.GUARD_COMPLETE, S.GUARD_TERMINATED),
    (S.GUARD_RESPONDING, TimerFired): T(_guard_stall_ignored, S.GUARD_RESPONDING),
    (S.GUARD_STREAMING, TimerFired): T(_guard_timer, S.GUARD_STREAMING,
                                              S.GUARD_TERMINATED),
    (S.GUARD_TERMINATED, ResponseBody): T(_guard_body_after_end, S.GUARD_TERMINATED),
    **stay(_guard_stall_ignored, (S.GUARD_TERMINATED, S.GUARD_COMPLETE, S.GUARD_CLOSED),
            TimerFired),
    (S.GUARD_AWAIT_CAUSE, CauseLearned): T(_guard_cause, S.GUARD_CLOSED),
    (S.GUARD_CLOSED, CauseLearned): T(_guard_cause_late, S.GUARD_CLOSED),
    (S.GUARD_CLOSED, StreamClosed): T(lambda m, ev: [], S.GUARD_CLOSED),
    # A Finish's write answers once it lands or gives up (the stream may be gone by then).
    **stay(_guard_recorded, (S.GUARD_TERMINATED, S.GUARD_CLOSED), RecordWritten),
    # A checkpoint's write answers whenever it lands, the stream going on or not.
    **stay(_guard_progress_written, (S.GUARD_STREAMING, S.GUARD_COMPLETE, S.GUARD_TERMINATED,
                                     S.GUARD_AWAIT_CAUSE, S.GUARD_CLOSED), ProgressWritten),
    (S.GUARD_RESPONDING, Fenced): T(_guard_fenced, S.GUARD_RESPONDING,
                                         S.GUARD_TERMINATED),
    (S.GUARD_STREAMING, Fenced): T(_guard_fenced, S.GUARD_STREAMING, S.GUARD_TERMINATED),
    **stay(_guard_fenced, (S.GUARD_WAITING, S.GUARD_COMPLETE, S.GUARD_TERMINATED,
                            S.GUARD_AWAIT_CAUSE, S.GUARD_CLOSED), Fenced),
    **{(st, StreamClosed): T(_guard_closed, S.GUARD_CLOSED, S.GUARD_AWAIT_CAUSE)
       for st in (S.GUARD_WAITING, S.GUARD_RESPONDING, S.GUARD_STREAMING, S.GUARD_COMPLETE,
                  S.GUARD_TERMINATED)},
}
GuardMachine.TABLE = GUARD_TABLE


# --- guard: the intake transaction itself ------------------------------------------------
#
# What OpenIntake starts, as a small machine of its own (it runs in its own task and
# outlives the stream; its answer is the RequestOpened the guard's rows wait for): the
# intake sent again while its answer is lost, a record that is our own earlier try, a
# repeat's answer from the journal, or its re-run re-opened in one transaction (decision
# 0027); every wait an action out and an event in, times on the events.

INTAKE_FIRST_PAUSE_S = 0.05
INTAKE_MAX_PAUSE_S = 0.4
# A repeat re-reads and re-decides once if another repeat changed the record in between.
REPEAT_ROUNDS = 2


class IntakeState(StrEnum):
    WRITING = "intake_writing"  # the intake transaction is in flight
    PAUSED = "intake_paused"  # unconfirmed: sent again after a pause
    SETTLING = "intake_settling"  # a record was there: settled if its processor died
    REOPENING = "intake_reopening"  # a repeat that runs again: the re-open is in flight
    RESETTLING = "intake_resettling"  # the re-open found the record changed: read again
    DONE = "intake_done"


@dataclass(frozen=True, slots=True)
class IntakeStart:
    mono: float


@dataclass(frozen=True, slots=True)
class IntakeWritten:
    """The intake transaction's answer: None when it created the record, else the record
    that was there."""

    existing: JournalView | None


@dataclass(frozen=True, slots=True)
class IntakeDown:
    """The write or read in flight got no answer from etcd."""

    error: str
    mono: float = 0.0


@dataclass(frozen=True, slots=True)
class IntakePauseOver:
    """The pause before sending the intake again is over."""


@dataclass(frozen=True, slots=True)
class ViewSettled:
    """The record as read (a dead processor's record settled first); None: gone."""

    view: JournalView | None
    wall: float


@dataclass(frozen=True, slots=True)
class ReopenAnswered:
    """The re-open's answer: None when it re-opened the record, else the record as it is."""

    view: JournalView | None


IntakeEvent: TypeAlias = (IntakeStart | IntakeWritten | IntakeDown | IntakePauseOver
                          | ViewSettled | ReopenAnswered)


@dataclass(frozen=True, slots=True)
class WriteIntake:
    """Run the intake transaction (the record and attempt 1); feed IntakeWritten."""


@dataclass(frozen=True, slots=True)
class PauseIntake:
    """Feed IntakePauseOver after `seconds`."""

    seconds: float


@dataclass(frozen=True, slots=True)
class TakeBackIntake:
    """An intake that gave up may still apply: take it back once etcd answers."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class SettleView:
    """Settle the record if its processor died, read it; feed ViewSettled."""

    view: JournalView


@dataclass(frozen=True, slots=True)
class Reopen:
    """Re-open the ended record for its re-run (decision 0027); feed ReopenAnswered."""

    outcome: Mapping[str, Any]
    history: tuple[int, Mapping[str, Any]]
    first: tuple[int, str, Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class UndoReopenLater:
    """A re-open whose answer never came may still apply: take it back once etcd answers
    (nothing ran for it)."""

    history: tuple[int, Mapping[str, Any]]
    first: tuple[int, str]


@dataclass(frozen=True, slots=True)
class IntakeAnswer:
    """The intake's end: None, the request is new (or runs again: `rerun`); else what to
    answer."""

    error: GatewayError | None
    rerun: Rerun | None = None


IntakeAction: TypeAlias = (WriteIntake | PauseIntake | TakeBackIntake | SettleView | Reopen
                           | UndoReopenLater | IntakeAnswer)


@dataclass(slots=True)
class IntakeFlow:
    request_id: str
    attempt_id: str  # attempt 1's, minted for this intake
    request_digest: str
    key: str | None
    resend_deadline_s: float
    gateway_id: str
    envoy_request_id: str | None = None
    state: IntakeState = IntakeState.WRITING
    give_up: float = 0.0
    pause: float = INTAKE_FIRST_PAUSE_S
    tries: int = 0
    confirmed_own: bool = False  # a lost answer's record, found to be our own try
    rounds: int = 0
    view: JournalView | None = None  # the record a repeat is answered from
    verdict: Rerun | None = None
    history: tuple[int, Mapping[str, Any]] | None = None

    def handle(self, ev: IntakeEvent) -> list[IntakeAction]:
        row = INTAKE_ROWS.get((self.state, type(ev)))
        if row is None:
            raise ProtocolViolation(f"intake: no row from {self.state} on "
                                    f"{type(ev).__name__}")
        return row(self, ev)

    def _start(self, ev: IntakeStart) -> list[IntakeAction]:
        self.give_up = ev.mono + self.resend_deadline_s
        self.tries = 1
        return [WriteIntake()]

    def _written(self, ev: IntakeWritten) -> list[IntakeAction]:
        existing = ev.existing
        if existing is not None and own_intake(existing.attempts, existing.live_attempt_id,
                                               self.attempt_id):
            self.confirmed_own = True
            existing = None
        if existing is None:
            return self._answer(None)
        self.state = IntakeState.SETTLING
        return [SettleView(existing)]

    def _write_down(self, ev: IntakeDown) -> list[IntakeAction]:
        # Sent again (each try goes to the member in use, which moves on when one fails)
        # until the resend deadline; one that gives up is taken back when etcd answers, so a
        # late apply leaves no record stuck in progress.
        if ev.mono + self.pause < self.give_up:
            self.state = IntakeState.PAUSED
            pause, self.pause = self.pause, min(self.pause * 2, INTAKE_MAX_PAUSE_S)
            return [PauseIntake(pause)]
        return [TakeBackIntake(self.attempt_id), *self._answer(journal_unavailable(
            self.request_id))]

    def _again(self, ev: IntakePauseOver) -> list[IntakeAction]:
        self.tries += 1
        self.state = IntakeState.WRITING
        return [WriteIntake()]

    def _settled(self, ev: ViewSettled) -> list[IntakeAction]:
        if ev.view is None:
            if self.state is IntakeState.SETTLING:
                return self._answer(None)
            return self._answer(request_in_progress(self.request_id, "prefill"))
        return self._repeat(ev.view, ev.wall)

    def _repeat(self, view: JournalView, wall: float) -> list[IntakeAction]:
        self.view = view
        self.rounds += 1
        if self.rounds > REPEAT_ROUNDS:
            return self._answer(request_in_progress(self.request_id, str(view.phase)))
        verdict = answer_repeat(view, self.request_digest, self.key)
        if isinstance(verdict, GatewayError):
            return self._answer(verdict)
        n, aid, gw = verdict.first_attempt, self.attempt_id, self.gateway_id
        self.verdict = verdict
        self.history = (verdict.run - 1, verdict.history(wall, gw, self.envoy_request_id))
        self.state = IntakeState.REOPENING
        return [Reopen(verdict.outcome, self.history,
                       (n, aid, records.first_attempt(aid, gw, wall, n)))]

    def _reopened(self, ev: ReopenAnswered) -> list[IntakeAction]:
        if ev.view is None:
            return self._answer(None, self.verdict)
        self.state = IntakeState.RESETTLING
        return [SettleView(ev.view)]

    def _settle_down(self, ev: IntakeDown) -> list[IntakeAction]:
        return self._answer(journal_unavailable(self.request_id))

    def _reopen_down(self, ev: IntakeDown) -> list[IntakeAction]:
        assert self.verdict is not None and self.history is not None
        return [UndoReopenLater(self.history, (self.verdict.first_attempt, self.attempt_id)),
                *self._answer(journal_unavailable(self.request_id))]

    def _answer(self, error: GatewayError | None,
                rerun: Rerun | None = None) -> list[IntakeAction]:
        self.state = IntakeState.DONE
        return [IntakeAnswer(error, rerun)]


_IS = IntakeState
INTAKE_ROWS: dict[tuple[IntakeState, type], Callable[[IntakeFlow, Any], list[IntakeAction]]] = {
    (_IS.WRITING, IntakeStart): IntakeFlow._start,
    (_IS.WRITING, IntakeWritten): IntakeFlow._written,
    (_IS.WRITING, IntakeDown): IntakeFlow._write_down,
    (_IS.PAUSED, IntakePauseOver): IntakeFlow._again,
    (_IS.SETTLING, ViewSettled): IntakeFlow._settled,
    (_IS.SETTLING, IntakeDown): IntakeFlow._settle_down,
    (_IS.REOPENING, ReopenAnswered): IntakeFlow._reopened,
    (_IS.REOPENING, IntakeDown): IntakeFlow._reopen_down,
    (_IS.RESETTLING, ViewSettled): IntakeFlow._settled,
    (_IS.RESETTLING, IntakeDown): IntakeFlow._reopen_down,
}
