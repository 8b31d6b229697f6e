"""The vocabulary both roles share: the events fed into a machine, the actions it answers
with, and the states (core.gate, core.guard).

Events and actions are frozen dataclasses: an event is what happened (an Envoy message, an
etcd answer, a timer), an action is what the adapter is asked to do. A wait is an action out
and an event in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeAlias

from .admission import Admitted, AttemptRequest
from .errors import GatewayError
from .handoff import HandOff
from .journal import Outcome
from .records import AttemptFacts
from .usage import UsageMode

# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """Gate: an attempt's request headers reached the upstream filter.

    `family`: the API family of its path (core.families): how its response is read.
    """

    attempt: int  # Envoy's count (x-envoy-attempt-count): the admission policy's
    family: str = "chat"
    # What the attempt's request headers and the ids port say (times from the clock port):
    attempt_id: str = ""  # attempt 1's from the guard (pre-admitted), a later one's minted
    attempt_offset: int = 0  # a re-run's: the attempts of the runs before (decision 0027)
    preadmitted: bool = False  # admitted by the guard with the request (attempt 1)
    first_admitted: str | None = None  # attempt 1's id, as every attempt sees it
    replica: str | None = None
    want_fingerprint: str | None = None
    prompt_tokens: int = 0
    accepted_at: float | None = None  # wall clock, when the guard accepted the request
    mono: float = 0.0
    wall: float = 0.0


@dataclass(frozen=True, slots=True)
class IntakeCommitted:
    """Gate: the request's intake answered (or none was in flight): `error` if it was never
    recorded. With it, what the process knows that the admission weighs: how many of the
    request's attempts reached a replica, this replica's fingerprint in the pool."""

    error: GatewayError | None = None
    reached_count: int = 0
    replica_fingerprint: str | None = None
    pool_enabled: bool = False
    wall: float = 0.0
    # The version of the agent that fronts the attempt's replica, as its pool record says
    # (0: none; decision 0034).
    agent: int = 0


@dataclass(frozen=True, slots=True)
class AdmissionDecided:
    """Gate: core.admission's verdict (the retry budget is the process's: the adapter asks
    it): `admitted`, or `error`."""

    admitted: Admitted | None = None
    error: GatewayError | None = None


@dataclass(frozen=True, slots=True)
class StoreDown:
    """Gate: a journal write was not confirmed within its resend deadline (decision 0026)."""

    what: str = ""
    wall: float = 0.0


class TimerKind(StrEnum):
    SOFT_FIRST_DELTA = "soft_first_delta"  # slow is not dead: noted, nothing changes
    FIRST_DELTA = "first_delta"  # the attempt's first-delta deadline
    RESEND = "resend"  # gate: the pause before an unconfirmed write is sent again
    STALL = "stall"  # guard: no byte from upstream for this long after the first delta
    # gate: the replica's agent said the first content left it; it has not arrived since
    SOURCE_GRACE = "source_grace"
    CHECKPOINT = "checkpoint"  # guard: time to record the delivered count again


@dataclass(frozen=True, slots=True)
class NotConfirmed:
    """Gate: one try of a conditioned write (the lease, the admission, the fence) got no
    answer from etcd: sent at `sent_mono`, given up on at `mono`. The rows decide whether
    it is sent again after a pause (decision 0026) or the attempt gives up."""

    error: str = ""
    sent_mono: float = 0.0
    mono: float = 0.0
    wall: float = 0.0


@dataclass(frozen=True, slots=True)
class LiveChanged:
    """Gate: the revocation watch saw the attempt's `live` key change (to `value`; None:
    deleted)."""

    value: str | None = None


@dataclass(frozen=True, slots=True)
class TimerFired:
    """A timer the machine started (StartTimer) ran out, on the injected clock."""

    kind: TimerKind
    mono: float = 0.0
    wall: float = 0.0


@dataclass(frozen=True, slots=True)
class Revoked:
    """Gate: the early revoke of an ended attempt's `live` key was confirmed, or given up."""

    confirmed: bool


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
    # Trace format 3: what the intake refused ("rejected", "misrouted"), and a generation
    # whose headers ended the request (no body to run).
    error: GatewayError | None = None
    end_of_stream: bool = False


