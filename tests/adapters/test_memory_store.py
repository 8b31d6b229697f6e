"""The memory store's own controls, which etcd has no counterpart of: failures on demand,
etcd away, a process lease revoked, leases expired on the fake clock. The journal's
transactions on this store are tested with etcd's in test_journal_store.py."""

from __future__ import annotations

import asyncio

import pytest

from extproc.adapters.leases import StoreUnavailable
from extproc.adapters.memory_store import MemoryLedger, MemoryStore

from .support import FakeTimers, idle
from .test_journal_store import META, OWNER, TTL_S, FakeClock, _cfg, _rec, _within

# --- the memory store's own controls (no etcd counterpart) ----------------------------------


def _memory() -> tuple[MemoryStore, FakeClock]:
    clock = FakeClock()
    return MemoryStore(_cfg("127.0.0.1:1"), clock, owner=OWNER), clock


async def test_memory_fail_next_and_unavailable_raise_and_apply_nothing() -> None:
    s, _ = _memory()
    s.fail_next(2)
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            await s.open_request("req_a", META, ("att_1", _rec(1, "att_1")))
    assert await s.get("req_a") is None
    await s.open_request("req_a", META, ("att_1", _rec(1, "att_1")))
    s.unavailable = True
    assert not await s.healthy()
    with pytest.raises(StoreUnavailable):
        await s.fence_first_delta("req_a", "att_1", {"at": 1.0})
    with pytest.raises(StoreUnavailable):
        await s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 1.0)
    with pytest.raises(StoreUnavailable):
        await MemoryLedger(s, 3600).claim("req_a:c", "req_a", "att_1", {}, 1)
    s.unavailable = False
    assert await s.healthy()
    assert await s.fence_first_delta("req_a", "att_1", {"at": 1.0})
    await s.close()


async def test_memory_etcd_down_mid_wait_ends_the_admission() -> None:
    clock = FakeClock()
    timers = FakeTimers(clock)
    s = MemoryStore(_cfg("127.0.0.1:1"), clock, owner=OWNER, timers=timers)
    await s.open_request("req_a", META, ("att_1", _rec(1, "att_1")))
    task = asyncio.create_task(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    await idle()
    assert not task.done()  # waiting for att_1's `live` to go
    s.unavailable = True
    assert timers.advance(0.25) == 1  # a poll's worth: the admission looks again, etcd away
    s.expire_leases()
    with pytest.raises(StoreUnavailable):
        await _within(task, 2.0)


async def test_memory_a_revoked_process_lease_fences_its_attempts() -> None:
    s, clock = _memory()
    await s.open_request("req_a", META, ("att_1", _rec(1, "att_1")))
    seen: list[str | None] = []
    s.on_live_change("req_a", seen.append)
    pl = s.current_process_lease("req_a")
    assert pl is not None and pl.valid(clock.monotonic())
    s.revoke_lease(pl.lease_id)
    assert seen == [None] and not pl.valid(clock.monotonic())
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id is None
    lease = await s.attempt_lease("req_a")
    assert lease.lease_id != pl.lease_id and lease.valid(clock.monotonic())


async def test_memory_expiry_is_applied_lazily_and_by_expire_leases() -> None:
    s, clock = _memory()
    await s.open_request("req_a", META, ("att_1", _rec(1, "att_1")))
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=True)
    seen: list[str | None] = []
    s.on_live_change("req_a", seen.append)
    clock.advance(TTL_S)
    assert seen == []  # nothing looked at the clock yet
    s.expire_leases()
    assert seen == [None]
    # The journal's retention: gone after journal_retention_s (within its window, as etcd).
    clock.advance(s.cfg.journal_retention_s)
    assert await s.get("req_a") is None
    assert await s.open_request("req_a", META) is None  # a fresh retention lease
    assert await s.get("req_a") is not None
