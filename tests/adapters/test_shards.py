"""The journal sharded by request id (shards.py, decision 0042): the shard function's
fixed vectors, and the router over two in-memory clusters: each request's keys on its own
shard only, the pool-wide budget on shard 0, a down shard refusing only its own requests.
The journal's contract over the router is tests/adapters/test_journal_store.py ("sharded")."""

from __future__ import annotations

import pytest

from extproc.adapters.journal_store import ToolLedger
from extproc.adapters.kv import Get, Txn
from extproc.adapters.leases import StoreUnavailable
from extproc.adapters.memory_store import MemoryStore
from extproc.adapters.shards import ShardedJournal, ShardedLedger, journal_for, shard_of
from extproc.core.config import load_config

META = {"model": "demo-model", "max_attempts": 3, "stream": True}


def test_the_shard_of_a_request_is_fixed_forever() -> None:
    # Fixed vectors: a change here moves every deployed request's records (decision 0042).
    assert [shard_of(r, 2) for r in ("req_a", "req_b", "req_c", "req_d")] == [0, 1, 0, 1]
    assert [shard_of(r, 3) for r in ("req_a", "req_b", "req_c", "req_d", "req_e")] == \
        [0, 0, 2, 1, 0]
    assert shard_of("req_0123456789abcdef", 4) == 3
    assert shard_of("req_0123456789abcdef", 7) == 4
    assert shard_of("anything", 1) == 0 and shard_of("", 1) == 0


def test_shards_spread_requests_evenly() -> None:
    counts = [0, 0, 0]
    for i in range(3000):
        counts[shard_of(f"req_{i:08x}", 3)] += 1
    assert all(900 < c < 1100 for c in counts), counts


def _stores() -> tuple[MemoryStore, MemoryStore]:
    cfg = load_config({"etcd": {"shards": [{"endpoints": ["127.0.0.1:2479"]}]}}).etcd
    a, b = (MemoryStore(c, owner="gw/1") for c in cfg.clusters())
    return a, b


async def _keys(store: MemoryStore) -> list[bytes]:
    res = await store.kv.txn(Txn(success=[Get(b"/llmgw/v1/", prefix=True)]))
    return [kv.key for kv in res.reads[0]]


async def test_each_request_lives_on_its_own_shard_only() -> None:
    s0, s1 = _stores()
    j = ShardedJournal((s0, s1))
    for rid in ("req_a", "req_b"):
        await j.open_request(rid, {**META, "request_id": rid},
                             (f"att_{rid}", {"attempt": 1, "attempt_id": f"att_{rid}"}))
        assert await j.fence_first_delta(rid, f"att_{rid}", {"attempt": 1})
    k0, k1 = await _keys(s0), await _keys(s1)
    assert k0 and all(b"req_a" in k for k in k0)
    assert k1 and all(b"req_b" in k for k in k1)
    # The process lease is the request's cluster's.
    la, lb = j.current_process_lease("req_a"), j.current_process_lease("req_b")
    assert la is s0.current_process_lease("req_a") and lb is s1.current_process_lease("req_b")
    assert (await j.attempt_lease("req_b")).lease_id == lb.lease_id  # type: ignore[union-attr]
    # The tool ledger: a key `<rid>:<call>` goes to its request's shard.
    ledger = ShardedLedger([ToolLedger(s0, 60), ToolLedger(s1, 60)])
    await ledger.record("req_b:call_1", {"state": "done"})
    assert await ledger.get("req_b:call_1") == ({"state": "done"}, False)
    assert await ToolLedger(s0, 60).get("req_b:call_1") == (None, False)


async def test_the_budget_is_pool_wide_on_shard_0() -> None:
    s0, s1 = _stores()
    j = ShardedJournal((s0, s1))
    await j.exchange_budget("gw-a", 10, 1)
    assert await _keys(s1) == []
    assert [k for k in await _keys(s0) if b"/budget/" in k] == [b"/llmgw/v1/budget/gw-a"]


async def test_a_down_shard_refuses_only_its_own_requests() -> None:
    s0, s1 = _stores()
    j = ShardedJournal((s0, s1))
    s1.unavailable = True
    assert await j.open_request("req_a", {**META, "request_id": "req_a"}) is None
    with pytest.raises(StoreUnavailable):
        await j.open_request("req_b", {**META, "request_id": "req_b"})
    assert await j.exchange_budget("gw-a", 1, 0) == {}
    s1.unavailable = False
    assert await j.open_request("req_b", {**META, "request_id": "req_b"}) is None
    view = await j.get("req_b")
    assert view is not None and view.request_id == "req_b"


def test_one_shard_is_the_store_itself() -> None:
    s0, _ = _stores()
    journal, ledger = journal_for([s0], 60)
    assert journal is s0 and isinstance(ledger, ToolLedger) and ledger.s is s0


class _Answers:
    def __init__(self, at: float | None) -> None:
        self.last_answer = at

    async def healthy(self) -> bool:
        return self.last_answer is not None


def test_each_shard_has_its_silence_gauge_and_readiness_follows_shard_0() -> None:
    from collections.abc import Callable

    from extproc.adapters.readiness import HealthReporter, export_gauges

    seen: dict[str, Callable[[], float | None]] = {}

    class Gauges:
        def observe(self, name: str, description: str, unit: str,
                    read: Callable[[], float | None]) -> None:
            seen[name] = read

    shards = [_Answers(90.0), _Answers(None), _Answers(99.5)]
    rep = HealthReporter(None, shards[0], 5.0, clock=lambda: 100.0)  # type: ignore[arg-type]
    export_gauges(Gauges(), rep, lambda: 0, None, shards)
    assert seen["llmgw.etcd.last_answer_age"]() == 10.0  # readiness's source: shard 0
    assert [seen[f"llmgw.etcd.shard{k}.last_answer_age"]() for k in range(3)] == \
        [10.0, None, 0.5]
    seen.clear()
    export_gauges(Gauges(), rep, lambda: 0, None, shards[:1])  # one cluster: no shard gauges
    assert not [n for n in seen if ".shard" in n]
