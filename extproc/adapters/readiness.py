"""The processor's gRPC health services: readiness follows etcd, liveness the event loop.

Service "" (what a readiness probe or a plain `grpc_health_probe` asks) is decided by
`extproc.core.readiness` from the time etcd (shard 0's cluster, when the journal is sharded:
decision 0042) last answered any call of this process: the
per-request transactions, the retry-budget exchange once a second, lease grants. Only when
none has answered for half the grace does this loop ask etcd itself (one Range), so a busy
or idle processor adds no etcd round trip per request. Service "liveness" is SERVING from
start until the very end of shutdown: it answers as long as the event loop does, and never
depends on etcd (decision 0016).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from grpc_health.v1 import health_pb2

from ..core.readiness import Readiness, Verdict
from .timers import LoopTimers, Timers, sleep

log = logging.getLogger("extproc.readiness")

READINESS_SERVICE = ""
LIVENESS_SERVICE = "liveness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class AnswerSource(Protocol):
    """What the loop observes: the store's last answer, and a probe when it is stale."""

    # Monotonic time etcd last answered a call of ours (None: never).
    last_answer: float | None

    async def healthy(self) -> bool: ...


class HealthStatuses(Protocol):
    """Where the statuses are served: grpc_health's aio servicer, or ours on grpclib."""

    async def set(self, service: str, status: Any) -> None: ...

    async def enter_graceful_shutdown(self) -> None: ...


class HealthReporter:
    def __init__(self, hs: HealthStatuses, source: AnswerSource, grace_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 timers: Timers | None = None) -> None:
        self.hs = hs
        self.source = source
        self.clock = clock
        self.timers: Timers = timers or LoopTimers()  # the loop's pauses (clock's time)
        self.state = Readiness(grace_s)
        # Evaluate at least this often (and exactly when the verdict would flip).
        self.tick_s = min(0.25, grace_s / 4)
        self._task: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one evaluate-and-set at a time: no reordered sets

    @property
    def ready(self) -> bool:
        return self.state.verdict.ready

    def last_answer_age(self) -> float | None:
        """Seconds since etcd last answered (None: never). Safe from a scrape thread."""
        seen = [t for t in (self.source.last_answer, self.state.last_answer) if t is not None]
        return max(0.0, self.clock() - max(seen)) if seen else None

    async def start(self) -> None:
        await self.hs.set(LIVENESS_SERVICE, _SERVING)
        await self.hs.set(READINESS_SERVICE, _NOT_SERVING)
        log.info("readiness: not serving until etcd answers",
                 extra={"ready": False, "reason": str(self.state.verdict.reason),
                        "grace_s": self.state.grace_s, "request_id": None,
                        "attempt_id": None})
        self._task = asyncio.ensure_future(self._loop())

    def _pull(self) -> None:
        at = self.source.last_answer
        if at is not None:
            self.state.answered(at)

    async def _apply(self) -> None:
        async with self._lock:
            self._pull()
            now = self.clock()
            v = self.state.evaluate(now)
            if v is None:
                return
            # The age the verdict was made on: a probe answering while the status is being
            # set must not make a "silent" line report a fresh answer.
            age = self.state.age(now)
            await self.hs.set(READINESS_SERVICE, _SERVING if v.ready else _NOT_SERVING)
            self._log(v, age)

    def _log(self, v: Verdict, age: float | None) -> None:
        log.log(logging.INFO if v.ready or v.reason == "draining" else logging.WARNING,
                "readiness: serving" if v.ready else "readiness: not serving",
                extra={"ready": v.ready, "reason": str(v.reason), "grace_s": self.state.grace_s,
                       "etcd_last_answer_age_s": None if age is None else round(age, 3),
                       "request_id": None, "attempt_id": None})

    async def _probe_once(self) -> None:
        if await self.source.healthy():
            self.state.answered(self.clock())
        await self._apply()

    async def _loop(self) -> None:
        while True:
            self._pull()
            now = self.clock()
            if self.state.should_probe(now) and (self._probe is None or self._probe.done()):
                self._probe = asyncio.ensure_future(self._probe_once())
            await self._apply()
            delay = self.tick_s
            flip = self.state.next_change(self.clock())
            if flip is not None:
                delay = min(delay, max(0.0, flip - self.clock()) + 0.005)
            await sleep(self.timers, delay)

    async def drain(self) -> None:
        """Shutting down: readiness NOT_SERVING now; liveness stays SERVING."""
        self.state.drain()
        await self._apply()

    async def stop(self) -> None:
        """The very end of shutdown: every service NOT_SERVING, for good."""
        for t in (self._task, self._probe):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        await self.hs.enter_graceful_shutdown()


def _age(clock: Callable[[], float], source: AnswerSource) -> float | None:
    at = source.last_answer
    return None if at is None else max(0.0, clock() - at)


class _Gauges(Protocol):
    def observe(self, name: str, description: str, unit: str,
                read: Callable[[], float | None]) -> None: ...


def export_gauges(tel: _Gauges, reporter: HealthReporter,
                  open_streams: Callable[[], int],
                  loop_lag: Callable[[], float | None] | None = None,
                  shards: Sequence[AnswerSource] = ()) -> None:
    """The processor's state as gauges (OTLP and /metrics alike; read at each collection).

    With the journal on several etcd clusters (decision 0042) readiness follows shard 0
    (the pool-wide keys) and each shard's silence is its own gauge: a shard that stopped
    answering refuses only its own requests, so it is an alert, not a reason to take
    every request off this processor."""
    tel.observe("llmgw.ready", "1 while readiness is SERVING (etcd answering), else 0", "1",
                lambda: 1.0 if reporter.ready else 0.0)
    tel.observe("llmgw.etcd.last_answer_age", "seconds since etcd last answered a call "
                "of this process (absent until it first has)", "s", reporter.last_answer_age)
    tel.observe("llmgw.open_streams", "ext_proc streams open now (gates and guards)", "1",
                lambda: float(open_streams()))
    if len(shards) > 1:
        for i, shard in enumerate(shards):
            tel.observe(f"llmgw.etcd.shard{i}.last_answer_age",
                        f"seconds since journal shard {i}'s etcd cluster last answered a call "
                        "of this process (absent until it first has)", "s",
                        partial(_age, reporter.clock, shard))
    if loop_lag is not None:
        tel.observe("llmgw.event_loop.lag", "the longest the event loop ran late over the "
                    "last 10 s (its saturation: every chunk waits behind it)", "s", loop_lag)