@dataclass(frozen=True, slots=True)
class StatusRead:
    """Guard: the journal's answer to a status lookup (LookUpStatus): the record as read
    (settled if its processor died; None: none), or `down`, etcd's trouble. `tenant`: the
    asking tenant's digest. Fed after the headers' row turned tracing off: never traced."""

    view: Any = None  # core.journal.JournalView | None
    tenant: str = ""
    down: str | None = None


@dataclass(frozen=True, slots=True)
class RequestBody:
    """Guard: a request body came; the rows say whether it is read (`ReadBody`: a
    generation's, awaited) or passes (`PassBody`)."""


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
    """Gate: the journal's answer to the admission (or the lease of a pre-admitted attempt):
    `reason` when refused; `waited_s` for the previous attempt's fence."""

    admitted: bool
    reason: str = ""
    waited_s: float = 0.0
    mono: float = 0.0  # when it answered: the first-delta deadline runs from here
    wall: float = 0.0


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
    # Gate: the replica's x-model-revision and Retry-After (429/503: overloaded, not dead).
    model_revision: str | None = None
    retry_after: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseBody:
    data: bytes
    end_of_stream: bool
    # The attempt's lease, as its port answers with this chunk, has run out or was lost
    # (the guard's released attempt, trace format 3; the gate's, too, since issue 25's
    # last pass): its deadline moves with the process lease's keep-alives.
    lease_expired: bool = False


@dataclass(frozen=True, slots=True)
class FenceDecided:
    committed: bool


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """Envoy closed our gRPC stream (the filter was destroyed): no more messages.

    The gate's carries the clock's times (its attempt's end is planned from them)."""

    mono: float = 0.0
    wall: float = 0.0


@dataclass(frozen=True, slots=True)
class Fenced:
    """Guard: the released attempt lost its fence (lease expired locally, or its `live` key
    was revoked or replaced): it may publish nothing more."""

    why: str = ""


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """Gate: after release, its attempt's lease is gone (lapsed locally, or revoked): the
    rest of what the replica sends may not be published. Read from traces kept before the
    chunk carried the lease's answer (`ResponseBody.lease_expired`); no longer fed."""


@dataclass(frozen=True, slots=True)
class RecordWritten:
    """Guard: the answer to Finish's write of the terminal record: it landed, or etcd never
    answered within its bounded retry (`landed` False: the record shows no outcome)."""

    landed: bool


@dataclass(frozen=True, slots=True)
class ProgressWritten:
    """Guard: the answer to WriteProgress (landed or not: a missed checkpoint only weakens
    the lower bound it gives)."""


@dataclass(frozen=True, slots=True)
class CauseLearned:
    """Guard: the termination cause, from Envoy's access log (or 'unknown' on timeout).

    `body_bytes`: the response body bytes Envoy's entry says it sent downstream (its
    `response_body_bytes`, counted after every filter); None when no entry came in time,
    so what reached the client is not known (decision 0025).
    """

    cause: str  # "client" | "upstream" | "timeout" | "unknown"
    body_bytes: int | None = None
    # Gate: whether an entry came at all (False: Envoy said nothing in time), and when.
    heard: bool = True
    wall: float = 0.0
    # Guard: the response status Envoy's entry says the client got (None: not said). Not
    # the guard's when Envoy replaced a response whose headers had not left yet with its
    # own reply (an upstream reset while the guard held them): then no release left.
    status: int | None = None


@dataclass(frozen=True, slots=True)
class SourceSent:
    """Gate: the replica's agent wrote that this attempt's first content delta left the
    replica toward Envoy (`src/<processor>/<rid>/<aid>`; decision 0034). `at`: the agent's
    wall clock then; `mono`: this process's clock when the word arrived."""

    at: float = 0.0
    mono: float = 0.0


