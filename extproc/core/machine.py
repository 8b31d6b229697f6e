"""The state machines of a logical request (the guard) and of an attempt (the gate).

Sans-IO in the manner of h11: adapters feed events in and carry out the actions that come
back; nothing here touches a socket, a clock or etcd. Both machines are driven by ONE
transition table, `TABLE`, keyed by (role, state, event type): a pair missing from the
table is a protocol violation and raises, so an unexpected message from Envoy can never be
silently mis-handled. Every event consumed is appended to `trace`; re-feeding a trace into a
fresh machine must reproduce its `decisions` (the tests check it).
"""

from __future__ import annotations

import json
import sys
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple, TypeAlias

from .errors import GatewayError, decode_interrupted, upstream_timeout, upstream_unavailable
from .families import CHAT, Family, family_named
from .journal import Outcome
from .sse import EventKind, SseDecoder, SseEvent
from .usage import UsageMode, take_usage

# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """Gate: an attempt's request headers reached the upstream filter.

    `family`: the API family of its path (core.families): how its response is read.
    """

    attempt: int
    family: str = "chat"


@dataclass(frozen=True, slots=True)
class RequestHeadersSeen:
    """Guard: the request's headers, classified by the intake (core.intake).

    `kind`: "generation" (a journaled request: its body comes next) or anything else
    ("passthrough", "status", "tool", "rejected"): not a logical request of ours.
    `family`: the API family of its path (core.families): how its response is read and
    how it is ended.
    """

    kind: str
    family: str = "chat"


@dataclass(frozen=True, slots=True)
class RequestBodySeen:
    """Guard: the request body, parsed; `error` if it cannot be run. `usage`: what the
    intake asked the engine for, so what the guard strips from its chunks (core.usage)."""

    error: GatewayError | None = None
    usage: UsageMode = UsageMode.OFF


@dataclass(frozen=True, slots=True)
class RequestOpened:
    """Guard: the intake transaction's answer: a new request (accepted), or not (a repeat
    answered from the journal, no compatible replica, or the journal unavailable)."""

    accepted: bool


@dataclass(frozen=True, slots=True)
class AdmitDecided:
    admitted: bool
    error: GatewayError | None = None


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    status: int
    content_type: str
    end_of_stream: bool = False
    # Envoy made this reply itself (its local_reply_config marks it, decision 0024).
    envoy_reply: bool = False
    # The processor wrote this error itself (x-gateway-error): already in our shape.
    ours: bool = False


@dataclass(frozen=True, slots=True)
class ResponseBody:
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class FenceDecided:
    committed: bool


@dataclass(frozen=True, slots=True)
class FirstDeltaTimeout:
    """Gate: the attempt's first-delta deadline passed (extproc.core.admission).

    `final`: no attempt or no request budget is left, so the request ends with
    `upstream_timeout` instead of a retry; `waited_s` is the request's wait so far.
    """

    final: bool = False
    waited_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StallTimeout:
    """Guard: no byte from upstream for the configured time after the first delta."""


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """Envoy closed our gRPC stream (the filter was destroyed): no more messages."""


@dataclass(frozen=True, slots=True)
class Fenced:
    """Guard: the released attempt lost its fence (lease expired locally, or its `live` key
    was revoked or replaced): it may publish nothing more."""


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """Gate: after release, its attempt's lease is gone (lapsed locally, or revoked): the
    rest of what the replica sends may not be published."""


@dataclass(frozen=True, slots=True)
class CauseLearned:
    """Guard: the termination cause, from Envoy's access log (or 'unknown' on timeout).

    `body_bytes`: the response body bytes Envoy's entry says it sent downstream (its
    `response_body_bytes`, counted after every filter); None when no entry came in time,
    so what reached the client is not known (decision 0025).
    """

    cause: str  # "client" | "upstream" | "timeout" | "unknown"
    body_bytes: int | None = None


Event: TypeAlias = (RequestStarted | AdmitDecided | ResponseHeaders | ResponseBody | FenceDecided
                    | FirstDeltaTimeout | StallTimeout | StreamClosed | CauseLearned | Fenced
                    | LeaseLost | RequestHeadersSeen | RequestBodySeen | RequestOpened)

# --- actions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Gate: run the admission transaction for this attempt, then feed AdmitDecided."""

    attempt: int


@dataclass(frozen=True, slots=True)
class ContinueRequest:
    """Gate: let the request headers go upstream."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with a managed error instead of the upstream (never retried by Envoy)."""

    error: GatewayError


@dataclass(frozen=True, slots=True)
class PassHeaders:
    """Gate: answer the response headers unchanged (non-2xx: the router decides)."""


@dataclass(frozen=True, slots=True)
class HoldChunk:
    """Gate: keep this body message unanswered; it is released or replaced later."""


@dataclass(frozen=True, slots=True)
class PassChunk:
    """Answer this body message unchanged."""


@dataclass(frozen=True, slots=True)
class Fence:
    """Gate: run the first-delta fence transaction, then feed FenceDecided."""


