"""The hand-off record: frozen, and its header form carries everything but the trace."""

from __future__ import annotations

import dataclasses
import json

import pytest

from extproc.core.events import IntakeCommitted, RequestStarted
from extproc.core.gate import GateMachine
from extproc.core.handoff import HandOff
from extproc.core.records import AttemptFacts
from extproc.core.replay import record, snapshot

RID = "req_0123456789abcdefghjkmnpqrs"


def _facts() -> AttemptFacts:
    return AttemptFacts(attempt=2, attempt_id="att_x", replica="127.0.0.1:9001",
                        gateway_id="gw-1", started_at=1700000000.25,
                        waited_for_previous_s=0.125, model_revision="rev-7", slow=True)


def test_the_header_is_the_records_handoff_json() -> None:
    f = _facts()
    ho = HandOff.from_record(f.base(), 42)
    # Byte for byte what the gate sent before the record existed (a guard of another
    # version reads the same header).
    assert ho.header() == json.dumps(f.handoff(42), separators=(",", ":"))
    back = HandOff.from_header(ho.header())
    assert back == ho
    assert back is not None and back.record() == f.base()


def test_the_record_is_frozen_and_the_trace_stays_in_process() -> None:
    m = GateMachine.new(RID)
    m.handle(RequestStarted(1, attempt_id="att_1"))
    ho = HandOff.from_record(_facts().base(), 7, snapshot(m))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ho.lease_id = 8  # type: ignore[misc]
    assert "trace" not in json.loads(ho.header())
    assert HandOff.from_header(ho.header()) == dataclasses.replace(ho, trace=None)
    # The snapshot does not move with the machine that made it.
    m.handle(IntakeCommitted())
    assert ho.trace is not None and len(ho.trace.events) == 1
    assert record(ho.trace, {}, 1 << 20)["events"] == m.trace[:1]


@pytest.mark.parametrize("bad", [None, "", "not json", "[]", '{"attempt": 1}',
                                 '{"attempt": "x", "attempt_id": "a"}'])
def test_an_unreadable_header_is_none(bad: str | None) -> None:
    assert HandOff.from_header(bad) is None
