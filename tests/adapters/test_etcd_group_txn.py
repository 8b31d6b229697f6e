"""Group commit on a real etcd: several independent conditional transactions nested in one
outer Txn with no compare (RequestOp.request_txn, etcd >= 3.3). Not something the journal
does; these are the rules such a batcher would have to live with (decision 0052, issue 28),
shown on the etcd the tests run: which keys siblings may share, that one sibling's failed
compare leaves the others alone, how many journal transactions fit in one group, and what a
lease does inside a nested transaction. The messages are aetcd's protobufs sent with
grpc.aio, as bench/etcd_transport.py sends them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from aetcd import rpc

from .test_journal_store import etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)

DUPLICATE = "etcdserver: duplicate key given in txn request"
TOO_MANY = "etcdserver: too many operations in txn request"
TOO_LARGE = "etcdserver: request is too large"


def put(key: bytes, val: bytes = b"v", lease: int = 0) -> Any:
    op = rpc.RequestOp()
    op.request_put.key, op.request_put.value, op.request_put.lease = key, val, lease
    return op


def delete(key: bytes) -> Any:
    op = rpc.RequestOp()
    op.request_delete_range.key = key
    return op


def get(key: bytes) -> Any:
    op = rpc.RequestOp()
    op.request_range.key = key
    return op


def absent(key: bytes) -> Any:
    c = rpc.Compare()
    c.key, c.target, c.result, c.version = key, rpc.Compare.VERSION, rpc.Compare.EQUAL, 0
    return c


def value_is(key: bytes, val: bytes) -> Any:
    c = rpc.Compare()
    c.key, c.target, c.result, c.value = key, rpc.Compare.VALUE, rpc.Compare.EQUAL, val
    return c


def txn(compare: Sequence[Any] = (), success: Sequence[Any] = (),
        failure: Sequence[Any] = ()) -> Any:
    t = rpc.TxnRequest()
    t.compare.extend(compare)
    t.success.extend(success)
    t.failure.extend(failure)
    return t


def nested(t: Any) -> Any:
    op = rpc.RequestOp()
    op.request_txn.CopyFrom(t)
    return op


def group(ts: Sequence[Any]) -> Any:
    """K transactions in one outer Txn with no compare: its success branch runs them all."""
    return txn(success=[nested(t) for t in ts])


def intake(p: bytes, lease: int = 0) -> Any:
    """The journal's intake shape (open_request with attempt 1 and a credential): absent
    meta; five puts; two reads on failure. Its widest branch has 5 ops."""
    return txn([absent(p + b"meta")],
               [put(p + b"meta", b"m" * 300, lease), put(p + b"guard", b"proc", lease),
                put(p + b"live", b"att_1", lease), put(p + b"attempts/001", b"a" * 300, lease),
                put(p + b"cred", b"c" * 64, lease)],
               [get(p + b"meta"), get(p + b"live")])


def finish(p: bytes) -> Any:
    """The journal's finish shape: absent outcome; put outcome, delete guard, the nested
    end-live txn, put the attempt's record; end-live alone on failure (depth 2 in a group)."""
    end_live = txn([value_is(p + b"live", b"att_1")], [delete(p + b"live")])
    return txn([absent(p + b"outcome")],
               [put(p + b"outcome", b"o" * 200), delete(p + b"guard"), nested(end_live),
                put(p + b"attempts/001", b"a" * 300)],
               [nested(end_live)])


@pytest.fixture
async def kv(etcd_endpoint: str) -> AsyncIterator[tuple[Any, Any]]:
    async with grpc.aio.insecure_channel(etcd_endpoint) as ch:
        yield rpc.KVStub(ch), rpc.LeaseStub(ch)


def _pfx() -> bytes:
    return f"/group/{uuid.uuid4().hex}/".encode()


async def _count(stub: Any, prefix: bytes) -> int:
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    got = await stub.Range(rpc.RangeRequest(key=prefix, range_end=end, count_only=True))
    return int(got.count)


