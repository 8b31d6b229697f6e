"""Timers on the injected clock: the port a machine's `StartTimer` runs on.

`LoopTimers` runs them on the event loop (the clock the loop keeps); `FakeTimers` runs them
on a `FakeClock` the test advances, so a hermetic test of a session never sleeps real time.
A timer fires by calling its callback; the session turns that into `TimerFired(kind)`.
`TimerSet` is a session's bookkeeping of its machine's timers (one per kind), `sleep` a
plain wait on the port, `timeout` and `wait_for` a deadline on an awaitable (asyncio's, on
the port): every background loop of the process waits through these, so a hermetic test
of one moves a FakeClock instead of sleeping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

K = TypeVar("K")
T = TypeVar("T")


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Call `fire` after `seconds`, unless the handle is cancelled first."""

    def start(self, seconds: float, fire: Callable[[], None]) -> TimerHandle: ...


class _Clock(Protocol):
    def monotonic(self) -> float: ...


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

    def next_due(self) -> float | None:
        """The clock's reading when the next timer falls due (None: none pending)."""
        while self._due and self._due[0][2].cancelled:
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else None

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


class _Due(Generic[K]):
    """One kind's timer in a `TimerSet`: its deadline, its handle on the port, and the
    port's callback itself (calling it is the timer falling due), so that a timer costs no
    closure and no cells beside it (decision 0055: one open stream holds two)."""

    __slots__ = ("at", "handle", "kind", "owner")

    def __init__(self, owner: TimerSet[K], kind: K, at: float) -> None:
        self.owner, self.kind, self.at = owner, kind, at
        self.handle: TimerHandle | None = None

    def __call__(self) -> None:
        self.owner._fell_due(self.kind)


class TimerSet(Generic[K]):
    """One session's timers, one per kind, on the `Timers` port: what a machine's
    `StartTimer(kind, s)` / `StopTimers` asks for, `fire(kind)` called when one falls due.

    A kind started again moves its deadline: later, by keeping its one timer on the port and
    waiting the rest when it fires (the guard's stall timer moves with every chunk, and a
    timer per chunk was a measurable share of the per-chunk cost); earlier, by starting it
    anew. Either way exactly one `fire(kind)`, at the last deadline asked for."""

    __slots__ = ("_clock", "_due", "_fire", "_timers")

    def __init__(self, timers: Timers, clock: _Clock, fire: Callable[[K], None]) -> None:
        self._timers, self._clock, self._fire = timers, clock, fire
        self._due: dict[K, _Due[K]] = {}

    def start(self, kind: K, seconds: float) -> None:
        at = self._clock.monotonic() + seconds
        t = self._due.get(kind)
        if t is not None and at >= t.at:
            t.at = at
            return
        if t is not None:
            assert t.handle is not None
            t.handle.cancel()
        t = self._due[kind] = _Due(self, kind, at)
        t.handle = self._timers.start(seconds, t)

    def _fell_due(self, kind: K) -> None:
        t = self._due.get(kind)
        if t is None:
            return
        left = t.at - self._clock.monotonic()
        if left > 0:  # moved later since it was started: wait the rest
            t.handle = self._timers.start(left, t)
            return
        del self._due[kind]
        self._fire(kind)

    def stop(self) -> None:
        for t in self._due.values():
            if t.handle is not None:
                t.handle.cancel()
        self._due.clear()

    def __contains__(self, kind: object) -> bool:
        return kind in self._due


async def sleep(timers: Timers, seconds: float) -> None:
    """Wait `seconds` on the Timers port (the injected clock's time, not the loop's)."""
    fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    timers.start(seconds, lambda: None if fired.done() else fired.set_result(None))
    await fired


class Timeout:
    """`async with timeout(timers, s):` asyncio.timeout's deadline on the Timers port: when
    it falls due the task is cancelled, and the block ends in TimeoutError (a cancel from
    anyone else stays a cancel)."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_seconds", "_task", "_timers")

    def __init__(self, timers: Timers, seconds: float) -> None:
        self._timers, self._seconds = timers, seconds
        self._expired = False
        self._task: asyncio.Task[object] | None = None
        self._handle: TimerHandle | None = None
        self._cancelling = 0

    async def __aenter__(self) -> Timeout:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("timeout() is used inside a task")
        self._task, self._cancelling = task, task.cancelling()
        self._handle = self._timers.start(self._seconds, self._fire)
        return self

    def _fire(self) -> None:
        if self._task is not None and not self._expired:
            self._expired = True
            self._task.cancel()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        task, self._task = self._task, None
        # (uncancel() is called whenever this deadline cancelled, as asyncio.timeout does)
        if (self._expired and task is not None and task.uncancel() <= self._cancelling
                and exc_type is asyncio.CancelledError):
            raise TimeoutError from exc


def timeout(timers: Timers, seconds: float) -> Timeout:
    """asyncio.timeout(seconds) on the Timers port."""
    return Timeout(timers, seconds)


async def wait_for(timers: Timers, aw: Awaitable[T], seconds: float) -> T:
    """asyncio.wait_for with its deadline on the Timers port: `aw`'s result, or TimeoutError
    once `seconds` passed on the injected clock (`aw` cancelled then)."""
    async with timeout(timers, seconds):
        return await aw
