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


class TimerSet(Generic[K]):
    """One session's timers, one per kind, on the `Timers` port: what a machine's
    `StartTimer(kind, s)` / `StopTimers` asks for, `fire(kind)` called when one falls due.

    The set keeps each kind's deadline, and port timers only for when one falls due: the
    port's callback is the set itself, and when it is called every kind whose deadline has
    come fires, earliest first (ties: the first started); then a port timer for the
    earliest left, unless one pending comes no later. A kind started again moves its
    deadline: later, by the number alone (the guard's stall timer moves with every chunk,
    and a port timer per chunk was a measurable share of the per-chunk cost; a port timer
    that then falls due early finds nothing due); earlier than every pending port timer,
    by a new one. The one it came before is kept, not cancelled (asyncio keeps a cancelled
    handle until its time anyway), as the `spare` for a later deadline; at most two are
    pending, the later one cancelled if a third is needed. Exactly one `fire(kind)`, at the
    last deadline asked for. An open guard stream's two kinds (stall, checkpoint) hold one
    port timer from its first delta to the checkpoint's first tick and while it is idle,
    two while it streams on; no record per kind (decision 0058)."""

    __slots__ = ("_armed", "_at", "_clock", "_fire", "_handle", "_spare", "_spare_at",
                 "_timers")

    def __init__(self, timers: Timers, clock: _Clock, fire: Callable[[K], None]) -> None:
        self._timers, self._clock, self._fire = timers, clock, fire
        self._at: dict[K, float] = {}  # each pending kind's deadline
        # The earliest pending port timer and when it falls due; and a later one.
        self._handle: TimerHandle | None = None
        self._armed = _NEVER
        self._spare: TimerHandle | None = None
        self._spare_at = _NEVER

    def start(self, kind: K, seconds: float) -> None:
        at = self._clock.monotonic() + seconds
        self._at[kind] = at
        if at < self._armed:
            self._arm(at, seconds)

    def _arm(self, at: float, seconds: float) -> None:
        if self._handle is not None:
            if self._spare is not None:
                self._spare.cancel()
            self._spare, self._spare_at = self._handle, self._armed
        self._armed = at
        self._handle = self._timers.start(seconds, self)

    def __call__(self) -> None:
        """A port timer fell due (the earliest pending): fire every kind due."""
        self._handle, self._armed = self._spare, self._spare_at
        self._spare, self._spare_at = None, _NEVER
        due = self._at
        while due:
            kind = min(due, key=due.__getitem__)
            at = due[kind]
            left = at - self._clock.monotonic()
            if left > 0:  # none due yet: a port timer for the earliest left, if needed
                if at < self._armed:
                    self._arm(at, left)
                return
            del due[kind]
            self._fire(kind)

    def stop(self) -> None:
        for h in (self._handle, self._spare):
            if h is not None:
                h.cancel()
        self._handle = self._spare = None
        self._armed = self._spare_at = _NEVER
        self._at.clear()

    def __contains__(self, kind: object) -> bool:
        return kind in self._at


_NEVER = float("inf")


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
