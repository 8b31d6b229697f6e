"""adapters/kv_etcd: the KV port on a real etcd. What is its own (etcd's semantics, which the
in-memory fake shares, are test_kv_memory.py's): every gRPC failure is a StoreUnavailable
within the call's deadline, an answered call is the readiness signal (a keep-alive is not),
and a watch says when it is up and stops when told."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from devkit.devstack import free_port
from extproc.adapters.kv import Get, Put, Txn, WatchEvent
from extproc.adapters.kv_etcd import EtcdKV
from extproc.adapters.leases import StoreUnavailable

from .support import KVTap, idle
from .test_journal_store import _cfg, etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)


async def test_a_client_not_opened_is_unavailable() -> None:
    kv = EtcdKV(_cfg("127.0.0.1:1"))
    with pytest.raises(StoreUnavailable, match="not open"):
        await kv.txn(Txn())


async def test_an_unreachable_etcd_is_unavailable_within_the_deadline() -> None:
    kv = EtcdKV(_cfg(f"127.0.0.1:{free_port()}"))
    kv.open()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        with pytest.raises(StoreUnavailable, match=r"^etcd (UNAVAILABLE|DEADLINE_EXCEEDED)"):
            await kv.txn(Txn(success=[Get(b"/x")]))
        assert loop.time() - t0 < kv.timeout + 1.0
        assert kv.last_answer is None  # nothing answered: readiness stays off
    finally:
        await kv.close()


async def test_answers_are_the_readiness_signal_and_a_watch_says_it_is_up(
        etcd_endpoint: str) -> None:
    kv = EtcdKV(_cfg(etcd_endpoint))
    kv.open()
    tap = KVTap(kv)
    p = f"/kv-etcd/{uuid.uuid4().hex}/".encode()
    try:
        res = await kv.txn(Txn(success=[Put(p + b"a", b"1")]))
        assert res.succeeded and res.revision > 0
        answered = kv.last_answer
        assert answered is not None
        lease = await kv.grant(5)
        assert lease.ttl_s == 5 and await kv.time_to_live(lease.id) > 0
        after_grant = kv.last_answer
        assert after_grant is not None and after_grant >= answered
        assert await kv.keep_alive(lease.id) == 5
        assert kv.last_answer == after_grant  # a keep-alive's own stream: not counted
        await kv.revoke(lease.id)
        assert await kv.keep_alive(lease.id) == 0  # gone

        stop = tap.watch(p, lambda ev: None)
        await tap.until(lambda: tap.up.get(p) is True, "the watch is up")
        await kv.txn(Txn(success=[Put(p + b"a", b"2")]))
        await tap.until(lambda: len(tap.events.get(p, [])) == 1, "the change")
        assert tap.events[p] == [WatchEvent(p + b"a", b"2", b"1", True)]
        stop()
        # A second watch of the same keys hears the next change; the stopped one does not
        # (both streams carry it from the same etcd at the same time).
        q = p + b"a"
        tap.watch(q, lambda ev: None)
        await tap.until(lambda: tap.up.get(q) is True, "the second watch is up")
        await kv.txn(Txn(success=[Put(p + b"a", b"3")]))
        await tap.until(lambda: len(tap.events.get(q, [])) == 1, "the second watch's change")
        await idle()
        assert len(tap.events[p]) == 1
    finally:
        await kv.close()
