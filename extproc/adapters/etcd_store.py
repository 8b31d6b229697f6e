"""The journal and the fence, in etcd.

Uses aetcd's generated etcd v3 stubs directly over one grpc.aio channel so that every call
carries its own deadline (aetcd's client has none by default: a frozen etcd would hang a
stream forever). Layout (docs/architecture.md):

  <prefix>/req/<rid>/meta | attempts/NNN | delivery | outcome | progress   (retention lease)
  <prefix>/req/<rid>/guard      the processor serving the request (its session lease)
  <prefix>/live/<rid>           the live attempt id (that attempt's own lease): the fence
  <prefix>/cred/<rid>/<aid>     sha256 of the attempt's tool-call secret (retention lease),
                                written with the `live` that makes the attempt live (0028)

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
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
from aetcd import rpc

from ..core import records
from ..core.admission import TAKE_OVER, WAIT, admission_poll_s, after_failed_admission
from ..core.config import EtcdConfig
from ..core.journal import JournalView, assemble, own_write
from .etcd_client import EtcdClient
from .leases import AdmitResult, AttemptLease, LiveListeners, ProcessLease, StoreUnavailable

log = logging.getLogger("extproc.etcd")

_NOID = {"request_id": None, "attempt_id": None}


# etcd's answer to a put on a lease it no longer has (it expired while we could not reach it).
_LEASE_NOT_FOUND = "requested lease not found"


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _eq_version(key: bytes, version: int) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL,
                       version=version)


def _put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _range(key: bytes, prefix: bool = False) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(
        key=key, range_end=_prefix_end(key) if prefix else b""))


class EtcdStore:
    def __init__(self, cfg: EtcdConfig, owner: str = "gw") -> None:
        self.cfg = cfg
        self.owner = owner
        self.timeout = cfg.timeout_s
        self.prefix = cfg.prefix.encode()
        self.live_prefix = self.prefix + b"/live/"
        # The channels to etcd's endpoints, TLS and the auth token (etcd_client.py).
        self._channel: EtcdClient | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        self._retention: dict[int, tuple[int, float]] = {}  # ttl -> (lease id, granted)
        self._retention_lock = asyncio.Lock()
        self._session: int = 0
        self._session_lock = asyncio.Lock()
        self._attempts: ProcessLease | None = None
        self._attempts_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        # rid -> callbacks run when live/<rid> is deleted or changes (revocation, expiry).
        self._live_listeners = LiveListeners()
        self.watch_connected = asyncio.Event()
        # Monotonic time etcd last answered any call of ours (None: never): readiness.
        self.last_answer: float | None = None

    # --- connection ---------------------------------------------------------------

    async def connect(self) -> None:
        """Open the channels (no call yet: etcd may come up later).

        Reads etcd.tls's and etcd.auth's files now: ConfigError naming the field and path.
        """
        self._channel = EtcdClient(self.cfg)
        self._channel.open()
        # Stub-shaped: every call goes to a connected endpoint with the auth token.
        self._kv = self._channel.kv
        self._lease = self._channel.lease
        self._watch = self._channel.watch

    def start_background(self) -> None:
        """The revocation watch and the lease keep-alives (call inside the event loop)."""
        self._tasks.append(asyncio.ensure_future(self._watch_live_loop()))
        self._tasks.append(asyncio.ensure_future(self._session_loop()))
        self._tasks.append(asyncio.ensure_future(self._attempts_loop()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for lid in (self._session, self._attempts.lease_id if self._attempts else 0):
            if lid:
                with contextlib.suppress(StoreUnavailable):
                    await self._call(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lid))
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    async def _call(self, fn: Any, req: Any, deadline_s: float | None = None) -> Any:
        try:
            resp = await fn(req, timeout=deadline_s or self.timeout)
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd {e.code().name}: {e.details()}") from e
        self.last_answer = time.monotonic()  # readiness (adapters/readiness.py)
        return resp

    async def healthy(self) -> bool:
        try:
            await self._call(self._kv.Range, rpc.RangeRequest(key=self.prefix + b"/health"))
        except StoreUnavailable:
            return False
        return True

    # --- keys ------------------------------------------------------------------------

    def _k(self, rid: str, suffix: str) -> bytes:
        return self.prefix + b"/req/" + rid.encode() + b"/" + suffix.encode()

    def _req_prefix(self, rid: str) -> bytes:
        return self.prefix + b"/req/" + rid.encode() + b"/"

    def _live(self, rid: str) -> bytes:
        return self.live_prefix + rid.encode()

    def _cred(self, rid: str, aid: str) -> bytes:
        return self.prefix + b"/cred/" + rid.encode() + b"/" + aid.encode()

    def _cred_put(self, rid: str, aid: str, credential: str | None, lease: int) -> list[Any]:
        """The attempt's credential digest, in the transaction that makes it live."""
        return [] if credential is None else [_put(self._cred(rid, aid), credential.encode(),
                                                   lease)]

    # --- leases ----------------------------------------------------------------------

    async def _retention_lease(self, ttl_s: int | None = None) -> int:
        """Keys with one retention share one lease per window: no lease call per request.

        A key written in a window lives between 90% and 100% of the TTL.
        """
        ttl = ttl_s or self.cfg.journal_retention_s
        window = max(60.0, ttl / 10)
        now = time.monotonic()
        cur = self._retention.get(ttl)
        if cur is not None and now - cur[1] < window:
            return cur[0]
        async with self._retention_lock:
            cur = self._retention.get(ttl)
            if cur is not None and time.monotonic() - cur[1] < window:
                return cur[0]
            resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
            self._retention[ttl] = (int(resp.ID), time.monotonic())
            return int(resp.ID)

    async def session_lease(self) -> int:
        """This processor's liveness lease: `guard` keys vanish if the process dies."""
        if self._session:
            return self._session
        async with self._session_lock:
            if not self._session:
                resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(
                    TTL=self.cfg.session_ttl_s))
                self._session = int(resp.ID)
            return self._session

    async def _session_loop(self) -> None:
        period = max(0.5, self.cfg.session_ttl_s / 3)
        while True:
            await asyncio.sleep(period)
            if self._session and await self._keep_alive(self._session, "session") == 0:
                # Our session expired (etcd unreachable longer than its TTL): the next
                # request grants a new one. Requests in flight lost their guard key; see
                # docs/fencing.md ("processor liveness").
                log.error("session lease expired; granting a new one", extra=_NOID)
                self._session = 0

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
            resp = await self._call(self._lease.LeaseTimeToLive,
                                    rpc.LeaseTimeToLiveRequest(ID=lid))
            if int(resp.TTL) > 0:
                continue
            log.error(f"{what} lease expired in etcd; granting a new one", extra=_NOID)
            if what == "session" and self._session == lid:
                self._session = 0
            elif what == "attempt" and self._attempts is not None \
                    and self._attempts.lease_id == lid:
                self._attempts.lost()  # every key on it is gone: its attempts are fenced
            else:
                self._retention = {t: v for t, v in self._retention.items() if v[0] != lid}

    async def _keep_alive(self, lease_id: int, what: str) -> int | None:
        """One keep-alive: the lease's new TTL, 0 if etcd says it expired, None if no answer."""
        try:
            call = self._lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                              timeout=self.timeout)
            async for reply in call:
                return max(0, int(reply.TTL))
        except grpc.aio.AioRpcError as e:
            # Keep trying; a lease's local deadline stops publishing if this goes on.
            log.warning(f"{what} lease keep-alive failed", extra={**_NOID,
                                                                   "error": str(e.code())})
        return None

    async def process_lease(self) -> ProcessLease:
        """The lease this process's live attempts hang on (granted on first use).

        A new attempt is not put on a lease about to lapse locally (keep-alives failed while
        etcd was away): it is renewed first, or the attempt would be fenced moments after
        its admission, mid-stream.
        """
        cur = self._attempts
        now = time.monotonic()
        if cur is not None and cur.deadline - now > self._renew_period():
            return cur
        async with self._attempts_lock:
            cur = self._attempts
            if cur is not None and cur.deadline - time.monotonic() > self._renew_period():
                return cur
            if cur is not None and cur.deadline > 0:
                await self._renew(cur)
                if cur.valid():
                    return cur
            sent = time.monotonic()
            ttl = self.cfg.attempt_lease_ttl_s
            resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
            margin = min(1.0, ttl / 5)
            self._attempts = ProcessLease(lease_id=int(resp.ID), ttl_s=int(resp.TTL),
                                          deadline=sent + int(resp.TTL) - margin,
                                          margin_s=margin)
            return self._attempts

    def current_process_lease(self) -> ProcessLease | None:
        return self._attempts

    async def attempt_lease(self) -> AttemptLease:
        return AttemptLease(await self.process_lease())

    def _renew_period(self) -> float:
        return max(0.3, self.cfg.attempt_lease_ttl_s / 3)

    async def _renew(self, lease: ProcessLease) -> bool | None:
        """One keep-alive of the process lease: True renewed, False lost, None no answer."""
        sent = time.monotonic()
        ttl = await self._keep_alive(lease.lease_id, "attempt")
        if ttl == 0:
            # Expired in etcd (we were cut off longer than its TTL): every key on it is
            # gone, so every attempt on it is fenced. The next admission grants anew.
            log.error("attempt lease expired; its attempts are fenced", extra=_NOID)
            lease.lost()
            return False
        if ttl is None:
            return None
        lease.renewed(sent, ttl)
        return True

    async def _attempts_loop(self) -> None:
        period = self._renew_period()
        delay = period
        while True:
            await asyncio.sleep(delay)
            lease = self._attempts
            if lease is None or lease.deadline <= 0:
                delay = period
                continue
            # After a failed keep-alive, try again soon: the local deadline is running out.
            delay = period if await self._renew(lease) is not None else min(period, 0.25)

    # --- the revocation watch ----------------------------------------------------------

    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]:
        """Call `cb(new_value_or_None)` when live/<rid> changes (with `mine`: only a change
        of that attempt's value, `LiveListeners`); returns an unsubscribe."""
        return self._live_listeners.subscribe(rid, cb, mine)

    async def _watch_live_loop(self) -> None:
        """One watch on <prefix>/live/ for the whole process, re-created on failure."""
        backoff = 0.05
        while True:
            try:
                req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=self.live_prefix, range_end=_prefix_end(self.live_prefix),
                    prev_kv=True))
                call = self._watch.Watch(iter([req]))
                async for resp in call:
                    if resp.canceled:
                        # etcd refused the watch (with auth on: a user without permission
                        # on the prefix): created and canceled at once, never an event.
                        raise StoreUnavailable(f"etcd refused the revocation watch: "
                                               f"{resp.cancel_reason}")
                    if resp.created:
                        self.watch_connected.set()
                        backoff = 0.05
                    for ev in resp.events:
                        rid = bytes(ev.kv.key)[len(self.live_prefix):].decode()
                        value = None if ev.type == 1 else bytes(ev.kv.value).decode()
                        if ev.HasField("prev_kv"):
                            prev, known = bytes(ev.prev_kv.value).decode(), True
                        else:  # a put that created the key replaced nothing
                            prev, known = None, ev.type == 0 and ev.kv.version == 1
                        self._live_listeners.fire(rid, value, prev, known)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down: the local lease deadline still protects
                log.warning("revocation watch lost; re-creating", extra={**_NOID,
                                                                        "error": repr(e)})
            self.watch_connected.clear()
            # While the watch is down nobody is told of revocations; the local deadline of
            # every lease still stops publishing in time (docs/fencing.md).
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    # --- journal ---------------------------------------------------------------------

    async def _write_or_read(self, rid: str,
                             txn: Callable[[], Awaitable[rpc.TxnRequest]]) -> JournalView | None:
        """Send a conditioned write whose failure branch reads the record: None when it
        applied, else the record as found (the open and the re-open)."""
        try:
            resp = await self._call(self._kv.Txn, await txn())
        except StoreUnavailable as e:
            # A lease of ours expired while etcd was unreachable: nothing was written (a
            # transaction is all or nothing), so re-grant what is gone and try once more.
            if _LEASE_NOT_FOUND not in str(e):
                raise
            await self._forget_expired_leases()
            resp = await self._call(self._kv.Txn, await txn())
        if resp.succeeded:
            return None
        return self._assemble(rid, list(resp.responses[0].response_range.kvs)
                              + list(resp.responses[1].response_range.kvs))

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

        async def txn() -> rpc.TxnRequest:
            rl = await self._retention_lease()
            sl = await self.session_lease()
            ops = [_put(key, _dumps(meta), rl),
                   _put(self._k(rid, "guard"), self.owner.encode(), sl)]
            if first_attempt is not None:
                pl = await self.process_lease()
                aid, record = first_attempt
                ops += [_put(self._live(rid), aid.encode(), pl.lease_id),
                        _put(self._k(rid, "attempts/001"), _dumps(record), rl),
                        *self._cred_put(rid, aid, credential, rl)]
            return rpc.TxnRequest(
                compare=[_eq_version(key, 0)],
                success=ops,
                failure=[_range(self._req_prefix(rid), prefix=True), _range(self._live(rid))],
            )

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
        att_k = self._k(rid, f"attempts/{n:03d}")

        async def txn() -> rpc.TxnRequest:
            rl = await self._retention_lease()
            sl = await self.session_lease()
            pl = await self.process_lease()
            return rpc.TxnRequest(
                compare=[rpc.Compare(key=out_k, target=rpc.Compare.VALUE,
                                     result=rpc.Compare.EQUAL, value=_dumps(ended_outcome)),
                         rpc.Compare(key=self._k(rid, "meta"), target=rpc.Compare.VERSION,
                                     result=rpc.Compare.GREATER, version=0),
                         _eq_version(self._k(rid, "delivery"), 0), _eq_version(live_k, 0),
                         _eq_version(att_k, 0)],
                success=[_delete(out_k), _delete(self._k(rid, "progress")),
                         _put(self._k(rid, f"history/{run:03d}"), _dumps(entry), rl),
                         _put(self._k(rid, "guard"), self.owner.encode(), sl),
                         _put(live_k, aid.encode(), pl.lease_id),
                         _put(att_k, _dumps(record), rl),
                         *self._cred_put(rid, aid, credential, rl)],
                failure=[_range(self._req_prefix(rid), prefix=True), _range(live_k)])

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
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.EQUAL, value=aid.encode()),
                     _eq_version(self._k(rid, "delivery"), 0),
                     _eq_version(self._k(rid, "outcome"), 0)],
            success=[_put(self._k(rid, "outcome"), _dumps(entry["outcome"]), rl),
                     _delete(self._k(rid, f"history/{run:03d}")),
                     _delete(self._k(rid, "guard")),
                     _delete(self._k(rid, f"attempts/{n:03d}")), _delete(live_k),
                     _delete(self._cred(rid, aid))]))
        return bool(resp.succeeded)

    async def get(self, rid: str) -> JournalView | None:
        req = rpc.TxnRequest(success=[_range(self._req_prefix(rid), prefix=True),
                                      _range(self._live(rid))])
        resp = await self._call(self._kv.Txn, req)
        kvs = list(resp.responses[0].response_range.kvs) + list(
            resp.responses[1].response_range.kvs)
        if not kvs:
            return None
        return self._assemble(rid, kvs)

    def _assemble(self, rid: str, kvs: list[Any]) -> JournalView | None:
        pfx, live_k = self._req_prefix(rid), self._live(rid)
        live = next((bytes(kv.value).decode() for kv in kvs if bytes(kv.key) == live_k), None)
        return assemble(rid, ((bytes(kv.key)[len(pfx):].decode(), bytes(kv.value))
                              for kv in kvs if bytes(kv.key) != live_k), live)

    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None,
                            first_attempt: int = 1,
                            credential: str | None = None) -> AdmitResult:
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
        """
        pl = await self.process_lease()
        rl = await self._retention_lease()
        live_k, deliv_k = self._live(rid), self._k(rid, "delivery")
        att_k, meta_k = self._k(rid, f"attempts/{attempt:03d}"), self._k(rid, "meta")
        start = time.monotonic()
        gone = asyncio.Event()
        off = self.on_live_change(rid, lambda v: gone.set() if v is None else None)
        try:
            while True:
                gone.clear()
                req = rpc.TxnRequest(
                    compare=[
                        rpc.Compare(key=meta_k, target=rpc.Compare.VERSION,
                                    result=rpc.Compare.GREATER, version=0),
                        _eq_version(deliv_k, 0), _eq_version(live_k, 0), _eq_version(att_k, 0),
                    ],
                    success=[_put(live_k, attempt_id.encode(), pl.lease_id),
                             _put(att_k, _dumps({**record, "admitted_at": round(
                                 time.time(), 6)}), rl),
                             *self._cred_put(rid, attempt_id, credential, rl)],
                    failure=[_range(meta_k), _range(deliv_k), _range(live_k), _range(att_k)],
                )
                resp = await self._call(self._kv.Txn, req)
                waited = time.monotonic() - start
                if resp.succeeded:
                    return AdmitResult(True, "admitted", AttemptLease(pl), waited)
                has = [len(r.response_range.kvs) > 0 for r in resp.responses]
                live_kvs = resp.responses[2].response_range.kvs
                if has[3] and live_kvs and bytes(live_kvs[0].value) == attempt_id.encode():
                    # Sent again after a lost answer: this attempt is admitted already.
                    return AdmitResult(True, "admitted (an earlier try applied)",
                                       AttemptLease(pl), waited)
                verdict = after_failed_admission(
                    attempt=attempt, has_meta=has[0], delivered=has[1], attempt_taken=has[3],
                    live_never_started=bool(
                        never_started is not None and live_kvs
                        and never_started(bytes(live_kvs[0].value).decode())),
                    waited_s=waited, fence_wait_s=fence_wait_s)
                if verdict == TAKE_OVER:
                    stale = bytes(live_kvs[0].value)
                    take = rpc.TxnRequest(
                        compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                             result=rpc.Compare.EQUAL, value=stale),
                                 _eq_version(deliv_k, 0), _eq_version(att_k, 0)],
                        success=[_put(live_k, attempt_id.encode(), pl.lease_id),
                                 _put(att_k, _dumps({**record, "admitted_at": round(
                                     time.time(), 6)}), rl),
                                 _put(self._k(rid, f"attempts/{first_attempt:03d}"),
                                      _dumps(records.taken_over_first_attempt(
                                          stale.decode(), round(time.time(), 6),
                                          first_attempt)), rl),
                                 *self._cred_put(rid, attempt_id, credential, rl)])
                    if (await self._call(self._kv.Txn, take)).succeeded:
                        return AdmitResult(True, "admitted (attempt 1 never started)",
                                           AttemptLease(pl), time.monotonic() - start)
                    continue
                if verdict == WAIT:
                    # Never run two attempts at once: wait for its revocation or expiry.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(),
                                               admission_poll_s(waited, fence_wait_s))
                    continue
                return AdmitResult(False, verdict, None, waited)
        finally:
            off()

    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool:
        """Record first_delta_sent, only while this attempt is the live one."""
        rl = await self._retention_lease()
        live_k, deliv_k = self._live(rid), self._k(rid, "delivery")
        req = rpc.TxnRequest(
            compare=[
                rpc.Compare(key=live_k, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL,
                            value=attempt_id.encode()),
                _eq_version(deliv_k, 0),
            ],
            success=[_put(deliv_k, _dumps(record), rl)],
            failure=[_range(deliv_k)],
        )
        resp = await self._call(self._kv.Txn, req)
        if resp.succeeded:
            return True
        # Sent again after a lost answer: a `delivery` of this very attempt is our own.
        kvs = resp.responses[0].response_range.kvs
        return own_write(bytes(kvs[0].value) if kvs else None, attempt_id)

    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool:
        """Remove a `delivery` our timed-out fence call may have written after all.

        A deadline is not a "no": a transaction queued in a frozen etcd can still apply when
        it wakes. The gate released nothing, so the record must not claim a first delta.
        """
        deliv_k = self._k(rid, "delivery")
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=deliv_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.EQUAL, value=_dumps(record))],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=deliv_k))]))
        return bool(resp.succeeded)

    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool:
        """Remove an admission our timed-out call may have written after all (its
        credential with it)."""
        live_k = self._live(rid)
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.EQUAL, value=attempt_id.encode())],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=live_k)),
                     rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                         key=self._k(rid, f"attempts/{attempt:03d}"))),
                     _delete(self._cred(rid, attempt_id))]))
        return bool(resp.succeeded)

    async def undo_intake(self, rid: str, attempt_id: str) -> bool:
        """Remove a record our given-up intake may have written after all, while nothing
        ran for it: `live` is still its attempt 1, nothing delivered, no outcome. The client
        was told nothing was recorded; a late apply must not leave the key in progress.
        Attempt 1's credential goes with it."""
        live_k, pfx = self._live(rid), self._req_prefix(rid)
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.EQUAL, value=attempt_id.encode()),
                     _eq_version(self._k(rid, "delivery"), 0),
                     _eq_version(self._k(rid, "outcome"), 0)],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=live_k)),
                     rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                         key=pfx, range_end=_prefix_end(pfx))),
                     _delete(self._cred(rid, attempt_id))]))
        return bool(resp.succeeded)

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
        put_record = _put(self._k(rid, f"attempts/{attempt:03d}"), _dumps(record), rl)
        if expire:
            resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(
                TTL=self.cfg.attempt_lease_ttl_s))
            fence = _put(live_k, b"fenced:" + attempt_id.encode(), int(resp.ID))
        else:
            fence = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=live_k))
        await self._call(self._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.EQUAL, value=attempt_id.encode())],
            success=[fence, put_record], failure=[put_record]))

    async def update_attempt(self, rid: str, attempt: int, record: Mapping[str, Any]) -> None:
        rl = await self._retention_lease()
        await self._call(self._kv.Put, rpc.PutRequest(
            key=self._k(rid, f"attempts/{attempt:03d}"), value=_dumps(record), lease=rl))

    async def progress(self, rid: str, record: Mapping[str, Any]) -> None:
        """Checkpoint what the client received so far (used if this processor dies)."""
        rl = await self._retention_lease()
        await self._call(self._kv.Put, rpc.PutRequest(key=self._k(rid, "progress"),
                                                      value=_dumps(record), lease=rl))

    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None) -> bool:
        """Write the outcome once, drop the guard key and end what is still live; one txn.

        `attempt_end` is the record of the attempt the gate handed over at release (the
        guard saw its end). When the request is over, every upstream request of it is over
        too, so a `live` key still naming an attempt is deleted; a `fenced:` marker (an
        attempt of uncertain liveness) is left to expire ("att_..." < "fenced:").
        """
        rl = await self._retention_lease()
        key, live_k = self._k(rid, "outcome"), self._live(rid)
        end_live = rpc.RequestOp(request_txn=rpc.TxnRequest(
            compare=[rpc.Compare(key=live_k, target=rpc.Compare.VALUE,
                                 result=rpc.Compare.LESS, value=b"fenced:")],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=live_k))]))
        ops = [_put(key, _dumps(outcome), rl),
               rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                   key=self._k(rid, "guard"))), end_live]
        if attempt_end is not None:
            n, record = attempt_end
            ops.append(_put(self._k(rid, f"attempts/{n:03d}"), _dumps(record), rl))
        req = rpc.TxnRequest(compare=[_eq_version(key, 0)], success=ops, failure=[end_live])
        resp = await self._call(self._kv.Txn, req)
        return bool(resp.succeeded)

    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]:
        """Publish this gateway's window counts; read every other gateway's (one txn)."""
        sl = await self.session_lease()
        pfx = self.prefix + b"/budget/"
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(success=[
            _put(pfx + gateway_id.encode(), _dumps({"requests": requests, "retries": retries}),
                 sl),
            _range(pfx, prefix=True)]))
        out: dict[str, tuple[int, int]] = {}
        for kv in resp.responses[1].response_range.kvs:
            gid = bytes(kv.key)[len(pfx):].decode()
            if gid != gateway_id:
                v = json.loads(kv.value)
                out[gid] = (int(v.get("requests", 0)), int(v.get("retries", 0)))
        return out

    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None:
        """An event trace for `extproc replay`, apart from the record (it can be large)."""
        rl = await self._retention_lease()
        key = self.prefix + b"/trace/" + rid.encode() + b"/" + name.encode()
        await self._call(self._kv.Put, rpc.PutRequest(key=key, value=_dumps(trace), lease=rl))

    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]:
        pfx = self.prefix + b"/trace/" + rid.encode() + b"/"
        resp = await self._call(self._kv.Range,
                                rpc.RangeRequest(key=pfx, range_end=_prefix_end(pfx)))
        return {bytes(kv.key)[len(pfx):].decode(): json.loads(kv.value) for kv in resp.kvs}

    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool:
        """Record the outcome of a request whose processor died (no guard, no live attempt).

        Create-only and conditioned on both being absent, so it can never overwrite or race
        the real guard's own record.
        """
        rl = await self._retention_lease()
        key = self._k(rid, "outcome")
        req = rpc.TxnRequest(
            compare=[_eq_version(key, 0), _eq_version(self._k(rid, "guard"), 0),
                     _eq_version(self._live(rid), 0),
                     rpc.Compare(key=self._k(rid, "meta"), target=rpc.Compare.VERSION,
                                 result=rpc.Compare.GREATER, version=0)],
            success=[_put(key, _dumps(outcome), rl)],
        )
        resp = await self._call(self._kv.Txn, req)
        return bool(resp.succeeded)


