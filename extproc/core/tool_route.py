"""The tool route's life as a small machine of its own: one tool call, from its headers to
its recorded result.

Sans-IO like the request's machines: the executor (`adapters.tools`) feeds events in and
carries out the actions that come back; every wait is a row (an action out, an event in):
the credential read, the claim, the bounded wait for a call another request is running
(`StartTimer` -> `TimerFired` -> `ReadLedger` -> `LedgerRead`), the record. Times come in on
the events (the executor reads its injected clock), so a trace re-decides the same way.

    new --HeadersSeen--> checking (ReadCredential) | refused
    checking --CredentialRead--> claiming (Claim) | refused            (decision 0028)
    claiming --ClaimAnswered--> forwarding | replayed | refused | waiting
    waiting --TimerFired--> reading (ReadLedger) --LedgerRead--> waiting | replayed | refused
    forwarding --response end--> recording (Record) --Recorded--> recorded
    forwarding --StreamClosed--> unknown (Record of the unknown outcome)

The rules of the ledger itself (its entries, what a repeat gets) are `core.tools`; the
credential's compare is `core.credentials`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, TypeAlias

from .credentials import matches
from .errors import ErrorCode, GatewayError, tool_ledger_unavailable
from .headers import ATTEMPT_SECRET
from .tools import (
    Replay,
    ResultCapture,
    ToolCall,
    answer_for,
    done_entry,
    fenced_error,
    in_progress_error,
    parse_tool_call,
    running_entry,
    unauthorized_error,
    unknown_entry,
)

# The bounded wait for a running call: the first pause, and the longest one.
FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 0.2
# How long the caller's last chunk waits for its result's record before it goes anyway
# (the record then goes on in the background).
RECORD_BEFORE_END_S = 5.0
WAIT_TIMER = "tool_wait"

# --- events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeadersSeen:
    """The tool call's request headers."""

    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class CredentialRead:
    """The journal's digest of the attempt's credential (None: none) and its key's
    mod_revision; `wall`: the time it came (a claimed entry's start)."""

    stored: str | None
    revision: int
    wall: float


@dataclass(frozen=True, slots=True)
class ClaimAnswered:
    """The claim transaction's answer (`Ledger.claim`); `mono`: when it came."""

    claimed: bool
    existing: Mapping[str, Any] | None
    is_live: bool
    executor_alive: bool
    mono: float


@dataclass(frozen=True, slots=True)
class LedgerRead:
    """The ledger entry read again while waiting for a running call; `mono`: when."""

    entry: Mapping[str, Any] | None
    executor_alive: bool
    mono: float


@dataclass(frozen=True, slots=True)
class TimerFired:
    kind: str


@dataclass(frozen=True, slots=True)
class StoreDown:
    """The read or the transaction in flight got no answer from the store."""

    error: str


@dataclass(frozen=True, slots=True)
class RequestBodySeen:
    """The call's body (it goes to the tool server unchanged)."""


@dataclass(frozen=True, slots=True)
class ResponseHeadersSeen:
    headers: Mapping[str, str]
    end_of_stream: bool
    wall: float


@dataclass(frozen=True, slots=True)
class ResponseBodySeen:
    data: bytes
    end_of_stream: bool
    wall: float


@dataclass(frozen=True, slots=True)
class Recorded:
    """The record's answer: `ok` False when it did not land within its bound."""

    ok: bool


@dataclass(frozen=True, slots=True)
class StreamClosed:
    wall: float


Event: TypeAlias = (HeadersSeen | CredentialRead | ClaimAnswered | LedgerRead | TimerFired
                    | StoreDown | RequestBodySeen | ResponseHeadersSeen | ResponseBodySeen
                    | Recorded | StreamClosed)

# --- actions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadCredential:
    """Read the credential's digest; feed CredentialRead (or StoreDown)."""

    request_id: str
    attempt_id: str


@dataclass(frozen=True, slots=True)
class Claim:
    """Run the claim transaction; feed ClaimAnswered (or StoreDown)."""

    key: str
    request_id: str
    attempt_id: str
    entry: Mapping[str, Any]
    credential_rev: int


@dataclass(frozen=True, slots=True)
class UndoClaimLater:
    """A claim whose answer never came may still apply: take it back (in the background,
    retried until etcd answers), or it would block every later call of its key."""

    key: str
    entry: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Feed TimerFired(kind) after `seconds` on the executor's clock."""

    kind: str
    seconds: float


@dataclass(frozen=True, slots=True)
class ReadLedger:
    """Read the call's ledger entry again; feed LedgerRead (or StoreDown)."""

    key: str


@dataclass(frozen=True, slots=True)
class Forward:
    """Let the call go to the tool server, with these header changes."""

    set_headers: Mapping[str, str]
    remove: tuple[str, ...]


