"""bench.split's arithmetic: the per-chunk / per-request fit and the break-even length."""

from __future__ import annotations

import pytest

from bench.split import at, break_even, fit, render


def test_fit_recovers_a_line_in_one_over_tokens() -> None:
    a, b = 7.5, 1500.0  # us per chunk, us per request
    pts = [(t, a + b / t) for t in (64, 256, 2048, 256)]
    fa, fb = fit(pts)
    assert fa == pytest.approx(a) and fb == pytest.approx(b)
    assert at((fa, fb), 256) == pytest.approx(a + b / 256)


def test_fit_needs_two_lengths() -> None:
    with pytest.raises(ValueError, match="two distinct"):
        fit([(256, 10.0), (256, 11.0)])


def test_break_even() -> None:
    floor, ours = (7.0, 1000.0), (8.0, 2500.0)
    t = break_even(ours, floor)
    assert t is not None
    # At that length ours is exactly 1.3x the floor; longer streams are under it.
    assert at(ours, t) == pytest.approx(1.3 * at(floor, t))
    assert at(ours, 2 * t) < 1.3 * at(floor, 2 * t)
    # A per-chunk part over 1.3x the floor's is over at every length.
    assert break_even((9.2, 0.0), floor) is None
    # Ours already under at any length: from the shortest.
    assert break_even((7.0, 100.0), floor) == 1.0


def test_render_names_the_parts() -> None:
    res = {"repeats": 1, "lengths": [256, 2048],
           "by_length": {"256": {"floor": [11.0], "ours": [20.0], "ratio": [20 / 11]},
                         "2048": {"floor": [7.5], "ours": [11.5], "ratio": [11.5 / 7.5]}},
           "fit": {"floor": {"a_us": 7.0, "b_us": 1000.0}, "ours": {"a_us": 10.0, "b_us": 2500.0}},
           "break_even_tokens": None}
    out = render(res)
    assert "x1.82" in out and "b = 2.50 ms per request (+1.50)" in out
    assert "no length: the per-chunk part alone is over" in out
