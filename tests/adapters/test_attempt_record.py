"""adapters/attempt_record.py: one attempt's journal calls as its gate's actions ask for
them, on the in-memory store (what the sessions' tests see end to end, here one call at a
time)."""

from __future__ import annotations

import asyncio

from extproc.adapters.attempt_record import AttemptRecord
from extproc.core import events as E
from extproc.core.credentials import digest
from extproc.core.records import AttemptFacts

from .support import RID, FakeClock, FakeTimers, idle
from .test_sessions import proc

AID = "att_test_2"


async def test_an_unanswered_admission_is_not_confirmed_and_its_retry_keeps_one_secret() -> None:
    p, store = proc()
    await store.open_request(RID, {"request_id": RID}, None)
    rec = AttemptRecord(p, RID, AID, None)
    admit = E.Admit(2, {"attempt": 2, "attempt_id": AID})
    store.unavailable = True
    got = await rec.confirmed(rec.admit(admit, lambda live: False))
    assert isinstance(got, E.NotConfirmed) and rec.lease is None
    secret = rec.secret
    assert secret is not None  # minted for the first try, before etcd answered
    store.unavailable = False
    got = await rec.confirmed(rec.admit(admit, lambda live: False))
    assert isinstance(got, E.AdmitDecided) and got.admitted
    # The same secret on every try: the journal keeps its digest, the gate sends it upstream.
    assert rec.secret == secret and p.ids.secrets == 1  # type: ignore[attr-defined]
    stored, rev = await p.ledger.credential(RID, AID)
    assert stored == digest(secret) and rev > 0
    assert rec.lease is not None and rec.lease_id != 0 and not rec.expired()


async def test_attempt_1s_secret_comes_from_the_guard_and_no_other_is_minted() -> None:
    p, _ = proc()
    rec = AttemptRecord(p, RID, "att_pre", "secret-from-the-guard")
    assert rec.secret == "secret-from-the-guard" and p.ids.secrets == 0  # type: ignore[attr-defined]


async def test_without_a_lease_there_is_no_permission_to_fence() -> None:
    p, _ = proc()
    rec = AttemptRecord(p, RID, AID, None)
    assert rec.lease_id == 0 and not rec.expired()
    facts = AttemptFacts(2, AID, "127.0.0.1:8001", "gw-1", 1_700_000_000.0)
    got = await rec.confirmed(rec.fence(E.Fence(facts)))
    assert got == E.FenceDecided(False)


async def test_the_attempt_s_end_is_retried_on_the_processor_s_timers() -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    await store.open_request(RID, {"request_id": RID}, (AID, {"attempt": 1, "attempt_id": AID}))
    rec = AttemptRecord(p, RID, AID, None)
    store.fail_next(2)
    end = asyncio.ensure_future(rec.ended(1, {"attempt": 1, "attempt_id": AID, "ended": 1},
                                          False))
    for pause in (0.1, 0.2):  # each on the fake clock: no real time passes
        await idle()
        assert not end.done() and timers.pending() == 1
        assert timers.advance(pause) == 1
    assert await asyncio.wait_for(end, 1) is True
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id is None
    assert view.attempts[0]["ended"] == 1