class Why(StrEnum):
    """Why the gateway answered a call itself (the executor's log line names it)."""

    BAD_REQUEST = "bad_request"
    NO_CREDENTIAL = "no_credential"
    UNAUTHORIZED = "unauthorized"
    UNAVAILABLE = "unavailable"
    FENCED = "fenced"
    REFUSED = "refused"  # a repeat of a call whose result cannot be given (core.tools)
    IN_PROGRESS = "in_progress"


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the caller with this error instead of the tool server."""

    error: GatewayError
    why: Why


@dataclass(frozen=True, slots=True)
class AnswerReplay:
    """Answer the caller with the recorded result."""

    replay: Replay


@dataclass(frozen=True, slots=True)
class PassResponseHeaders:
    remove: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PassBody:
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class ContinueRequestBody:
    pass


@dataclass(frozen=True, slots=True)
class Record:
    """Write this ledger entry, retried for at most `limit_s` (None: the executor's usual
    bound); feed Recorded."""

    key: str
    entry: Mapping[str, Any]
    what: str
    limit_s: float | None = None


@dataclass(frozen=True, slots=True)
class RecordLater:
    """Keep writing this entry in the background (the caller no longer waits for it)."""

    key: str
    entry: Mapping[str, Any]
    what: str


Action: TypeAlias = (ReadCredential | Claim | UndoClaimLater | StartTimer | ReadLedger | Forward
                     | Answer | AnswerReplay | PassResponseHeaders | PassBody
                     | ContinueRequestBody | Record | RecordLater)


class ProtocolViolation(RuntimeError):
    """An event arrived that the route's table has no row for."""


class RouteState(StrEnum):
    NEW = "tool_new"
    CHECKING = "tool_checking_credential"  # the credential's digest is being read
    CLAIMING = "tool_claiming"  # the credential matched; the claim is in flight
    WAITING = "tool_waiting"  # another call runs it: a pause before reading it again
    READING = "tool_reading"  # reading the running call's entry again
    REFUSED = "tool_refused"  # answered by the gateway with an error
    REPLAYED = "tool_replayed"  # answered with the recorded result
    FORWARDING = "tool_forwarding"  # claimed: the tool server runs it
    RECORDING = "tool_recording"  # its result is complete and being recorded
    RECORDED = "tool_recorded"
    UNKNOWN = "tool_unknown"  # it ended before its result was complete: recorded unknown
    CLOSED = "tool_closed"


S = RouteState