async def _rejected(stub: Any, req: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Txn(req, timeout=5)
    return e.value.code(), str(e.value.details())


async def test_siblings_may_not_write_the_same_key_in_any_branch(kv: tuple[Any, Any]) -> None:
    stub, _ = kv
    p = _pfx()
    shared = p + b"budget/gw1"
    # Two requests' own keys: one group, both applied.
    ok = await stub.Txn(group([txn([absent(p + b"a")], [put(p + b"a")]),
                               txn([absent(p + b"b")], [put(p + b"b")])]), timeout=5)
    assert ok.succeeded and [r.response_txn.succeeded for r in ok.responses] == [True, True]
    # Both put one pool-wide key: the whole group is refused, nothing written.
    assert await _rejected(stub, group([txn([absent(p + b"c")], [put(shared)]),
                                        txn([absent(p + b"d")], [put(shared)])])) == (
        grpc.StatusCode.INVALID_ARGUMENT, DUPLICATE)
    # etcd checks both branches of every sibling: one's success against the other's
    # failure is refused too, though only one of them could run.
    assert await _rejected(stub, group([txn([absent(p + b"e")], [put(shared)]),
                                        txn([absent(p + b"f")], [put(p + b"f")],
                                            [put(shared)])])) == (
        grpc.StatusCode.INVALID_ARGUMENT, DUPLICATE)
    assert await _count(stub, p) == 2  # a, b
    # A put in one sibling and a delete of that key in the next are not refused: they run
    # in order, the put then the delete (a batcher would have to keep them apart itself).
    ok = await stub.Txn(group([txn(success=[put(shared)]), txn(success=[delete(shared)])]),
                        timeout=5)
    assert ok.succeeded and ok.responses[1].response_txn.responses[0] \
        .response_delete_range.deleted == 1
    assert await _count(stub, p) == 2
    # Within one nested txn the same key in its success and failure branches is fine,
    # and a read of a key another sibling writes is fine.
    ok = await stub.Txn(group([txn([absent(p + b"g")], [put(shared)], [put(shared)]),
                               txn(success=[get(shared)])]), timeout=5)
    assert [r.response_txn.succeeded for r in ok.responses] == [True, True]
    assert await _count(stub, p) == 3


async def test_one_failed_compare_leaves_its_siblings_alone(kv: tuple[Any, Any]) -> None:
    stub, _ = kv
    p = _pfx()
    await stub.Txn(txn(success=[put(p + b"taken", b"first")]), timeout=5)
    res = await stub.Txn(group([
        txn([absent(p + b"x")], [put(p + b"x")]),
        txn([absent(p + b"taken")], [put(p + b"taken", b"second")], [get(p + b"taken")]),
        txn([absent(p + b"y")], [put(p + b"y")])]), timeout=5)
    assert res.succeeded  # the outer has no compare
    assert [r.response_txn.succeeded for r in res.responses] == [True, False, True]
    # The failed one ran its failure branch: the read says what is there.
    (read,) = res.responses[1].response_txn.responses
    assert [x.value for x in read.response_range.kvs] == [b"first"]
    assert await _count(stub, p) == 3
    # All of them at one revision: one raft entry.
    got = await stub.Range(rpc.RangeRequest(key=p + b"x"))
    got_y = await stub.Range(rpc.RangeRequest(key=p + b"y"))
    assert got.kvs[0].mod_revision == got_y.kvs[0].mod_revision == res.header.revision


async def test_how_many_journal_transactions_fit_in_one_group(kv: tuple[Any, Any]) -> None:
    """max-txn-ops (128 by default) bounds the ops along a path, not their total: the outer's
    K siblings plus a nested txn's widest branch (its compares count) plus, one level down,
    its own nested txn's widest branch, at most 128. The journal's intake (5 puts) and
    finish (4 ops, one a nested txn of 1) both allow K = 123."""
    stub, _ = kv
    p = _pfx()

    def ones(k: int, m: int) -> Any:
        return group([txn(success=[put(p + b"o%d/%d/%d" % (k, i, j)) for j in range(m)])
                      for i in range(k)])

    assert (await stub.Txn(ones(127, 1), timeout=5)).succeeded
    assert await _rejected(stub, ones(127, 2)) == (grpc.StatusCode.INVALID_ARGUMENT, TOO_MANY)
    assert (await stub.Txn(ones(64, 64), timeout=5)).succeeded  # 4,096 puts, one call
    assert await _rejected(stub, ones(64, 65)) == (grpc.StatusCode.INVALID_ARGUMENT, TOO_MANY)

    intakes = [intake(p + b"req/%d/" % i) for i in range(124)]
    assert await _rejected(stub, group(intakes)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                     TOO_MANY)
    res = await stub.Txn(group(intakes[:123]), timeout=5)
    assert [r.response_txn.succeeded for r in res.responses] == [True] * 123
    finishes = [finish(p + b"req/%d/" % i) for i in range(124)]
    assert await _rejected(stub, group(finishes)) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                      TOO_MANY)
    res = await stub.Txn(group(finishes[:123]), timeout=5)
    assert [r.response_txn.succeeded for r in res.responses] == [True] * 123
    # finish's nested end-live ran in each: every live key is gone.
    live = await stub.Range(rpc.RangeRequest(key=p + b"req/0/live"))
    assert live.count == 0


