"""Readiness from observations of etcd (extproc.core.readiness): pure, clock passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.readiness import Readiness, Reason, Verdict, decide, probe_after_s


@pytest.mark.parametrize(("last", "now", "draining", "want"), [
    (None, 0.0, False, Verdict(False, Reason.NEVER_ANSWERED)),
    (None, 1e6, False, Verdict(False, Reason.NEVER_ANSWERED)),
    (10.0, 10.0, False, Verdict(True, Reason.ANSWERING)),
    (10.0, 15.0, False, Verdict(True, Reason.ANSWERING)),      # exactly the grace: still ready
    (10.0, 15.0001, False, Verdict(False, Reason.SILENT)),     # just past it
    (10.0, 9.0, False, Verdict(True, Reason.ANSWERING)),       # stamped after "now": age 0
    (10.0, 10.0, True, Verdict(False, Reason.DRAINING)),       # draining beats everything
    (None, 0.0, True, Verdict(False, Reason.DRAINING)),
    (10.0, 99.0, True, Verdict(False, Reason.DRAINING)),
])
def test_decide_table(last: float | None, now: float, draining: bool, want: Verdict) -> None:
    assert decide(last, now, 5.0, draining) == want


@given(last=st.one_of(st.none(), st.floats(0, 1e6)), now=st.floats(0, 1e6),
       grace=st.floats(0.5, 600), draining=st.booleans())
def test_ready_iff_answered_within_grace_and_not_draining(
        last: float | None, now: float, grace: float, draining: bool) -> None:
    v = decide(last, now, grace, draining)
    assert v.ready == (not draining and last is not None and now - last <= grace)
    assert v.ready == (v.reason is Reason.ANSWERING)


def test_not_serving_until_the_first_answer() -> None:
    r = Readiness(5.0)
    assert not r.verdict.ready and r.verdict.reason is Reason.NEVER_ANSWERED
    assert r.evaluate(100.0) is None  # no change: still never answered
    assert r.age(100.0) is None and r.next_change(100.0) is None
    r.answered(100.5)
    assert r.evaluate(101.0) == Verdict(True, Reason.ANSWERING)
    assert r.evaluate(101.0) is None  # a verdict is reported once


def test_silent_after_the_grace_and_back_when_etcd_answers() -> None:
    r = Readiness(2.0)
    r.answered(10.0)
    assert r.evaluate(10.0) == Verdict(True, Reason.ANSWERING)
    assert r.next_change(10.0) == 12.0
    assert r.evaluate(11.9) is None and r.evaluate(12.0) is None  # within the grace
    assert r.evaluate(12.01) == Verdict(False, Reason.SILENT)
    assert r.next_change(12.01) is None  # only an answer makes it ready again
    assert r.age(12.5) == pytest.approx(2.5)
    r.answered(13.0)
    assert r.evaluate(13.0) == Verdict(True, Reason.ANSWERING)


def test_an_answer_reported_late_never_moves_the_last_answer_back() -> None:
    r = Readiness(2.0)
    r.answered(20.0)
    r.answered(15.0)  # a slow call's answer, reported after a newer one
    assert r.last_answer == 20.0
    assert r.evaluate(21.5) == Verdict(True, Reason.ANSWERING)


def test_draining_is_final() -> None:
    r = Readiness(5.0)
    r.answered(1.0)
    assert r.evaluate(1.0) == Verdict(True, Reason.ANSWERING)
    r.drain()
    assert r.evaluate(1.1) == Verdict(False, Reason.DRAINING)
    r.answered(2.0)
    assert r.evaluate(2.0) is None and not r.verdict.ready
    assert r.next_change(2.0) is None and not r.should_probe(100.0)


def test_probe_only_when_the_last_answer_is_stale() -> None:
    r = Readiness(4.0)
    assert probe_after_s(4.0) == 2.0
    assert r.should_probe(0.0)  # never answered: always ask
    r.answered(10.0)
    assert not r.should_probe(11.9)
    assert r.should_probe(12.0)


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Readiness(0.0)


@given(st.lists(st.tuples(st.sampled_from(["answer", "tick", "drain"]),
                          st.floats(0.0, 3.0)), max_size=60),
       st.floats(0.5, 10.0))
def test_reported_changes_track_the_verdict(steps: list[tuple[str, float]],
                                            grace: float) -> None:
    """Replaying any observation sequence: the changes evaluate() reports, applied in order,
    always equal decide() on the observations so far (no change is lost or invented)."""
    r = Readiness(grace)
    now = 0.0
    last: float | None = None
    draining = False
    shown = Verdict(False, Reason.NEVER_ANSWERED)
    for kind, dt in steps:
        now += dt
        if kind == "answer":
            r.answered(now)
            last = now
        elif kind == "drain":
            r.drain()
            draining = True
        change = r.evaluate(now)
        if change is not None:
            assert change != shown
            shown = change
        assert shown == decide(last, now, grace, draining)
        flip = r.next_change(now)
        if flip is not None:
            # No change before the flip time; the verdict is SILENT just after it.
            assert decide(last, flip - 1e-6, grace, draining).ready
            assert not decide(last, flip + 1e-6, grace, draining).ready
