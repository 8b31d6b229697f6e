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


def test_a_header_written_here_is_read_back_as_parsing_it_would() -> None:
    """The guard of this process finds the hand-off its gate wrote, equal field for field
    (types included) to what parsing the header gives; read once, then parsed again; the
    kept ones are bounded, the oldest forgotten."""
    import random

    from extproc.core import handoff

    rng = random.Random(3)
    for i in range(300):
        f = AttemptFacts(attempt=rng.randrange(1, 9), attempt_id=f"att_{i}",
                         replica=rng.choice([None, "127.0.0.1:9001", "é:1"]),
                         gateway_id=rng.choice(["gw-1", ""]),
                         started_at=rng.choice([0.0, 1e9 + rng.random(), 1 / 3]),
                         waited_for_previous_s=rng.choice([0.0, rng.random() * 5]),
                         model_revision=rng.choice([None, "rev-7"]), slow=rng.random() < .5)
        ho = HandOff.from_record(f.base(), rng.randrange(0, 1 << 62))
        text = ho.header()
        assert text in handoff._WRITTEN
        found = HandOff.from_header(text)
        assert text not in handoff._WRITTEN  # read once
        parsed = HandOff.from_header(text)  # not kept any more: parsed
        assert found == parsed == dataclasses.replace(ho, trace=None)
        assert found is not None and parsed is not None
        assert [type(v) for v in dataclasses.astuple(found)] == \
            [type(v) for v in dataclasses.astuple(parsed)]
    texts = [HandOff.from_record(_facts().base(), i).header()
             for i in range(handoff.WRITTEN_KEPT + 5)]
    assert len(handoff._WRITTEN) == handoff.WRITTEN_KEPT
    assert list(handoff._WRITTEN) == texts[5:]  # the five oldest forgotten
    assert HandOff.from_header(texts[0]) == HandOff.from_record(_facts().base(), 0)
