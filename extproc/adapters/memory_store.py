"""The journal and the tool ledger in memory, with etcd's compare semantics.

For hermetic tests of the guard and gate sessions: no etcd process, no sockets, and time on
an injected clock (a fake one jumps a `fenced:` marker's lease past its TTL at once). It keeps
etcd_store's key layout and runs each of EtcdStore's and ToolLedger's transactions as one
synchronous step over a dict of keys -> (value bytes, lease), so the compares, the values
written (JSON as etcd_store encodes it, parsed again on read) and the watch events are the
same. tests/adapters/test_store_contract.py runs one suite against this store and a real
etcd with identical assertions; that suite is what says the two agree.

Modelled, as in etcd:
  - leases expire on the injected clock's monotonic time, lazily at every call and at
    `expire_leases()`; a key on an expired lease is gone. The retention lease follows
    EtcdStore's windows; `fenced:` markers get a fresh lease of attempt_lease_ttl_s.
  - `on_live_change` callbacks fire when `live/<rid>` is put (its value) or deleted, revoked
    or expired (None), right after the transaction that did it.
  - a put on a lease that no longer exists fails the whole call ("requested lease not
    found"), and `open_request` forgets the dead leases and tries once more.
  - `admit_attempt` waits up to fence_wait_s (on the injected clock) for `live` to go, woken
    by the callbacks, polling as EtcdStore polls (real seconds: asyncio sleeps).

Not modelled (said here so that no test relies on it):
  - the keep-alives: this process's session and process leases never lapse by time, also
    while `unavailable` (etcd's lapse after their TTL without keep-alives). Their loss is
    simulated with `revoke_lease()`, and noticed at once (etcd's loops notice within a third
    of a TTL): the process lease's local deadline is infinite until then.
  - an etcd call that times out after applying, only for the intake: `lose_next_intake_answer()`
    (an intake whose deadline passed on a frozen or electing member, applied later). Every
    other failed call here applied nothing.
  - more than one processor: one MemoryStore is one process's view of its own etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core import records
from ..core.admission import TAKE_OVER, WAIT, admission_poll_s, after_failed_admission
from ..core.config import EtcdConfig
from ..core.journal import JournalView, assemble, own_write
from .leases import AdmitResult, AttemptLease, LiveListeners, ProcessLease, StoreUnavailable
from .ports import Clock, SystemClock

if TYPE_CHECKING:
    from .ports import Journal, Ledger

__all__ = ["MemoryLedger", "MemoryStore"]

log = logging.getLogger("extproc.memory_store")

# etcd's answer to a put on a lease it no longer has (etcd_store matches on it too).
_LEASE_NOT_FOUND = "requested lease not found"
_FENCED = b"fenced:"


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass(slots=True)
class _Entry:
    value: bytes
    lease: int  # 0: none
    mod: int = 0  # etcd's mod_revision: the store revision of the last put of this key


# One operation of a transaction: (key, value, lease) puts, (key, None, 0) deletes.
_Op = tuple[str, bytes | None, int]


def _put(key: str, value: bytes, lease: int = 0) -> _Op:
    return (key, value, lease)


def _delete(key: str) -> _Op:
    return (key, None, 0)


class MemoryStore:
    """EtcdStore's journal, fence and leases over a dict (one process's etcd)."""

    def __init__(self, cfg: EtcdConfig, clock: Clock | None = None, owner: str = "gw") -> None:
        self.cfg = cfg
        self.owner = owner
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.prefix = cfg.prefix
        self.live_prefix = self.prefix + "/live/"
        # While True every call raises StoreUnavailable, as with etcd down or partitioned.
        self.unavailable = False
        self._failures = 0
        self._lost_intake_answers = 0
        self._closed = False
        self._kv: dict[str, _Entry] = {}
        self._revision = 1  # etcd's store revision: one more per transaction that writes
        self._leases: dict[int, float] = {}  # id -> expiry (clock.monotonic; inf: kept alive)
        self._next_lease = 0x7E57_0000
        self._retention: dict[int, tuple[int, float]] = {}  # ttl -> (lease id, granted)
        self._session = 0
        self._attempts: ProcessLease | None = None
        self._live_listeners = LiveListeners()
        self._waiters: set[asyncio.Event] = set()  # admissions waiting for `live` to go

    # --- test controls ----------------------------------------------------------------

    def fail_next(self, n: int = 1) -> None:
        """The next n store transactions raise StoreUnavailable, applying nothing.

        Each Journal/Ledger call is one transaction; each poll of a waiting admission is one
        more (as each is one etcd call).
        """
        self._failures += n

    def lose_next_intake_answer(self, n: int = 1) -> None:
        """The next n intakes (open_request) apply, then raise StoreUnavailable: etcd
        applied the transaction but the caller's deadline passed first."""
        self._lost_intake_answers += n

    def expire_leases(self) -> None:
        """Apply every lease expiry due on the clock now (the callbacks of the `live` keys that
        go run), and wake waiting admissions so they look at the clock again at once."""
        self._expire()
        for ev in list(self._waiters):
            ev.set()

    def revoke_lease(self, lease_id: int) -> None:
        """etcd's LeaseRevoke: the lease and every key on it go now (the session or process
        lease too: what etcd does to them after keep-alives failed for their TTL)."""
        if lease_id in self._leases:
            self._drop_leases({lease_id})
        if lease_id == self._session:
            self._session = 0
        if self._attempts is not None and self._attempts.lease_id == lease_id:
            self._attempts.lost()  # every key on it is gone: its attempts are fenced

    # --- connection -------------------------------------------------------------------

    async def connect(self) -> None:
        return None

    def start_background(self) -> None:
        """Nothing to start: no watch to keep (callbacks run inline), no keep-alives."""

    async def close(self) -> None:
        """As EtcdStore.close: the watch stops first, then our leases are revoked."""
        self._live_listeners.clear()
        for lid in (self._session, self._attempts.lease_id if self._attempts else 0):
            if lid in self._leases:
                self._drop_leases({lid})
        self._closed = True

    async def healthy(self) -> bool:
        try:
            self._enter()
        except StoreUnavailable:
            return False
        return True

    def _check_up(self) -> None:
        if self._closed:
            raise StoreUnavailable("etcd CANCELLED: the store is closed")
        if self.unavailable:
            raise StoreUnavailable("etcd UNAVAILABLE: the memory store is switched off")

    def _enter(self) -> None:
        """Every transaction starts here: etcd down, or this one call failed; else expiry."""
        self._check_up()
        if self._failures > 0:
            self._failures -= 1
            raise StoreUnavailable("etcd DEADLINE_EXCEEDED: fail_next")
        self._expire()

    # --- keys ---------------------------------------------------------------------------

    def _k(self, rid: str, suffix: str) -> str:
        return f"{self.prefix}/req/{rid}/{suffix}"

    def _req_prefix(self, rid: str) -> str:
        return f"{self.prefix}/req/{rid}/"

    def _live(self, rid: str) -> str:
        return self.live_prefix + rid

    def _cred(self, rid: str, aid: str) -> str:
        return f"{self.prefix}/cred/{rid}/{aid}"

    def _cred_put(self, rid: str, aid: str, credential: str | None, lease: int) -> list[_Op]:
        return [] if credential is None else [_put(self._cred(rid, aid), credential.encode(),
                                                   lease)]

    def _value(self, key: str) -> bytes | None:
        e = self._kv.get(key)
        return None if e is None else e.value

    def _txn(self, ops: Iterable[_Op]) -> None:
        """Apply the operations all or nothing, then run the `live` callbacks."""
        ops = list(ops)
        for _, value, lease in ops:
            if value is not None and lease and lease not in self._leases:
                raise StoreUnavailable(f"etcd NOT_FOUND: etcdserver: {_LEASE_NOT_FOUND}")
        events: list[tuple[str, str | None, str | None]] = []
        if ops:
            self._revision += 1
        for key, value, lease in ops:
            old = self._kv.get(key)
            if value is None:
                if self._kv.pop(key, None) is None:
                    continue  # etcd: a delete of nothing is no event
            else:
                self._kv[key] = _Entry(value, lease, self._revision)
            if key.startswith(self.live_prefix):
                events.append((key[len(self.live_prefix):],
                               None if value is None else value.decode(),
                               None if old is None else old.value.decode()))
        self._fire(events)

    def _fire(self, events: list[tuple[str, str | None, str | None]]) -> None:
        for rid, value, prev in events:
            self._live_listeners.fire(rid, value, prev, True)

    # --- leases -------------------------------------------------------------------------

    def _grant(self, ttl_s: float) -> int:
        self._check_up()
        self._next_lease += 1
        self._leases[self._next_lease] = self.clock.monotonic() + ttl_s
        return self._next_lease

    def _expire(self) -> None:
        now = self.clock.monotonic()
        due = {lid for lid, expiry in self._leases.items() if expiry <= now}
        if due:
            self._drop_leases(due)

    def _drop_leases(self, ids: set[int]) -> None:
        for lid in ids:
            self._leases.pop(lid, None)
        self._txn(_delete(k) for k, e in list(self._kv.items()) if e.lease in ids)

    def _retention_lease(self, ttl_s: int | None = None) -> int:
        """As EtcdStore: one lease per retention window (not re-checked once cached)."""
        ttl = ttl_s or self.cfg.journal_retention_s
        window = max(60.0, ttl / 10)
        now = self.clock.monotonic()
        cur = self._retention.get(ttl)
        if cur is not None and now - cur[1] < window:
            return cur[0]
        lid = self._grant(ttl)
        self._retention[ttl] = (lid, now)
        return lid

    def _forget_expired_leases(self) -> None:
        """EtcdStore's recovery after "lease not found": drop the cached leases etcd lost."""
        if self._session and self._session not in self._leases:
            self._session = 0
        if self._attempts is not None and self._attempts.lease_id not in self._leases:
            self._attempts.lost()
        self._retention = {t: v for t, v in self._retention.items() if v[0] in self._leases}

    def _session_now(self) -> int:
        if not self._session:
            self._session = self._grant(math.inf)  # kept alive (see the module docstring)
        return self._session

    def _process_now(self) -> ProcessLease:
        cur = self._attempts
        if cur is not None and cur.deadline > 0:
            return cur
        ttl = self.cfg.attempt_lease_ttl_s
        self._attempts = ProcessLease(lease_id=self._grant(math.inf), ttl_s=ttl,
                                      deadline=math.inf, margin_s=min(1.0, ttl / 5))
        return self._attempts

    async def session_lease(self) -> int:
        """This processor's liveness lease: `guard` keys vanish if the process dies."""
        return self._session_now()

    async def process_lease(self) -> ProcessLease:
        """The lease this process's live attempts hang on (granted on first use)."""
        return self._process_now()

    def current_process_lease(self) -> ProcessLease | None:
        return self._attempts

    async def attempt_lease(self) -> AttemptLease:
        return AttemptLease(self._process_now())

    # --- the revocation watch --------------------------------------------------------

    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]:
        """Call `cb(new_value_or_None)` when live/<rid> changes; returns an unsubscribe."""
        return self._live_listeners.subscribe(rid, cb, mine)

    # --- journal ------------------------------------------------------------------------

    def _txn_regranting(self, ops: Callable[[], list[_Op]]) -> None:
        """As etcd_store: a put on a lease that expired meanwhile re-grants it, once."""
        try:
            self._txn(ops())
        except StoreUnavailable as e:
            if _LEASE_NOT_FOUND not in str(e):
                raise
            self._forget_expired_leases()
            self._txn(ops())

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None:
        """Create the record (admitting attempt 1 with it, its credential digest beside it);
        a repeat gets the record back."""
        self._enter()
        key = self._k(rid, "meta")
        if key in self._kv:
            return self._assemble(rid)

        def ops() -> list[_Op]:
            rl = self._retention_lease()
            out = [_put(key, _dumps(meta), rl),
                   _put(self._k(rid, "guard"), self.owner.encode(), self._session_now())]
            if first_attempt is not None:
                aid, record = first_attempt
                out += [_put(self._live(rid), aid.encode(), self._process_now().lease_id),
                        _put(self._k(rid, "attempts/001"), _dumps(record), rl),
                        *self._cred_put(rid, aid, credential, rl)]
            return out

        self._txn_regranting(ops)
        if self._lost_intake_answers > 0:
            self._lost_intake_answers -= 1
            raise StoreUnavailable("etcd DEADLINE_EXCEEDED: the intake applied, its answer "
                                   "was lost")
        return None

    async def reopen_request(self, rid: str, ended_outcome: Mapping[str, Any],
                             history: tuple[int, Mapping[str, Any]],
                             first_attempt: tuple[int, str, Mapping[str, Any]],
                             credential: str | None = None) -> JournalView | None:
        """Run a finished request again (EtcdStore.reopen_request); None when re-opened,
        else the record as it is now."""
        self._enter()
        out_k, live_k = self._k(rid, "outcome"), self._live(rid)
        n, aid, record = first_attempt
        run, entry = history
        att_k = self._k(rid, f"attempts/{n:03d}")
        if (self._value(out_k) != _dumps(ended_outcome) or self._k(rid, "meta") not in self._kv
                or self._k(rid, "delivery") in self._kv or live_k in self._kv
                or att_k in self._kv):
            return self._assemble(rid)

        def ops() -> list[_Op]:
            rl = self._retention_lease()
            return [_delete(out_k), _delete(self._k(rid, "progress")),
                    _put(self._k(rid, f"history/{run:03d}"), _dumps(entry), rl),
                    _put(self._k(rid, "guard"), self.owner.encode(), self._session_now()),
                    _put(live_k, aid.encode(), self._process_now().lease_id),
                    _put(att_k, _dumps(record), rl), *self._cred_put(rid, aid, credential, rl)]

        self._txn_regranting(ops)
        return None

    async def undo_reopen(self, rid: str, history: tuple[int, Mapping[str, Any]],
                          first_attempt: tuple[int, str]) -> bool:
        """Take back a re-open while nothing ran for it (EtcdStore.undo_reopen)."""
        self._enter()
        n, aid = first_attempt
        run, entry = history
        live_k = self._live(rid)
        if (self._value(live_k) != aid.encode() or self._k(rid, "delivery") in self._kv
                or self._k(rid, "outcome") in self._kv):
            return False
        self._txn([_put(self._k(rid, "outcome"), _dumps(entry["outcome"]),
                        self._retention_lease()),
                   _delete(self._k(rid, f"history/{run:03d}")), _delete(self._k(rid, "guard")),
                   _delete(self._k(rid, f"attempts/{n:03d}")), _delete(live_k),
                   _delete(self._cred(rid, aid))])
        return True

    async def get(self, rid: str) -> JournalView | None:
        self._enter()
        return self._assemble(rid)

    def _assemble(self, rid: str) -> JournalView | None:
        pfx = self._req_prefix(rid)
        live = self._value(self._live(rid))
        return assemble(rid, ((k[len(pfx):], self._kv[k].value)
                              for k in sorted(k for k in self._kv if k.startswith(pfx))),
                        None if live is None else live.decode())

    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None,
                            first_attempt: int = 1,
                            credential: str | None = None) -> AdmitResult:
        """Admit attempt n only if nothing was delivered and no other attempt is live,
        waiting (bounded) for another live attempt to go (EtcdStore.admit_attempt)."""
        self._check_up()
        pl = self._process_now()
        rl = self._retention_lease()
        live_k, deliv_k = self._live(rid), self._k(rid, "delivery")
        att_k, meta_k = self._k(rid, f"attempts/{attempt:03d}"), self._k(rid, "meta")
        start = self.clock.monotonic()
        gone = asyncio.Event()
        off = self.on_live_change(rid, lambda v: gone.set() if v is None else None)
        self._waiters.add(gone)
        try:
            while True:
                gone.clear()
                self._enter()
                live = self._value(live_k)
                waited = self.clock.monotonic() - start
                if live == attempt_id.encode() and att_k in self._kv:
                    # Sent again after a lost answer: this attempt is admitted already.
                    return AdmitResult(True, "admitted (an earlier try applied)",
                                       AttemptLease(pl), waited)
                admit = [_put(live_k, attempt_id.encode(), pl.lease_id),
                         _put(att_k, _dumps({**record,
                                             "admitted_at": round(self.clock.wall(), 6)}), rl),
                         *self._cred_put(rid, attempt_id, credential, rl)]
                if (meta_k in self._kv and deliv_k not in self._kv and live is None
                        and att_k not in self._kv):
                    self._txn(admit)
                    return AdmitResult(True, "admitted", AttemptLease(pl), waited)
                verdict = after_failed_admission(
                    attempt=attempt, has_meta=meta_k in self._kv, delivered=deliv_k in self._kv,
                    attempt_taken=att_k in self._kv,
                    live_never_started=bool(never_started is not None and live is not None
                                            and never_started(live.decode())),
                    waited_s=waited, fence_wait_s=fence_wait_s)
                if verdict == TAKE_OVER:
                    assert live is not None
                    # The take-over, conditioned as etcd's (nothing can run in between here).
                    if (self._value(live_k) == live and deliv_k not in self._kv
                            and att_k not in self._kv):
                        self._txn([*admit, _put(self._k(rid, f"attempts/{first_attempt:03d}"),
                                                _dumps(records.taken_over_first_attempt(
                                                    live.decode(), round(self.clock.wall(), 6),
                                                    first_attempt)), rl)])
                        return AdmitResult(True, "admitted (attempt 1 never started)",
                                           AttemptLease(pl), self.clock.monotonic() - start)
                    continue
                if verdict == WAIT:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(),
                                               admission_poll_s(waited, fence_wait_s))
                    continue
                return AdmitResult(False, verdict, None, waited)
        finally:
            self._waiters.discard(gone)
            off()

    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool:
        """Record first_delta_sent, only while this attempt is the live one."""
        self._enter()
        rl = self._retention_lease()
        deliv_k = self._k(rid, "delivery")
        if self._value(self._live(rid)) != attempt_id.encode() or deliv_k in self._kv:
            # Sent again after a lost answer: a `delivery` of this very attempt is our own.
            return own_write(self._value(deliv_k), attempt_id)
        self._txn([_put(deliv_k, _dumps(record), rl)])
        return True

    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool:
        """Remove a `delivery` equal to `record`."""
        self._enter()
        deliv_k = self._k(rid, "delivery")
        if self._value(deliv_k) != _dumps(record):
            return False
        self._txn([_delete(deliv_k)])
        return True

    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool:
        """Remove an admission (`live` and the attempt's record) while `live` is still it."""
        self._enter()
        live_k = self._live(rid)
        if self._value(live_k) != attempt_id.encode():
            return False
        self._txn([_delete(live_k), _delete(self._k(rid, f"attempts/{attempt:03d}")),
                   _delete(self._cred(rid, attempt_id))])
        return True

    async def undo_intake(self, rid: str, attempt_id: str) -> bool:
        """Remove a record our given-up intake may have written after all, while nothing
        ran for it: `live` is still its attempt 1, nothing delivered, no outcome."""
        self._enter()
        if (self._value(self._live(rid)) != attempt_id.encode()
                or self._k(rid, "delivery") in self._kv or self._k(rid, "outcome") in self._kv):
            return False
        pfx = self._req_prefix(rid)
        self._txn([_delete(self._live(rid)), *(_delete(k) for k in sorted(self._kv)
                                              if k.startswith(pfx)),
                   _delete(self._cred(rid, attempt_id))])
        return True

    async def end_attempt(self, rid: str, attempt: int, attempt_id: str,
                          record: Mapping[str, Any], expire: bool) -> None:
        """Close the attempt's record; if `live` is still it, delete it (expire=False) or
        make it `fenced:<attempt_id>` on a fresh lease of attempt_lease_ttl_s."""
        self._enter()
        rl = self._retention_lease()
        live_k = self._live(rid)
        put_record = _put(self._k(rid, f"attempts/{attempt:03d}"), _dumps(record), rl)
        if expire:
            fence = _put(live_k, _FENCED + attempt_id.encode(),
                         self._grant(self.cfg.attempt_lease_ttl_s))
        else:
            fence = _delete(live_k)
        if self._value(live_k) == attempt_id.encode():
            self._txn([fence, put_record])
        else:
            self._txn([put_record])

    async def update_attempt(self, rid: str, attempt: int, record: Mapping[str, Any]) -> None:
        self._enter()
        self._txn([_put(self._k(rid, f"attempts/{attempt:03d}"), _dumps(record),
                        self._retention_lease())])

    async def progress(self, rid: str, record: Mapping[str, Any]) -> None:
        self._enter()
        self._txn([_put(self._k(rid, "progress"), _dumps(record), self._retention_lease())])

    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None) -> bool:
        """Write the outcome once, drop the guard key and delete a `live` naming an attempt
        (not a `fenced:` marker); the live key goes even when the outcome was there."""
        self._enter()
        rl = self._retention_lease()
        key, live_k = self._k(rid, "outcome"), self._live(rid)
        live = self._value(live_k)
        end_live = [_delete(live_k)] if live is not None and live < _FENCED else []
        if key in self._kv:
            self._txn(end_live)
            return False
        ops = [_put(key, _dumps(outcome), rl), _delete(self._k(rid, "guard")), *end_live]
        if attempt_end is not None:
            n, record = attempt_end
            ops.append(_put(self._k(rid, f"attempts/{n:03d}"), _dumps(record), rl))
        self._txn(ops)
        return True

    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]:
        """Publish this gateway's window counts; read every other gateway's."""
        self._enter()
        pfx = self.prefix + "/budget/"
        self._txn([_put(pfx + gateway_id, _dumps({"requests": requests, "retries": retries}),
                        self._session_now())])
        out: dict[str, tuple[int, int]] = {}
        for key in sorted(k for k in self._kv if k.startswith(pfx)):
            gid = key[len(pfx):]
            if gid != gateway_id:
                v = json.loads(self._kv[key].value)
                out[gid] = (int(v.get("requests", 0)), int(v.get("retries", 0)))
        return out

    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None:
        self._enter()
        self._txn([_put(f"{self.prefix}/trace/{rid}/{name}", _dumps(trace),
                        self._retention_lease())])

    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]:
        self._enter()
        pfx = f"{self.prefix}/trace/{rid}/"
        return {k[len(pfx):]: json.loads(self._kv[k].value)
                for k in sorted(k for k in self._kv if k.startswith(pfx))}

    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool:
        """Record the outcome only if none exists, no guard, no live key, and a meta does."""
        self._enter()
        rl = self._retention_lease()
        key = self._k(rid, "outcome")
        if (key in self._kv or self._k(rid, "guard") in self._kv
                or self._live(rid) in self._kv or self._k(rid, "meta") not in self._kv):
            return False
        self._txn([_put(key, _dumps(outcome), rl)])
        return True