@dataclass(frozen=True, slots=True)
class AckLearned:
    """Gate: the replica's agent acknowledged the cancel (`ack/<rid>/<aid>`: the engine let
    go; `evidence` is its record), or (`heard` False) no acknowledgement came in time."""

    heard: bool
    evidence: Mapping[str, Any] | None = None
    wall: float = 0.0


Event: TypeAlias = (SourceSent | AckLearned
                    | RequestStarted | IntakeCommitted | AdmissionDecided | StoreDown | TimerFired
                    | Revoked | AdmitDecided | ResponseHeaders | ResponseBody | FenceDecided
                    | StreamClosed | CauseLearned | RecordWritten | ProgressWritten
                    | Fenced
                    | LeaseLost | RequestHeadersSeen | RequestBodySeen | RequestOpened
                    | StatusRead | NotConfirmed | LiveChanged | RequestBody)

# --- actions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Gate: run the admission transaction (its record, and how long it may wait for the
    previous attempt's fence), sent again until `deadline_s` from now at the latest; then
    feed AdmitDecided, or StoreDown. The adapter mints the attempt's credential with it."""

    attempt: int  # the journal's number
    record: Mapping[str, Any] = field(default_factory=dict)
    fence_wait_s: float = 0.0
    first_attempt: int = 1
    deadline_s: float = float("inf")


@dataclass(frozen=True, slots=True)
class AwaitIntakeCommit:
    """Gate: wait for the request's intake (decision 0021), then feed IntakeCommitted."""


@dataclass(frozen=True, slots=True)
class Decide:
    """Gate: ask core.admission.decide with the process's retry budget; feed
    AdmissionDecided."""

    request: AttemptRequest


@dataclass(frozen=True, slots=True)
class TakeLease:
    """Gate: the pre-admitted attempt's lease (the process lease); feed AdmitDecided, or
    StoreDown."""


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Gate: a pre-admitted attempt 1 its gate refused: give `live` back (`record`)."""

    attempt: int
    record: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class UndoAdmission:
    """Gate: an admission never confirmed may still apply: take it back once etcd answers."""

    attempt: int


@dataclass(frozen=True, slots=True)
class UndoFence:
    """Gate: a fence never confirmed may still apply: take it back once etcd answers."""

    facts: AttemptFacts

    def record(self, wall: float) -> dict[str, Any]:
        return self.facts.fence(wall)


@dataclass(frozen=True, slots=True)
class Watch:
    """Gate: subscribe to the attempt's `live` key: its lease is lost if it changes."""


