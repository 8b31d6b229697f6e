"""The gate: one upstream attempt, held until its first content delta is fenced in etcd.

Its data, its handlers and its rows (`GateMachine.TABLE`); read down the rows to draw an
attempt's life.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import GatewayError, upstream_timeout, upstream_unavailable
from .events import (
    Action,
    Admit,
    AdmitDecided,
    ContinueRequest,
    DropChunk,
    EndAttempt,
    FailAttempt,
    Fence,
    FenceDecided,
    FirstDeltaTimeout,
    HoldChunk,
    LeaseLost,
    PassChunk,
    PassHeaders,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    State,
    StreamClosed,
)
from .families import CHAT, Family, family_named
from .machine import Machine, T, Table, counting_decoder, stay
from .sse import EventKind, SseDecoder

S = State


@dataclass(slots=True)
class GateMachine(Machine):
    """One attempt: hold the response until the first content delta is fenced in etcd."""

    attempt: int = 0
    max_buffer: int = 4 << 20
    streaming: bool = False
    family: Family = CHAT
    decoder: SseDecoder = field(default_factory=counting_decoder)
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



GateFn = Callable[[GateMachine, Any], list[Action]]


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


GATE_TABLE: Table = {
    (S.GATE_NEW, RequestStarted): T(_gate_start, S.GATE_ADMITTING),
    (S.GATE_ADMITTING, AdmitDecided): T(_gate_admit, S.GATE_FORWARDED, S.GATE_CLOSED),
    (S.GATE_FORWARDED, ResponseHeaders): T(_gate_headers, S.GATE_PASSTHROUGH,
                                               S.GATE_HOLDING, S.GATE_FAILED),
    (S.GATE_HOLDING, ResponseBody): T(_gate_body_holding, S.GATE_HOLDING, S.GATE_FENCING,
                                          S.GATE_FAILED),
    (S.GATE_FENCING, ResponseBody): T(_gate_body_fencing, S.GATE_FENCING),
    (S.GATE_FENCING, FenceDecided): T(_gate_fence, S.GATE_RELEASED, S.GATE_FAILED),
    (S.GATE_RELEASED, ResponseBody): T(_gate_pass, S.GATE_RELEASED),
    (S.GATE_PASSTHROUGH, ResponseBody): T(_gate_pass, S.GATE_PASSTHROUGH),
    (S.GATE_FAILED, ResponseBody): T(_gate_drop, S.GATE_FAILED),
    (S.GATE_RELEASED, LeaseLost): T(_gate_lease_lost, S.GATE_RELEASED),
    # Before release the fence transaction itself checks the lease; after the end, moot.
    **stay(_gate_ignore, (S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING,
                           S.GATE_FENCING, S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED),
            LeaseLost),
    (S.GATE_HOLDING, FirstDeltaTimeout): T(_gate_first_delta_timeout, S.GATE_FAILED),
    (S.GATE_FORWARDED, FirstDeltaTimeout): T(_gate_forwarded_timeout, S.GATE_FORWARDED,
                                                 S.GATE_FAILED),
    # Fencing (etcd txn in flight), released or over: too late to matter.
    **stay(_gate_ignore, (S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FENCING, S.GATE_RELEASED,
                           S.GATE_PASSTHROUGH, S.GATE_FAILED, S.GATE_CLOSED),
            FirstDeltaTimeout),
    **{(st, StreamClosed): T(_gate_closed, S.GATE_CLOSED) for st in (
        S.GATE_NEW, S.GATE_ADMITTING, S.GATE_FORWARDED, S.GATE_HOLDING, S.GATE_FENCING,
        S.GATE_RELEASED, S.GATE_PASSTHROUGH, S.GATE_FAILED)},
    (S.GATE_CLOSED, StreamClosed): T(_gate_closed_again, S.GATE_CLOSED),
}
GateMachine.TABLE = GATE_TABLE
