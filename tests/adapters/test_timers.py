"""timers.TimerSet (a session's timers, one per kind), timers.sleep and the deadline on an
awaitable (timers.timeout, timers.wait_for), on a fake clock; the deadline also on the loop's
own timers, against asyncio.wait_for."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Awaitable
from typing import Any

import pytest

from extproc.adapters.timers import (
    FakeClock,
    FakeTimers,
    LoopTimers,
    TimerSet,
    sleep,
    timeout,
    wait_for,
)


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
    assert timers.pending() == 2 and timers.next_due() == 5.0  # the 30 s one kept, spare
    assert timers.advance(40.0) == 2  # the spare finds nothing due
    assert fired == [("first_delta", 5.0)] and timers.pending() == 0


def test_at_most_two_port_timers_the_later_cancelled_for_a_third() -> None:
    timers, ts, fired = _set()
    ts.start("stall", 30.0)
    ts.start("checkpoint", 2.0)  # earlier: the 30 s port timer kept as the spare
    assert timers.pending() == 2
    ts.start("first_delta", 1.0)  # earlier again: the spare (30 s) cancelled
    assert timers.pending() == 2 and timers.next_due() == 1.0
    assert timers.advance(1.0) == 1 and fired == [("first_delta", 1.0)]
    # The 2 s one is now the earliest; after it fires, one for the stall's 30 s.
    assert timers.advance(1.0) == 1 and fired[-1] == ("checkpoint", 2.0)
    assert timers.pending() == 1 and timers.next_due() == 30.0
    timers.advance(28.0)
    assert fired[-1] == ("stall", 30.0) and len(fired) == 3 and timers.pending() == 0


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


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_wait_for_answers_what_came_in_time_and_leaves_no_timer() -> None:
    timers = FakeTimers(FakeClock())
    got: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wait_for(timers, got, 2.0))
    await _turns()
    assert timers.pending() == 1
    timers.advance(1.9)
    await _turns()
    assert not task.done()
    got.set_result("word")
    assert await task == "word"
    assert timers.pending() == 0  # its deadline cancelled with the answer
    assert timers.advance(5.0) == 0


async def test_wait_for_times_out_on_the_port_and_cancels_what_it_waited_for() -> None:
    timers = FakeTimers(FakeClock())
    inner: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wait_for(timers, inner, 2.0))
    await _turns()
    timers.advance(1.999)
    await _turns()
    assert not task.done() and not inner.done()
    assert timers.advance(0.001) == 1
    with pytest.raises(TimeoutError):
        await task
    assert inner.cancelled()
    assert timers.clock.now == 2.0


async def test_a_cancel_from_elsewhere_stays_a_cancel_and_the_deadline_goes() -> None:
    timers = FakeTimers(FakeClock())
    task = asyncio.ensure_future(wait_for(timers, asyncio.Event().wait(), 2.0))
    await _turns()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timers.pending() == 0


async def test_timeout_ends_the_block_not_the_task() -> None:
    """The deadline's own cancel is taken back (the task goes on, and a later await in it
    is not cancelled), as asyncio.timeout's is."""
    timers = FakeTimers(FakeClock())
    seen: list[str] = []

    async def body() -> str:
        try:
            async with timeout(timers, 1.0):
                await asyncio.Event().wait()
        except TimeoutError:
            seen.append("timed out")
        await sleep(timers, 1.0)
        return "went on"

    task = asyncio.ensure_future(body())
    await _turns()
    timers.advance(1.0)
    await _turns()
    assert seen == ["timed out"] and not task.done()
    timers.advance(1.0)
    assert await task == "went on"
    assert task.cancelling() == 0  # the deadline's cancel was taken back


