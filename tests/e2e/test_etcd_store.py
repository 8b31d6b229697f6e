"""The etcd store against a real etcd, where timing alone cannot make the case happen."""

from __future__ import annotations

import asyncio
import time
import uuid

from aetcd import rpc

from devkit.devstack import Stack
from extproc.adapters.etcd_store import EtcdStore, ToolLedger
from extproc.adapters.leases import UNDO_SETTLE_S
from extproc.adapters.processor import retrying
from extproc.adapters.timers import LoopTimers
from extproc.core.config import EtcdConfig, load_config


def _cfg(stack: Stack) -> EtcdConfig:
    return load_config({"etcd": {"endpoints": [stack.etcd_endpoint],
                                 "prefix": f"/test-store/{uuid.uuid4().hex}"}}).etcd


def test_intake_after_etcd_expired_our_leases_writes_on_new_ones(stack: Stack) -> None:
    """etcd frozen longer than the session TTL expires the session and process leases on
    waking; the keep-alive loops notice only a third of a TTL later. A request arriving in
    between must not fail with `journal_unavailable`: the intake finds the expired leases,
    re-grants them and writes its record (found by the fencing tests' etcd freeze)."""
    async def run() -> None:
        store = EtcdStore(_cfg(stack), owner="test")
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
            pl = store.current_process_lease("req_t1")
            assert pl is not None and pl.lease_id == new_process and pl.valid()
            assert (await store.session_lease()) == new_session
        finally:
            await store.close()

    asyncio.run(run())


def test_a_take_back_catches_the_write_etcd_applies_after_it(stack: Stack) -> None:
    """A tool claim timed out in a frozen etcd; when etcd wakes it may apply our take-back
    first and the queued claim right after (seen in the tool tests: a claim nobody executes
    stayed "in progress" for good). The take-back goes on being applied for UNDO_SETTLE_S
    after its first answer, so it removes the late claim too."""
    async def run() -> None:
        store = EtcdStore(_cfg(stack), owner="test")
        await store.connect()
        ledger = ToolLedger(store, 3600)
        rid, aid, key = "req_t2", "att_t2", "req_t2:call_1"
        entry = {"state": "running", "attempt_id": aid}
        try:
            await store._kv.Put(rpc.PutRequest(key=store._live(rid), value=aid.encode()))
            # Its credential digest (decision 0028): a claim compares its revision.
            await store._kv.Put(rpc.PutRequest(key=store._cred(rid, aid), value=b"0" * 64))
            _, cred_rev = await ledger.credential(rid, aid)
            answers: list[bool] = []

            async def undo() -> None:
                answers.append(await ledger.undo_claim(key, entry))
                if len(answers) == 1:  # etcd applies the queued claim just after
                    claimed, _, _, _ = await ledger.claim(key, rid, aid, entry, cred_rev)
                    assert claimed

            # On the loop's own time: what it catches is a real etcd applying a queued write.
            assert await retrying(undo, "undo a claim", rid, aid, settle_s=UNDO_SETTLE_S,
                                  timers=LoopTimers(), now=asyncio.get_running_loop().time)
            assert answers[0] is False and True in answers[1:]
            assert await ledger.get(key) == (None, False)  # no claim, no executor marker
        finally:
            await store.close()

    asyncio.run(run())


def test_a_new_attempt_is_not_put_on_a_lease_about_to_lapse(stack: Stack) -> None:
    """Keep-alives failed while etcd was frozen, so the process lease's local deadline is
    close. An attempt admitted on it now would be fenced moments later, mid-stream (seen in
    the fencing tests); the lease is renewed before it is handed out."""
    async def run() -> None:
        store = EtcdStore(_cfg(stack), owner="test")
        await store.connect()
        try:
            lease = await store.process_lease()
            lease.deadline = time.monotonic() + 0.1  # as after failed keep-alives
            again = await store.process_lease()
            assert again is lease  # the same lease: attempts already on it stay valid
            assert lease.deadline - time.monotonic() > lease.ttl_s / 2
        finally:
            await store.close()

    asyncio.run(run())
