"""Our leases against a real etcd: a lease etcd expired while it was unreachable."""

from __future__ import annotations

import asyncio
import uuid

from aetcd import rpc

from extproc.adapters.etcd_store import EtcdStore
from extproc.core.config import load_config
from extproc.devstack import Stack


def test_intake_after_etcd_expired_our_leases_writes_on_new_ones(stack: Stack) -> None:
    """etcd frozen longer than the session TTL expires the session and process leases on
    waking; the keep-alive loops notice only a third of a TTL later. A request arriving in
    between must not fail with `journal_unavailable`: the intake finds the expired leases,
    re-grants them and writes its record (found by the fencing tests' etcd freeze)."""
    cfg = load_config({"etcd": {"endpoints": [stack.etcd_endpoint],
                                "prefix": f"/test-leases/{uuid.uuid4().hex}"}}).etcd

    async def run() -> None:
        store = EtcdStore(cfg, owner="test")
        await store.connect()  # no background loops: nothing else notices the expiry
        try:
            old_session = await store.session_lease()
            old_process = (await store.process_lease()).lease_id
            for lid in (old_session, old_process):  # what etcd does to an expired lease
                await store._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lid))
            created = await store.open_request(
                "req_t1", {"request_id": "req_t1"}, ("att_t1", {"attempt_id": "att_t1"}))
            assert created is None  # a new record, not a repeat
            view = await store.get("req_t1")
            assert view is not None and view.live_attempt_id == "att_t1"
            assert view.guard == "test" and view.attempts[0]["attempt_id"] == "att_t1"
            live = await store._kv.Range(rpc.RangeRequest(key=store._live("req_t1")))
            guard = await store._kv.Range(rpc.RangeRequest(key=store._k("req_t1", "guard")))
            new_process, new_session = live.kvs[0].lease, guard.kvs[0].lease
            assert new_process not in (0, old_process) and new_session not in (0, old_session)
            pl = store.current_process_lease()
            assert pl is not None and pl.lease_id == new_process and pl.valid()
            assert (await store.session_lease()) == new_session
        finally:
            await store.close()

    asyncio.run(run())
