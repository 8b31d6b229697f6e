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


# --- the request built in place (decision 0048) ------------------------------------------

def _reference_txn(t: Txn) -> object:
    """The request as keyword constructors build it, each level given to its parent: what
    etcd received before decision 0048; the in-place build must send the same bytes."""
    from aetcd import rpc

    from extproc.adapters.kv import Compare, Delete, Target, prefix_end
    from extproc.adapters.kv_etcd import _RESULT, _TARGET

    def compare(c: Compare) -> object:
        field = {Target.VALUE: "value", Target.VERSION: "version",
                 Target.MOD: "mod_revision"}[c.target]
        return rpc.Compare(key=c.key, target=_TARGET[c.target], result=_RESULT[c.result],
                           **{field: c.value})

    def op(o: object) -> object:
        if isinstance(o, Put):
            return rpc.RequestOp(request_put=rpc.PutRequest(key=o.key, value=o.value,
                                                            lease=o.lease))
        if isinstance(o, Delete):
            return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                key=o.key, range_end=prefix_end(o.key) if o.prefix else b""))
        if isinstance(o, Get):
            return rpc.RequestOp(request_range=rpc.RangeRequest(
                key=o.key, range_end=prefix_end(o.key) if o.prefix else b""))
        assert isinstance(o, Txn)
        return rpc.RequestOp(request_txn=_reference_txn(o))

    return rpc.TxnRequest(compare=[compare(c) for c in t.compare],
                          success=[op(o) for o in t.success],
                          failure=[op(o) for o in t.failure])


def test_the_request_built_in_place_is_the_same_bytes_as_the_constructors() -> None:
    import random

    from extproc.adapters.kv import Cmp, Compare, Delete, Target
    from extproc.adapters.kv_etcd import _txn

    rng = random.Random(48)
    keys = [b"", b"/p/live/r1", b"/p/req/\xff", b"a"]

    def compare() -> Compare:
        target = rng.choice(list(Target))
        value: bytes | int = (rng.choice([b"", b"v", b"{}"]) if target is Target.VALUE
                              else rng.choice([0, 1, 7, 2**40]))
        return Compare(rng.choice(keys), target, rng.choice(list(Cmp)), value)

    def op(depth: int) -> object:
        kind = rng.randrange(4 if depth < 2 else 3)
        if kind == 0:
            return Put(rng.choice(keys), rng.choice([b"", b"x", b"{\"a\":1}"]),
                       rng.choice([0, 0, 5, 2**62]))
        if kind == 1:
            return Delete(rng.choice(keys), rng.random() < 0.5)
        if kind == 2:
            return Get(rng.choice(keys), rng.random() < 0.5)
        return txn(depth + 1)

    def txn(depth: int) -> Txn:
        return Txn(compare=[compare() for _ in range(rng.randrange(3))],
                   success=[op(depth) for _ in range(rng.randrange(4))],
                   failure=[op(depth) for _ in range(rng.randrange(3))])

    shapes = [Txn(), Txn(success=[Put(b"", b"")]), Txn(success=[Delete(b"")]),
              Txn(success=[Get(b"")]), Txn(success=[Txn()]), Txn(failure=[Txn(compare=[
                  Compare(b"", Target.VERSION, Cmp.EQUAL, 0)])])]
    shapes += [txn(0) for _ in range(400)]
    for t in shapes:
        got, want = _txn(t).SerializeToString(), _reference_txn(t).SerializeToString()
        assert got == want, t
        assert _txn(t) == _reference_txn(t), t


async def test_reads_are_the_ranges_of_the_branch_taken_and_empty_for_other_ops(
        etcd_endpoint: str) -> None:
    from extproc.adapters.kv import Delete, absent, present

    kv = EtcdKV(_cfg(etcd_endpoint))
    kv.open()
    p = f"/kv-etcd/{uuid.uuid4().hex}/".encode()
    try:
        put = await kv.txn(Txn(success=[Put(p + b"a", b"1"), Put(p + b"b", b"2")]))
        assert put.succeeded and put.reads == ((), ())
        # The failure branch, a read among other ops, a nested transaction's answer.
        r = await kv.txn(Txn(compare=[absent(p + b"a")], success=[Put(p + b"c", b"3")],
                             failure=[Put(p + b"d", b"4"), Get(p, prefix=True),
                                      Txn(success=[Get(p + b"a")]), Get(p + b"zz")]))
        assert not r.succeeded and r.revision == put.revision + 1
        assert [[(x.key, x.value) for x in rd] for rd in r.reads] == [
            [], [(p + b"a", b"1"), (p + b"b", b"2"), (p + b"d", b"4")], [], []]
        w = await kv.txn(Txn(compare=[present(p + b"a")], success=[Delete(p + b"d")],
                             failure=[Get(p)]))
        assert w.succeeded and w.reads == ((),)
    finally:
        await kv.close()
