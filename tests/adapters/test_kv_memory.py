"""The in-memory fake of etcd behaves like etcd where the journal relies on it.

Every test runs twice with identical assertions: on kv_memory.MemoryKV (time on a fake clock,
advanced instead of slept) and on kv_etcd.EtcdKV over a real etcd started for this module on
a free loopback port. What is asserted is what journal_store.py leans on: compare semantics
(an absent key, values, versions, mod revisions), the store revision and each key's
revisions and version, a transaction all or nothing (a put on a lost lease refuses it whole),
nested transactions judged before anything applies, leases whose end takes their keys, and
the prefix watch (values, the value replaced, deletes by a lease's end).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from extproc.adapters.kv import (
    KV,
    LEASE_NOT_FOUND,
    Delete,
    Get,
    KeyValue,
    Put,
    Txn,
    WatchEvent,
    absent,
    mod_is,
    present,
    value_below,
    value_is,
    version_is,
)
from extproc.adapters.kv_etcd import EtcdKV
from extproc.adapters.kv_memory import MemoryKV
from extproc.adapters.leases import StoreUnavailable
from tests.adapters.support import KVTap
from tests.adapters.test_journal_store import FakeClock, _cfg, etcd_endpoint

__all__ = ["etcd_endpoint"]  # the module's etcd (a fixture of its own here)

TTL_S = 2  # etcd's minimum lease TTL


@dataclass
class Env:
    kind: str
    kv: KV
    p: bytes  # this test's key prefix
    clock: FakeClock | None

    def k(self, name: str) -> bytes:
        return self.p + name.encode()

    async def pass_time(self, s: float) -> None:
        """s seconds go by: on the fake clock, advanced; on etcd, real ones (a real lease's
        TTL runs on etcd's own time: decision 0032 lists this wait)."""
        if self.clock is None:
            await asyncio.sleep(s)
        else:
            self.clock.advance(s)

    async def read(self, name: str, prefix: bool = False) -> tuple[KeyValue, ...]:
        return (await self.kv.txn(Txn(success=[Get(self.k(name), prefix)]))).reads[0]

    async def revision(self) -> int:
        return (await self.kv.txn(Txn(success=[Get(self.k("nothing"))]))).revision


@pytest.fixture(params=["memory", "etcd"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    p = f"/kv/{uuid.uuid4().hex}/".encode()
    if request.param == "memory":
        clock = FakeClock()
        mem = MemoryKV(clock)
        yield Env("memory", mem, p, clock)
        await mem.close()
        return
    etcd = EtcdKV(_cfg(request.getfixturevalue("etcd_endpoint")))
    etcd.open()
    try:
        yield Env("etcd", etcd, p, None)
    finally:
        await etcd.close()


async def _until(pred: Callable[[], Awaitable[bool]], what: str, env: Env,
                 s: float = 6.0) -> None:
    """Until `pred`: on the fake clock time moves by steps; a real etcd ends a lease on its
    own time (it checks expiries about twice a second): a bounded poll of etcd's own
    asynchrony, used for the lease's expiry only."""
    deadline = time.monotonic() + s
    while not await pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await env.pass_time(0.1)


# --- compares -------------------------------------------------------------------------------


async def test_compares_on_an_absent_key(env: Env) -> None:
    kv, a = env.kv, env.k("a")
    for c, holds in ((value_is(a, b""), False), (value_below(a, b"zzz"), False),
                     (version_is(a, 0), True), (absent(a), True), (present(a), False),
                     (mod_is(a, 0), True)):
        assert (await kv.txn(Txn([c]))).succeeded is holds, c


async def test_compares_on_a_present_key(env: Env) -> None:
    kv, a = env.kv, env.k("a")
    rev = (await kv.txn(Txn(success=[Put(a, b"att_1")]))).revision
    for c, holds in ((value_is(a, b"att_1"), True), (value_is(a, b"att_2"), False),
                     (value_below(a, b"fenced:"), True), (value_below(a, b"att_1"), False),
                     (absent(a), False), (present(a), True), (version_is(a, 1), True),
                     (mod_is(a, rev), True), (mod_is(a, rev - 1), False)):
        assert (await kv.txn(Txn([c]))).succeeded is holds, c
    await kv.txn(Txn(success=[Put(a, b"fenced:att_1")]))
    assert not (await kv.txn(Txn([value_below(a, b"fenced:")]))).succeeded


async def test_every_compare_must_hold_and_the_branch_runs_with_its_reads(env: Env) -> None:
    kv, a, b = env.kv, env.k("a"), env.k("b")
    await kv.txn(Txn(success=[Put(a, b"1")]))
    res = await kv.txn(Txn([present(a), present(b)], [Put(b, b"won")],
                           [Get(a), Get(b), Put(b, b"lost"), Get(b)]))
    assert not res.succeeded
    assert [[x.value for x in r] for r in res.reads] == [[b"1"], [], [], [b"lost"]]
    res = await kv.txn(Txn([present(a), present(b)], [Put(b, b"won")], [Put(b, b"x")]))
    assert res.succeeded and res.reads == ((),)
    assert [x.value for x in await env.read("b")] == [b"won"]


# --- revisions --------------------------------------------------------------------------------


async def test_revisions_and_versions(env: Env) -> None:
    kv, a, b = env.kv, env.k("a"), env.k("b")
    r0 = await env.revision()
    r1 = (await kv.txn(Txn(success=[Put(a, b"1"), Put(b, b"1")]))).revision
    assert r1 == r0 + 1  # one transaction, one revision for all its writes
    (ka,), (kb,) = await env.read("a"), await env.read("b")
    assert (ka.create_revision, ka.mod_revision, ka.version) == (r1, r1, 1)
    assert (kb.create_revision, kb.mod_revision, kb.version) == (r1, r1, 1)
    r2 = (await kv.txn(Txn(success=[Put(a, b"2")]))).revision
    assert r2 == r1 + 1
    (ka,) = await env.read("a")
    assert (ka.create_revision, ka.mod_revision, ka.version) == (r1, r2, 2)
    # Nothing changed, no new revision: reads, a failed compare, a delete of nothing.
    await kv.txn(Txn([absent(a)], [Put(a, b"x")]))
    await kv.txn(Txn(success=[Delete(env.k("nobody")), Get(a)]))
    assert await env.revision() == r2
    r3 = (await kv.txn(Txn(success=[Delete(a)]))).revision
    assert r3 == r2 + 1 and await env.read("a") == ()
    r4 = (await kv.txn(Txn(success=[Put(a, b"3")]))).revision
    (ka,) = await env.read("a")  # a new key: its history forgotten
    assert (ka.create_revision, ka.mod_revision, ka.version) == (r4, r4, 1)


async def test_prefix_reads_are_sorted_and_prefix_deletes_take_only_the_prefix(
        env: Env) -> None:
    kv = env.kv
    await kv.txn(Txn(success=[Put(env.k(n), n.encode()) for n in ("r/b", "r/a/2", "r/a/1",
                                                                  "r", "rx")]))
    assert [x.key for x in await env.read("r/", prefix=True)] == [
        env.k("r/a/1"), env.k("r/a/2"), env.k("r/b")]
    await kv.txn(Txn(success=[Delete(env.k("r/a/"), prefix=True)]))
    assert [x.key for x in await env.read("r", prefix=True)] == [
        env.k("r"), env.k("r/b"), env.k("rx")]


async def test_a_nested_transaction_is_judged_before_anything_applies(env: Env) -> None:
    kv, a, b, c = env.kv, env.k("a"), env.k("b"), env.k("c")
    res = await kv.txn(Txn(success=[Put(a, b"1"),
                                    Txn([present(a)], [Put(b, b"1")], [Put(c, b"1")])]))
    assert res.succeeded
    assert await env.read("b") == ()  # `a` was absent when the compares were judged
    assert [x.value for x in await env.read("c")] == [b"1"]
    (ka,), (kc,) = await env.read("a"), await env.read("c")
    assert ka.mod_revision == kc.mod_revision == res.revision


# --- leases -----------------------------------------------------------------------------------


async def test_a_put_on_a_lease_that_is_gone_refuses_the_whole_transaction(env: Env) -> None:
    kv, a, b = env.kv, env.k("a"), env.k("b")
    lease = await kv.grant(60)
    assert lease.ttl_s == 60
    await kv.revoke(lease.id)
    r = await env.revision()
    with pytest.raises(StoreUnavailable, match=LEASE_NOT_FOUND):
        await kv.txn(Txn(success=[Put(a, b"1"), Put(b, b"1", lease.id)]))
    assert await env.read("a") == () and await env.revision() == r
    # Only the branch that runs counts.
    assert not (await kv.txn(Txn([present(a)], [Put(b, b"1", lease.id)],
                                 [Put(a, b"2")]))).succeeded
    assert [x.value for x in await env.read("a")] == [b"2"]
    assert await kv.time_to_live(lease.id) <= 0
    assert await kv.keep_alive(lease.id) == 0


async def test_a_revoked_lease_takes_its_keys_in_one_revision(env: Env) -> None:
    kv = env.kv
    lease = await kv.grant(60)
    r = (await kv.txn(Txn(success=[Put(env.k("a"), b"1", lease.id),
                                   Put(env.k("b"), b"1", lease.id), Put(env.k("c"), b"1")]))
         ).revision
    (ka,) = await env.read("a")
    assert ka.lease == lease.id
    assert 0 < await kv.time_to_live(lease.id) <= 60
    await kv.revoke(lease.id)
    assert await env.read("a") == () and await env.read("b") == ()
    assert [x.value for x in await env.read("c")] == [b"1"]
    assert await env.revision() == r + 1


async def test_a_lease_expires_after_its_ttl_unless_kept_alive(env: Env) -> None:
    kv = env.kv
    short, kept = await kv.grant(TTL_S), await kv.grant(TTL_S)
    await kv.txn(Txn(success=[Put(env.k("short"), b"1", short.id),
                              Put(env.k("kept"), b"1", kept.id)]))
    await env.pass_time(TTL_S / 2)
    assert await kv.keep_alive(kept.id) == TTL_S
    assert await env.read("short") != ()  # not yet

    async def short_gone() -> bool:
        return await env.read("short") == ()
    await _until(short_gone, "the short lease's expiry", env)
    assert await kv.time_to_live(short.id) <= 0 and await kv.keep_alive(short.id) == 0
    assert await env.read("kept") != () and await kv.keep_alive(kept.id) == TTL_S
    assert TTL_S - 1 <= await kv.time_to_live(kept.id) <= TTL_S  # whole seconds left


# --- the prefix watch -------------------------------------------------------------------------


async def test_the_watch_sees_puts_replaces_deletes_and_lease_ends(env: Env) -> None:
    kv, a, b = env.kv, env.k("w/a"), env.k("w/b")
    tap = KVTap(kv)  # the watches' state and events, to wait for them instead of time
    seen: list[WatchEvent] = []
    ups: list[bool] = []
    stop = tap.watch(env.k("w/"), seen.append, ups.append)
    await tap.until(lambda: ups[-1:] == [True], "the watch")
    lease = await kv.grant(60)
    await kv.txn(Txn(success=[Put(a, b"att_1", lease.id), Put(env.k("other"), b"x")]))
    await kv.txn(Txn(success=[Put(a, b"att_2", lease.id)]))
    await kv.txn(Txn(success=[Delete(a)]))
    await kv.txn(Txn(success=[Put(b, b"fenced:att_2", lease.id)]))
    await kv.revoke(lease.id)
    want = [WatchEvent(a, b"att_1", None, True), WatchEvent(a, b"att_2", b"att_1", True),
            WatchEvent(a, None, b"att_2", True), WatchEvent(b, b"fenced:att_2", None, True),
            WatchEvent(b, None, b"fenced:att_2", True)]
    await tap.until(lambda: len(seen) >= len(want), "every event")
    assert seen == want
    stop()
    # Stopped: the next put reaches a watch still running (a second one, of `a`), not it.
    stop_a = tap.watch(a, lambda ev: None)
    await tap.until(lambda: tap.up.get(a, False), "a second watch")
    await kv.txn(Txn(success=[Put(a, b"att_3")]))
    await tap.until(lambda: tap.delivered(a, a, b"att_3"), "the put, to the second watch")
    assert seen == want  # no more events
    stop_a()