@dataclass(frozen=True, slots=True)
class Release:
    """Gate: answer the held headers, then every held body message, in order.

    From here the guard owns the attempt (its end, its record, its fence). With `hand_off`
    the gate also closes its gRPC stream, so Envoy sends it nothing more: the rest of the
    response flows past the gate with no processor round trip per chunk.
    """

    held_chunks: int
    hand_off: bool = False


@dataclass(frozen=True, slots=True)
class FailAttempt:
    """Gate: answer the held headers with `:status: 503` so the router retries elsewhere.

    Held body messages are replaced by `error`'s JSON (the first) and emptied (the rest),
    so if the router does not retry, the client sees a clean error and no stray bytes.
    """

    reason: str
    error: GatewayError
    held_chunks: int


@dataclass(frozen=True, slots=True)
class DropChunk:
    """Answer this body message with an empty body (its attempt was failed on purpose)."""


@dataclass(frozen=True, slots=True)
class Send:
    """Guard: send these bytes downstream in place of the received chunk."""

    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class ArmWatchdog:
    seconds: float


@dataclass(frozen=True, slots=True)
class DisarmWatchdog:
    pass


@dataclass(frozen=True, slots=True)
class AwaitCause:
    """Guard: wait (bounded) for Envoy's access log to say why the stream ended."""


@dataclass(frozen=True, slots=True)
class EndAttempt:
    """Gate: the attempt's stream is over; record it and give its lease back."""

    released: bool
    upstream_finished: bool
    last_state: str
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """Write the terminal record: the outcome and what the client received."""

    outcome: Outcome
    delivered_output_tokens: int
    cause: str | None
    # Whether the count is the engine's own (decision 0018), and where it came from:
    # "engine" (usage the engine reported), "tokenizer" (the delivered text re-encoded),
    # "events" (content events forwarded: a lower bound when the engine merges tokens).
    exact: bool = True
    source: str = "events"
    # "upper": the count is of what the guard handed to Envoy, and Envoy did not say how
    # much of it it sent: at most this much reached the client (decision 0025).
    bound: str | None = None


Action: TypeAlias = (Admit | ContinueRequest | Refuse | PassHeaders | HoldChunk | PassChunk
                     | Fence | Release | FailAttempt | DropChunk | Send | ArmWatchdog
                     | DisarmWatchdog | AwaitCause | EndAttempt | Finish)


class ProtocolViolation(RuntimeError):
    """An event arrived that the table has no transition for."""


class State(StrEnum):
    # gate (one upstream attempt)
    GATE_NEW = "gate_new"
    GATE_ADMITTING = "gate_admitting"
    GATE_FORWARDED = "gate_forwarded"
    GATE_HOLDING = "gate_holding"
    GATE_FENCING = "gate_fencing"
    GATE_RELEASED = "gate_released"
    GATE_PASSTHROUGH = "gate_passthrough"
    GATE_FAILED = "gate_failed"
    GATE_CLOSED = "gate_closed"
    # guard (the logical request, downstream)
    GUARD_NEW = "guard_new"  # nothing seen yet
    GUARD_AWAITING_BODY = "guard_awaiting_body"  # a generation request: its body comes next
    GUARD_OPENING = "guard_opening"  # the intake transaction is in flight
    # The stream closed while the intake was in flight: if it commits, the request is ours
    # to finish (client gone, or Envoy gave up on the stream).
    GUARD_LEFT_OPENING = "guard_left_opening"
    GUARD_ASIDE = "guard_aside"  # not a logical request of ours (pass-through, tool, lookup)
    GUARD_WAITING = "guard_waiting"  # accepted: waiting for the released response headers
    GUARD_RESPONDING = "guard_responding"
    GUARD_STREAMING = "guard_streaming"
    GUARD_COMPLETE = "guard_complete"
    GUARD_TERMINATED = "guard_terminated"
    GUARD_AWAIT_CAUSE = "guard_await_cause"
    GUARD_CLOSED = "guard_closed"


Role = Literal["gate", "guard"]

# --- the machines -----------------------------------------------------------------------


# Memory of one recorded event besides its body data: the record's dict and string, its
# decision string, two list slots (measured with tracemalloc on CPython 3.11: ~330 bytes).
TRACE_RECORD_COST = 320


# Records of events that repeat across requests (no request-specific data in them) are one
# shared, never mutated dict each: an open stream holds references, not copies.
_SHARED_RECORD_TYPES = (RequestStarted, ResponseHeaders, FenceDecided, FirstDeltaTimeout,
                        StallTimeout, StreamClosed, Fenced, LeaseLost,
                        RequestHeadersSeen, RequestOpened)
_SHARED_RECORDS: dict[Event, dict[str, Any]] = {}


def _event_record(ev: Event) -> dict[str, Any]:
    if type(ev) is ResponseBody:  # the hot path: one per body message
        return {"type": "ResponseBody", "data": ev.data.decode("latin-1"),
                "end_of_stream": ev.end_of_stream}
    if isinstance(ev, _SHARED_RECORD_TYPES):
        rec = _SHARED_RECORDS.get(ev)
        if rec is None:
            rec = _build_record(ev)
            if len(_SHARED_RECORDS) < 4096:  # a handful in practice; bounded regardless
                _SHARED_RECORDS[ev] = rec
        return rec
    return _build_record(ev)