class MemoryLedger:
    """ToolLedger over a MemoryStore: `<prefix>/tools/<key>` and `<prefix>/tools-exec/<key>`."""

    def __init__(self, store: MemoryStore, ttl_s: int) -> None:
        self.s = store
        self.ttl_s = ttl_s

    def _k(self, key: str) -> str:
        return self.s.prefix + "/tools/" + key

    def _exec(self, key: str) -> str:
        return self.s.prefix + "/tools-exec/" + key

    async def credential(self, rid: str, attempt_id: str) -> tuple[str | None, int]:
        """The stored credential digest and its key's mod_revision (None, 0: absent)."""
        s = self.s
        s._enter()
        e = s._kv.get(s._cred(rid, attempt_id))
        return (None, 0) if e is None else (e.value.decode(errors="replace"), e.mod)

    async def claim(self, key: str, rid: str, attempt_id: str, entry: Mapping[str, Any],
                    credential_rev: int) -> tuple[bool, dict[str, Any] | None, bool, bool]:
        """Claim the first execution, only for the live attempt whose credential key is
        unchanged since it was checked (ToolLedger.claim).

        Returns (claimed, existing entry, caller is the live attempt, executor alive).
        """
        s = self.s
        s._enter()
        rl = s._retention_lease(self.ttl_s)
        sl = s._session_now()
        k, ex = self._k(key), self._exec(key)
        cred = s._kv.get(s._cred(rid, attempt_id))
        is_live = (s._value(s._live(rid)) == attempt_id.encode() and cred is not None
                   and cred.mod == credential_rev)
        if k not in s._kv and is_live:
            s._txn([_put(k, _dumps(entry), rl), _put(ex, attempt_id.encode(), sl)])
            return True, None, True, True
        existing = s._value(k)
        return (False, None if existing is None else json.loads(existing), is_live,
                ex in s._kv)

    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Take back a claim equal to `entry` (and its executor marker)."""
        s = self.s
        s._enter()
        k = self._k(key)
        if s._value(k) != _dumps(entry):
            return False
        s._txn([_delete(k), _delete(self._exec(key))])
        return True

    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]:
        s = self.s
        s._enter()
        v = s._value(self._k(key))
        return (None if v is None else json.loads(v)), self._exec(key) in s._kv

    async def record(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store the result (or `unknown`) and release the executor marker, atomically."""
        s = self.s
        s._enter()
        s._txn([_put(self._k(key), _dumps(entry), s._retention_lease(self.ttl_s)),
                _delete(self._exec(key))])


if TYPE_CHECKING:
    # mypy --strict proves the structural fit with the ports the sessions consume.
    def _fits_the_ports(store: MemoryStore, ledger: MemoryLedger) -> tuple[Journal, Ledger]:
        return store, ledger
