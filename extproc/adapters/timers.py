"""Timers on the injected clock: the port a machine's `StartTimer` runs on.

`LoopTimers` runs them on the event loop (the clock the loop keeps); `FakeTimers` runs them
on a `FakeClock` the test advances, so a hermetic test of a session never sleeps real time.
A timer fires by calling its callback; the session turns that into `TimerFired(kind)`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Call `fire` after `seconds`, unless the handle is cancelled first."""

    def start(self, seconds: float, fire: Callable[[], None]) -> TimerHandle: ...


class LoopTimers:
    """The event loop's own timers (asyncio's call_later)."""

    def start(self, seconds: float, fire: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_later(max(0.0, seconds), fire)


class FakeClock:
    """A clock that moves only when a test says so (monotonic and wall move together)."""

    def __init__(self, wall0: float = 1_700_000_000.0) -> None:
        self.now = 0.0
        self.wall0 = wall0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return round(self.wall0 + self.now, 6)


class _Fake:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTimers:
    """Timers on a FakeClock: `advance(s)` moves the clock and fires what fell due, in
    order of their deadlines (ties in the order they were started)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._due: list[tuple[float, int, _Fake, Callable[[], None]]] = []
        self._n = itertools.count()

    def start(self, seconds: float, fire: Callable[[], None]) -> TimerHandle:
        h = _Fake()
        heapq.heappush(self._due, (self.clock.now + max(0.0, seconds), next(self._n), h, fire))
        return h

    def pending(self) -> int:
        return sum(1 for _, _, h, _ in self._due if not h.cancelled)

    def advance(self, seconds: float) -> int:
        """Move the clock by `seconds`; returns how many timers fired."""
        until = self.clock.now + seconds
        fired = 0
        while self._due and self._due[0][0] <= until:
            at, _, h, fire = heapq.heappop(self._due)
            self.clock.now = max(self.clock.now, at)
            if not h.cancelled:
                fired += 1
                fire()
        self.clock.now = until
        return fired