@dataclass(slots=True)
class ToolRoute:
    """One tool call on the tool listener (decisions 0028, 0029)."""

    prefix: str
    wait_s: float
    max_result_bytes: int
    state: RouteState = RouteState.NEW
    call: ToolCall | None = None
    cred_rev: int = 0
    entry: dict[str, Any] | None = None  # our running entry: set once claimed
    # The running call we wait for: its entry, whether its executor lives, our deadline.
    seen: Mapping[str, Any] | None = None
    executor_alive: bool = False
    deadline: float = 0.0
    pause: float = FIRST_PAUSE_S
    status: int = 0
    resp_headers: Mapping[str, str] = field(default_factory=dict)
    result: ResultCapture | None = None
    last_chunk: bytes | None = None  # the caller's last chunk, held until its record lands
    done: dict[str, Any] | None = None  # the recorded result's entry
    decisions: list[str] = field(default_factory=list)

    @property
    def request_id(self) -> str | None:
        return self.call.request_id if self.call else None

    @property
    def attempt_id(self) -> str | None:
        return self.call.attempt_id if self.call else None

    def handle(self, ev: Event) -> list[Action]:
        row = ROWS.get((self.state, type(ev)))
        if row is None:
            raise ProtocolViolation(f"tool route: no row from {self.state} on "
                                    f"{type(ev).__name__}")
        before = self.state
        actions = row.fn(self, ev)
        if self.state not in row.next:
            raise ProtocolViolation(f"tool route: {before} on {type(ev).__name__} went to "
                                    f"{self.state}, the table allows {sorted(row.next)}")
        self.decisions.append(f"{before}:" + ",".join(type(a).__name__ for a in actions))
        return actions

    # --- the rows' handlers

    def _headers(self, ev: HeadersSeen) -> list[Action]:
        call = parse_tool_call(ev.headers, self.prefix)
        if isinstance(call, GatewayError):
            self.state = S.REFUSED
            why = (Why.NO_CREDENTIAL if call.code is ErrorCode.TOOL_CALL_UNAUTHORIZED
                   else Why.BAD_REQUEST)
            return [Answer(call, why)]
        self.call = call
        self.state = S.CHECKING
        # The credential first, for every call (a first one, a repeat, a replay): nothing
        # of the ledger is read or claimed for a caller that is not the attempt's worker.
        return [ReadCredential(call.request_id, call.attempt_id)]

    def _credential(self, ev: CredentialRead) -> list[Action]:
        call = self.call
        assert call is not None
        if not matches(call.secret, ev.stored):
            self.state = S.REFUSED
            return [Answer(unauthorized_error(call), Why.UNAUTHORIZED)]
        self.cred_rev = ev.revision
        self.entry = running_entry(call, ev.wall)
        self.state = S.CLAIMING
        return [Claim(call.key, call.request_id, call.attempt_id, self.entry, ev.revision)]

    def _claimed(self, ev: ClaimAnswered) -> list[Action]:
        call = self.call
        assert call is not None and self.entry is not None
        if ev.claimed:
            self.state = S.FORWARDING
            self.result = ResultCapture(self.max_result_bytes)
            # The secret stops here: the tool server never sees it.
            return [Forward({"idempotency-key": call.key}, (ATTEMPT_SECRET,))]
        self.entry = None
        if not ev.is_live:
            self.state = S.REFUSED
            return [Answer(fenced_error(call), Why.FENCED)]
        assert ev.existing is not None
        self.seen, self.executor_alive = ev.existing, ev.executor_alive
        self.deadline = ev.mono + self.wait_s
        return self._answer_repeat(ev.mono)

    def _answer_repeat(self, now: float) -> list[Action]:
        call, seen = self.call, self.seen
        assert call is not None and seen is not None
        ans = answer_for(seen, call, self.executor_alive)
        if isinstance(ans, Replay):
            self.state = S.REPLAYED
            return [AnswerReplay(ans)]
        if isinstance(ans, GatewayError):
            self.state = S.REFUSED
            return [Answer(ans, Why.REFUSED)]
        # Another call is executing it right now: wait (bounded) for its result.
        if now + self.pause > self.deadline:
            self.state = S.REFUSED
            return [Answer(in_progress_error(call), Why.IN_PROGRESS)]
        self.state = S.WAITING
        return [StartTimer(WAIT_TIMER, self.pause)]

    def _timer(self, ev: TimerFired) -> list[Action]:
        assert self.call is not None
        self.pause = min(self.pause * 2, MAX_PAUSE_S)
        self.state = S.READING
        return [ReadLedger(self.call.key)]

    def _read(self, ev: LedgerRead) -> list[Action]:
        self.executor_alive = ev.executor_alive
        if ev.entry is not None:
            self.seen = ev.entry
        return self._answer_repeat(ev.mono)

    def _store_down(self, ev: StoreDown) -> list[Action]:
        claiming, entry, call = self.state is S.CLAIMING, self.entry, self.call
        self.state = S.REFUSED
        self.entry = None
        # Fail closed: no execution without a ledger record.
        out: list[Action] = [Answer(tool_ledger_unavailable(self.request_id), Why.UNAVAILABLE)]
        if claiming and entry is not None and call is not None:
            # The claim may still apply when etcd wakes.
            out.append(UndoClaimLater(call.key, entry))
        return out

    def _request_body(self, ev: RequestBodySeen) -> list[Action]:
        return [ContinueRequestBody()]

    def _response_headers(self, ev: ResponseHeadersSeen) -> list[Action]:
        self.status = int(ev.headers.get(":status", "0") or 0)
        self.resp_headers = ev.headers
        out: list[Action] = [PassResponseHeaders((ATTEMPT_SECRET,))]
        if ev.end_of_stream:
            out.append(self._record(ev.wall))
        return out

    def _response_body(self, ev: ResponseBodySeen) -> list[Action]:
        assert self.result is not None
        self.result.add(ev.data)
        if not ev.end_of_stream:
            return [PassBody(ev.data, False)]
        # Recorded before the caller sees the end of the result: a caller that got it and
        # retries finds it in the ledger.
        self.last_chunk = ev.data
        return [self._record(ev.wall)]

    def _record(self, wall: float) -> Record:
        assert self.call is not None and self.entry is not None and self.result is not None
        self.state = S.RECORDING
        self.done = done_entry(self.entry, self.status, self.resp_headers, self.result, wall)
        return Record(self.call.key, self.done, "record a tool result", RECORD_BEFORE_END_S)

    def _recorded(self, ev: Recorded) -> list[Action]:
        assert self.call is not None and self.done is not None
        self.state = S.RECORDED
        out: list[Action] = []
        if not ev.ok:
            # Keep trying in the background; the caller still gets the result it caused.
            out.append(RecordLater(self.call.key, self.done, "record a tool result"))
        if self.last_chunk is not None:
            out.append(PassBody(self.last_chunk, True))
            self.last_chunk = None
        return out

    def _pass_headers(self, ev: ResponseHeadersSeen) -> list[Action]:
        return [PassResponseHeaders((ATTEMPT_SECRET,))]

    def _pass_body(self, ev: ResponseBodySeen) -> list[Action]:
        return [PassBody(ev.data, ev.end_of_stream)]

    def _closed(self, ev: StreamClosed) -> list[Action]:
        was, entry, call = self.state, self.entry, self.call
        self.state = S.CLOSED
        if was is S.CLAIMING and entry is not None and call is not None:
            # Its answer never came (the stream went first): nothing was forwarded, and a
            # claim that applied would block its key; take it back.
            return [UndoClaimLater(call.key, entry)]
        if was is S.FORWARDING and entry is not None and call is not None:
            # We executed and never saw the whole result: say so.
            self.state = S.UNKNOWN
            return [Record(call.key, unknown_entry(
                entry, "the tool call ended before its result was complete", ev.wall),
                "record an unknown tool outcome")]
        if was is S.RECORDING and call is not None and self.done is not None:
            # The result is whole; its record (cut short with the stream) goes on.
            return [RecordLater(call.key, self.done, "record a tool result")]
        return []

    def _ignore(self, ev: Any) -> list[Action]:
        return []


