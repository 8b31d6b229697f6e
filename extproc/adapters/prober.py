"""The processor's own health probe of the compatibility pool's replicas.

Envoy probes them too, but its verdict cannot reach the override_host list the guard
writes (Envoy picks a listed host whatever its health), so the processor keeps its own,
with the same path, interval and thresholds (`pool.health_check`). One plain HTTP/1.1 GET
per replica per interval, no client library: the answer's status line is all it reads.
The interval and a probe's timeout are waited on the `Timers` port (the loop's in
production), the verdicts timed by the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from ..core.config import HealthCheckConfig
from ..core.health import HostHealth
from .timers import LoopTimers, Timers, sleep, timeout

log = logging.getLogger("extproc.prober")


async def probe_once(address: str, path: str, timeout_s: float,
                     timers: Timers | None = None) -> bool:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    writer = None
    try:
        async with timeout(timers or LoopTimers(), timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {address}\r\n"
                         f"User-Agent: llm-failover-extproc\r\nConnection: close\r\n\r\n"
                         .encode())
            await writer.drain()
            line = await reader.readline()
        parts = line.split(b" ", 2)
        return len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1] == b"200"
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def probe_forever(pool: Callable[[], Sequence[str]], cfg: HealthCheckConfig,
                        health: HostHealth, timers: Timers | None = None,
                        clock: Callable[[], float] = time.monotonic) -> None:
    """Probe every replica the pool holds now (a live pool changes between rounds)."""
    timers = timers or LoopTimers()
    while True:
        addresses = list(pool())
        results = await asyncio.gather(*(probe_once(a, cfg.path, cfg.timeout_s, timers)
                                         for a in addresses))
        now = clock()
        for addr, ok in zip(addresses, results, strict=True):
            was = health.healthy(addr, now)
            health.probed(addr, ok, now)
            if was != health.healthy(addr, now):
                log.warning("replica health changed", extra={
                    "replica": addr, "healthy": not was, "request_id": None,
                    "attempt_id": None})
        await sleep(timers, cfg.interval_s)
