"""adapters/request_record.py: a request's journal record as the guard's actions ask for it,
on the in-memory store with a fake clock (the intake's pause runs on the Timers port)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from extproc.adapters import request_record as R
from extproc.adapters.memory_store import MemoryLedger, MemoryStore
from extproc.adapters.processor import Processor
from extproc.core import events as E
from extproc.core import guard as G
from extproc.core.config import load_config
from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.intake import Generation, Prepared, StatusLookup
from extproc.core.journal import Outcome

from .support import FakeClock, FakeTimers, FixedIds, idle

RID = "req_0123456789abcdefghjkmnpqrs"
GEN = Generation(RID, "default", None, "/v1/chat/completions")
CHAT = json.dumps({"model": "demo-model", "stream": False,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def setup() -> tuple[Processor, MemoryStore, FakeTimers]:
    timers = FakeTimers(FakeClock())
    cfg = load_config({})
    store = MemoryStore(cfg.etcd, clock=timers.clock, owner="gw-1/test")
    p = Processor(cfg, store, MemoryLedger(store, cfg.tools.ledger_ttl_s), ids=FixedIds(),
                  clock=timers.clock, timers=timers)
    return p, store, timers


def read(p: Processor, body: bytes, envoy_id: str | None
         ) -> tuple[Prepared | None, E.RequestBodySeen, G.GuardMachine]:
    """The body as the guard's session has the machine read it (core.guard.read_body),
    with this process's view of the world."""
    m = G.GuardMachine.at_request(RID, p.cfg, 0)
    prep, ev = G.read_body(m, body, p.cfg, GEN, envoy_id, pool=p.pool,
                           order_hosts=p.host_order, new_attempt_id=p.ids.attempt_id,
                           wall=p.clock.wall(), tokenizers=p.tokenizers)
    return prep, ev, m


def prepared(p: Processor) -> Prepared:
    prep, ev, m = read(p, CHAT, "envoy-1")
    assert prep is not None and ev.error is None
    assert m.count_text is None  # not a stream: the replica's usage counts it
    return prep


def test_a_body_that_is_not_json_is_refused_before_anything_runs() -> None:
    p, _, _ = setup()
    prep, ev, _ = read(p, b"{nope", None)
    assert prep is None and isinstance(ev.error, GatewayError)
    assert ev.error.code is ErrorCode.INVALID_REQUEST_BODY
    assert isinstance(p.ids, FixedIds) and p.ids.n == 0  # no attempt id minted


async def test_a_new_request_is_recorded_with_attempt_1_and_its_credential() -> None:
    p, store, _ = setup()
    prep = prepared(p)
    p.intakes.put(RID, asyncio.get_running_loop().create_future())
    got = await R.run_intake(p, RID, GEN, prep, "digest-1", "envoy-1")
    assert got == G.IntakeAnswer(None)
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id == "att_test_1"
    stored, rev = await p.ledger.credential(RID, "att_test_1")
    assert stored == "digest-1" and rev > 0
    assert p.intakes.get(RID) is None  # recorded: a gate need not wait any more


async def test_the_intake_run_keeps_what_it_wrote_no_longer_than_its_write() -> None:
    """An open stream keeps its IntakeRun until it closes; the credential's digest and the
    prepared record are written and then let go (decision 0055)."""
    p, _, _ = setup()
    tx = R.IntakeRun(p, GEN, prepared(p), "digest-1", "envoy-1")
    tx.open()
    tx.register()
    assert tx.cred == "digest-1" and tx.prep is not None
    assert await tx.opened() == E.RequestOpened(True, None)
    assert tx.cred == "" and tx.prep is None
    stored, _ = await p.ledger.credential(RID, "att_test_1")
    assert stored == "digest-1"


async def test_an_unanswered_intake_is_sent_again_after_a_pause_on_the_timers_port(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extproc")
    p, store, timers = setup()
    prep = prepared(p)
    store.fail_next(1)
    task = asyncio.ensure_future(R.run_intake(p, RID, GEN, prep, None, None))
    await idle()
    assert not task.done() and timers.pending() == 1  # paused, on the fake clock
    assert await store.get(RID) is None
    timers.advance(0.05)
    assert await asyncio.wait_for(task, 1) == G.IntakeAnswer(None)
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id == "att_test_1"
    assert [r.getMessage() for r in caplog.records] == [
        "intake not confirmed; sending it again"]


async def test_status_is_the_record_or_the_store_trouble() -> None:
    p, store, _ = setup()
    await R.run_intake(p, RID, GEN, prepared(p), None, None)
    q = StatusLookup(RID, "default")
    got = await R.read_status(p, q)
    assert got.view is not None and got.view.request_id == RID and got.down is None
    store.unavailable = True
    got = await R.read_status(p, q)
    assert got.view is None and got.tenant == "default" and got.down


async def test_the_checkpoint_and_the_outcome_are_written_exactly() -> None:
    p, store, timers = setup()
    await R.run_intake(p, RID, GEN, prepared(p), None, None)
    timers.advance(2.0)
    assert await R.write_progress(p, RID, 3) == E.ProgressWritten()
    store.unavailable = True
    # A missed checkpoint is no error: the machine hears it was written all the same.
    assert await R.write_progress(p, RID, 4) == E.ProgressWritten()
    store.unavailable = False
    f = E.Finish(outcome=Outcome.COMPLETED, delivered_output_tokens=5, cause=None)
    assert await R.write_outcome(p, RID, f, None, None) == E.RecordWritten(True)
    view = await store.get(RID)
    assert view is not None and view.outcome is not None
    assert view.progress["delivered_output_tokens"] == 3
    assert (view.outcome["outcome"], view.outcome["delivered_output_tokens"],
            view.outcome["finished_at"]) == ("completed", 5, timers.clock.wall())


async def test_the_outcome_is_written_again_on_the_processor_s_timers_while_etcd_is_away(
        ) -> None:
    p, store, timers = setup()
    await R.run_intake(p, RID, GEN, prepared(p), None, None)
    store.fail_next(3)
    f = E.Finish(outcome=Outcome.COMPLETED, delivered_output_tokens=5, cause=None)
    task = asyncio.ensure_future(R.write_outcome(p, RID, f, None, None))
    for pause in (0.1, 0.2, 0.4):  # on the fake clock, doubling from 0.1 s
        await idle()
        assert not task.done() and timers.pending() == 1
        assert timers.advance(pause) == 1
    assert await asyncio.wait_for(task, 1) == E.RecordWritten(True)
    view = await store.get(RID)
    assert view is not None and view.outcome is not None
    assert view.outcome["finished_at"] == timers.clock.wall() - 0.7  # when it was asked for