class Row(NamedTuple):
    fn: Callable[[ToolRoute, Any], list[Action]]
    next: frozenset[RouteState]


def _r(fn: Callable[[ToolRoute, Any], list[Action]], *to: RouteState) -> Row:
    return Row(fn, frozenset(to))


_ANSWERED = (S.REFUSED, S.REPLAYED)
_LIVE = (S.NEW, S.CHECKING, S.CLAIMING, S.WAITING, S.READING, S.REFUSED, S.REPLAYED,
         S.FORWARDING, S.RECORDING, S.RECORDED)
_STORE_ANSWERS = (CredentialRead, ClaimAnswered, LedgerRead, TimerFired, StoreDown, Recorded)

# (state, event) -> the handler and the states it may lead to. Read down to draw the route.
ROWS: dict[tuple[RouteState, type], Row] = {
    (S.NEW, HeadersSeen): _r(ToolRoute._headers, S.CHECKING, S.REFUSED),
    (S.CHECKING, CredentialRead): _r(ToolRoute._credential, S.CLAIMING, S.REFUSED),
    (S.CHECKING, StoreDown): _r(ToolRoute._store_down, S.REFUSED),
    (S.CLAIMING, ClaimAnswered): _r(ToolRoute._claimed, S.FORWARDING, S.REFUSED, S.REPLAYED,
                                    S.WAITING),
    (S.CLAIMING, StoreDown): _r(ToolRoute._store_down, S.REFUSED),
    (S.WAITING, TimerFired): _r(ToolRoute._timer, S.READING),
    (S.READING, LedgerRead): _r(ToolRoute._read, S.WAITING, S.REFUSED, S.REPLAYED),
    (S.READING, StoreDown): _r(ToolRoute._store_down, S.REFUSED),
    (S.FORWARDING, ResponseHeadersSeen): _r(ToolRoute._response_headers, S.FORWARDING,
                                            S.RECORDING),
    (S.FORWARDING, ResponseBodySeen): _r(ToolRoute._response_body, S.FORWARDING, S.RECORDING),
    (S.RECORDING, Recorded): _r(ToolRoute._recorded, S.RECORDED),
    # Answered by the gateway: Envoy sends nothing more in practice; if it did, it passes.
    **{(st, ResponseHeadersSeen): _r(ToolRoute._pass_headers, st)
       for st in (*_ANSWERED, S.RECORDED)},
    **{(st, ResponseBodySeen): _r(ToolRoute._pass_body, st) for st in (*_ANSWERED, S.RECORDED)},
    **{(st, RequestBodySeen): _r(ToolRoute._request_body, st) for st in _LIVE},
    **{(st, StreamClosed): _r(ToolRoute._closed, S.CLOSED, S.UNKNOWN)
       for st in _LIVE},
    # After the end: a second close, the unknown outcome's record, and store answers or
    # timers that come after the stream went (nothing waits for them any more).
    **{(st, StreamClosed): _r(ToolRoute._ignore, st) for st in (S.CLOSED, S.UNKNOWN)},
    **{(st, ev): _r(ToolRoute._ignore, st) for st in (S.CLOSED, S.UNKNOWN)
       for ev in _STORE_ANSWERS},
}


def arrows() -> list[str]:
    """The route's life as its rows draw it: every row that moves it, in table order."""
    out = []
    for (state, ev), row in ROWS.items():
        moves = sorted(str(n) for n in row.next if n is not state)
        if not moves:
            continue
        stays = " (or stays)" if state in row.next else ""
        out.append(f"{state} --{ev.__name__}--> {' | '.join(moves)}{stays}")
    return out
