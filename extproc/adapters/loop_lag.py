"""How late the event loop runs: the processor's saturation signal, before clients feel it.

One process is one event loop (decision 0019): every chunk waits while the loop is busy with
others, so per-chunk tail latency follows the loop's lag, and it was this lag that showed
where grpclib's p99 comes from (decision 0020). A timer every `interval_s` measures how much
later than asked it ran; the gauge is the worst of the last `window_s`. Four wake-ups a
second by default: nothing per chunk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib


class LoopLag:
    def __init__(self, interval_s: float = 0.25, window_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._lags: collections.deque[float] = collections.deque(
            maxlen=max(1, round(window_s / interval_s)))
        self._task: asyncio.Task[None] | None = None

    def worst(self) -> float | None:
        """Seconds: the longest the loop was late over the window (None before a sample).
        Read from a scrape thread: a deque's max over a snapshot is safe without a lock."""
        lags = tuple(self._lags)
        return max(lags) if lags else None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._lags.append(max(0.0, loop.time() - asked))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
