"""The plan for an attempt's end and the records built from it: exhaustive over the inputs."""

from __future__ import annotations

import itertools

import pytest

from extproc.core.failure import FailureClass, Fence
from extproc.core.records import (
    AttemptFacts,
    EndFacts,
    attempt_end,
    plan_end,
    released_end,
    settle_end,
)

FIRST = 30.0


def test_plan_and_settle_over_every_input() -> None:
    for rel, fin, to, fail, st, el, entry, ack in itertools.product(
            [False, True], [False, True], [False, True], [False, True], [0, 200, 429, 500],
            [1.0, 31.0], [None, "upstream", "timeout", "client", "unknown"], [True, False]):
        f = EndFacts(released=rel, upstream_finished=fin, timed_out=to, failed_on_purpose=fail,
                     http_status=st, elapsed_s=el, first_delta_s=FIRST)
        p = plan_end(f)
        if rel:
            assert p.handed_off and not p.revoke_now and not p.needs_cause
            continue
        # Revoked before Envoy's word only for an end no uncertain cause can explain.
        assert p.revoke_now == (p.needs_cause and not to and el < FIRST)
        s = settle_end(f, p, entry, ack)
        if p.revoke_now:
            assert s.fence is Fence.REVOKE
        if s.fence is Fence.EXPIRE:
            # Lease expiry only where the publisher's state is unknown: an uncertain end
            # with no word from Envoy, or a policy that never takes Envoy's close for a
            # cancel ack.
            assert s.failure_class is FailureClass.NETWORK_UNCERTAIN
            assert entry is None or not ack
            assert not p.revoke_now
        if (s.failure_class is FailureClass.NETWORK_UNCERTAIN and p.needs_cause
                and not p.revoke_now and (entry is None or not ack)):
            assert s.fence is Fence.EXPIRE
        assert s.envoy_closed == (entry is not None or not p.needs_cause)


def test_records_carry_what_the_journal_shows() -> None:
    facts = AttemptFacts(attempt=2, attempt_id="att_2", replica="127.0.0.1:8002",
                         gateway_id="gw-1", started_at=100.0, waited_for_previous_s=0.25,
                         model_revision="fp-1", slow=True)
    assert facts.admission() == {"attempt": 2, "attempt_id": "att_2",
                                 "replica": "127.0.0.1:8002", "gateway_id": "gw-1",
                                 "started_at": 100.0, "model_revision": "fp-1"}
    assert facts.handoff(7)["lease_id"] == 7 and facts.handoff(7)["admitted_at"] == 100.25
    f = EndFacts(False, False, True, True, 200, 31.0, FIRST)
    s = settle_end(f, plan_end(f), None)
    rec = attempt_end(facts.base(), f, s, 131.0, 10)
    assert rec["fence"] == "expiry" and rec["lease_expires_by"] == 141.0
    assert rec["envoy_closed"] is False and rec["failure_class"] == "network_uncertain"
    s = settle_end(f, plan_end(f), "unknown")  # an entry without flags: Envoy closed it
    rec = attempt_end(facts.base(), f, s, 131.0, 10)
    assert rec["fence"] == "revoked" and "lease_expires_by" not in rec
    cls, rec = released_end(facts.handoff(7), upstream_finished=False, cause="stall",
                            ended_at=140.0)
    assert cls is FailureClass.NETWORK_UNCERTAIN and "lease_id" not in rec
    assert rec["fence"] == "ended_with_request" and rec["released"] is True


def test_an_end_plan_in_a_trace_is_decided_again_by_replay() -> None:
    from extproc.core.events import (
        RequestStarted,
        StreamClosed,
    )
    from extproc.core.gate import GateMachine
    from extproc.core.records import end_trace, replay_end
    from extproc.core.replay import record, replay

    f = EndFacts(False, False, True, True, 200, 31.0, FIRST)
    s = settle_end(f, plan_end(f), None, True)
    rec = end_trace(f, None, True, s)
    assert replay_end(rec) is None
    m = GateMachine.new("req_0123456789abcdefghjkmnpqrs")
    m.handle(RequestStarted(1))
    m.handle(StreamClosed())
    trace = record(m, {"end": rec}, 1 << 20)
    assert replay(trace).ok
    # A tampered (or since-changed) verdict shows up as a divergence.
    bad = {**trace, "meta": {"end": {**rec, "fence": "revoked"}}}
    r = replay(bad)
    assert not r.ok and r.divergence is not None and "end plan differs" in r.divergence
    broken = {**trace, "meta": {"end": {**rec, "facts": {"nope": 1}}}}
    assert not replay(broken).ok


def test_one_shot_writes_what_its_encoder_writes() -> None:
    import json
    import math

    from extproc.core.records import one_shot

    values = [{"b": 1, "a": [1.5, 1796281779.271494, None, True], "é": "ü\u2028\ud800"},
              {"z": {"y": {"x": -0.0, "w": 1e300}}, "n": math.inf}, [], "plain", 3,
              {"attempt": 1, "started_at": 0.1 + 0.2, "model_revision": None}]
    for kw in ({"separators": (",", ":"), "sort_keys": True}, {"separators": (",", ":")},
               {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": False}, {}):
        enc = json.JSONEncoder(**kw)  # type: ignore[arg-type]
        f = one_shot(enc)
        for v in values:
            assert f(v) == enc.encode(v), (kw, v)
    strict = json.JSONEncoder(allow_nan=False)
    with pytest.raises(ValueError):
        one_shot(strict)({"n": math.nan})
    with pytest.raises(TypeError):
        one_shot(json.JSONEncoder())({"b": b"x"})
    pretty = json.JSONEncoder(indent=2)
    assert one_shot(pretty) == pretty.encode
