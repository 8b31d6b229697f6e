"""The journal, its fence and the tool ledger: every transaction written once, over `KV`.

`JournalStore` and `ToolLedger` hold each of the journal's transactions exactly once, as
etcd v3 transactions of the `KV` port (kv.py): on a real etcd (etcd_store.EtcdStore, over
kv_etcd.EtcdKV) and on the in-memory fake of etcd (memory_store.MemoryStore, over
kv_memory.MemoryKV) the same compares run, so a hermetic session test means what it would
on etcd (decision 0031). What differs is the process's own leases: how the session and
process leases are granted and kept alive is the subclasses' (etcd's loops; the fake's
never lapse by time). Layout (docs/architecture.md):

  <prefix>/req/<rid>/meta | attempts/NNN | delivery | outcome | progress   (retention lease)
  <prefix>/req/<rid>/history/NNN  an ended run a repeat re-opened (decision 0027)
  <prefix>/req/<rid>/guard      the processor serving the request (its session lease)
  <prefix>/live/<rid>           the live attempt id (that attempt's own lease): the fence
  <prefix>/cred/<rid>/<aid>     sha256 of the attempt's tool-call secret (retention lease),
                                written with the `live` that makes the attempt live (0028)
  <prefix>/trace/<rid>/<name>   an event trace for `extproc replay`
  <prefix>/budget/<gateway>     a gateway's retry-budget window (its session lease)
  <prefix>/tools/<key>, tools-exec/<key>   the tool ledger and its executor marker
  <prefix>/src/<processor>/<rid>/<aid>   a replica's agent: the attempt's first content left
                                the replica (one watch per processor; decision 0034)
  <prefix>/cancel/<rid>/<aid>   the gateway asks the agent to stop the attempt at the engine
  <prefix>/ack/<rid>/<aid>      the agent: the engine let go (its evidence)

The two transactions that make failover honest are `admit_attempt` (a new attempt only while
nothing was delivered and no other attempt holds a live lease) and `fence_first_delta`
(release only while this attempt is the live one). `live/` keys sit under one prefix so a
single watch per processor learns of every revocation (docs/fencing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core import records
from ..core.admission import (
    RECLAIM,
    TAKE_OVER,
    WAIT,
    admission_poll_s,
    after_failed_admission,
    lost_release_fence,
    release_lost,
)
from ..core.config import EtcdConfig
from ..core.failure import Fence
from ..core.journal import JournalView, assemble, delivered_by, own_write
from .kv import (
    KV,
    LEASE_NOT_FOUND,
    Compare,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    Txn,
    WatchEvent,
    absent,
    mod_is,
    present,
    value_below,
    value_is,
)
from .leases import AdmitResult, AttemptLease, LiveListeners, ProcessLease, StoreUnavailable
from .ports import Clock
from .timers import LoopTimers, Timers, wait_for

if TYPE_CHECKING:
    from .ports import Journal, Ledger

__all__ = ["JournalStore", "ToolLedger"]

log = logging.getLogger("extproc.etcd")

_NOID = {"request_id": None, "attempt_id": None}
_FENCED = b"fenced:"
# A cancel key outlives any wait for its acknowledgement (at most a lease TTL), then goes.
CANCEL_TTL_S = 600


# json.dumps with options builds its encoder on every call; this one is built once (and
# its C encoder too: records.one_shot).
_ENCODE = records.one_shot(json.JSONEncoder(separators=(",", ":"), sort_keys=True))


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return _ENCODE(obj).encode()


def _at(value: bytes) -> float:
    """The agent's wall time in its `src/` word (0.0 when it does not say)."""
    try:
        at = json.loads(value).get("at", 0.0)
        return float(at) if isinstance(at, int | float) else 0.0
    except (ValueError, AttributeError):
        return 0.0


def _evidence(value: bytes) -> dict[str, Any]:
    """The agent's acknowledgement as evidence for the record (kept raw if not JSON)."""
    try:
        obj = json.loads(value)
    except ValueError:
        obj = None
    return dict(obj) if isinstance(obj, dict) else {"raw": value.decode(errors="replace")}