def _build_record(ev: Event) -> dict[str, Any]:
    d: dict[str, Any]
    if isinstance(ev, AdmitDecided):
        d = {"admitted": ev.admitted, "error": ev.error.body() if ev.error else None}
    elif isinstance(ev, RequestBodySeen):
        d = {"error": ev.error.body() if ev.error else None,
             "http_status": ev.error.http_status if ev.error else None,
             "usage": str(ev.usage)}
    else:
        d = asdict(ev)
    for k, v in list(d.items()):
        if isinstance(v, bytes):
            d[k] = v.decode("latin-1")
    return {"type": type(ev).__name__, **d}


@dataclass(slots=True)
class _Base:
    request_id: str
    state: State
    trace: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)

    role: Role = "gate"
    initial_state: State | None = None  # where it started (replay starts there too)
    # Bytes the trace may still take (telemetry.max_trace_bytes; 0: no trace), counted as
    # what it costs in memory: body data plus TRACE_RECORD_COST per event. Past it events
    # are still handled, only no longer recorded: a prefix replays as a prefix, and an
    # open stream's memory stays bounded (decision 0009).
    trace_budget: int = 1 << 62
    trace_truncated: bool = False

    def handle(self, ev: Event) -> list[Action]:
        t = TABLE.get((self.role, self.state, type(ev)))
        if t is None:
            raise ProtocolViolation(
                f"{self.role}: no transition from {self.state} on {type(ev).__name__}")
        before = self.state
        if self.trace_budget <= 0:
            self.trace_truncated = True
            actions = t.fn(self, ev)
        else:
            self.trace_budget -= TRACE_RECORD_COST + (len(ev.data) if type(ev) is ResponseBody
                                                      else 0)
            self.trace.append(_event_record(ev))
            actions = t.fn(self, ev)
            # Interned: a few dozen distinct decisions, shared by every open stream.
            self.decisions.append(sys.intern(
                f"{self.state}:" + ",".join([type(a).__name__ for a in actions])))
        if self.state not in t.next:
            # The table declares every arrow; a handler that leaves by another is a bug.
            raise ProtocolViolation(
                f"{self.role}: {before} on {type(ev).__name__} went to {self.state}, "
                f"the table allows {sorted(t.next)}")
        return actions


def _counting_decoder() -> SseDecoder:
    """The machines count and forward events, so runs of token events may come merged."""
    return SseDecoder(merge_content=True)


@dataclass(slots=True)
class GateMachine(_Base):
    """One attempt: hold the response until the first content delta is fenced in etcd."""

    attempt: int = 0
    max_buffer: int = 4 << 20
    streaming: bool = False
    family: Family = CHAT
    decoder: SseDecoder = field(default_factory=_counting_decoder)
    held: int = 0  # body messages received and not yet answered
    buffered: bytearray = field(default_factory=bytearray)  # non-streaming body so far
    body_bytes: int = 0
    saw_content: bool = False
    saw_done: bool = False
    ended: bool = False  # upstream sent end_of_stream
    timed_out: bool = False  # failed by the first-delta limit: liveness uncertain
    lease_lost: bool = False  # after release: publish nothing more

    @classmethod
    def new(cls, request_id: str, max_buffer: int = 4 << 20) -> GateMachine:
        return cls(request_id=request_id, state=State.GATE_NEW, role="gate",
                   max_buffer=max_buffer)

    def _unavailable(self, reason: str) -> GatewayError:
        return upstream_unavailable(self.request_id, reason)

    def fail(self, reason: str) -> list[Action]:
        held = self.held
        self.held = 0
        self.state = State.GATE_FAILED
        return [FailAttempt(reason=reason, error=self._unavailable(reason), held_chunks=held)]


