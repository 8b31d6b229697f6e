"""Event traces: what a machine consumed, kept so a rare failure can be replayed.

A trace holds the machine's parameters, the ordered events it consumed, the decisions it
took and a summary of where it ended. `replay` re-feeds the events into a fresh machine and
reports the first place where the decisions or the summary diverge: a changed core, or a
tampered trace, shows up there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .admission import Admitted
from .errors import ErrorCode, GatewayError
from .events import (
    AckLearned,
    AdmissionDecided,
    AdmitDecided,
    CauseLearned,
    Event,
    Fenced,
    FenceDecided,
    IntakeCommitted,
    LeaseLost,
    LiveChanged,
    NotConfirmed,
    ProgressWritten,
    RecordWritten,
    RequestBody,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Revoked,
    SourceSent,
    State,
    StoreDown,
    StreamClosed,
    TimerFired,
    TimerKind,
)
from .gate import GateMachine, GateParams
from .guard import GuardMachine
from .handoff import TraceSnapshot
from .machine import ProtocolViolation
from .records import replay_end
from .usage import UsageMode

# 2: the gate's trace holds its whole life, waits included (its admission, timers, end);
# a format-1 gate trace was recorded by a core that decided those outside the machine.
# 3: the guard's request phase answers its headers by rows (AnswerHeaders, ...), and the
# loss of its released attempt's lease is a row's LoseLease (a chunk says when the lease ran
# out); a format-2 guard trace is compared without those actions, which it did not record.
# 4: the sessions' last policy is rows: the gate's end marks a first delta that never came
# against its replica (MarkTimedOut) and keeps its trace (KeepTrace), the guard's stream end
# ends the request for the retry budget (RequestEnded), and a chunk with nothing to forward
# is no Send at all; a hand-off that cannot be read is UnreadableHandOff, not TakeOver(None).
# An older trace is compared without those three actions, with its TakeOver of nothing as
# UnreadableHandOff, and one Send it recorded where the rows now decide none is taken as that
# empty chunk; a Finish it recorded last in its batch comes first now (the session started
# its write before the batch's bytes, now the rows' order says so).
# 5: the stream's close is rows: every close stops what feeds the stream first (StopTimers,
# StopWatching), the guard's closes its intake (CloseIntake; AwaitLateIntake when it is in
# flight) and its tool route (CloseTool); the session did these before feeding the close.
# An older trace is compared without those four actions, and a guard's close without its
# StopTimers (it now opens every close; its end put it elsewhere, or nowhere, before).
# 6: the guard's CHECKPOINT tick that finds nothing new to write arms no other; the next
# content event arms it (decision 0053). An older guard trace is replayed by a machine that
# ticks on as its core did (`GuardMachine.idle_ticks`), so its decisions compare as they are.
# Also from 6 on, Envoy's own 5xx reply to a request whose key-less intake failed is answered
# with that intake's error (PassHeaders as JSON, its body replaced; decision 0056): an older
# trace that recorded it passed aside replays as a difference (the core now decides
# otherwise; none of tests/core/traces has one).
FORMAT = 6
# Actions a guard's rows took from format 3 on, absent from the decisions of older traces.
_GUARD_FORMAT_3 = frozenset({"AnswerHeaders", "PassRequest", "LookUpStatus", "StartToolCall",
                             "LoseLease"})
# Actions rows took from format 4 on, absent from the decisions of older traces, and the
# one an older trace recorded under another name (a TakeOver of nothing).
_FORMAT_4 = frozenset({"MarkTimedOut", "KeepTrace", "RequestEnded"})
_RENAMED_4 = {"UnreadableHandOff": "TakeOver"}
# Actions the close's rows took from format 5 on, absent from the decisions of older traces.
_FORMAT_5 = frozenset({"StopWatching", "CloseIntake", "AwaitLateIntake", "CloseTool"})


def _same(got: str, want: str | None, fmt: int, guard: bool, closed: bool = False) -> bool:
    """Whether a replayed decision is the recorded one, as a trace of format `fmt` said it
    (`closed`: the decision on the stream's close)."""
    if got == want or want is None or fmt >= FORMAT:
        return got == want
    old4 = fmt < 4
    drop = (_FORMAT_5 | (_FORMAT_4 if old4 else frozenset())
            | (_GUARD_FORMAT_3 if guard and fmt < 3 else frozenset()))
    state, _, acts = got.partition(":")
    w_state, _, w_acts = want.partition(":")
    mine = [_RENAMED_4.get(a, a) if old4 else a for a in acts.split(",") if a and a not in drop]
    theirs = [a for a in w_acts.split(",") if a]
    if guard and closed:
        mine = [a for a in mine if a != "StopTimers"]
        theirs = [a for a in theirs if a != "StopTimers"]
    if not old4:
        return state == w_state and mine == theirs
    if guard and "Send" not in mine and theirs.count("Send") == 1:
        theirs.remove("Send")  # an empty chunk's: written as nothing then too
    if guard and mine.count("Finish") == theirs.count("Finish") == 1:
        # Before its batch's bytes now, after them then: compared where it stands.
        theirs.remove("Finish")
        theirs.insert(mine.index("Finish"), "Finish")
    return state == w_state and mine == theirs


def event_from_record(d: Mapping[str, Any]) -> Event:
    t = d.get("type")
    if t == "RequestStarted":
        acc = d.get("accepted_at")
        return RequestStarted(
            int(d["attempt"]), str(d.get("family", "chat")), str(d.get("attempt_id", "")),
            int(d.get("attempt_offset", 0)), bool(d.get("preadmitted", False)),
            _opt(d.get("first_admitted")), _opt(d.get("replica")),
            _opt(d.get("want_fingerprint")), int(d.get("prompt_tokens", 0)),
            None if acc is None else float(acc), float(d.get("mono", 0.0)),
            float(d.get("wall", 0.0)))
    if t == "IntakeCommitted":
        return IntakeCommitted(_error(d, "journal_unavailable"), int(d.get("reached_count", 0)),
                               _opt(d.get("replica_fingerprint")),
                               bool(d.get("pool_enabled", False)), float(d.get("wall", 0.0)),
                               int(d.get("agent", 0)))
    if t == "AdmissionDecided":
        adm = d.get("admitted")
        return AdmissionDecided(
            Admitted(bool(adm["counts_as_retry"]), float(adm["fence_wait_s"]),
                     float(adm["deadline_s"]), bool(adm["final"]))
            if isinstance(adm, Mapping) else None, _error(d, "attempt_not_admitted"))
    if t == "AdmitDecided":
        return AdmitDecided(bool(d["admitted"]), str(d.get("reason", "")),
                            float(d.get("waited_s", 0.0)), float(d.get("mono", 0.0)),
                            float(d.get("wall", 0.0)))
    if t == "StoreDown":
        return StoreDown(str(d.get("what", "")), float(d.get("wall", 0.0)))
    if t == "NotConfirmed":
        return NotConfirmed(str(d.get("error", "")), float(d.get("sent_mono", 0.0)),
                            float(d.get("mono", 0.0)), float(d.get("wall", 0.0)))
    if t == "LiveChanged":
        return LiveChanged(_opt(d.get("value")))
    if t == "TimerFired":
        return TimerFired(TimerKind(str(d["kind"])), float(d.get("mono", 0.0)),
                          float(d.get("wall", 0.0)))
    if t == "Revoked":
        return Revoked(bool(d["confirmed"]))
    if t == "ResponseHeaders":
        return ResponseHeaders(int(d["status"]), str(d["content_type"]),
                               bool(d.get("end_of_stream", False)),
                               bool(d.get("envoy_reply", False)), bool(d.get("ours", False)),
                               d.get("handoff"), _opt(d.get("model_revision")),
                               _opt(d.get("retry_after")))
    if t == "ResponseBody":
        return ResponseBody(str(d["data"]).encode("latin-1"), bool(d["end_of_stream"]),
                            bool(d.get("lease_expired", False)))
    if t == "FenceDecided":
        return FenceDecided(bool(d["committed"]))
    if t == "LeaseLost":
        return LeaseLost()
    if t == "RequestHeadersSeen":
        return RequestHeadersSeen(str(d["kind"]), str(d.get("family", "chat")),
                                  _error(d, "invalid_header"),
                                  bool(d.get("end_of_stream", False)))
    if t == "RequestBody":
        return RequestBody()
    if t == "RequestBodySeen":
        body = d.get("error")
        if not isinstance(body, Mapping):
            return RequestBodySeen(None, UsageMode(str(d.get("usage", "off"))),
                                   bool(d.get("keyed", False)))
        return RequestBodySeen(GatewayError.from_body(
            body, int(d.get("http_status") or 400), ErrorCode.INVALID_REQUEST_BODY))
    if t == "RequestOpened":
        return RequestOpened(bool(d["accepted"]), _error(d, "journal_unavailable"))
    if t == "StallTimeout":  # traces kept before the stall watchdog was a timer row
        return TimerFired(TimerKind.STALL)
    if t == "ProgressWritten":
        return ProgressWritten()
    if t == "RecordWritten":
        return RecordWritten(bool(d["landed"]))
    if t == "Fenced":
        return Fenced(str(d.get("why", "")))
    if t == "StreamClosed":
        return StreamClosed(float(d.get("mono", 0.0)), float(d.get("wall", 0.0)))
    if t == "CauseLearned":
        sent = d.get("body_bytes")  # absent in traces kept before decision 0025
        return CauseLearned(str(d["cause"]), None if sent is None else int(sent),
                            bool(d.get("heard", True)), float(d.get("wall", 0.0)))
    if t == "SourceSent":
        return SourceSent(float(d.get("at", 0.0)), float(d.get("mono", 0.0)))
    if t == "AckLearned":
        ev = d.get("evidence")
        return AckLearned(bool(d["heard"]), dict(ev) if isinstance(ev, Mapping) else None,
                          float(d.get("wall", 0.0)))
    raise ValueError(f"unknown event type in trace: {t!r}")


def _opt(v: Any) -> str | None:
    return None if v is None else str(v)


def _error(d: Mapping[str, Any], default: str) -> GatewayError | None:
    body = d.get("error")
    if not isinstance(body, Mapping):
        return None
    return GatewayError.from_body(body, int(d.get("http_status") or 503), ErrorCode(default))


def summary(m: GateMachine | GuardMachine) -> dict[str, Any]:
    out: dict[str, Any] = {"state": str(m.state)}
    if isinstance(m, GuardMachine):
        out["delivered"] = m.delivered
        if m.finished is not None:
            out["outcome"] = str(m.finished.outcome)
            out["cause"] = m.finished.cause
    else:
        out["timed_out"] = m.timed_out
        out["ended"] = m.ended
        if m.settled is not None:
            out["end"] = m.settled  # how its end was settled: class, fence, Envoy's cause
    return out


# The process's gate parameters as a trace keeps them: one dict, shared by every snapshot
# and never changed (asdict's deep copy per hand-off was a tenth of the gate's release).
_last_params: tuple[GateParams, Mapping[str, Any]] | None = None


def _gate_params(p: GateParams) -> Mapping[str, Any]:
    global _last_params
    if _last_params is None or _last_params[0] is not p:
        _last_params = (p, asdict(p))
    return _last_params[1]


def snapshot(m: GateMachine | GuardMachine) -> TraceSnapshot:
    """The machine's trace as it stands now, frozen (the hand-off carries the gate's)."""
    params: dict[str, Any] = {"max_buffer": m.max_buffer}
    if isinstance(m, GateMachine):
        params["gate"] = _gate_params(m.params)
    if m.initial_state is not None:
        params["initial_state"] = str(m.initial_state)
    if isinstance(m, GuardMachine):
        params["stall_after_first_delta_s"] = m.stall_after_first_delta_s
        params["progress_every"] = m.progress_every
    return TraceSnapshot(role=m.role, request_id=m.request_id, params=params,
                         events=tuple(m.trace), decisions=tuple(m.decisions),
                         summary=summary(m))


def record(m: GateMachine | GuardMachine | TraceSnapshot, meta: Mapping[str, Any],
           max_bytes: int) -> dict[str, Any]:
    """The stored trace, cut to `max_bytes` of events (a prefix replays as a prefix)."""
    snap = m if isinstance(m, TraceSnapshot) else snapshot(m)
    events: list[Mapping[str, Any]] = []
    size = 0
    for ev in snap.events:
        n = len(json.dumps(ev))
        if size + n > max_bytes:
            break
        events.append(ev)
        size += n
    truncated = len(events) < len(snap.events)
    return {"format": FORMAT, "role": snap.role, "request_id": snap.request_id,
            "params": dict(snap.params), "meta": dict(meta), "events": events,
            "decisions": list(snap.decisions[: len(events)]),
            "summary": None if truncated else dict(snap.summary), "truncated": truncated}


@dataclass(frozen=True, slots=True)
class ReplayResult:
    ok: bool
    steps: int
    divergence: str | None = None


def replay(trace: Mapping[str, Any]) -> ReplayResult:
    rid = str(trace["request_id"])
    params = trace.get("params") or {}
    m: GateMachine | GuardMachine
    if trace["role"] == "gate":
        if int(trace.get("format", 1)) < 2:
            return ReplayResult(False, 0, "a format-1 gate trace: recorded by an older core, "
                                "which decided the attempt's waits outside the machine")
        gp = params.get("gate")
        m = GateMachine.new(rid, int(params.get("max_buffer", 4 << 20)),
                            GateParams(**gp) if isinstance(gp, Mapping) else None)
    elif trace["role"] == "guard":
        m = GuardMachine.new(rid, float(params.get("stall_after_first_delta_s", 15.0)),
                             int(params.get("max_buffer", 4 << 20)),
                             at_request=params.get("initial_state") == str(State.GUARD_NEW),
                             progress_every=float(params.get("progress_every", 0.0)))
        m.idle_ticks = int(trace.get("format", 1)) < 6
    else:
        return ReplayResult(False, 0, f"unknown role {trace['role']!r}")
    recorded = list(trace.get("decisions") or [])
    fmt = int(trace.get("format", 1))
    for i, d in enumerate(trace.get("events") or []):
        try:
            m.handle(event_from_record(d))
        except (ProtocolViolation, ValueError, KeyError) as e:
            return ReplayResult(False, i, f"event {i} ({d.get('type')}) cannot be replayed: {e}")
        want = recorded[i] if i < len(recorded) else None
        got = m.decisions[-1]
        if not _same(got, want, fmt, m.role == "guard", d.get("type") == "StreamClosed"):
            return ReplayResult(False, i + 1, f"event {i} ({d.get('type')}): recorded "
                                f"{want!r}, replay decided {got!r}")
    if len(recorded) != len(m.decisions):
        return ReplayResult(False, len(m.decisions),
                            f"{len(recorded)} decisions recorded, {len(m.decisions)} replayed")
    want_summary = trace.get("summary")
    if want_summary is not None and want_summary != summary(m):
        return ReplayResult(False, len(m.decisions),
                            f"final state differs: recorded {want_summary}, "
                            f"replay {summary(m)}")
    end = (trace.get("meta") or {}).get("end")
    if isinstance(end, Mapping):
        # The attempt's end was decided outside the machine (core.records): decide it again.
        try:
            differs = replay_end(end)
        except (TypeError, KeyError, ValueError) as e:
            return ReplayResult(False, len(m.decisions), f"end plan cannot be replayed: {e}")
        if differs is not None:
            return ReplayResult(False, len(m.decisions), differs)
    return ReplayResult(True, len(m.decisions))