async def test_a_group_is_bounded_by_max_request_bytes(kv: tuple[Any, Any]) -> None:
    """max-request-bytes (1.5 MiB by default) bounds the whole group: 100 puts of 15,000
    bytes pass, 100 of 16,000 do not. The journal's records (a few hundred bytes each) meet
    the ops limit long before this one."""
    stub, _ = kv
    p = _pfx()

    def big(n: int) -> Any:
        return group([txn(success=[put(p + b"%d/%d" % (n, i), b"z" * n)]) for i in range(100)])

    assert (await stub.Txn(big(15_000), timeout=5)).succeeded
    assert await _rejected(stub, big(16_000)) == (grpc.StatusCode.INVALID_ARGUMENT, TOO_LARGE)
    assert await _count(stub, p) == 100
    # The 1.5 MB go at once, not with the test etcd's data.
    await stub.DeleteRange(rpc.DeleteRangeRequest(key=p, range_end=p[:-1] + b"0"))


async def test_leases_inside_nested_transactions(kv: tuple[Any, Any]) -> None:
    stub, leases = kv
    p = _pfx()
    lease = (await leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=30), timeout=5)).ID
    try:
        res = await stub.Txn(group([intake(p + b"r1/", lease), intake(p + b"r2/")]), timeout=5)
        assert [r.response_txn.succeeded for r in res.responses] == [True, True]
        ttl = await leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease, keys=True),
                                           timeout=5)
        assert sorted(ttl.keys) == sorted(p + b"r1/" + k for k in (
            b"meta", b"guard", b"live", b"attempts/001", b"cred"))
        # A lease etcd does not have, in one sibling's branch that runs: the whole group
        # fails, its siblings unwritten (a lost lease in one request fails all K).
        gone = lease + 1_000_003
        code, msg = await _rejected(stub, group([intake(p + b"r3/", gone), intake(p + b"r4/")]))
        assert (code, msg) == (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
        assert await _count(stub, p + b"r4/") == 0
        # In a branch that does not run (r1's meta exists: its failure branch runs), it
        # is not looked at.
        res = await stub.Txn(group([intake(p + b"r1/", gone), intake(p + b"r5/")]), timeout=5)
        assert [r.response_txn.succeeded for r in res.responses] == [False, True]
        # Revoking the lease takes r1's keys, and no other request's.
        await leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease), timeout=5)
        lease = 0
        assert await _count(stub, p + b"r1/") == 0
        assert await _count(stub, p + b"r2/") == 5
    finally:
        if lease:
            await leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease), timeout=5)
