"""adapters/prober: one plain HTTP/1.1 GET per replica, whose status line alone decides
(200 is healthy; any other status, a refused connection, garbage or silence is not), and a
loop that probes whatever the pool holds each round and feeds the verdicts to HostHealth."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from devkit.devstack import free_port
from extproc.adapters.prober import probe_forever, probe_once
from extproc.core.config import HealthCheckConfig
from extproc.core.health import HealthPolicy, HostHealth

from .support import FakeClock, FakeTimers, idle


@contextlib.asynccontextmanager
async def replica(answer: bytes | None, seen: list[bytes] | None = None,
                  heard: asyncio.Event | None = None) -> AsyncIterator[str]:
    """A loopback server answering `answer` to every request (None: never answering);
    each request's head is added to `seen`, and `heard` is set when one came."""
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        if seen is not None:
            seen.append(head)
        if heard is not None:
            heard.set()
        if answer is not None:
            w.write(answer)
            await w.drain()
            w.close()
        else:
            await r.read()  # until the prober gives up and closes
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("answer", "ok"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
    (b"HTTP/1.0 200 OK\r\n\r\n", True),
    (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", False),
    (b"HTTP/1.1 2000 OK\r\n\r\n", False),
    (b"SSH-2.0-OpenSSH\r\n", False),
    (b"", False),
])
async def test_only_a_200_status_line_is_healthy(answer: bytes, ok: bool) -> None:
    seen: list[bytes] = []
    async with replica(answer, seen) as addr:
        assert await probe_once(addr, "/health", 2.0) is ok
    assert seen and seen[0].startswith(b"GET /health HTTP/1.1\r\n")
    assert f"Host: {addr}".encode() in seen[0] and b"Connection: close" in seen[0]


async def test_a_refused_or_silent_replica_is_unhealthy_within_the_timeout() -> None:
    assert await probe_once(f"127.0.0.1:{free_port()}", "/health", 2.0) is False
    timers = FakeTimers(FakeClock())
    seen: list[bytes] = []
    heard = asyncio.Event()
    async with replica(None, seen, heard) as addr:
        task = asyncio.ensure_future(probe_once(addr, "/health", 0.2, timers))
        # Until the request reached the silent replica (loopback I/O; no clock moves).
        await asyncio.wait_for(heard.wait(), 5)
        assert len(seen) == 1 and timers.clock.now == 0.0
        assert timers.advance(0.199) == 0
        await idle()
        assert not task.done()  # silent, but not yet for the whole timeout
        assert timers.advance(0.001) == 1
        assert await asyncio.wait_for(task, 5) is False
        assert timers.pending() == 0
    assert await probe_once("not-an-address", "/health", 0.5) is False


async def test_by_default_a_probe_times_out_on_the_loop() -> None:
    async with replica(None) as addr:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await probe_once(addr, "/health", 0.05) is False
        assert loop.time() - t0 >= 0.05


class CountingHealth(HostHealth):
    """HostHealth that lets a test wait for a number of probes instead of sleeping."""

    def __init__(self, policy: HealthPolicy) -> None:
        super().__init__(policy)
        self.probes: list[tuple[str, bool]] = []
        self.more = asyncio.Event()

    def probed(self, addr: str, ok: bool, now: float) -> None:
        super().probed(addr, ok, now)
        self.probes.append((addr, ok))
        self.more.set()

    async def until(self, pred: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not pred():
                self.more.clear()
                await self.more.wait()
        await asyncio.wait_for(wait(), 10)


async def test_the_loop_probes_the_pool_as_it_is_now_and_marks_health() -> None:
    """Round by round on a fake clock: a round probes what the pool holds then, and the
    next one starts when the interval has passed on the Timers port, not before."""
    cfg = HealthCheckConfig(interval_s=5.0, timeout_s=1.0, unhealthy_threshold=2)
    health = CountingHealth(HealthPolicy(unhealthy_threshold=2, healthy_threshold=1))
    timers = FakeTimers(FakeClock())
    clock = timers.clock
    dead = f"127.0.0.1:{free_port()}"
    async with replica(b"HTTP/1.1 200 OK\r\n\r\n") as good:
        pool = [good, dead]
        task = asyncio.ensure_future(probe_forever(lambda: pool, cfg, health, timers,
                                                   clock.monotonic))
        try:
            await health.until(lambda: len(health.probes) == 2)
            assert sorted(health.probes) == sorted([(good, True), (dead, False)])
            assert health.healthy(dead, clock.now)  # one failure: not yet the threshold
            await idle()
            assert len(health.probes) == 2 and timers.next_due() == 5.0  # waits the interval
            timers.advance(4.999)
            await idle()
            assert len(health.probes) == 2
            timers.advance(0.001)
            await health.until(lambda: len(health.probes) == 4)
            assert health.healthy(good, clock.now) and not health.healthy(dead, clock.now)
            assert all(ok is (a == good) for a, ok in health.probes)
            pool.remove(dead)  # a live pool changes between rounds
            timers.advance(5.0)
            await health.until(lambda: len(health.probes) == 5)
            assert health.probes[-1] == (good, True) and clock.now == 10.0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