@dataclass(slots=True)
class GuardMachine(_Base):
    """The logical request downstream: count what the client got, end it honestly."""

    stall_after_first_delta_s: float = 15.0
    streaming: bool = False
    family: Family = CHAT
    decoder: SseDecoder = field(default_factory=_counting_decoder)
    delivered: int = 0  # content units forwarded downstream
    # The engine's running completion count as of the last event forwarded (None: a
    # content event came without one, so it no longer says what the client has).
    usage_mode: UsageMode = UsageMode.OFF
    engine_tokens: int | None = None
    # A tokenizer for the request's model (adapters.tokenizer), and the forwarded content
    # events it re-encodes when the engine gave no count; set by the adapter, not traced.
    count_text: Callable[[str], int] | None = None
    kept: list[bytes] = field(default_factory=list)
    uncounted: bool = False  # a whole (non-streaming) answer that reported no usage
    # Families whose terminal event refers to the stream (Responses): the data of its first
    # event and of the last one forwarded (references, not copies).
    first_data: bytes = b""
    last_data: bytes = b""
    status: int = 0
    body: bytearray = field(default_factory=bytearray)  # non-streaming body (bounded)
    max_buffer: int = 4 << 20
    finished: Finish | None = None
    done_seen: bool = False  # `[DONE]` forwarded: the client has a complete answer
    # Envoy's own plain-text 5xx (e.g. no healthy upstream, overflow): replaced by our JSON
    # error so every client sees the same contract.
    replaced_error: bytes | None = None
    # Delivery is what left toward the client (decision 0025): `sent` is the body bytes of a
    # stream handed to Envoy so far; `marks` holds, per content event forwarded, MARK_STRIDE
    # numbers: the offset just past its last byte, then `delivered`, `engine_tokens` (-1:
    # none) and len(`kept`) as of that event. Marks more than `max_buffer` bytes behind
    # `sent` are folded into `floor` (bounded memory on a long stream).
    sent: int = 0
    marks: array[int] = field(default_factory=lambda: array("q"))
    floor: tuple[int, int, int, int] = (0, 0, -1, 0)
    bound: str | None = None  # "upper": Envoy did not say what it sent (see Finish)
    withheld: int = 0  # content units the guard forwarded that Envoy never sent

    @classmethod
    def new(cls, request_id: str, stall_after_first_delta_s: float,
            max_buffer: int = 4 << 20, at_request: bool = False) -> GuardMachine:
        """At the request's headers (`at_request`, as the guard runs it), or already
        accepted and waiting for the response (tests of the response path)."""
        state = State.GUARD_NEW if at_request else State.GUARD_WAITING
        return cls(request_id=request_id, state=state, role="guard", initial_state=state,
                   stall_after_first_delta_s=stall_after_first_delta_s, max_buffer=max_buffer)

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
        if self.count_text is not None and self.kept:
            return self.count_text(self.family.text_of(self.kept)), False, "tokenizer"
        return self.delivered, False, "events"

    def mark(self, end: int) -> None:
        """A content event forwarded: its last byte ends at body offset `end`."""
        et = self.engine_tokens
        self.marks.extend((end, self.delivered, -1 if et is None else et, len(self.kept)))

    def sent_downstream(self, n: int) -> None:
        """`n` more body bytes handed to Envoy; old marks folded once far enough behind."""
        self.sent += n
        marks = self.marks
        if len(marks) >= MARK_STRIDE * MARKS_KEPT:
            keep_from = self.sent - self.max_buffer
            i = 0
            while i < len(marks) and marks[i] < keep_from:
                i += MARK_STRIDE
            if i:
                j = i - MARK_STRIDE
                self.floor = (marks[j], marks[j + 1], marks[j + 2], marks[j + 3])
                del marks[:i]

    def cut_to(self, body_bytes: int | None) -> None:
        """Envoy says it sent `body_bytes` of the body (None: it did not say): the counts
        become those of the content events whose last byte is within it."""
        if body_bytes is None:
            if self.delivered > 0:
                self.bound = "upper"
            return
        marks = self.marks
        ends = marks[0::MARK_STRIDE]
        if body_bytes >= self.sent or not ends or body_bytes >= ends[-1]:
            return  # every content event forwarded went out
        i = bisect_right(ends, body_bytes)
        if i:
            j = (i - 1) * MARK_STRIDE
            end, units, et, kept = marks[j], marks[j + 1], marks[j + 2], marks[j + 3]
        else:
            end, units, et, kept = self.floor
            if end > body_bytes:
                self.bound = "upper"  # folded away: the oldest count kept is the bound
        self.withheld = self.delivered - units
        self.delivered = units
        self.engine_tokens = None if et < 0 else et
        del self.kept[kept:]

    def _terminal(self) -> bytes:
        """The family's terminal event: our error, in the stream's own shape."""
        n, exact, _ = self.delivered_tokens()
        return self.family.terminal(decode_interrupted(self.request_id, n, exact),
                                    self.first_data, self.last_data)

    def _finish(self, outcome: Outcome, cause: str | None) -> Finish:
        n, exact, source = self.delivered_tokens()
        self.finished = Finish(outcome=outcome, delivered_output_tokens=n, cause=cause,
                               exact=exact, source=source,
                               bound=self.bound if n > 0 else None)
        return self.finished


# GuardMachine.marks: numbers per content event; events kept before folding is considered.
MARK_STRIDE = 4
MARKS_KEPT = 4096


# --- gate transitions -----------------------------------------------------------------

GateFn = Callable[[GateMachine, Any], list[Action]]
GuardFn = Callable[[GuardMachine, Any], list[Action]]


def _gate_start(m: GateMachine, ev: RequestStarted) -> list[Action]:
    m.attempt = ev.attempt
    if ev.family != m.family.name:
        m.family = family_named(ev.family)
        m.decoder = m.family.decoder()
    m.state = State.GATE_ADMITTING
    return [Admit(ev.attempt)]


def _gate_admit(m: GateMachine, ev: AdmitDecided) -> list[Action]:
    if ev.admitted:
        m.state = State.GATE_FORWARDED
        return [ContinueRequest()]
    m.state = State.GATE_CLOSED
    assert ev.error is not None
    return [Refuse(ev.error)]


def _gate_headers(m: GateMachine, ev: ResponseHeaders) -> list[Action]:
    if ev.status != 200:
        # The provider's own answer (a 400 with its reason, a 429, a 5xx): pass it through
        # untouched; Envoy's retry_on decides, and the client gets the provider's body.
        m.state = State.GATE_PASSTHROUGH
        return [PassHeaders()]
    m.streaming = ev.content_type.split(";", 1)[0].strip().lower() == "text/event-stream"
    m.state = State.GATE_HOLDING
    if ev.end_of_stream:
        return m.fail("empty 200 response")
    return []


