"""adapters/etcd_pool: replica registrations in etcd, each on its agent's lease. The agent's
side (register, keep alive, withdraw at once) and the processor's (a listing, then a watch
from its revision, every change told as the whole pool); with etcd away a withdrawal says it
was not confirmed. (The live pool through Envoy: tests/e2e.)"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest

from devkit.devstack import free_port
from extproc.adapters.etcd_pool import EtcdPoolRegistry
from extproc.adapters.etcd_store import EtcdStore
from extproc.core.config import load_config

from .test_journal_store import etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)


def _store(endpoint: str) -> EtcdStore:
    return EtcdStore(load_config({"etcd": {"endpoints": [endpoint], "timeout_s": 2.0,
                                           "prefix": f"/pool-test/{uuid.uuid4().hex}"}}).etcd,
                     owner="test/pool")


@pytest.fixture()
async def registry(etcd_endpoint: str) -> AsyncIterator[EtcdPoolRegistry]:
    s = _store(etcd_endpoint)
    await s.connect()
    reg = EtcdPoolRegistry(s)
    try:
        yield reg
    finally:
        await reg.close()
        await s.close()


async def test_a_registration_lives_on_its_lease_and_goes_at_once_when_withdrawn(
        registry: EtcdPoolRegistry) -> None:
    rec = {"address": "127.0.0.1:8001", "fingerprint": {"weights_revision": "r1"}}
    lease = await registry.register("127.0.0.1:8001", rec, ttl_s=5)
    rev, pool = await registry.snapshot()
    assert rev > 0 and list(pool) == ["127.0.0.1:8001"]
    assert json.loads(pool["127.0.0.1:8001"]) == rec
    assert pool["127.0.0.1:8001"] == json.dumps(rec, separators=(",", ":"),
                                                sort_keys=True).encode()  # one spelling
    assert await registry.keep_alive(lease) is True
    assert await registry.withdraw(lease) is True
    assert (await registry.snapshot())[1] == {}  # at once, not after the TTL
    assert await registry.keep_alive(lease) is False  # etcd no longer has it


async def test_the_processor_hears_the_listing_then_every_change(
        registry: EtcdPoolRegistry) -> None:
    seen: list[dict[str, bytes]] = []
    moved = asyncio.Event()

    def on_change(pool: dict[str, bytes]) -> None:
        seen.append(pool)
        moved.set()

    async def until(n: int) -> None:
        async def wait() -> None:
            while len(seen) < n:
                moved.clear()
                await moved.wait()
        await asyncio.wait_for(wait(), 5)

    a = await registry.register("127.0.0.1:1", {"address": "127.0.0.1:1"}, ttl_s=5)
    registry.watch(on_change)
    await until(1)
    assert registry.listed.is_set() and list(seen[0]) == ["127.0.0.1:1"]
    b = await registry.register("127.0.0.1:2", {"address": "127.0.0.1:2"}, ttl_s=5)
    await until(2)
    assert sorted(seen[1]) == ["127.0.0.1:1", "127.0.0.1:2"]
    await registry.withdraw(a)
    await until(3)
    assert list(seen[2]) == ["127.0.0.1:2"]
    await registry.withdraw(b)
    await until(4)
    assert seen[3] == {}


async def test_a_withdrawal_etcd_did_not_answer_is_not_confirmed() -> None:
    s = _store(f"127.0.0.1:{free_port()}")
    await s.connect()
    try:
        assert await EtcdPoolRegistry(s).withdraw(12345) is False
        assert await EtcdPoolRegistry(s).keep_alive(12345) is None  # no answer: unknown
    finally:
        await s.close()
