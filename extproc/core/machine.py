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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeAlias

from .errors import ErrorCode, GatewayError, decode_interrupted, upstream_timeout
from .journal import Outcome
from .sse import EventKind, SseDecoder, SseEvent

# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """Gate: an attempt's request headers reached the upstream filter."""

    attempt: int


@dataclass(frozen=True, slots=True)
class AdmitDecided:
    admitted: bool
    error: GatewayError | None = None


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    status: int
    content_type: str
    end_of_stream: bool = False


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
    """Guard: the termination cause, from Envoy's access log (or 'unknown' on timeout)."""

    cause: str  # "client" | "upstream" | "timeout" | "unknown"


Event: TypeAlias = (RequestStarted | AdmitDecided | ResponseHeaders | ResponseBody | FenceDecided
                    | FirstDeltaTimeout | StallTimeout | StreamClosed | CauseLearned | Fenced
                    | LeaseLost)

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
    GUARD_WAITING = "guard_waiting"
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


def _event_record(ev: Event) -> dict[str, Any]:
    if type(ev) is ResponseBody:  # the hot path: one per body message
        return {"type": "ResponseBody", "data": ev.data.decode("latin-1"),
                "end_of_stream": ev.end_of_stream}
    d: dict[str, Any] = asdict(ev) if not isinstance(ev, AdmitDecided) else {
        "admitted": ev.admitted, "error": ev.error.body() if ev.error else None}
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
    # Bytes the trace may still take (telemetry.max_trace_bytes; 0: no trace), counted as
    # what it costs in memory: body data plus TRACE_RECORD_COST per event. Past it events
    # are still handled, only no longer recorded: a prefix replays as a prefix, and an
    # open stream's memory stays bounded (decision 0009).
    trace_budget: int = 1 << 62
    trace_truncated: bool = False

    def handle(self, ev: Event) -> list[Action]:
        fn = TABLE.get((self.role, self.state, type(ev)))
        if fn is None:
            raise ProtocolViolation(
                f"{self.role}: no transition from {self.state} on {type(ev).__name__}")
        if self.trace_budget <= 0:
            self.trace_truncated = True
            return fn(self, ev)
        self.trace_budget -= TRACE_RECORD_COST + (len(ev.data) if type(ev) is ResponseBody
                                                  else 0)
        self.trace.append(_event_record(ev))
        actions = fn(self, ev)
        self.decisions.append(
            f"{self.state}:" + ",".join([type(a).__name__ for a in actions]))
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
        return GatewayError(code=ErrorCode.UPSTREAM_UNAVAILABLE,
                            message=f"no replica produced an answer ({reason})",
                            http_status=503, request_id=self.request_id, retryable=True)

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
    decoder: SseDecoder = field(default_factory=_counting_decoder)
    delivered: int = 0  # content units forwarded downstream
    status: int = 0
    body: bytearray = field(default_factory=bytearray)  # non-streaming body (bounded)
    max_buffer: int = 4 << 20
    finished: Finish | None = None
    done_seen: bool = False  # `[DONE]` forwarded: the client has a complete answer
    # Envoy's own plain-text 5xx (e.g. no healthy upstream, overflow): replaced by our JSON
    # error so every client sees the same contract.
    replaced_error: bytes | None = None

    @classmethod
    def new(cls, request_id: str, stall_after_first_delta_s: float,
            max_buffer: int = 4 << 20) -> GuardMachine:
        return cls(request_id=request_id, state=State.GUARD_WAITING, role="guard",
                   stall_after_first_delta_s=stall_after_first_delta_s, max_buffer=max_buffer)

    def _finish(self, outcome: Outcome, cause: str | None) -> Finish:
        self.finished = Finish(outcome=outcome, delivered_output_tokens=self.delivered,
                               cause=cause)
        return self.finished


# --- gate transitions -----------------------------------------------------------------

GateFn = Callable[[GateMachine, Any], list[Action]]
GuardFn = Callable[[GuardMachine, Any], list[Action]]


def _gate_start(m: GateMachine, ev: RequestStarted) -> list[Action]:
    m.attempt = ev.attempt
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
    if not isinstance(obj, dict) or obj.get("error") is not None:
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
    if ev.status >= 500 and ev.content_type.startswith("text/plain") and not ev.end_of_stream:
        # Envoy's own local reply (no host answered, or its per-try timeout on the last
        # attempt): our error shape instead of its plain text.
        m.replaced_error = GatewayError(
            code=ErrorCode.UPSTREAM_TIMEOUT if ev.status == 504 else ErrorCode.UPSTREAM_UNAVAILABLE,
            message=f"no replica produced an answer (gateway status {ev.status})",
            http_status=ev.status, request_id=m.request_id, retryable=True).json_bytes()
    if ev.end_of_stream:
        m.state = State.GUARD_COMPLETE
    return [PassHeaders()]


