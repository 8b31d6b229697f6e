"""The vocabulary both roles share: the events fed into a machine, the actions it answers
with, and the states (core.gate, core.guard).

Events and actions are frozen dataclasses: an event is what happened (an Envoy message, an
etcd answer, a timer), an action is what the adapter is asked to do. A wait is an action out
and an event in.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, TypeAlias

from .errors import GatewayError
from .journal import Outcome
from .usage import UsageMode

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
    # The request names an idempotency key, so it may be a repeat: its intake is answered
    # before the body goes on (decision 0021).
    keyed: bool = False


@dataclass(frozen=True, slots=True)
class RequestOpened:
    """Guard: the intake transaction's answer: a new request (accepted), or not (a repeat
    answered from the journal, no compatible replica, or the journal unavailable), with
    what to answer then."""

    accepted: bool
    error: GatewayError | None = None


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
    # Guard: the gate's hand-off of a released attempt (x-gateway-attempt-handoff).
    handoff: str | None = None


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


# --- guard: the intake order (decision 0021) and the take-over of a hand-off ------------


@dataclass(frozen=True, slots=True)
class OpenIntake:
    """Guard: start the intake transaction (its own task: it outlives the stream)."""


@dataclass(frozen=True, slots=True)
class RegisterIntake:
    """Guard: let the request's gates wait for the intake before attempt 1 goes upstream."""


@dataclass(frozen=True, slots=True)
class AnswerBody:
    """Guard: let the body go on, with attempt 1's headers and the route."""


@dataclass(frozen=True, slots=True)
class AwaitIntake:
    """Guard: wait for the intake's answer, then feed RequestOpened."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """Guard: the request is ours: in flight for the retry budget until its stream ends."""


@dataclass(frozen=True, slots=True)
class IntakeFailed:
    """Guard: a key-less intake failed after its body went on: its gate answers the client
    with `error`; here only what was started for it ends."""

    error: GatewayError


@dataclass(frozen=True, slots=True)
class TakeOver:
    """Guard: own the released attempt the gate handed over (`handoff`, its header form):
    its end, its record and its fence."""

    handoff: str


@dataclass(frozen=True, slots=True)
class PassAside:
    """Guard: let response headers that are not of a request of ours go on, unchanged but
    for the headers that never reach a client."""


Action: TypeAlias = (Admit | ContinueRequest | Refuse | PassHeaders | HoldChunk | PassChunk
                     | Fence | Release | FailAttempt | DropChunk | Send | ArmWatchdog
                     | DisarmWatchdog | AwaitCause | EndAttempt | Finish
                     | OpenIntake | RegisterIntake | AnswerBody | AwaitIntake | Accepted
                     | IntakeFailed | TakeOver | PassAside)


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
