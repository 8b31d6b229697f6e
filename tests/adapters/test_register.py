"""adapters/register: the agent beside a model server keeps it in the live pool while it
answers its health checks. It registers once healthy, withdraws when the server fails
`unhealthy_threshold` probes in a row, registers again once it is back, and withdraws when
told to stop; every probe's verdict is told to `on_probe`."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

from extproc.adapters.etcd_pool import EtcdPoolRegistry
from extproc.adapters.etcd_store import EtcdStore
from extproc.adapters.register import run_agent
from extproc.core.config import load_config

from .test_journal_store import etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)


class ModelServer:
    """A loopback health endpoint whose answer the test sets."""

    def __init__(self) -> None:
        self.healthy = True
        self.server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.1 200 OK\r\n\r\n" if self.healthy
                    else b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
            await w.drain()
            w.close()
        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_registered_while_healthy_withdrawn_when_not_and_when_stopped(
        etcd_endpoint: str) -> None:
    cfg = load_config({
        "etcd": {"endpoints": [etcd_endpoint], "timeout_s": 2.0,
                 "prefix": f"/register-test/{uuid.uuid4().hex}"},
        # A TTL longer than every wait below: each withdrawal seen is the agent's own, not
        # its lease lapsing.
        "pool": {"registration_ttl_s": 30,
                 "health_check": {"interval_s": 0.1, "timeout_s": 1.0,
                                  "unhealthy_threshold": 2, "healthy_threshold": 1}}})
    model = ModelServer()
    await model.start()
    record = {"address": "127.0.0.1:8001", "fingerprint": {"weights_revision": "r1"}}
    viewer = EtcdStore(cfg.etcd, owner="test/viewer")
    await viewer.connect()
    registry = EtcdPoolRegistry(viewer)
    pools: list[dict[str, bytes]] = []
    probes: list[bool] = []
    moved = asyncio.Event()

    def changed(pool: dict[str, bytes]) -> None:
        pools.append(pool)
        moved.set()

    def probed(ok: bool) -> None:
        probes.append(ok)
        moved.set()

    async def until(pred: Callable[[], object], what: str) -> None:
        async def wait() -> None:
            while not pred():
                moved.clear()
                await moved.wait()
        try:
            await asyncio.wait_for(wait(), 10)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}: {pools} {probes}") from None

    registry.watch(changed)
    stop = asyncio.Event()
    agent = asyncio.ensure_future(run_agent(cfg, record, model.address, stop=stop,
                                            on_probe=probed, signals=False))
    try:
        await until(lambda: pools and "127.0.0.1:8001" in pools[-1], "the registration")
        assert probes and probes[0] is True
        model.healthy = False
        n = len(probes)
        await until(lambda: pools[-1] == {}, "the withdrawal")
        assert probes[n:].count(False) >= 2  # not before unhealthy_threshold probes
        model.healthy = True
        await until(lambda: "127.0.0.1:8001" in pools[-1], "the registration again")
        stop.set()
        assert await asyncio.wait_for(agent, 10) == 0
        await until(lambda: pools[-1] == {}, "the withdrawal on stop")
    finally:
        stop.set()
        if not agent.done():
            agent.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await agent
        await registry.close()
        await viewer.close()
        await model.stop()
