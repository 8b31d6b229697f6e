"""core/replay: a recorded trace is decided again by a fresh machine, and any place where
the decisions or the final state differ is reported, at the event where they part; a trace
it cannot read (an unknown role, a format-1 gate trace, an unknown event) is refused, never
passed. Every traced event reads back from its record as the event that was fed."""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path
from typing import Any

import pytest

from extproc.core import events as E
from extproc.core import replay as R
from extproc.core.admission import Admitted
from extproc.core.errors import journal_unavailable
from extproc.core.guard import GuardMachine
from extproc.core.machine import _build_record
from extproc.core.usage import UsageMode

TRACES = Path(__file__).parent / "traces"


def _old(name: str) -> dict[str, Any]:
    d: dict[str, Any] = json.loads((TRACES / name).read_text())
    return d


def _current_guard_trace() -> dict[str, Any]:
    """The recorded guard stream, fed to today's machine and recorded in today's format."""
    old = _old("format3_guard_stream.json")
    p = old["params"]
    m = GuardMachine.new(old["request_id"], p["stall_after_first_delta_s"], p["max_buffer"],
                         at_request=True, progress_every=p["progress_every"])
    for d in old["events"]:
        m.handle(R.event_from_record(d))
    return R.record(m, {}, 1 << 20)


@pytest.mark.parametrize("name", sorted(p.name for p in TRACES.glob("*.json")))
def test_traces_an_older_core_recorded_replay(name: str) -> None:
    res = R.replay(_old(name))
    assert res.ok, res.divergence
    assert res.steps == len(_old(name)["events"])


def test_a_trace_recorded_now_replays_with_every_decision() -> None:
    tr = _current_guard_trace()
    assert tr["format"] == R.FORMAT and not tr["truncated"]
    res = R.replay(tr)
    assert (res.ok, res.steps) == (True, len(tr["events"]))


def test_a_changed_decision_is_found_at_its_event() -> None:
    tr = _current_guard_trace()
    bad = copy.deepcopy(tr)
    bad["decisions"][3] = "guard_closed:Finish"
    res = R.replay(bad)
    assert not res.ok and res.steps == 4
    assert res.divergence is not None and res.divergence.startswith("event 3 (")


def test_a_changed_final_state_or_a_missing_decision_is_found() -> None:
    tr = _current_guard_trace()
    bad = copy.deepcopy(tr)
    bad["summary"]["delivered"] += 1
    res = R.replay(bad)
    assert not res.ok and "final state differs" in str(res.divergence)
    short = copy.deepcopy(tr)
    short["events"].append(short["events"][-1])  # one event more than decisions recorded
    assert not R.replay(short).ok


def test_a_trace_it_cannot_read_is_refused() -> None:
    tr = _current_guard_trace()
    assert R.replay({**tr, "role": "router"}).divergence == "unknown role 'router'"
    gate = _old("format3_gate_timed_out.json")
    res = R.replay({**gate, "format": 1})
    assert not res.ok and "format-1" in str(res.divergence)
    unknown = copy.deepcopy(tr)
    unknown["events"][1] = {"type": "Teleported"}
    res = R.replay(unknown)
    assert not res.ok and res.steps == 1 and "Teleported" in str(res.divergence)


def test_a_cut_trace_keeps_a_prefix_that_replays_as_a_prefix() -> None:
    full = _current_guard_trace()
    size = sum(len(json.dumps(e)) for e in full["events"][:3])
    snap = R.snapshot(_machine_after(full))
    cut = R.record(snap, {"why": "budget"}, size)
    assert cut["truncated"] and cut["summary"] is None
    assert cut["events"] == full["events"][:3] and len(cut["decisions"]) == 3
    assert cut["meta"] == {"why": "budget"}
    assert R.replay(cut).ok  # no summary to compare: the prefix's decisions are


