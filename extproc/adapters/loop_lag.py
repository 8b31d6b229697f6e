"""How late the event loop runs: the processor's saturation signal, before clients feel it.

One process is one event loop (decision 0019): every chunk waits while the loop is busy with
others, so per-chunk tail latency follows the loop's lag, and it was this lag that showed
where grpclib's p99 comes from (decision 0020). A task sleeps `interval_s` and measures how
much later than asked it woke; the gauge is the worst of the last `window_s`. Four wake-ups
a second by default: nothing per chunk.

The sleep is a timer on the `Timers` port and the time the injected clock's: the event
loop's own in production (so a sample is what `asyncio.sleep` would see: the timer's
lateness and the task's wake-up behind it), a `FakeTimers` and `FakeClock` in a hermetic
test, which blocks the loop by moving the clock without firing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable

from .timers import LoopTimers, Timers


class LoopLag:
    def __init__(self, interval_s: float = 0.25, window_s: float = 10.0,
                 timers: Timers | None = None,
                 now: Callable[[], float] | None = None) -> None:
        """`timers` and `now` default to the running loop's (taken at `start`)."""
        self.interval_s = interval_s
        self._lags: collections.deque[float] = collections.deque(
            maxlen=max(1, round(window_s / interval_s)))
        self._timers = timers
        self._now = now
        self._task: asyncio.Task[None] | None = None

    def worst(self) -> float | None:
        """Seconds: the longest the loop was late over the window (None before a sample).
        Read from a scrape thread: a deque's max over a snapshot is safe without a lock."""
        lags = tuple(self._lags)
        return max(lags) if lags else None

    def start(self) -> None:
        """Start sampling (inside the event loop)."""
        timers = self._timers if self._timers is not None else LoopTimers()
        now = self._now if self._now is not None else asyncio.get_running_loop().time
        self._task = asyncio.ensure_future(self._run(timers, now))

    async def _run(self, timers: Timers, now: Callable[[], float]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = now() + self.interval_s
            woke: asyncio.Future[None] = loop.create_future()
            handle = timers.start(self.interval_s, _waker(woke))
            try:
                await woke
            finally:
                handle.cancel()
            self._lags.append(max(0.0, now() - asked))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _waker(fut: asyncio.Future[None]) -> Callable[[], None]:
    """A timer's callback that wakes the task awaiting `fut` (once; not a cancelled one)."""
    def fire() -> None:
        if not fut.done():
            fut.set_result(None)
    return fire