def _gate_body_holding(m: GateMachine, ev: ResponseBody) -> list[Action]:
    m.held += 1
    m.body_bytes += len(ev.data)
    m.ended = ev.end_of_stream
    if m.body_bytes > m.max_buffer:
        return m.fail("response exceeded the gateway's buffer before the first delta")
    if m.streaming:
        # Only what comes before the first content matters here (the guard parses the
        # released bytes itself): the decoder stops there.
        events = m.decoder.feed_to_first_content(ev.data)
        if ev.end_of_stream and not (events and events[-1].kind is EventKind.CONTENT):
            events += m.decoder.finish()
        for e in events:
            if e.kind is EventKind.CONTENT:
                m.saw_content = True
                break
            if e.kind is EventKind.ERROR:
                return m.fail("in-band error event before the first delta")
            if e.kind is EventKind.MALFORMED:
                return m.fail("malformed event before the first delta")
            if e.kind is EventKind.DONE:
                m.saw_done = True
        if m.saw_content or (ev.end_of_stream and m.saw_done):
            # An answer with no content that ended with [DONE] is a complete empty answer.
            m.state = State.GATE_FENCING
            return [HoldChunk(), Fence()]
        if ev.end_of_stream:
            return m.fail("stream ended without content or [DONE]")
        return [HoldChunk()]
    # Non-streaming: the "first delta" is the complete, valid body.
    m.buffered += ev.data
    if not ev.end_of_stream:
        return [HoldChunk()]
    try:
        obj = json.loads(bytes(m.buffered))
    except (ValueError, RecursionError):
        return m.fail("malformed JSON body")
    if not m.family.body_ok(obj):
        return m.fail("error body with status 200")
    m.state = State.GATE_FENCING
    return [HoldChunk(), Fence()]


def _gate_body_fencing(m: GateMachine, ev: ResponseBody) -> list[Action]:
    m.held += 1
    m.ended = ev.end_of_stream
    return [HoldChunk()]


def _gate_fence(m: GateMachine, ev: FenceDecided) -> list[Action]:
    if not ev.committed:
        # Another attempt holds the request, or our lease is gone: never publish.
        return m.fail("fence lost: this attempt is no longer the live one")
    held = m.held
    m.held = 0
    m.state = State.GATE_RELEASED
    m.decoder = SseDecoder()  # the guard parses from here on; the gate only passes bytes
    return [Release(held_chunks=held, hand_off=not m.ended)]


def _gate_first_delta_timeout(m: GateMachine, ev: FirstDeltaTimeout) -> list[Action]:
    # Headers (maybe a role event) came, no content within the limit: fail the attempt so
    # the router retries, or, with nothing left to retry with, end the request cleanly.
    # The replica may be partitioned or stuck: liveness uncertain (docs/fencing.md).
    m.timed_out = True
    if ev.final:
        return _gate_timed_out_final(m, ev)
    return m.fail("no first delta within the first-delta limit")


def _gate_timed_out_final(m: GateMachine, ev: FirstDeltaTimeout) -> list[Action]:
    # An ImmediateResponse from the upstream filter is never retried by the router: the
    # client gets our error at once, whether or not the replica ever sent headers.
    m.timed_out = True
    m.held = 0
    m.state = State.GATE_FAILED
    return [Refuse(upstream_timeout(m.request_id, ev.waited_s, m.attempt))]


def _gate_forwarded_timeout(m: GateMachine, ev: FirstDeltaTimeout) -> list[Action]:
    # No response headers: nothing to answer with a 503. Envoy's per-try timeout (the
    # same limit, a moment later) resets the attempt and retries; the last attempt ends here.
    if ev.final:
        return _gate_timed_out_final(m, ev)
    return []


def _gate_ignore(m: GateMachine, ev: Any) -> list[Action]:
    return []


def _gate_pass(m: GateMachine, ev: ResponseBody) -> list[Action]:
    if ev.end_of_stream:
        m.ended = True
    if m.lease_lost:
        # The guard's watchdog (or its own fence check) ends the stream for the client with
        # the terminal error; nothing more of this attempt goes out.
        return [DropChunk()]
    return [PassChunk()]


def _gate_lease_lost(m: GateMachine, ev: LeaseLost) -> list[Action]:
    m.lease_lost = True
    return []


def _gate_drop(m: GateMachine, ev: ResponseBody) -> list[Action]:
    if ev.end_of_stream:
        m.ended = True
    return [DropChunk()]


def _gate_closed(m: GateMachine, ev: StreamClosed) -> list[Action]:
    prev = m.state
    m.state = State.GATE_CLOSED
    return [EndAttempt(released=prev is State.GATE_RELEASED, upstream_finished=m.ended,
                       last_state=str(prev), timed_out=m.timed_out)]


def _gate_closed_again(m: GateMachine, ev: StreamClosed) -> list[Action]:
    return []


