"""Event traces: what a machine consumed, kept so a rare failure can be replayed.

A trace holds the machine's parameters, the ordered events it consumed, the decisions it
took and a summary of where it ended. `replay` re-feeds the events into a fresh machine and
reports the first place where the decisions or the summary diverge: a changed core, or a
tampered trace, shows up there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ErrorCode, GatewayError
from .events import (
    AdmitDecided,
    CauseLearned,
    Event,
    Fenced,
    FenceDecided,
    FirstDeltaTimeout,
    LeaseLost,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    StallTimeout,
    State,
    StreamClosed,
)
from .gate import GateMachine
from .guard import GuardMachine
from .handoff import TraceSnapshot
from .machine import ProtocolViolation
from .records import replay_end
from .usage import UsageMode

FORMAT = 1


def event_from_record(d: Mapping[str, Any]) -> Event:
    t = d.get("type")
    if t == "RequestStarted":
        return RequestStarted(int(d["attempt"]), str(d.get("family", "chat")))
    if t == "AdmitDecided":
        err = None
        body = d.get("error")
        if isinstance(body, Mapping):
            e = body.get("error", {})
            err = GatewayError(ErrorCode(e.get("code", "attempt_not_admitted")),
                               str(e.get("message", "")), 503, request_id=e.get("request_id"))
        return AdmitDecided(bool(d["admitted"]), err)
    if t == "ResponseHeaders":
        return ResponseHeaders(int(d["status"]), str(d["content_type"]),
                               bool(d.get("end_of_stream", False)),
                               bool(d.get("envoy_reply", False)), bool(d.get("ours", False)),
                               d.get("handoff"))
    if t == "ResponseBody":
        return ResponseBody(str(d["data"]).encode("latin-1"), bool(d["end_of_stream"]))
    if t == "FenceDecided":
        return FenceDecided(bool(d["committed"]))
    if t == "FirstDeltaTimeout":
        return FirstDeltaTimeout(bool(d.get("final", False)), float(d.get("waited_s", 0.0)))
    if t == "LeaseLost":
        return LeaseLost()
    if t == "RequestHeadersSeen":
        return RequestHeadersSeen(str(d["kind"]), str(d.get("family", "chat")))
    if t == "RequestBodySeen":
        body = d.get("error")
        if not isinstance(body, Mapping):
            return RequestBodySeen(None, UsageMode(str(d.get("usage", "off"))),
                                   bool(d.get("keyed", False)))
        e = body.get("error", {})
        return RequestBodySeen(GatewayError(
            ErrorCode(e.get("code", "invalid_request_body")), str(e.get("message", "")),
            int(d.get("http_status") or 400), request_id=e.get("request_id")))
    if t == "RequestOpened":
        body = d.get("error")
        err = None
        if isinstance(body, Mapping):
            e = body.get("error", {})
            err = GatewayError(ErrorCode(e.get("code", "journal_unavailable")),
                               str(e.get("message", "")), int(d.get("http_status") or 503),
                               request_id=e.get("request_id"))
        return RequestOpened(bool(d["accepted"]), err)
    if t == "StallTimeout":
        return StallTimeout()
    if t == "Fenced":
        return Fenced()
    if t == "StreamClosed":
        return StreamClosed()
    if t == "CauseLearned":
        sent = d.get("body_bytes")  # absent in traces kept before decision 0025
        return CauseLearned(str(d["cause"]), None if sent is None else int(sent))
    raise ValueError(f"unknown event type in trace: {t!r}")


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
    return out


def snapshot(m: GateMachine | GuardMachine) -> TraceSnapshot:
    """The machine's trace as it stands now, frozen (the hand-off carries the gate's)."""
    params: dict[str, Any] = {"max_buffer": m.max_buffer}
    if m.initial_state is not None:
        params["initial_state"] = str(m.initial_state)
    if isinstance(m, GuardMachine):
        params["stall_after_first_delta_s"] = m.stall_after_first_delta_s
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
        m = GateMachine.new(rid, int(params.get("max_buffer", 4 << 20)))
    elif trace["role"] == "guard":
        m = GuardMachine.new(rid, float(params.get("stall_after_first_delta_s", 15.0)),
                             int(params.get("max_buffer", 4 << 20)),
                             at_request=params.get("initial_state") == str(State.GUARD_NEW))
    else:
        return ReplayResult(False, 0, f"unknown role {trace['role']!r}")
    recorded = list(trace.get("decisions") or [])
    for i, d in enumerate(trace.get("events") or []):
        try:
            m.handle(event_from_record(d))
        except (ProtocolViolation, ValueError, KeyError) as e:
            return ReplayResult(False, i, f"event {i} ({d.get('type')}) cannot be replayed: {e}")
        want = recorded[i] if i < len(recorded) else None
        if m.decisions[-1] != want:
            return ReplayResult(False, i + 1, f"event {i} ({d.get('type')}): recorded "
                                f"{want!r}, replay decided {m.decisions[-1]!r}")
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