@dataclass(frozen=True, slots=True)
class LoseLease:
    """The attempt's permission to publish ends (`why`), said once by either role.

    The gate's names who holds `live` now when the watch said (`live`); the guard's, for a
    released attempt, leaves it None."""

    why: str
    live: str | None = None


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Feed TimerFired(kind) after `seconds` on the injected clock (replacing that kind's)."""

    kind: TimerKind
    seconds: float


@dataclass(frozen=True, slots=True)
class StopTimers:
    """Cancel every timer the machine started."""


@dataclass(frozen=True, slots=True)
class StopWatching:
    """The stream closed: stop the watches that feed its machine (the gate's on its
    attempt's `live` key and its replica agent's word, the guard's on the released
    attempt's `live` key). A closed stream has nothing more to fence, and its own end
    deletes `live`."""


@dataclass(frozen=True, slots=True)
class MarkSlow:
    """Gate: the first delta is slower than the soft expectation (recorded, not failed)."""


@dataclass(frozen=True, slots=True)
class RevokeEarly:
    """Gate: a confirmed end before the first-delta limit: end `live` now with the pending
    `record`; feed Revoked."""

    attempt: int
    record: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class CloseAttempt:
    """Gate: the attempt's end is settled: its lease ends, its record is written (ending
    `live`, or, after an early revoke, updating the record)."""

    attempt: int
    record: Mapping[str, Any]
    expire: bool  # fenced until the lease expires (an uncertain end)
    update_only: bool  # `live` already went with the early revoke
    failure_class: str
    fence: str
    cause: str
    timed_out: bool
    end_trace: Mapping[str, Any]
    # The agent's acknowledgement is awaited next (AwaitAck): KeepTrace comes with its end.
    ack_follows: bool = False


@dataclass(frozen=True, slots=True)
class MarkTimedOut:
    """Gate: the replica's first delta did not come within the limit (or its path was
    lost): the hosts' health records it against `replica`, now."""

    replica: str


@dataclass(frozen=True, slots=True)
class KeepTrace:
    """Gate: keep the ended attempt's trace (if the traces kept include it): its `name`,
    its `meta` (the end plan's inputs and verdict) and whether it `completed`. Comes once,
    with the attempt's close, or after the agent's acknowledgement when one is awaited."""

    name: str
    meta: Mapping[str, Any]
    completed: bool


@dataclass(frozen=True, slots=True)
class ContinueRequest:
    """Gate: let the request headers go upstream; `agent`: the replica's agent is told
    where to address its word (this process's instance id, decision 0034)."""

    agent: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with a managed error instead of the upstream (never retried by Envoy)."""

    error: GatewayError


@dataclass(frozen=True, slots=True)
class PassHeaders:
    """Answer the response headers (the gate's: unchanged but for the retry mark, with which
    Envoy retries a non-2xx; decision 0024)."""

    retry: bool = False
    # The guard's: our error's shape (JSON) replaces Envoy's or the replica's 5xx body.
    as_json: bool = False


@dataclass(frozen=True, slots=True)
class HoldChunk:
    """Gate: keep this body message unanswered; it is released or replaced later."""


@dataclass(frozen=True, slots=True)
class PassChunk:
    """Answer this body message unchanged."""


@dataclass(frozen=True, slots=True)
class Fence:
    """Gate: run the first-delta fence transaction (of `facts`, stamped when sent), sent
    again until `until_mono` at the latest; then feed FenceDecided, or StoreDown."""

    facts: AttemptFacts | None = None
    until_mono: float = float("inf")

    def record(self, wall: float) -> dict[str, Any]:
        """The fence's record, stamped `wall` when it is sent."""
        assert self.facts is not None
        return self.facts.fence(wall)


@dataclass(frozen=True, slots=True)
class Release:
    """Gate: answer the held headers, then every held body message, in order.

    From here the guard owns the attempt (its end, its record, its fence). With `hand_off`
    the gate also closes its gRPC stream, so Envoy sends it nothing more: the rest of the
    response flows past the gate with no processor round trip per chunk.
    """

    held_chunks: int
    hand_off: bool = False
    facts: AttemptFacts | None = None  # the attempt's record so far: the hand-off's


@dataclass(frozen=True, slots=True)
class Overloaded:
    """Gate: the replica said it is overloaded (429/503): tried after the others until
    `seconds` from now."""

    seconds: float


@dataclass(frozen=True, slots=True)
class RetryEnded:
    """Gate: over before release: a re-prefill stops counting in the retry budget."""


@dataclass(frozen=True, slots=True)
class FailAttempt:
    """Gate: answer the held headers with `:status: 503` so the router retries elsewhere.

    Held body messages are replaced by `error`'s JSON (the first) and emptied (the rest),
    so if the router does not retry, the client sees a clean error and no stray bytes.
    """

    reason: str
    error: GatewayError
    held_chunks: int
    retry: bool = False  # mark the 503 for Envoy's retry (not on the last attempt)


@dataclass(frozen=True, slots=True)
class DropChunk:
    """Answer this body message with an empty body (its attempt was failed on purpose)."""


@dataclass(frozen=True, slots=True)
class Send:
    """Guard: send these bytes downstream in place of the received chunk (never empty
    unless it ends the stream: a chunk with nothing to forward is no Send at all)."""

    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class AwaitCause:
    """Wait (bounded) for Envoy's access log to say why the stream ended: the guard's
    request entry, or (`attempt_id`) the gate's per-attempt entry; feed CauseLearned.
    The gate's says how long (`timeout_s`): the cause log's port bounds the wait on the
    Timers port and answers CauseLearned(heard=False) when Envoy said nothing by then."""

    attempt_id: str | None = None
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class EndAttempt:
    """Gate: the attempt's stream is over; record it and give its lease back."""

    released: bool
    upstream_finished: bool
    last_state: str
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class WriteProgress:
    """Record the delivered count so far (a lower bound, in case this process dies
    mid-stream); its answer comes back as ProgressWritten."""

    delivered: int


@dataclass(frozen=True, slots=True)
class Finish:
    """Write the terminal record: the outcome and what the client received; its answer
    comes back as RecordWritten. First in its batch, before any Send: it is written in its
    own task, started before our last bytes go out (Envoy may then close the stream and
    cancel the handler mid-await; found by the fault sweep)."""

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
    # The upstream's answer was whole (`[DONE]` forwarded, or completed): how the released
    # attempt's own record ends (core.records.released_end). Derived from the rest of the
    # machine's state, so not part of what makes two Finishes the same.
    upstream_finished: bool = field(default=False, compare=False)
    # The client's response is not a 200: no attempt's release reached it, so a `delivery`
    # the journal holds is one that never left Envoy, taken back with the outcome
    # (decision 0057). Derived from the response's status, so not compared either.
    nothing_released: bool = field(default=False, compare=False)


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
class CloseIntake:
    """Guard: the stream closed after its intake answered. A failed intake stays offered
    to the request's gates while its stream is open (each one gives the client its
    error); none comes after the stream, so the offer ends."""


@dataclass(frozen=True, slots=True)
class AwaitLateIntake:
    """Guard: the stream closed with its intake in flight: its answer still counts. Feed
    RequestOpened when it comes, after the close (a failed one's offer to the gates
    ends then)."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """Guard: the request is ours: in flight for the retry budget until its stream ends."""


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """Guard: the stream of a request whose body was read for its intake ended: the
    request, and with it its re-prefills, stop counting in the retry budget (idempotent;
    one never accepted counts nothing)."""


@dataclass(frozen=True, slots=True)
class IntakeFailed:
    """Guard: a key-less intake failed after its body went on: its gate answers the client
    with `error`; here only what was started for it ends."""

    error: GatewayError


@dataclass(frozen=True, slots=True)
class TakeOver:
    """Guard: own the released attempt the gate handed over (`handoff`, read from its
    header): its end, its record and its fence."""

    handoff: HandOff


@dataclass(frozen=True, slots=True)
class UnreadableHandOff:
    """Guard: the released attempt's hand-off header could not be read: there is nothing
    to own (said by the observer; the gate's lease lapses by itself)."""


@dataclass(frozen=True, slots=True)
class ReadBody:
    """Guard: read the generation's body (core.intake, through the record's ports); feed
    RequestBodySeen."""


@dataclass(frozen=True, slots=True)
class PassBody:
    """Guard: a body that is not read (not a generation's, or not awaited) goes on."""


@dataclass(frozen=True, slots=True)
class PassAside:
    """Guard: let response headers that are not of a request of ours go on, unchanged but
    for the headers that never reach a client."""


@dataclass(frozen=True, slots=True)
class AnswerHeaders:
    """Guard: a generation's headers go on, with its request id (a client's copies of the
    gateway's own headers removed)."""


@dataclass(frozen=True, slots=True)
class PassRequest:
    """Guard: not a request of ours: its headers go on without the gateway's own."""


@dataclass(frozen=True, slots=True)
class LookUpStatus:
    """Guard: read the request's record for a status lookup; feed StatusRead."""


@dataclass(frozen=True, slots=True)
class AnswerStatus:
    """Guard: answer a status lookup with the record (`view`, a core.journal.JournalView)."""

    view: Any


@dataclass(frozen=True, slots=True)
class StartToolCall:
    """Guard: the tool route serves this stream (its own machine, core.tool_route)."""


@dataclass(frozen=True, slots=True)
class CloseTool:
    """Guard: the stream closed: the tool route's machine hears it (its own task)."""


@dataclass(frozen=True, slots=True)
class WatchSource:
    """Gate: listen for the replica's agent saying the first content left it; feed
    SourceSent (the session stops listening at release or close)."""


@dataclass(frozen=True, slots=True)
class MarkPathLost:
    """Gate: the agent's first content did not arrive within source_grace_s: the path from
    the replica is lost. `failed`: the gate failed the attempt for it (headers had come);
    else only noted (no headers: Envoy's per-try timeout ends it)."""

    failed: bool


@dataclass(frozen=True, slots=True)
class PutCancel:
    """Gate: ask the replica's agent to stop this attempt at the engine
    (`cancel/<rid>/<aid>`), and listen for its acknowledgement from now on."""


@dataclass(frozen=True, slots=True)
class AwaitAck:
    """Gate: wait, at most `seconds` on the Timers port, for the agent's acknowledgement of
    the cancel; feed AckLearned."""

    seconds: float


@dataclass(frozen=True, slots=True)
class AckSettled:
    """Gate: the wait for the agent's acknowledgement is over. `record`: the attempt's end
    record again, with the engine's evidence (None: no acknowledgement, nothing to write);
    `revoke`: the acknowledgement ends the attempt's `fenced:` marker, so a retry runs now.
    The attempt's trace is kept here (its end trace with it)."""

    attempt: int
    record: Mapping[str, Any] | None
    revoke: bool
    failure_class: str
    end_trace: Mapping[str, Any]


Action: TypeAlias = (WatchSource | MarkPathLost | PutCancel | AwaitAck | AckSettled
                     | Admit | AwaitIntakeCommit | Decide | TakeLease | GiveBack | UndoAdmission
                     | UndoFence | Watch | StartTimer | StopTimers | MarkSlow | RevokeEarly
                     | CloseAttempt | MarkTimedOut | KeepTrace | Overloaded | RetryEnded
                     | ContinueRequest | Refuse | PassHeaders | HoldChunk | PassChunk
                     | Fence | Release | FailAttempt | DropChunk | Send
                     | AwaitCause | EndAttempt | Finish | OpenIntake
                     | RegisterIntake | AnswerBody | AwaitIntake | Accepted | RequestEnded
                     | IntakeFailed | TakeOver | UnreadableHandOff | PassAside | WriteProgress
                     | AnswerHeaders | PassRequest | LookUpStatus | AnswerStatus
                     | StartToolCall | LoseLease | ReadBody | PassBody | StopWatching
                     | CloseIntake | AwaitLateIntake | CloseTool)


class State(StrEnum):
    # gate (one upstream attempt)
    GATE_NEW = "gate_new"
    GATE_AWAITING_INTAKE = "gate_awaiting_intake"  # the request's intake not yet committed
    GATE_DECIDING = "gate_deciding"  # core.admission's verdict asked
    GATE_ADMITTING = "gate_admitting"  # the admission transaction (or the lease) in flight
    GATE_FORWARDED = "gate_forwarded"
    GATE_HOLDING = "gate_holding"
    GATE_FENCING = "gate_fencing"
    GATE_RELEASED = "gate_released"
    GATE_PASSTHROUGH = "gate_passthrough"
    GATE_FAILED = "gate_failed"
    GATE_REVOKING = "gate_revoking"  # over before release: the early revoke in flight
    GATE_AWAITING_WORD = "gate_awaiting_word"  # over: waiting for Envoy's access-log word
    GATE_AWAITING_ACK = "gate_awaiting_ack"  # over: waiting for the agent's cancel ack
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