# --- guard transitions ----------------------------------------------------------------


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
    return [PassHeaders()]


def _sse_forward(m: GuardMachine, events: list[SseEvent], end: bool) -> list[Action]:
    out = bytearray()
    ctx = m.family.wants_context
    mode = m.usage_mode
    usage = mode is not UsageMode.OFF  # only a family with running usage gets another mode
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
            if e.kind is not EventKind.ERROR and e.kind is not EventKind.MALFORMED:
                m.last_data = e.data
        if e.kind is EventKind.DONE:
            m.done_seen = True
            out += e.raw
            if final_count is not None and (n := final_count(e.data)) is not None:
                m.engine_tokens = n
        elif e.kind is EventKind.CONTENT:
            if usage:
                raw, m.engine_tokens = take_usage(mode, e)
                out += raw
            else:
                out += e.raw
                m.engine_tokens = None  # output the last count did not include
            if keep:
                m.kept.append(e.raw)
            m.delivered += e.content_units
            m.mark(m.sent + len(out))
        elif e.kind in (EventKind.ERROR, EventKind.MALFORMED) and m.delivered > 0:
            # Replace their error (or garbage) with our terminal event; never forward it.
            out += m._terminal()
            m.state = State.GUARD_TERMINATED
            m.sent_downstream(len(out))
            return [Send(bytes(out), True), DisarmWatchdog(),
                    m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED,
                              "in-band error" if e.kind is EventKind.ERROR else "malformed event")]
        elif usage and e.kind is EventKind.NON_CONTENT:
            raw, n = take_usage(mode, e)
            out += raw
            if n is not None:
                m.engine_tokens = n
        elif final_count is not None and e.kind is EventKind.NON_CONTENT and m.delivered:
            out += e.raw
            if (n := final_count(e.data)) is not None:
                m.engine_tokens = n
        else:
            out += e.raw
    m.sent_downstream(len(out))
    acts: list[Action] = [Send(bytes(out), end)]
    if end:
        m.state = State.GUARD_COMPLETE
        acts.append(DisarmWatchdog())
    elif m.done_seen:
        acts.append(DisarmWatchdog())  # complete answer: silence now is no interruption
    elif m.delivered > 0:
        m.state = State.GUARD_STREAMING
        acts.append(ArmWatchdog(m.stall_after_first_delta_s))
    return acts


def _guard_body(m: GuardMachine, ev: ResponseBody) -> list[Action]:
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
            m.state = State.GUARD_COMPLETE
        return [Send(data, ev.end_of_stream)]
    # Non-streaming or an error status: pass bytes through; count once complete.
    if m.status == 200 and len(m.body) <= m.max_buffer:
        m.body += ev.data
    if ev.end_of_stream:
        m.state = State.GUARD_COMPLETE
        if m.status == 200:
            n = _output_tokens(m.family, bytes(m.body))
            # A whole answer went out: its usage is the engine's count; without one,
            # nothing says how many tokens it held (0, not exact).
            m.delivered, m.engine_tokens, m.uncounted = n or 0, n, n is None
    return [Send(ev.data, ev.end_of_stream)]


def _output_tokens(family: Family, body: bytes) -> int | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return family.output_tokens(obj)


def _guard_stall(m: GuardMachine, ev: StallTimeout) -> list[Action]:
    if m.delivered == 0 or m.done_seen:
        return []  # before delivery, stalls belong to Envoy's per-try timeout (retryable)
    # An incomplete event fragment still in the decoder is never sent: the terminal event
    # must parse cleanly on its own.
    m.state = State.GUARD_TERMINATED
    end = m._terminal()
    m.sent_downstream(len(end))
    return [Send(end, True), m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "stall")]


def _guard_fenced(m: GuardMachine, ev: Fenced) -> list[Action]:
    if m.done_seen or not (m.status == 200 and m.streaming):
        return []  # a complete answer (or a whole non-streaming body) is already out
    # Like a stall, but the cause is known: this attempt may not publish another byte.
    m.state = State.GUARD_TERMINATED
    end = m._terminal()
    m.sent_downstream(len(end))
    return [Send(end, True),
            DisarmWatchdog(), m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "fenced")]


def _guard_ignore(m: GuardMachine, ev: Any) -> list[Action]:
    return []


def _guard_body_after_end(m: GuardMachine, ev: ResponseBody) -> list[Action]:
    # Bytes after we ended the stream are never forwarded: the stream is over for the client.
    return []


