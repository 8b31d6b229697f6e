"""timers.TimerSet (a session's timers, one per kind) and timers.sleep, on a fake clock."""

from __future__ import annotations

import asyncio

from extproc.adapters.timers import FakeClock, FakeTimers, TimerSet, sleep


def _set() -> tuple[FakeTimers, TimerSet[str], list[tuple[str, float]]]:
    timers = FakeTimers(FakeClock())
    fired: list[tuple[str, float]] = []
    ts: TimerSet[str] = TimerSet(timers, timers.clock,
                                 lambda kind: fired.append((kind, timers.clock.now)))
    return timers, ts, fired


def test_a_kind_started_again_later_keeps_one_timer_and_fires_once_at_the_last_deadline() -> None:
    timers, ts, fired = _set()
    ts.start("stall", 10.0)
    timers.advance(6.0)
    ts.start("stall", 10.0)  # deadline 16
    assert timers.pending() == 1
    assert timers.advance(4.0) == 1 and fired == []  # the first end: waits the rest
    assert timers.pending() == 1 and "stall" in ts
    assert timers.advance(5.9) == 0
    assert timers.advance(0.1) == 1
    assert fired == [("stall", 16.0)] and "stall" not in ts and timers.pending() == 0


def test_a_kind_started_again_earlier_is_started_anew_and_fires_once() -> None:
    timers, ts, fired = _set()
    ts.start("first_delta", 30.0)
    ts.start("first_delta", 5.0)
    assert timers.pending() == 1  # the 30 s one was cancelled
    timers.advance(40.0)
    assert fired == [("first_delta", 5.0)]


def test_kinds_are_independent_and_stop_cancels_every_one() -> None:
    timers, ts, fired = _set()
    ts.start("stall", 2.0)
    ts.start("checkpoint", 1.0)
    timers.advance(1.0)
    assert fired == [("checkpoint", 1.0)] and "stall" in ts
    ts.start("checkpoint", 1.0)
    ts.stop()
    assert timers.pending() == 0
    timers.advance(10.0)
    assert fired == [("checkpoint", 1.0)]


async def test_sleep_waits_for_the_port_not_the_loop() -> None:
    timers = FakeTimers(FakeClock())
    task = asyncio.ensure_future(sleep(timers, 0.5))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done() and timers.pending() == 1
    timers.advance(0.4)
    await asyncio.sleep(0)
    assert not task.done()
    timers.advance(0.1)
    await asyncio.wait_for(task, 1)
    assert timers.clock.now == 0.5
