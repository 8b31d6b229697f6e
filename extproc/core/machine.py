"""The machinery every role's state machine shares (core.gate, core.guard).

Sans-IO in the manner of h11: adapters feed events in and carry out the actions that come
back; nothing here touches a socket, a clock or etcd. Each role's machine is driven by its
own transition table (`Machine.TABLE`), keyed by (state, event type): a pair missing from
the table is a protocol violation and raises, so an unexpected message from Envoy can never
be silently mis-handled. Every event consumed is appended to `trace`; re-feeding a trace
into a fresh machine must reproduce its `decisions` (core.replay; the tests check it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, NamedTuple, TypeAlias

from .events import (
    Action,
    AdmissionDecided,
    Event,
    Fenced,
    FenceDecided,
    IntakeCommitted,
    LeaseLost,
    RequestBody,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    ResponseBody,
    ResponseHeaders,
    Role,
    State,
)
from .sse import SseDecoder
from .usage import UsageMode


class ProtocolViolation(RuntimeError):
    """An event arrived that the table has no transition for."""


class Transition(NamedTuple):
    fn: Callable[[Any, Any], list[Action]]
    next: frozenset[State]  # every state the handler may leave the machine in


# A role's rows: (state, event type) -> the handler and the states it may lead to.
Table: TypeAlias = dict[tuple[State, type], Transition]


def T(fn: Callable[[Any, Any], list[Action]], *to: State) -> Transition:
    return Transition(fn, frozenset(to))


def stay(fn: Callable[[Any, Any], list[Action]], states: tuple[State, ...],
         ev: type) -> Table:
    """Rows where `ev` leaves each of `states` as it was."""
    return {(st, ev): T(fn, st) for st in states}


# Memory of one recorded event besides its body data: the record's dict and string, its
# decision string, two list slots (measured with tracemalloc on CPython 3.11: ~330 bytes).
TRACE_RECORD_COST = 320


# Records of events that repeat across requests (no request-specific data in them) are one
# shared, never mutated dict each: an open stream holds references, not copies.
_SHARED_RECORD_TYPES = frozenset({ResponseHeaders, FenceDecided, Fenced, LeaseLost,
                                  RequestHeadersSeen, RequestOpened, RequestBody})
_SHARED_RECORDS: dict[Event, dict[str, Any]] = {}


def chunk_record(data: bytes, end_of_stream: bool, lease_expired: bool) -> dict[str, Any]:
    """A ResponseBody's record (the hot path: one per body message; a fast path records
    its chunks with it too, without building the event)."""
    if lease_expired:
        return {"type": "ResponseBody", "data": data.decode("latin-1"),
                "end_of_stream": end_of_stream, "lease_expired": True}
    return {"type": "ResponseBody", "data": data.decode("latin-1"),
            "end_of_stream": end_of_stream}


def _event_record(ev: Event) -> dict[str, Any]:
    if type(ev) is ResponseBody:
        return chunk_record(ev.data, ev.end_of_stream, ev.lease_expired)
    if type(ev) in _SHARED_RECORD_TYPES and not (
            (isinstance(ev, ResponseHeaders) and (ev.handoff or ev.model_revision))
            or (isinstance(ev, RequestHeadersSeen) and ev.error is not None)):
        # (A hand-off, a model revision or a refusal is per request: such are not shared.)
        rec = _SHARED_RECORDS.get(ev)
        if rec is None:
            rec = _build_record(ev)
            if len(_SHARED_RECORDS) < 4096:  # a handful in practice; bounded regardless
                _SHARED_RECORDS[ev] = rec
        return rec
    return _build_record(ev)


def _build_record(ev: Event) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(ev).__name__}
    if isinstance(ev, (IntakeCommitted, AdmissionDecided)):  # a tuple: a union checks slower
        # An error is kept as the body the client got, and its status.
        _fields_into(d, ev)
        d["error"] = ev.error.body() if ev.error else None
        d["http_status"] = ev.error.http_status if ev.error else None
    elif isinstance(ev, RequestHeadersSeen):
        d.update(kind=ev.kind, family=ev.family,
                 error=ev.error.body() if ev.error else None,
                 http_status=ev.error.http_status if ev.error else None,
                 end_of_stream=ev.end_of_stream)
    elif isinstance(ev, RequestBodySeen):
        d.update(error=ev.error.body() if ev.error else None,
                 http_status=ev.error.http_status if ev.error else None,
                 usage=_USAGE_TEXT[ev.usage], keyed=ev.keyed)
    elif isinstance(ev, RequestOpened):
        d.update(accepted=ev.accepted, error=ev.error.body() if ev.error else None,
                 http_status=ev.error.http_status if ev.error else None)
    else:
        _fields_into(d, ev)
    return d


# A usage mode's text as the record writes it (`str(mode)`), one string per mode shared by
# every record instead of a copy per accepted body.
_USAGE_TEXT: dict[UsageMode, str] = {m: str(m) for m in UsageMode}

_PLAIN = frozenset({str, int, float, bool, type(None)})
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _fields_into(d: dict[str, Any], ev: Event) -> None:
    """`dataclasses.asdict(ev)` into `d`, its bytes as latin-1 text, without asdict's
    generic walk (a deep copy of every value: a tenth of a request start's instructions):
    plain values are taken as they are, a dataclass value is asdict's, and an event with
    any other value (a list, a dict, an enum) takes asdict's walk whole."""
    for n in _names(ev):
        v = getattr(ev, n)
        t = type(v)
        if t in _PLAIN:
            d[n] = v
        elif t is bytes:
            d[n] = v.decode("latin-1")
        elif is_dataclass(v):
            d[n] = _nested(v)
        else:
            for k, w in asdict(ev).items():
                d[k] = w.decode("latin-1") if isinstance(w, bytes) else w
            return


def _names(obj: Any) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return names


def _nested(v: Any) -> dict[str, Any]:
    """asdict(v) of a dataclass value: its plain fields as they are, else asdict's walk."""
    out: dict[str, Any] = {}
    for n in _names(v):
        w = getattr(v, n)
        if type(w) not in _PLAIN:
            return asdict(v)
        out[n] = w
    return out


# (state, action types...) -> the decision `handle` records for it.
_DECISIONS: dict[tuple[Any, ...], str] = {}


@dataclass(slots=True)
class Machine:
    """What every role's machine has: its state, its trace and its decisions."""

    # The role's rows; each role's class sets its own.
    TABLE: ClassVar[Table] = {}

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
        t = self.TABLE.get((self.state, type(ev)))
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
            # Interned: a few dozen distinct decisions, shared by every open stream; each
            # one written once (formatting a StrEnum member goes through Enum.__format__).
            types = [type(a) for a in actions]
            key = (self.state, *types)
            d = _DECISIONS.get(key)
            if d is None:
                d = sys.intern(f"{self.state}:" + ",".join([a.__name__ for a in types]))
                if len(_DECISIONS) < 4096:  # a few dozen in practice; bounded regardless
                    _DECISIONS[key] = d
            self.decisions.append(d)
        if self.state not in t.next:
            # The table declares every arrow; a handler that leaves by another is a bug.
            raise ProtocolViolation(
                f"{self.role}: {before} on {type(ev).__name__} went to {self.state}, "
                f"the table allows {sorted(t.next)}")
        return actions


def decided(state: State, actions: tuple[type, ...]) -> str:
    """The decision `handle` records for a transition that leaves the machine in `state`
    having answered with actions of these types (a fast path records it the same)."""
    return sys.intern(f"{state}:" + ",".join([a.__name__ for a in actions]))


def counting_decoder() -> SseDecoder:
    """The machines count and forward events, so runs of token events may come merged."""
    return SseDecoder(merge_content=True)



def arrows(role: str) -> list[str]:
    """The role's life as its table draws it: every transition that moves the machine,
    `state --Event--> next | next`, in table order (docs/architecture.md shows exactly
    these lines; a test keeps them equal)."""
    from .gate import GateMachine
    from .guard import GuardMachine

    table = {"gate": GateMachine.TABLE, "guard": GuardMachine.TABLE}[role]
    out = []
    for (state, ev), t in table.items():
        moves = sorted(str(n) for n in t.next if n is not state)
        if not moves:
            continue
        stays = " (or stays)" if state in t.next else ""
        out.append(f"{state} --{ev.__name__}--> {' | '.join(moves)}{stays}")
    return out