def _guard_closed(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    if m.state is State.GUARD_COMPLETE:
        m.state = State.GUARD_CLOSED
        ok = m.status == 200
        return [DisarmWatchdog(),
                m._finish(Outcome.COMPLETED if ok else Outcome.UPSTREAM_FAILED,
                          None if ok else f"http {m.status}")]
    if m.state is State.GUARD_TERMINATED:
        m.state = State.GUARD_CLOSED
        return []
    if m.done_seen:
        # `[DONE]` reached the client before the reset: its answer is complete.
        m.state = State.GUARD_CLOSED
        return [DisarmWatchdog(), m._finish(Outcome.COMPLETED, "reset after [DONE]")]
    # Ended without an end of stream: the client left, or the upstream was reset.
    m.state = State.GUARD_AWAIT_CAUSE
    return [DisarmWatchdog(), AwaitCause()]


def _guard_cause(m: GuardMachine, ev: CauseLearned) -> list[Action]:
    m.state = State.GUARD_CLOSED
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


def _guard_cause_late(m: GuardMachine, ev: CauseLearned) -> list[Action]:
    return []


def _guard_stall_ignored(m: GuardMachine, ev: StallTimeout) -> list[Action]:
    return []


# --- guard: the request's intake ------------------------------------------------------


REQUEST_PHASE = frozenset({State.GUARD_NEW, State.GUARD_AWAITING_BODY, State.GUARD_OPENING,
                           State.GUARD_LEFT_OPENING, State.GUARD_ASIDE})


def _guard_request_headers(m: GuardMachine, ev: RequestHeadersSeen) -> list[Action]:
    m.state = State.GUARD_AWAITING_BODY if ev.kind == "generation" else State.GUARD_ASIDE
    if ev.family != m.family.name:
        m.family = family_named(ev.family)
        m.decoder = m.family.decoder()
    return []


def _guard_request_body(m: GuardMachine, ev: RequestBodySeen) -> list[Action]:
    if ev.error is not None:
        m.state = State.GUARD_ASIDE
        return [Refuse(ev.error)]
    m.usage_mode = ev.usage
    m.state = State.GUARD_OPENING
    return []


def _guard_opened(m: GuardMachine, ev: RequestOpened) -> list[Action]:
    m.state = State.GUARD_WAITING if ev.accepted else State.GUARD_ASIDE
    return []


def _guard_closed_early(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    # Before the intake there is no record to finish.
    m.state = State.GUARD_CLOSED
    return []


def _guard_closed_opening(m: GuardMachine, ev: StreamClosed) -> list[Action]:
    # The intake goes on (its own task): what it answers decides whether there is a
    # record to finish.
    m.state = State.GUARD_LEFT_OPENING
    return []


def _guard_opened_after_close(m: GuardMachine, ev: RequestOpened) -> list[Action]:
    if not ev.accepted:
        m.state = State.GUARD_CLOSED
        return []
    # Recorded, with nobody left to answer: finish it as any stream that ended without an
    # end, from Envoy's own cause (a record left open would answer every repeat of its key
    # with request_in_progress for as long as this process lives).
    m.state = State.GUARD_AWAIT_CAUSE
    return [AwaitCause()]


GATE: Role = "gate"
GUARD: Role = "guard"
S = State


class Transition(NamedTuple):
    fn: Callable[[Any, Any], list[Action]]
    next: frozenset[State]  # every state the handler may leave the machine in


def T(fn: Callable[[Any, Any], list[Action]], *to: State) -> Transition:
    return Transition(fn, frozenset(to))


def _stay(fn: Callable[[Any, Any], list[Action]], states: tuple[State, ...], role: str,
          ev: type) -> dict[tuple[str, State, type], Transition]:
    return {(role, st, ev): T(fn, st) for st in states}


# (role, state, event) -> the handler and the states it may lead to. Read down a role's
# rows to draw its life; docs/architecture.md's drawing is generated from these arrows.
TABLE: dict[tuple[str, State, type], Transition] = {
    # --- gate: one attempt
    (GATE, S.GATE_NEW, RequestStarted): T(_gate_start, S.GATE_ADMITTING),
    (GATE, S.GATE_ADMITTING, AdmitDecided): T(_gate_admit, S.GATE_FORWARDED, S.GATE_CLOSED),
    (GATE, S.GATE_FORWARDED, ResponseHeaders): T(_gate_headers, S.GATE_PASSTHROUGH,
                                               S.GATE_HOLDING, S.GATE_FAILED),
    (GATE, S.GATE_HOLDING, ResponseBody): T(_gate_body_holding, S.GATE_HOLDING, S.GATE_FENCING,
                                          S.GATE_FAILED),
    (GATE, S.GATE_FENCING, ResponseBody): T(_gate_body_fencing, S.GATE_FENCING),
    (GATE, S.GATE_FENCING, FenceDecided): T(_gate_fence, S.GATE_RELEASED, S.GATE_FAILED),
    (GATE, S.GATE_RELEASED, ResponseBody): T(_gate_pass, S.GATE_RELEASED),
    (GATE, S.GATE_PASSTHROUGH, ResponseBody): T(_gate_pass, S.GATE_PASSTHROUGH),
    (GATE, S.GATE_FAILED, ResponseBody): T(_gate_drop, S.GATE_FAILED),
    (GATE, S.GATE_RELEASED, LeaseLost): T(_gate_lease_lost, S.GATE_RELEASED),
    # Before release the fence transaction itself checks the lease; after the end, moot.
    **_stay(_gate_ignore, (S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING,
                           S.GATE_FENCING, S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED),
            GATE, LeaseLost),
    (GATE, S.GATE_HOLDING, FirstDeltaTimeout): T(_gate_first_delta_timeout, S.GATE_FAILED),
    (GATE, S.GATE_FORWARDED, FirstDeltaTimeout): T(_gate_forwarded_timeout, S.GATE_FORWARDED,
                                                 S.GATE_FAILED),
    # Fencing (etcd txn in flight), released or over: too late to matter.
    **_stay(_gate_ignore, (S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FENCING, S.GATE_RELEASED,
                           S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED),
            GATE, FirstDeltaTimeout),
    **{(GATE, st, StreamClosed): T(_gate_closed, S.GATE_CLOSED) for st in (
        S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING,
        S.GATE_RELEASED, S.GATE_PASSTHROUGH, S.GATE_FAILED)},
    (GATE, S.GATE_CLOSED, StreamClosed): T(_gate_closed_again, S.GATE_CLOSED),
    # --- guard: the logical request, from its headers to its recorded outcome
    (GUARD, S.GUARD_NEW, RequestHeadersSeen): T(_guard_request_headers, S.GUARD_AWAITING_BODY,
                                              S.GUARD_ASIDE),
    (GUARD, S.GUARD_AWAITING_BODY, RequestBodySeen): T(_guard_request_body, S.GUARD_OPENING,
                                                     S.GUARD_ASIDE),
    (GUARD, S.GUARD_OPENING, RequestOpened): T(_guard_opened, S.GUARD_WAITING, S.GUARD_ASIDE),
    **{(GUARD, st, StreamClosed): T(_guard_closed_early, S.GUARD_CLOSED) for st in (
        S.GUARD_NEW, S.GUARD_AWAITING_BODY, S.GUARD_ASIDE)},
    (GUARD, S.GUARD_OPENING, StreamClosed): T(_guard_closed_opening, S.GUARD_LEFT_OPENING),
    (GUARD, S.GUARD_LEFT_OPENING, RequestOpened): T(_guard_opened_after_close,
                                                  S.GUARD_AWAIT_CAUSE, S.GUARD_CLOSED),
    (GUARD, S.GUARD_LEFT_OPENING, StreamClosed): T(lambda m, ev: [], S.GUARD_LEFT_OPENING),
    (GUARD, S.GUARD_WAITING, ResponseHeaders): T(_guard_headers, S.GUARD_RESPONDING,
                                               S.GUARD_COMPLETE),
    (GUARD, S.GUARD_RESPONDING, ResponseBody): T(_guard_body, S.GUARD_RESPONDING,
                                               S.GUARD_STREAMING, S.GUARD_COMPLETE,
                                               S.GUARD_TERMINATED),
    (GUARD, S.GUARD_STREAMING, ResponseBody): T(_guard_body, S.GUARD_STREAMING,
                                              S.GUARD_COMPLETE, S.GUARD_TERMINATED),
    (GUARD, S.GUARD_RESPONDING, StallTimeout): T(_guard_stall_ignored, S.GUARD_RESPONDING),
    (GUARD, S.GUARD_STREAMING, StallTimeout): T(_guard_stall, S.GUARD_STREAMING,
                                              S.GUARD_TERMINATED),
    (GUARD, S.GUARD_TERMINATED, ResponseBody): T(_guard_body_after_end, S.GUARD_TERMINATED),
    **_stay(_guard_stall_ignored, (S.GUARD_TERMINATED, S.GUARD_COMPLETE, S.GUARD_CLOSED),
            GUARD, StallTimeout),
    (GUARD, S.GUARD_AWAIT_CAUSE, CauseLearned): T(_guard_cause, S.GUARD_CLOSED),
    (GUARD, S.GUARD_CLOSED, CauseLearned): T(_guard_cause_late, S.GUARD_CLOSED),
    (GUARD, S.GUARD_CLOSED, StreamClosed): T(lambda m, ev: [], S.GUARD_CLOSED),
    (GUARD, S.GUARD_RESPONDING, Fenced): T(_guard_fenced, S.GUARD_RESPONDING,
                                         S.GUARD_TERMINATED),
    (GUARD, S.GUARD_STREAMING, Fenced): T(_guard_fenced, S.GUARD_STREAMING, S.GUARD_TERMINATED),
    **_stay(_guard_ignore, (S.GUARD_WAITING, S.GUARD_COMPLETE, S.GUARD_TERMINATED,
                            S.GUARD_AWAIT_CAUSE, S.GUARD_CLOSED), GUARD, Fenced),
    **{(GUARD, st, StreamClosed): T(_guard_closed, S.GUARD_CLOSED, S.GUARD_AWAIT_CAUSE)
       for st in (S.GUARD_WAITING, S.GUARD_RESPONDING, S.GUARD_STREAMING, S.GUARD_COMPLETE,
                  S.GUARD_TERMINATED)},
}


def arrows(role: str) -> list[str]:
    """The role's life as the table draws it: every transition that moves the machine,
    `state --Event--> next | next`, in table order (docs/architecture.md shows exactly
    these lines; a test keeps them equal)."""
    out = []
    for (r, state, ev), t in TABLE.items():
        moves = sorted(str(n) for n in t.next if n is not state)
        if r != role or not moves:
            continue
        stays = " (or stays)" if state in t.next else ""
        out.append(f"{state} --{ev.__name__}--> {' | '.join(moves)}{stays}")
    return out
