"""The event-loop lag gauge: how late a periodic timer ran, the worst of a window.

On a fake clock: the test runs the timers and blocks the loop by moving the clock without
running any (what a long synchronous step does), so the figures are exact.
"""

from __future__ import annotations

import pytest

from extproc.adapters.loop_lag import LoopLag

from .support import FakeClock, FakeTimers, idle


async def _samples(timers: FakeTimers, n: int, interval_s: float) -> None:
    """n on-time wake-ups: each timer fires when due and the task records it."""
    for _ in range(n):
        assert timers.advance(interval_s) == 1
        await idle(5)


async def test_a_blocked_loop_shows_as_lag_and_ages_out_of_the_window() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    lag = LoopLag(interval_s=0.02, window_s=0.2, timers=timers, now=clock.monotonic)
    assert lag.worst() is None  # no sample yet: the series is left out
    lag.start()
    await idle(5)
    assert timers.pending() == 1  # one wake-up asked for, not one per sample
    await _samples(timers, 5, 0.02)
    assert lag.worst() == 0.0
    clock.now += 0.6  # the loop blocked: time went by and no timer ran
    assert timers.advance(0) == 1  # the overdue wake-up runs once the loop is free
    await idle(5)
    assert lag.worst() == pytest.approx(0.58)  # asked for 0.02 s after the last sample
    # The window is the last 10 samples: after 9 on-time ones the block is still in it,
    # after the 10th it has aged out.
    await _samples(timers, 9, 0.02)
    assert lag.worst() == pytest.approx(0.58)
    await _samples(timers, 1, 0.02)
    assert lag.worst() == 0.0
    await lag.stop()
    assert timers.pending() == 0  # stopped: its timer cancelled


async def test_by_default_it_runs_on_the_loops_timers_and_clock() -> None:
    """Started with no port, it takes the running loop's timers and clock (what server.py
    does); stopped before its first wake-up, it leaves no sample."""
    lag = LoopLag(interval_s=3600.0)
    lag.start()
    await idle(5)
    await lag.stop()
    assert lag.worst() is None
