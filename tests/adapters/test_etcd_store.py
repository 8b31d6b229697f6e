"""adapters/etcd_store: what is etcd's own in the journal store (its transactions are
journal_store's, run on both stores by test_journal_store.py): one session lease per process
however many ask at once; the process lease's local deadline set from before the grant,
minus a margin, reused while far from it, renewed before a new attempt is put on it, and
granted anew once etcd lost it; readiness reading etcd's last answer. (Freezes and expiries
that only a real etcd shows, with the stack: tests/e2e/test_etcd_store.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from extproc.adapters.etcd_store import EtcdStore, keep_alive_deadline

from .test_journal_store import TTL_S, _cfg, etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)


@pytest.fixture()
async def store(etcd_endpoint: str) -> AsyncIterator[EtcdStore]:
    s = EtcdStore(_cfg(etcd_endpoint), owner="test/etcd_store")
    await s.connect()  # no background loops: each test drives what it checks
    try:
        yield s
    finally:
        await s.close()


async def test_one_session_lease_however_many_ask_at_once(store: EtcdStore) -> None:
    assert store.last_answer is None
    ids = await asyncio.gather(*(store.session_lease() for _ in range(5)))
    assert len(set(ids)) == 1 and ids[0] > 0
    assert await store.etcd.time_to_live(ids[0]) > 0
    assert store.last_answer is not None  # etcd answered: readiness reads this


async def test_the_process_lease_s_deadline_falls_before_etcd_s(store: EtcdStore) -> None:
    before = time.monotonic()
    lease = await store.process_lease()
    after = time.monotonic()
    margin = min(1.0, TTL_S / 5)
    assert lease.ttl_s == TTL_S and lease.margin_s == margin
    assert before + TTL_S - margin <= lease.deadline <= after + TTL_S - margin
    assert await store.process_lease() is lease  # far from its deadline: the same


async def test_a_lease_about_to_lapse_is_renewed_before_a_new_attempt_goes_on_it(
        store: EtcdStore) -> None:
    lease = await store.process_lease()
    lease.deadline = time.monotonic() + 0.05  # keep-alives failed a while: nearly out
    again = await store.process_lease()
    assert again is lease and again.lease_id == lease.lease_id
    assert again.deadline - time.monotonic() > TTL_S / 3  # renewed, not left to lapse


async def test_a_lease_etcd_lost_is_replaced_by_a_new_one(store: EtcdStore) -> None:
    lease = await store.process_lease()
    old = lease.lease_id
    await store.etcd.revoke(old)  # what etcd does once keep-alives failed past its TTL
    lease.deadline = time.monotonic() + 0.05
    new = await store.process_lease()
    assert not lease.valid()  # the old one is lost: every attempt on it is fenced
    assert new.lease_id != old and new.valid()


def test_a_keep_alive_s_deadline_leaves_time_to_fail_over_before_the_lease_lapses() -> None:
    # At a 2 s TTL a keep-alive is sent with ~0.93 s left locally: a whole 1 s timeout on a
    # frozen member would outlast it (tests/e2e/test_devstack_etcd.py shows the freeze).
    assert keep_alive_deadline(0.93, 1.0) == pytest.approx(0.465)
    assert keep_alive_deadline(8.0, 1.0) == 1.0  # never longer than the store's timeout
    assert keep_alive_deadline(0.05, 1.0) == 0.1  # nor too short for a healthy member
    assert keep_alive_deadline(0.0, 1.0) == keep_alive_deadline(-3.0, 1.0) == 1.0  # lapsed