def _sse_forward(m: GuardMachine, events: list[SseEvent], end: bool) -> list[Action]:
    out = bytearray()
    for e in events:
        if m.done_seen:
            continue  # nothing after `[DONE]` reaches the client: its answer is complete
        if e.kind is EventKind.DONE:
            m.done_seen = True
            out += e.raw
        elif e.kind is EventKind.CONTENT:
            out += e.raw
            m.delivered += e.content_units
        elif e.kind in (EventKind.ERROR, EventKind.MALFORMED) and m.delivered > 0:
            # Replace their error (or garbage) with our terminal event; never forward it.
            out += decode_interrupted(m.request_id, m.delivered).sse_bytes()
            m.state = State.GUARD_TERMINATED
            return [Send(bytes(out), True), DisarmWatchdog(),
                    m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED,
                              "in-band error" if e.kind is EventKind.ERROR else "malformed event")]
        else:
            out += e.raw
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
            m.delivered = _completion_tokens(bytes(m.body))
    return [Send(ev.data, ev.end_of_stream)]


def _completion_tokens(body: bytes) -> int:
    try:
        obj = json.loads(body)
    except ValueError:
        return 0
    if isinstance(obj, dict):
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return int(usage["completion_tokens"])
    return 0


def _guard_stall(m: GuardMachine, ev: StallTimeout) -> list[Action]:
    if m.delivered == 0 or m.done_seen:
        return []  # before delivery, stalls belong to Envoy's per-try timeout (retryable)
    # An incomplete event fragment still in the decoder is never sent: the terminal event
    # must parse cleanly on its own.
    m.state = State.GUARD_TERMINATED
    return [Send(decode_interrupted(m.request_id, m.delivered).sse_bytes(), True),
            m._finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, "stall")]


def _guard_fenced(m: GuardMachine, ev: Fenced) -> list[Action]:
    if m.done_seen or not (m.status == 200 and m.streaming):
        return []  # a complete answer (or a whole non-streaming body) is already out
    # Like a stall, but the cause is known: this attempt may not publish another byte.
    m.state = State.GUARD_TERMINATED
    return [Send(decode_interrupted(m.request_id, m.delivered).sse_bytes(), True),
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


_G = "gate"
_D = "guard"
S = State

TABLE: dict[tuple[str, State, type], Callable[[Any, Any], list[Action]]] = {
    (_G, S.GATE_NEW, RequestStarted): _gate_start,
    (_G, S.GATE_ADMITTING, AdmitDecided): _gate_admit,
    (_G, S.GATE_FORWARDED, ResponseHeaders): _gate_headers,
    (_G, S.GATE_HOLDING, ResponseBody): _gate_body_holding,
    (_G, S.GATE_FENCING, ResponseBody): _gate_body_fencing,
    (_G, S.GATE_FENCING, FenceDecided): _gate_fence,
    (_G, S.GATE_RELEASED, ResponseBody): _gate_pass,
    (_G, S.GATE_PASSTHROUGH, ResponseBody): _gate_pass,
    (_G, S.GATE_FAILED, ResponseBody): _gate_drop,
    (_G, S.GATE_RELEASED, LeaseLost): _gate_lease_lost,
    # Before release the fence transaction itself checks the lease; after the end, moot.
    **{(_G, s, LeaseLost): _gate_ignore for s in (
        S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING,
        S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED)},
    (_G, S.GATE_HOLDING, FirstDeltaTimeout): _gate_first_delta_timeout,
    (_G, S.GATE_FORWARDED, FirstDeltaTimeout): _gate_forwarded_timeout,
    # Fencing (etcd txn in flight), released or over: too late to matter.
    **{(_G, s, FirstDeltaTimeout): _gate_ignore for s in (
        S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FENCING, S.GATE_RELEASED,
        S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED)},
    **{(_G, s, StreamClosed): _gate_closed for s in (
        S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING,
        S.GATE_RELEASED, S.GATE_PASSTHROUGH, S.GATE_FAILED)},
    (_G, S.GATE_CLOSED, StreamClosed): _gate_closed_again,
    (_D, S.GUARD_WAITING, ResponseHeaders): _guard_headers,
    (_D, S.GUARD_RESPONDING, ResponseBody): _guard_body,
    (_D, S.GUARD_STREAMING, ResponseBody): _guard_body,
    (_D, S.GUARD_RESPONDING, StallTimeout): _guard_stall_ignored,
    (_D, S.GUARD_STREAMING, StallTimeout): _guard_stall,
    (_D, S.GUARD_TERMINATED, ResponseBody): _guard_body_after_end,
    (_D, S.GUARD_TERMINATED, StallTimeout): _guard_stall_ignored,
    (_D, S.GUARD_COMPLETE, StallTimeout): _guard_stall_ignored,
    (_D, S.GUARD_AWAIT_CAUSE, CauseLearned): _guard_cause,
    (_D, S.GUARD_CLOSED, CauseLearned): _guard_cause_late,
    (_D, S.GUARD_CLOSED, StallTimeout): _guard_stall_ignored,
    (_D, S.GUARD_CLOSED, StreamClosed): lambda m, ev: [],
    (_D, S.GUARD_RESPONDING, Fenced): _guard_fenced,
    (_D, S.GUARD_STREAMING, Fenced): _guard_fenced,
    **{(_D, s, Fenced): _guard_ignore for s in (
        S.GUARD_WAITING, S.GUARD_COMPLETE, S.GUARD_TERMINATED, S.GUARD_AWAIT_CAUSE,
        S.GUARD_CLOSED)},
    **{(_D, s, StreamClosed): _guard_closed for s in (
        S.GUARD_WAITING, S.GUARD_RESPONDING, S.GUARD_STREAMING, S.GUARD_COMPLETE,
        S.GUARD_TERMINATED)},
}