@pytest.mark.parametrize("ours", [True, False])
async def test_on_the_loop_it_behaves_as_asyncio_wait_for(ours: bool) -> None:
    """LoopTimers (production): the same answers as asyncio.wait_for, on the loop's clock."""
    async def waited(aw: Awaitable[Any], s: float) -> Any:
        return await (wait_for(LoopTimers(), aw, s) if ours else asyncio.wait_for(aw, s))
    loop = asyncio.get_running_loop()
    assert await waited(asyncio.sleep(0, "now"), 5.0) == "now"
    t0 = loop.time()
    inner = asyncio.ensure_future(asyncio.Event().wait())
    with pytest.raises(TimeoutError):
        await waited(inner, 0.02)
    assert loop.time() - t0 >= 0.02
    await _turns()
    assert inner.cancelled()


class _Kept:
    """A port's handle that keeps its callback, as the loop's does until it fires."""

    __slots__ = ("fire",)

    def __init__(self, fire: Any) -> None:
        self.fire = fire

    def cancel(self) -> None:
        return None


class _KeepingPort:
    def start(self, seconds: float, fire: Any) -> _Kept:
        return _Kept(fire)


def test_two_kinds_cost_their_deadlines_and_one_port_timer() -> None:
    """An open guard stream holds two timers, started as its first delta starts them
    (checkpoint, then stall): one port timer for the earlier, the set itself its
    callback, no record, closure or cells per start (on this port and clock: 1,209 bytes
    before decision 0055, 751 before decision 0058, 575 now)."""
    port, clock = _KeepingPort(), FakeClock()
    keep: list[TimerSet[str]] = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(500):
            ts: TimerSet[str] = TimerSet(port, clock, lambda kind: None)
            ts.start("checkpoint", 2.0)
            ts.start("stall", 600.0)
            keep.append(ts)
        each = (tracemalloc.get_traced_memory()[0] - before) / len(keep)
    finally:
        tracemalloc.stop()
    assert each < 640, f"{each:.0f} bytes per TimerSet with two timers"


def test_a_moved_timer_fires_once_and_a_port_timer_early_finds_nothing() -> None:
    timers, ts, fired = _set()
    ts.start("a", 1.0)
    ts.start("a", 3.0)  # later: the same port timer, waiting the rest when it fires
    ts.start("b", 2.0)  # later than the port's timer: no other
    assert timers.pending() == 1 and timers.next_due() == 1.0
    ts.start("b", 0.5)  # earlier: a port timer for it, the first one kept as the spare
    assert timers.pending() == 2 and timers.next_due() == 0.5
    assert timers.advance(5.0) == 3  # 0.5 (b), 1.0 (nothing due: waits for a), 3.0 (a)
    assert fired == [("b", 0.5), ("a", 3.0)]
    assert "a" not in ts and "b" not in ts and timers.pending() == 0


def test_kinds_due_together_fire_earliest_deadline_first_and_one_may_restart() -> None:
    timers = FakeTimers(FakeClock())
    fired: list[tuple[str, float]] = []

    def fire(kind: str) -> None:
        fired.append((kind, timers.clock.now))
        if kind == "a" and len(fired) == 1:
            ts.start("a", 4.0)  # from within a firing: due at 14.0, after b and c

    ts: TimerSet[str] = TimerSet(timers, timers.clock, fire)
    ts.start("a", 2.0)
    ts.start("b", 1.0)
    ts.start("c", 3.0)
    ts.start("b", 2.5)  # b moves later: the port's timer at 1.0 finds nothing due
    assert timers.advance(1.0) == 1 and fired == [] and timers.next_due() == 2.0
    timers.clock.now = 10.0  # a late loop: the port's timer runs when a, b and c are due
    assert timers.advance(0.0) == 1
    assert fired == [("a", 10.0), ("b", 10.0), ("c", 10.0)]
    assert "a" in ts and "b" not in ts and timers.pending() == 1 and timers.next_due() == 14.0
    timers.advance(4.0)
    assert fired[-1] == ("a", 14.0) and len(fired) == 4 and timers.pending() == 0