class ToolLedger:
    """The tool-call ledger on the same etcd: `<prefix>/tools/<request_id>:<call_id>`."""

    def __init__(self, store: EtcdStore, ttl_s: int) -> None:
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
        resp = await self.s._call(self.s._kv.Range,
                                  rpc.RangeRequest(key=self.s._cred(rid, attempt_id)))
        if not resp.kvs:
            return None, 0
        kv = resp.kvs[0]
        return bytes(kv.value).decode(errors="replace"), int(kv.mod_revision)

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
        resp = await self.s._call(self.s._kv.Txn, rpc.TxnRequest(
            compare=[_eq_version(k, 0),
                     rpc.Compare(key=live, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL,
                                 value=attempt_id.encode()),
                     rpc.Compare(key=cred, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL,
                                 mod_revision=credential_rev),
                     # An absent key's mod_revision is 0: never a credential.
                     rpc.Compare(key=cred, target=rpc.Compare.VERSION,
                                 result=rpc.Compare.GREATER, version=0)],
            success=[_put(k, _dumps(entry), rl), _put(ex, attempt_id.encode(), sl)],
            failure=[_range(k), _range(live), _range(ex), _range(cred)]))
        if resp.succeeded:
            return True, None, True, True
        kvs = [list(r.response_range.kvs) for r in resp.responses]
        existing = json.loads(kvs[0][0].value) if kvs[0] else None
        same_cred = bool(kvs[3]) and int(kvs[3][0].mod_revision) == credential_rev
        is_live = (bool(kvs[1]) and bytes(kvs[1][0].value) == attempt_id.encode()
                   and same_cred)
        return False, existing, is_live, bool(kvs[2])

    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool:
        """Take back a claim whose transaction timed out but may apply when etcd wakes."""
        k = self._k(key)
        resp = await self.s._call(self.s._kv.Txn, rpc.TxnRequest(
            compare=[rpc.Compare(key=k, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL,
                                 value=_dumps(entry))],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k)),
                     rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                         key=self._exec(key)))]))
        return bool(resp.succeeded)

    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]:
        resp = await self.s._call(self.s._kv.Txn, rpc.TxnRequest(
            success=[_range(self._k(key)), _range(self._exec(key))]))
        kvs = [list(r.response_range.kvs) for r in resp.responses]
        return (json.loads(kvs[0][0].value) if kvs[0] else None), bool(kvs[1])

    async def record(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store the result (or `unknown`) and release the executor marker, atomically."""
        rl = await self.s._retention_lease(self.ttl_s)
        await self.s._call(self.s._kv.Txn, rpc.TxnRequest(success=[
            _put(self._k(key), _dumps(entry), rl),
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=self._exec(key)))]))


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