def _machine_after(tr: dict[str, Any]) -> GuardMachine:
    p = tr["params"]
    m = GuardMachine.new(tr["request_id"], p["stall_after_first_delta_s"], p["max_buffer"],
                         at_request=True, progress_every=p["progress_every"])
    for d in tr["events"]:
        m.handle(R.event_from_record(d))
    return m


# Every traced event with its fields off their defaults. StatusRead is fed after tracing was
# turned off for a status lookup (events.StatusRead): it is never in a trace.
EXAMPLES: list[E.Event] = [
    E.RequestStarted(2, "responses", "att_2", 3, True, "att_1", "127.0.0.1:1", "fp", 77,
                     1.5, 2.5, 3.5),
    E.IntakeCommitted(None, 2, "fp", True, 4.5, 1),
    E.AdmissionDecided(Admitted(True, 1.5, 30.0, False), None),
    E.AdmitDecided(False, "fenced", 0.25, 1.0, 2.0),
    E.StoreDown("lease", 9.0),
    E.NotConfirmed("deadline", 1.0, 2.0, 3.0),
    E.LiveChanged("att_9"),
    E.TimerFired(E.TimerKind.STALL, 1.0, 2.0),
    E.Revoked(True),
    E.ResponseHeaders(503, "text/event-stream", True, True, True, '{"a":1}', "rev", "2"),
    E.ResponseBody(b"\xff\x00data", True, True),
    E.FenceDecided(True),
    E.LeaseLost(),
    E.RequestHeadersSeen("generation", "messages", None, True),
    E.RequestBody(),
    E.RequestBodySeen(None, UsageMode.STRIP_RUNNING, keyed=True),
    E.RequestOpened(True),
    E.ProgressWritten(),
    E.RecordWritten(False),
    E.Fenced("replaced"),
    E.StreamClosed(1.0, 2.0),
    E.CauseLearned("client", 42, False, 5.0),
    E.SourceSent(1.0, 2.0),
    E.AckLearned(True, {"engine": "aborted"}, 3.0),
]


def test_the_examples_cover_every_traced_event() -> None:
    traced = set(typing.get_args(E.Event)) - {E.StatusRead}
    assert {type(e) for e in EXAMPLES} == traced


@pytest.mark.parametrize("ev", EXAMPLES, ids=lambda e: type(e).__name__)
def test_an_event_reads_back_from_its_record(ev: E.Event) -> None:
    rec = json.loads(json.dumps(_build_record(ev)))  # as stored: JSON
    assert R.event_from_record(rec) == ev


def test_an_error_reads_back_as_what_the_client_was_told() -> None:
    """Of an error the record keeps the body and status the client got."""
    err = journal_unavailable("req_1")
    for ev in (E.IntakeCommitted(err), E.RequestOpened(False, err),
               E.RequestHeadersSeen("generation", error=err),
               E.RequestBodySeen(err)):
        back = R.event_from_record(json.loads(json.dumps(_build_record(ev))))
        got = getattr(back, "error")  # noqa: B009
        assert got is not None, ev
        assert (got.code, got.message, got.http_status, got.request_id) == \
            (err.code, err.message, err.http_status, err.request_id), ev


def test_an_idle_checkpoint_tick_replays_as_its_format_decided_it() -> None:
    """format5_guard_idle: recorded by a core whose idle CHECKPOINT tick armed the next;
    format6_guard_idle: the same stream as this core runs it (the idle tick arms none, the
    next content event does; decision 0053). Each replays by its own format's rule only."""
    old, new = _old("format5_guard_idle.json"), _old("format6_guard_idle.json")
    assert (old["format"], new["format"]) == (5, 6)
    assert "guard_streaming:StartTimer" in old["decisions"]
    assert "guard_streaming:" in new["decisions"]
    assert len(new["events"]) == len(old["events"]) - 1  # the tick nothing armed
    assert R.replay(old).ok and R.replay(new).ok
    res = R.replay({**old, "format": 6})
    assert not res.ok and "recorded 'guard_streaming:StartTimer'" in str(res.divergence)
    assert not R.replay({**new, "format": 5}).ok