class JournalStore:
    """The journal and the fence over a `KV`; the process's session and process leases
    come from the subclass (`session_lease`, `process_lease`)."""

    def __init__(self, cfg: EtcdConfig, kv: KV, clock: Clock, owner: str,
                 timers: Timers | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.clock = clock
        self.timers: Timers = timers or LoopTimers()  # the waits, on `clock`'s time
        self.owner = owner
        self.prefix = cfg.prefix.encode()
        self.live_prefix = self.prefix + b"/live/"
        self._retention: dict[int, tuple[int, float]] = {}  # ttl -> (lease id, granted)
        self._retention_lock = asyncio.Lock()
        self._session: int = 0
        self._attempts: ProcessLease | None = None
        # rid -> callbacks run when live/<rid> is deleted or changes (revocation, expiry).
        self._live_listeners = LiveListeners()
        self._waiters: set[asyncio.Event] = set()  # admissions waiting for `live` to go
        self._stop_watch: Callable[[], None] | None = None
        self.watch_connected = asyncio.Event()
        # The replica agents' word that an attempt's first content left (decision 0034):
        # one watch of src/<processor>/, started on first use, and who listens, by attempt.
        self._stop_src: Callable[[], None] | None = None
        self._src_prefix = b""
        self._src_listeners: dict[tuple[str, str], Callable[[float], None]] = {}

    # --- the process: its leases (the subclass's), the watch, closing -------------------

    async def session_lease(self) -> int:
        """This processor's liveness lease: `guard` keys vanish if the process dies."""
        raise NotImplementedError

    async def process_lease(self) -> ProcessLease:
        """The lease this process's live attempts hang on (granted on first use)."""
        raise NotImplementedError

    def current_process_lease(self, rid: str) -> ProcessLease | None:
        """This store's process lease (one per cluster: `rid` names the request's shard,
        shards.py)."""
        return self._attempts

    async def attempt_lease(self, rid: str) -> AttemptLease:
        """Attempt 1's permission: the process lease of the request's cluster."""
        return AttemptLease(await self.process_lease())

    def start_background(self) -> None:
        """The revocation watch (call inside the event loop); subclasses add their loops."""
        self._watch_live()

    def _watch_live(self) -> None:
        if self._stop_watch is None:
            self._stop_watch = self.kv.watch(self.live_prefix, self._live_changed,
                                             self._watch_state, "revocation watch")

    def _watch_state(self, up: bool) -> None:
        # While the watch is down nobody is told of revocations; the local deadline of
        # every lease still stops publishing in time (docs/fencing.md).
        if up:
            self.watch_connected.set()
        else:
            self.watch_connected.clear()

    def _live_changed(self, ev: WatchEvent) -> None:
        self._live_listeners.fire(ev.key[len(self.live_prefix):].decode(),
                                  None if ev.value is None else ev.value.decode(),
                                  None if ev.prev is None else ev.prev.decode(),
                                  ev.prev_known)

    def _wake_waiters(self) -> None:
        """Waiting admissions look again at once (the clock moved, a lease ended)."""
        for ev in list(self._waiters):
            ev.set()

    async def _stop_background(self) -> None:
        """The subclass's loops stop (before our leases are revoked)."""

    async def close(self) -> None:
        """The watch and the loops stop first, then our leases are revoked."""
        if self._stop_watch is not None:
            self._stop_watch()
        if self._stop_src is not None:
            self._stop_src()
        await self._stop_background()
        for lid in (self._session, self._attempts.lease_id if self._attempts else 0):
            if lid:
                with contextlib.suppress(StoreUnavailable):
                    await self.kv.revoke(lid)
        await self.kv.close()

    async def healthy(self) -> bool:
        try:
            await self.kv.txn(Txn(success=[Get(self.prefix + b"/health")]))
        except StoreUnavailable:
            return False
        return True

    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]:
        """Call `cb(new_value_or_None)` when live/<rid> changes (with `mine`: only a change
        of that attempt's value, `LiveListeners`); returns an unsubscribe."""
        return self._live_listeners.subscribe(rid, cb, mine)

    # --- the replica's agent: its word, the cancel and its acknowledgement (0034) -------

    def _agent_key(self, kind: str, rid: str, aid: str) -> bytes:
        return self.prefix + f"/{kind}/{rid}/{aid}".encode()

    def on_source_sent(self, processor: str, rid: str, attempt_id: str,
                       cb: Callable[[float], None]) -> Callable[[], None]:
        """Call `cb(at)` when the attempt's agent writes `src/<processor>/<rid>/<aid>` (its
        first content left the replica at the agent's wall time `at`); returns a stop.

        One watch per processor of `src/<processor>/`, started on the first listener and
        re-created with back-off when lost (the KV's watch); while it is down the word is
        missed and the first-delta limit still holds."""
        if self._stop_src is None:
            self._src_prefix = self.prefix + f"/src/{processor}/".encode()
            self._stop_src = self.kv.watch(self._src_prefix, self._source_changed,
                                           None, "source watch")
        key = (rid, attempt_id)
        self._src_listeners[key] = cb

        def off() -> None:
            if self._src_listeners.get(key) is cb:
                del self._src_listeners[key]
        return off

    def _source_changed(self, ev: WatchEvent) -> None:
        if ev.value is None or not ev.key.startswith(self._src_prefix):
            return
        rid, _, aid = ev.key[len(self._src_prefix):].decode(errors="replace").partition("/")
        cb = self._src_listeners.get((rid, aid))
        if cb is not None:
            cb(_at(ev.value))

    async def put_cancel(self, rid: str, attempt_id: str, record: Mapping[str, Any]) -> None:
        """Ask the attempt's agent to stop it at the engine (`cancel/<rid>/<aid>`)."""
        rl = await self._retention_lease(CANCEL_TTL_S)
        await self.kv.txn(Txn(success=[Put(self._agent_key("cancel", rid, attempt_id),
                                           _dumps(record), rl)]))

    def on_ack(self, rid: str, attempt_id: str,
               cb: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """Call `cb(evidence)` once, when the agent's acknowledgement `ack/<rid>/<aid>` is
        there (written before the watch was up: read once it is); returns a stop.

        A watch of that one key: awaited only for an attempt whose cancel was put, an
        uncertain end, so one stream for a few seconds at most."""
        key = self._agent_key("ack", rid, attempt_id)
        heard = False
        reads: list[asyncio.Task[None]] = []

        def found(value: bytes) -> None:
            nonlocal heard
            if not heard:
                heard = True
                cb(_evidence(value))

        def changed(ev: WatchEvent) -> None:
            if ev.key == key and ev.value is not None:
                found(ev.value)

        async def read() -> None:
            with contextlib.suppress(StoreUnavailable):
                res = await self.kv.txn(Txn(success=[Get(key)]))
                if res.reads[0]:
                    found(res.reads[0][0].value)

        def up(ok: bool) -> None:
            if ok and not heard:
                reads.append(asyncio.ensure_future(read()))

        stop = self.kv.watch(key, changed, up, "ack watch")

        def off() -> None:
            stop()
            for t in reads:
                t.cancel()
        return off

    async def revoke_fenced(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any]) -> None:
        """The agent acknowledged the cancel of an attempt fenced until its lease expires:
        its `fenced:` marker goes (if still its own) and its record says so, one txn."""
        rl = await self._retention_lease()
        live_k = self._live(rid)
        put_record = Put(self._att(rid, attempt), _dumps(record), rl)
        await self.kv.txn(Txn([value_is(live_k, _FENCED + attempt_id.encode())],
                              [Delete(live_k), put_record], [put_record]))
        self._wake_waiters()

    # --- keys ------------------------------------------------------------------------

    def _k(self, rid: str, suffix: str) -> bytes:
        return self.prefix + b"/req/" + rid.encode() + b"/" + suffix.encode()

    def _req_prefix(self, rid: str) -> bytes:
        return self.prefix + b"/req/" + rid.encode() + b"/"

    def _att(self, rid: str, n: int) -> bytes:
        return self._k(rid, f"attempts/{n:03d}")

    def _live(self, rid: str) -> bytes:
        return self.live_prefix + rid.encode()

    def _cred(self, rid: str, aid: str) -> bytes:
        return self.prefix + b"/cred/" + rid.encode() + b"/" + aid.encode()

    def _cred_put(self, rid: str, aid: str, credential: str | None, lease: int) -> list[Op]:
        """The attempt's credential digest, in the transaction that makes it live."""
        return [] if credential is None else [Put(self._cred(rid, aid), credential.encode(),
                                                  lease)]

    # --- the retention lease and lost leases ------------------------------------------

    async def _retention_lease(self, ttl_s: int | None = None) -> int:
        """Keys with one retention share one lease per window: no lease call per request.

        A key written in a window lives between 90% and 100% of the TTL.
        """
        ttl = ttl_s or self.cfg.journal_retention_s
        window = max(60.0, ttl / 10)
        cur = self._retention.get(ttl)
        if cur is not None and self.clock.monotonic() - cur[1] < window:
            return cur[0]
        async with self._retention_lock:
            cur = self._retention.get(ttl)
            if cur is not None and self.clock.monotonic() - cur[1] < window:
                return cur[0]
            lease = await self.kv.grant(ttl)
            self._retention[ttl] = (lease.id, self.clock.monotonic())
            return lease.id

    async def _forget_expired_leases(self) -> None:
        """Ask etcd which of our cached leases it still has; forget the ones it expired.

        A lease etcd expired while it was unreachable (frozen, partitioned) is only found by
        the keep-alive loops, up to a third of its TTL later; a write on it fails meanwhile.
        """
        cached = [("session", self._session)] if self._session else []
        if self._attempts is not None and self._attempts.deadline > 0:
            cached.append(("attempt", self._attempts.lease_id))
        cached += [("retention", lid) for lid, _ in self._retention.values()]
        for what, lid in cached:
            if await self.kv.time_to_live(lid) > 0:
                continue
            log.error(f"{what} lease expired in etcd; granting a new one", extra=_NOID)
            if what == "session" and self._session == lid:
                self._session = 0
            elif what == "attempt" and self._attempts is not None \
                    and self._attempts.lease_id == lid:
                self._attempts.lost()  # every key on it is gone: its attempts are fenced
            else:
                self._retention = {t: v for t, v in self._retention.items() if v[0] != lid}

    # --- journal ---------------------------------------------------------------------

    async def _write_or_read(self, rid: str,
                             txn: Callable[[], Awaitable[Txn]]) -> JournalView | None:
        """Send a conditioned write whose failure branch reads the record: None when it
        applied, else the record as found (the open and the re-open)."""
        try:
            res = await self.kv.txn(await txn())
        except StoreUnavailable as e:
            # A lease of ours expired while etcd was unreachable: nothing was written (a
            # transaction is all or nothing), so re-grant what is gone and try once more.
            if LEASE_NOT_FOUND not in str(e):
                raise
            await self._forget_expired_leases()
            res = await self.kv.txn(await txn())
        if res.succeeded:
            return None
        return self._assemble(rid, res.reads[0] + res.reads[1])

    def _record_reads(self, rid: str) -> list[Op]:
        return [Get(self._req_prefix(rid), prefix=True), Get(self._live(rid))]

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None:
        """Create the record; if it exists already (a repeat), return it instead.

        With `first_attempt` (id, record) the same transaction admits attempt 1: its `live`
        key goes on this process's lease, so the gate of attempt 1 needs no etcd call of its
        own (one round trip fewer before the first byte); `credential` (the digest of its
        secret, decision 0028) goes to `cred/<rid>/<aid>` in it too.
        """
        key = self._k(rid, "meta")

        async def txn() -> Txn:
            rl = await self._retention_lease()
            sl = await self.session_lease()
            ops: list[Op] = [Put(key, _dumps(meta), rl),
                             Put(self._k(rid, "guard"), self.owner.encode(), sl)]
            if first_attempt is not None:
                pl = await self.process_lease()
                aid, record = first_attempt
                ops += [Put(self._live(rid), aid.encode(), pl.lease_id),
                        Put(self._att(rid, 1), _dumps(record), rl),
                        *self._cred_put(rid, aid, credential, rl)]
            return Txn([absent(key)], ops, self._record_reads(rid))

        return await self._write_or_read(rid, txn)

    async def reopen_request(self, rid: str, ended_outcome: Mapping[str, Any],
                             history: tuple[int, Mapping[str, Any]],
                             first_attempt: tuple[int, str, Mapping[str, Any]],
                             credential: str | None = None) -> JournalView | None:
        """Run a finished request again as the same logical request (decision 0027).

        One transaction, only while the record is as the caller read it: `outcome` still the
        value read (`ended_outcome`: a concurrent re-open deleted it, a late writer changed
        it), `delivery` and `live` absent (nothing delivered, no attempt may run),
        `attempts/<n>` free, `meta` present. Then: the outcome moves to `history/<run>`
        (`history` = (run, entry)), `progress` goes, the `guard` key is ours again, and the
        run's first attempt (`first_attempt` = (n, id, record)) is admitted as the intake
        admits attempt 1 (`live` on this process's lease, its `credential` digest beside
        it, decision 0028). `meta` stays. None when
        re-opened; else the record as it is now, for the caller to answer.
        """
        out_k, live_k = self._k(rid, "outcome"), self._live(rid)
        n, aid, record = first_attempt
        run, entry = history
        att_k = self._att(rid, n)

        async def txn() -> Txn:
            rl = await self._retention_lease()
            sl = await self.session_lease()
            pl = await self.process_lease()
            return Txn(
                [value_is(out_k, _dumps(ended_outcome)), present(self._k(rid, "meta")),
                 absent(self._k(rid, "delivery")), absent(live_k), absent(att_k)],
                [Delete(out_k), Delete(self._k(rid, "progress")),
                 Put(self._k(rid, f"history/{run:03d}"), _dumps(entry), rl),
                 Put(self._k(rid, "guard"), self.owner.encode(), sl),
                 Put(live_k, aid.encode(), pl.lease_id), Put(att_k, _dumps(record), rl),
                 *self._cred_put(rid, aid, credential, rl)],
                self._record_reads(rid))

        return await self._write_or_read(rid, txn)

    async def undo_reopen(self, rid: str, history: tuple[int, Mapping[str, Any]],
                          first_attempt: tuple[int, str]) -> bool:
        """Take back a re-open our timed-out call may have applied after all, while nothing
        ran for it (`live` still its first attempt, nothing delivered, no outcome): the
        ended run's outcome comes back, the history entry, the attempt, its credential,
        `guard` and `live` go. The client was told nothing ran; a late apply must not leave
        the key in progress."""
        n, aid = first_attempt
        run, entry = history
        live_k = self._live(rid)
        rl = await self._retention_lease()
        res = await self.kv.txn(Txn(
            [value_is(live_k, aid.encode()), absent(self._k(rid, "delivery")),
             absent(self._k(rid, "outcome"))],
            [Put(self._k(rid, "outcome"), _dumps(entry["outcome"]), rl),
             Delete(self._k(rid, f"history/{run:03d}")), Delete(self._k(rid, "guard")),
             Delete(self._att(rid, n)), Delete(live_k), Delete(self._cred(rid, aid))]))
        return res.succeeded

    async def get(self, rid: str) -> JournalView | None:
        res = await self.kv.txn(Txn(success=self._record_reads(rid)))
        kvs = res.reads[0] + res.reads[1]
        return self._assemble(rid, kvs) if kvs else None

    def _assemble(self, rid: str, kvs: Sequence[KeyValue]) -> JournalView | None:
        pfx, live_k = self._req_prefix(rid), self._live(rid)
        live = next((kv.value.decode() for kv in kvs if kv.key == live_k), None)
        return assemble(rid, ((kv.key[len(pfx):].decode(), kv.value)
                              for kv in kvs if kv.key != live_k), live)

    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None,
                            first_attempt: int = 1,
                            credential: str | None = None,
                            cancel_ack: bool = True) -> AdmitResult:
        """Admit attempt n only if nothing was delivered and no other attempt is live.

        `credential` (the digest of the attempt's secret, decision 0028) is put at
        `cred/<rid>/<aid>` by whichever transaction makes it live (the admission or the
        take-over).

        If another attempt still holds `live`, wait (bounded) for it to be revoked or to
        expire: that is the mission's `wait_for: cancel_ack_or_lease_expiry`. The watch
        wakes us the moment `live` goes; a slow poll covers a lost watch.

        `never_started(live_value)` says that the live attempt is one the guard admitted
        with the request and that Envoy's access log shows no gate ever ran for it (its
        connection failed before any byte was sent): it is taken over at once, in one
        transaction conditioned on `live` still naming it (decision 0007). That attempt is
        `first_attempt`: 1, or a re-run's first (decision 0027).

        A `delivery` an earlier attempt wrote whose release never left Envoy (this gate
        runs, so Envoy retried, so nothing reached the client) is taken back and that
        attempt fenced (`_reclaim`, decision 0057): revoked with this admission in one
        transaction when `cancel_ack` (Envoy's retry is its confirmed close), else marked
        fenced until its lease runs out, which this admission then waits for.
        """
        pl = await self.process_lease()
        rl = await self._retention_lease()
        live_k, deliv_k = self._live(rid), self._k(rid, "delivery")
        att_k, meta_k = self._att(rid, attempt), self._k(rid, "meta")

        def admit() -> list[Op]:
            return [Put(live_k, attempt_id.encode(), pl.lease_id),
                    Put(att_k, _dumps({**record, "admitted_at": round(self.clock.wall(), 6)}),
                        rl),
                    *self._cred_put(rid, attempt_id, credential, rl)]

        start = self.clock.monotonic()
        lost: str | None = None  # an earlier attempt whose release never left, taken back
        gone = asyncio.Event()
        off = self.on_live_change(rid, lambda v: gone.set() if v is None else None)
        self._waiters.add(gone)
        try:
            while True:
                gone.clear()
                res = await self.kv.txn(Txn(
                    [present(meta_k), absent(deliv_k), absent(live_k), absent(att_k)],
                    admit(), [Get(meta_k), Get(deliv_k), Get(live_k), Get(att_k)]))
                waited = self.clock.monotonic() - start
                if res.succeeded:
                    return AdmitResult(True, "admitted", AttemptLease(pl), waited, lost)
                has = [bool(r) for r in res.reads]
                live = res.reads[2][0].value if res.reads[2] else None
                if has[3] and live == attempt_id.encode():
                    # Sent again after a lost answer: this attempt is admitted already.
                    return AdmitResult(True, "admitted (an earlier try applied)",
                                       AttemptLease(pl), waited)
                deliv = res.reads[1][0].value if res.reads[1] else None
                by = delivered_by(deliv)
                verdict = after_failed_admission(
                    attempt=attempt, has_meta=has[0], delivered=has[1], attempt_taken=has[3],
                    live_never_started=bool(never_started is not None and live is not None
                                            and never_started(live.decode())),
                    waited_s=waited, fence_wait_s=fence_wait_s,
                    release_lost=release_lost(by, None if live is None else live.decode(),
                                              attempt, attempt_id, _FENCED.decode()))
                if verdict == RECLAIM:
                    assert deliv is not None and by is not None
                    fence = lost_release_fence(cancel_ack)
                    with_admit = live is None or fence is Fence.REVOKE
                    if await self._reclaim(rid, deliv, by, live, attempt_id, fence,
                                           admit() if with_admit else None,
                                           present(meta_k), absent(att_k)):
                        lost = by[1]
                        if with_admit:
                            return AdmitResult(
                                True, f"admitted (attempt {by[0]}'s release never left "
                                      "Envoy: its delivery taken back)",
                                AttemptLease(pl), self.clock.monotonic() - start, lost)
                    continue  # the fence's lease to run out, or a record that changed
                if verdict == TAKE_OVER:
                    assert live is not None
                    taken = records.taken_over_first_attempt(
                        live.decode(), round(self.clock.wall(), 6), first_attempt)
                    take = Txn([value_is(live_k, live), absent(deliv_k), absent(att_k)],
                               [*admit(), Put(self._att(rid, first_attempt), _dumps(taken),
                                              rl)])
                    if (await self.kv.txn(take)).succeeded:
                        return AdmitResult(True, "admitted (attempt 1 never started)",
                                           AttemptLease(pl), self.clock.monotonic() - start)
                    continue
                if verdict == WAIT:
                    # Never run two attempts at once: wait for its revocation or expiry.
                    with contextlib.suppress(TimeoutError):
                        await wait_for(self.timers, gone.wait(),
                                       admission_poll_s(waited, fence_wait_s))
                    continue
                return AdmitResult(False, verdict, None, waited)
        finally:
            self._waiters.discard(gone)
            off()

    async def _reclaim(self, rid: str, deliv: bytes, by: tuple[int, str],
                       live: bytes | None, attempt_id: str, fence: Fence,
                       admit: list[Op] | None, *admit_compares: Compare) -> bool:
        """Take back a `delivery` whose release never left (decision 0057), in one
        transaction conditioned on `delivery` and `live` being what the failed admission
        read: close the attempt's record as `release_lost` and fence it. With `admit` (the
        attempt revoked, or its `live` already gone) this attempt is admitted in the same
        transaction; else `live` becomes `fenced:<id>` on a fresh lease (or stays so), and
        the caller waits for it to go. False: something changed; the caller reads again."""
        n, aid = by
        rl = await self._retention_lease()
        live_k, deliv_k = self._live(rid), self._k(rid, "delivery")
        rec = await self._lost_release(rid, deliv, n, str(fence), attempt_id, rl,
                                       envoy_cause="retried")
        compares = [value_is(deliv_k, deliv),
                    absent(live_k) if live is None else value_is(live_k, live)]
        ops: list[Op] = [Delete(deliv_k), rec]
        if admit is not None:
            compares += list(admit_compares)
            ops += admit
        elif live == aid.encode():
            lease = await self.kv.grant(self.cfg.attempt_lease_ttl_s)
            ops.append(Put(live_k, _FENCED + live, lease.id))
        res = await self.kv.txn(Txn(compares, ops))
        log.warning("attempt %d's release never left Envoy: its delivery %s",
                    n, "taken back" if res.succeeded else "changed meanwhile",
                    extra={"request_id": rid, "attempt_id": aid, "reclaimed_by": attempt_id,
                           "fence": str(fence)})
        return res.succeeded

    async def _lost_release(self, rid: str, deliv: bytes, n: int, fence: str, by: str,
                            rl: int, known: Mapping[str, Any] | None = None,
                            **extra: Any) -> Put:
        """The put that closes attempt n's record as a release that never left: over the
        record `known` (the guard's end of the attempt it took over), else the one read."""
        att_k = self._att(rid, n)
        admitted: Any = known
        if admitted is None:
            found = (await self.kv.txn(Txn(success=[Get(att_k)]))).reads[0]
            try:
                admitted = json.loads(found[0].value) if found else {}
            except ValueError:
                admitted = {}
        rec = records.lost_release_end(
            admitted if isinstance(admitted, Mapping) else {}, json.loads(deliv),
            fence=fence, at=round(self.clock.wall(), 6), by=by)
        return Put(att_k, _dumps({**rec, **extra}), rl)

    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool:
        """Record first_delta_sent, only while this attempt is the live one."""
        rl = await self._retention_lease()
        deliv_k = self._k(rid, "delivery")
        res = await self.kv.txn(Txn(
            [value_is(self._live(rid), attempt_id.encode()), absent(deliv_k)],
            [Put(deliv_k, _dumps(record), rl)], [Get(deliv_k)]))
        if res.succeeded:
            return True
        # Sent again after a lost answer: a `delivery` of this very attempt is our own.
        found = res.reads[0]
        return own_write(found[0].value if found else None, attempt_id)

    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool:
        """Remove a `delivery` our timed-out fence call may have written after all.

        A deadline is not a "no": a transaction queued in a frozen etcd can still apply when
        it wakes. The gate released nothing, so the record must not claim a first delta.
        The record is matched by its attempt id, not byte for byte: each try of the fence
        was stamped when it was sent, and any one of them may be the one that applied.
        """
        deliv_k = self._k(rid, "delivery")
        found = (await self.kv.txn(Txn(success=[Get(deliv_k)]))).reads[0]
        raw = found[0].value if found else None
        if raw is None or not own_write(raw, str(record.get("attempt_id", ""))):
            return False
        # Deleted only if still that very value (nothing else wrote it since the read).
        res = await self.kv.txn(Txn([value_is(deliv_k, raw)], [Delete(deliv_k)]))
        return res.succeeded

    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool:
        """Remove an admission our timed-out call may have written after all (its
        credential with it)."""
        live_k = self._live(rid)
        res = await self.kv.txn(Txn(
            [value_is(live_k, attempt_id.encode())],
            [Delete(live_k), Delete(self._att(rid, attempt)),
             Delete(self._cred(rid, attempt_id))]))
        return res.succeeded

    async def undo_intake(self, rid: str, attempt_id: str) -> bool:
        """Remove a record our given-up intake may have written after all, while nothing
        ran for it: `live` is still its attempt 1, nothing delivered, no outcome. The client
        was told nothing was recorded; a late apply must not leave the key in progress.
        Attempt 1's credential goes with it."""
        live_k = self._live(rid)
        res = await self.kv.txn(Txn(
            [value_is(live_k, attempt_id.encode()), absent(self._k(rid, "delivery")),
             absent(self._k(rid, "outcome"))],
            [Delete(live_k), Delete(self._req_prefix(rid), prefix=True),
             Delete(self._cred(rid, attempt_id))]))
        return res.succeeded

    async def end_attempt(self, rid: str, attempt: int, attempt_id: str,
                          record: Mapping[str, Any], expire: bool) -> None:
        """Close the attempt's record and fence it, in one transaction.

        Revoke (`expire=False`, the end is confirmed): `live` is deleted if it is still
        ours, so a retry may start at once. Expire (liveness uncertain): `live` becomes
        `fenced:<attempt_id>` on a fresh lease of `attempt_lease_ttl_s`: every check for
        this attempt (the first-delta fence, tool calls) fails at once, while a retry waits
        until that lease runs out.
        """
        rl = await self._retention_lease()
        live_k = self._live(rid)
        put_record = Put(self._att(rid, attempt), _dumps(record), rl)
        fence: Op = Delete(live_k)
        if expire:
            lease = await self.kv.grant(self.cfg.attempt_lease_ttl_s)
            fence = Put(live_k, _FENCED + attempt_id.encode(), lease.id)
        await self.kv.txn(Txn([value_is(live_k, attempt_id.encode())], [fence, put_record],
                              [put_record]))

    async def update_attempt(self, rid: str, attempt: int, record: Mapping[str, Any]) -> None:
        rl = await self._retention_lease()
        await self.kv.txn(Txn(success=[Put(self._att(rid, attempt), _dumps(record), rl)]))

    async def progress(self, rid: str, record: Mapping[str, Any]) -> None:
        """Checkpoint what the client received so far (used if this processor dies)."""
        rl = await self._retention_lease()
        await self.kv.txn(Txn(success=[Put(self._k(rid, "progress"), _dumps(record), rl)]))

    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None,
                     nothing_released: bool = False) -> bool:
        """Write the outcome once, drop the guard key and end what is still live; one txn.

        `attempt_end` is the record of the attempt the gate handed over at release (the
        guard saw its end). When the request is over, every upstream request of it is over
        too, so a `live` key still naming an attempt is deleted; a `fenced:` marker (an
        attempt of uncertain liveness) is left to expire ("att_..." < "fenced:").

        `nothing_released`: the client's response was not a 200, so no release reached it;
        a `delivery` found now is one that never left Envoy (decision 0057). It goes with
        the outcome, and its attempt's record says so.
        """
        rl = await self._retention_lease()
        key, live_k = self._k(rid, "outcome"), self._live(rid)
        end_live = Txn([value_below(live_k, _FENCED)], [Delete(live_k)])
        ops: list[Op] = [Put(key, _dumps(outcome), rl), Delete(self._k(rid, "guard")),
                         end_live]
        deliv_k = self._k(rid, "delivery")
        found = ((await self.kv.txn(Txn(success=[Get(deliv_k)]))).reads[0]
                 if nothing_released else [])
        by = delivered_by(found[0].value) if found else None
        # The released attempt the guard took over may be the lost one (Envoy replaced its
        # headers with its own reply): then its one record says both.
        own = attempt_end is not None and by is not None and by[0] == attempt_end[0]
        if attempt_end is not None and not own:
            ops.append(Put(self._att(rid, attempt_end[0]), _dumps(attempt_end[1]), rl))
        if by is not None:
            ops += [Delete(deliv_k), await self._lost_release(
                rid, found[0].value, by[0], "ended_with_request", "request_end", rl,
                attempt_end[1] if attempt_end is not None and own else None)]
        done = (await self.kv.txn(Txn([absent(key)], ops, [end_live]))).succeeded
        if done and by is not None:
            log.warning("attempt %d's release never left Envoy: its delivery taken back "
                        "with the outcome", by[0],
                        extra={"request_id": rid, "attempt_id": by[1]})
        return done

    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]:
        """Publish this gateway's window counts; read every other gateway's (one txn)."""
        sl = await self.session_lease()
        pfx = self.prefix + b"/budget/"
        res = await self.kv.txn(Txn(success=[
            Put(pfx + gateway_id.encode(),
                _dumps({"requests": requests, "retries": retries}), sl),
            Get(pfx, prefix=True)]))
        out: dict[str, tuple[int, int]] = {}
        for kv in res.reads[1]:
            gid = kv.key[len(pfx):].decode()
            if gid != gateway_id:
                v = json.loads(kv.value)
                out[gid] = (int(v.get("requests", 0)), int(v.get("retries", 0)))
        return out

    def _trace(self, rid: str, name: str = "") -> bytes:
        return self.prefix + b"/trace/" + rid.encode() + b"/" + name.encode()

    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None:
        """An event trace for `extproc replay`, apart from the record (it can be large)."""
        rl = await self._retention_lease()
        await self.kv.txn(Txn(success=[Put(self._trace(rid, name), _dumps(trace), rl)]))

    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]:
        pfx = self._trace(rid)
        res = await self.kv.txn(Txn(success=[Get(pfx, prefix=True)]))
        return {kv.key[len(pfx):].decode(): json.loads(kv.value) for kv in res.reads[0]}

    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool:
        """Record the outcome of a request whose processor died (no guard, no live attempt).

        Create-only and conditioned on both being absent, so it can never overwrite or race
        the real guard's own record.
        """
        rl = await self._retention_lease()
        key = self._k(rid, "outcome")
        res = await self.kv.txn(Txn(
            [absent(key), absent(self._k(rid, "guard")), absent(self._live(rid)),
             present(self._k(rid, "meta"))],
            [Put(key, _dumps(outcome), rl)]))
        return res.succeeded


