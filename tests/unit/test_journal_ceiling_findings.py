"""What the journal-ceiling e2e found (issue 28, part 3), pinned where it can be shown
without timing: a fence whose answer was lost and which applied late is never taken back.

tests/e2e/test_journal_ceiling.py throttles etcd; in one run a gate's fence was sent three
times into a stopped etcd ("fence not confirmed; sending it again" x2, then "journal
unavailable at the fence: not releasing"), one try applied when etcd woke, and the
take-back (`UndoFence`, adapters/gate.py) left `delivery` in place: the record says
`first_delta_sent: true` for an attempt that released nothing, and Envoy's retry was refused
with 503 `attempt_not_admitted` ("first delta already sent", `retryable: false`) where
docs/errors.md promises the etcd refusal. The cause: the gate builds the fence record with
the wall clock of each call (`AttemptFacts.fence(clock.wall())` for every try and again for
the take-back), and `JournalStore.undo_fence` deletes `delivery` only when its value is
byte for byte the record it is given. This test replays exactly those calls on the
journal's own code (the in-memory etcd). Fixed: `undo_fence` now matches the `delivery` by
its attempt id (tests/adapters/test_journal_store.py has the contract on both stores).
"""

from __future__ import annotations

from extproc.adapters.memory_store import MemoryStore
from extproc.adapters.timers import FakeClock
from extproc.core import records
from extproc.core.config import EtcdConfig
from extproc.core.records import AttemptFacts


async def test_a_late_applied_fence_is_taken_back() -> None:
    clock = FakeClock()
    store = MemoryStore(EtcdConfig(), clock, owner="gw-1")
    rid, aid = "req_ceiling", "att_ceiling1"
    facts = AttemptFacts(1, aid, "r1", "gw-1", clock.wall())
    meta = records.request_meta(
        request_id=rid, tenant="t", idempotency_key=None, endpoint="/v1/chat/completions",
        max_attempts=2, gateway_id="gw-1", envoy_request_id=None, created_at=clock.wall(),
        body_meta={"model": "m", "stream": True}, route=None)
    assert await store.open_request(rid, meta, (aid, records.first_attempt(
        aid, "gw-1", clock.wall()))) is None
    # The fence's try (adapters/gate.py GateSession.fence): applied, its answer never came.
    clock.now += 2.0
    assert await store.fence_first_delta(rid, aid, facts.fence(clock.wall()))
    # The gate gave up, released nothing; its take-back runs once etcd answers
    # (adapters/gate.py, E.UndoFence: `j.undo_fence(rid, a.facts.fence(s.p.clock.wall()))`).
    clock.now += 1.0
    await store.undo_fence(rid, facts.fence(clock.wall()))
    view = await store.get(rid)
    assert view is not None and not view.first_delta_sent, \
        "delivery kept: the record claims a first delta the gate never released"