class ToolLedger:
    """The tool-call ledger on the same store: `<prefix>/tools/<request_id>:<call_id>`."""

    def __init__(self, store: JournalStore, ttl_s: int) -> None:
        self.s = store
        self.ttl_s = ttl_s

    def _k(self, key: str) -> bytes:
        return self.s.prefix + b"/tools/" + key.encode()

    def _exec(self, key: str) -> bytes:
        # Present while the executing call's processor is alive (its session lease).
        return self.s.prefix + b"/tools-exec/" + key.encode()

    async def credential(self, rid: str, attempt_id: str) -> tuple[str | None, int]:
        """The attempt's stored credential digest (None: none) and its key's mod_revision
        (0 when absent), for `claim` to compare (decision 0028)."""
        res = await self.s.kv.txn(Txn(success=[Get(self.s._cred(rid, attempt_id))]))
        if not res.reads[0]:
            return None, 0
        kv = res.reads[0][0]
        return kv.value.decode(errors="replace"), kv.mod_revision

    async def claim(self, key: str, rid: str, attempt_id: str, entry: Mapping[str, Any],
                    credential_rev: int) -> tuple[bool, dict[str, Any] | None, bool, bool]:
        """Claim the first execution, only for the live attempt whose credential was checked.

        Returns (claimed, existing entry, caller is the live attempt, executor alive).
        One transaction: the fence check, the credential (its key unchanged since it was
        read and compared: `credential_rev`, its mod_revision then) and the claim cannot be
        separated by a revocation or an undo. "Live" is false when the credential key
        changed or went: such an attempt is no longer the one that was checked.
        """
        rl = await self.s._retention_lease(self.ttl_s)
        sl = await self.s.session_lease()
        k, ex, live = self._k(key), self._exec(key), self.s._live(rid)
        cred = self.s._cred(rid, attempt_id)
        res = await self.s.kv.txn(Txn(
            # An absent key's mod_revision is 0: never a credential.
            [absent(k), value_is(live, attempt_id.encode()), mod_is(cred, credential_rev),
             present(cred)],
            [Put(k, _dumps(entry), rl), Put(ex, attempt_id.encode(), sl)],
            [Get(k), Get(live), Get(ex), Get(cred)]))
        if res.succeeded:
            return True, None, True, True
        found, lv, marker, cr = res.reads
        existing = json.loads(found[0].value) if found else None
        same_cred = bool(cr) and cr[0].mod_revision == credential_rev
        is_live = bool(lv) and lv[0].value == attempt_id.encode() and same_cred
        return False, existing, is_live, bool(marker)

    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Take back a claim whose transaction timed out but may apply when etcd wakes."""
        k = self._k(key)
        res = await self.s.kv.txn(Txn([value_is(k, _dumps(entry))],
                                      [Delete(k), Delete(self._exec(key))]))
        return res.succeeded

    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]:
        res = await self.s.kv.txn(Txn(success=[Get(self._k(key)), Get(self._exec(key))]))
        found, marker = res.reads
        return (json.loads(found[0].value) if found else None), bool(marker)

    async def record(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store the result (or `unknown`) and release the executor marker, atomically."""
        rl = await self.s._retention_lease(self.ttl_s)
        await self.s.kv.txn(Txn(success=[Put(self._k(key), _dumps(entry), rl),
                                         Delete(self._exec(key))]))


if TYPE_CHECKING:
    # mypy --strict proves the structural fit with the ports the sessions consume.
    def _fits_the_ports(store: JournalStore, ledger: ToolLedger) -> tuple[Journal, Ledger]:
        return store, ledger
