"""The journal and the fence in etcd: journal_store's transactions over kv_etcd.EtcdKV.

What is etcd's own here is the process's part: the channels (etcd_client: TLS, auth,
endpoint failover), the session lease and the process lease with their keep-alive loops,
and the revocation watch's stream. Every transaction of the journal and the tool ledger is
journal_store.JournalStore's and ToolLedger's, the same code the in-memory store runs
(decision 0031).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ..core.config import EtcdConfig
from .etcd_client import EtcdClient
from .journal_store import JournalStore, ToolLedger
from .kv import prefix_end
from .kv_etcd import EtcdKV
from .leases import ProcessLease, StoreUnavailable
from .ports import SystemClock
from .timers import Timers

__all__ = ["EtcdStore", "ToolLedger"]

log = logging.getLogger("extproc.etcd")

_NOID = {"request_id": None, "attempt_id": None}

# etcd_pool's import: the end of a prefix's range.
_prefix_end = prefix_end


def keep_alive_deadline(left_s: float, timeout_s: float) -> float:
    """A keep-alive's own deadline: half of what the process lease has left locally, so a
    try on a frozen member fails over to the next one before the lease lapses here (one
    `timeout_s` can be longer than the lease's whole margin: 0.93 s left at a 2 s TTL); at
    least 0.1 s, and `timeout_s` once it has lapsed (then only etcd's answer matters)."""
    if left_s <= 0:
        return timeout_s
    return max(0.1, min(timeout_s, left_s / 2))


class EtcdStore(JournalStore):
    def __init__(self, cfg: EtcdConfig, owner: str = "gw",
                 timers: Timers | None = None) -> None:
        self.etcd = EtcdKV(cfg, timers)
        super().__init__(cfg, self.etcd, SystemClock(), owner, timers)
        self.timeout = cfg.timeout_s
        self._session_lock = asyncio.Lock()
        self._attempts_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    # --- connection ---------------------------------------------------------------

    async def connect(self) -> None:
        """Open the channels (no call yet: etcd may come up later).

        Reads etcd.tls's and etcd.auth's files now: ConfigError naming the field and path.
        """
        self.etcd.open()

    def start_background(self) -> None:
        """The revocation watch and the lease keep-alives (call inside the event loop)."""
        super().start_background()
        self._tasks.append(asyncio.ensure_future(self._session_loop()))
        self._tasks.append(asyncio.ensure_future(self._attempts_loop()))

    async def _stop_background(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    @property
    def last_answer(self) -> float | None:
        """Monotonic time etcd last answered any call of ours (None: never): readiness."""
        return self.etcd.last_answer

    @last_answer.setter
    def last_answer(self, at: float | None) -> None:
        self.etcd.last_answer = at

    # The channels and etcd's stub-shaped services (etcd_pool and tests call them).
    @property
    def _channel(self) -> EtcdClient | None:
        return self.etcd.client

    @property
    def _kv(self) -> Any:
        return None if self.etcd.client is None else self.etcd.client.kv

    @property
    def _lease(self) -> Any:
        return None if self.etcd.client is None else self.etcd.client.lease

    @property
    def _watch(self) -> Any:
        return None if self.etcd.client is None else self.etcd.client.watch

    async def _call(self, fn: Any, req: Any, deadline_s: float | None = None) -> Any:
        return await self.etcd.call(fn, req, deadline_s)

    # --- the session lease ---------------------------------------------------------------

    async def session_lease(self) -> int:
        """This processor's liveness lease: `guard` keys vanish if the process dies."""
        if self._session:
            return self._session
        async with self._session_lock:
            if not self._session:
                self._session = (await self.kv.grant(self.cfg.session_ttl_s)).id
            return self._session

    async def _session_loop(self) -> None:
        period = max(0.5, self.cfg.session_ttl_s / 3)
        while True:
            # On the loop, not the Timers port: it races etcd's lease TTL, on etcd's clock.
            await asyncio.sleep(period)
            if self._session and await self._keep_alive(self._session, "session") == 0:
                # Our session expired (etcd unreachable longer than its TTL): the next
                # request grants a new one. Requests in flight lost their guard key; see
                # docs/fencing.md ("processor liveness").
                log.error("session lease expired; granting a new one", extra=_NOID)
                self._session = 0

    async def _keep_alive(self, lease_id: int, what: str,
                          deadline_s: float | None = None) -> int | None:
        """One keep-alive: the lease's new TTL, 0 if etcd says it expired, None if no answer."""
        try:
            return await self.etcd.keep_alive(lease_id, deadline_s)
        except StoreUnavailable as e:
            # Keep trying; a lease's local deadline stops publishing if this goes on.
            log.warning(f"{what} lease keep-alive failed", extra={**_NOID, "error": str(e)})
        return None

    # --- the process lease ---------------------------------------------------------------

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
            lease = await self.kv.grant(ttl)
            margin = min(1.0, ttl / 5)
            self._attempts = ProcessLease(lease_id=lease.id, ttl_s=lease.ttl_s,
                                          deadline=sent + lease.ttl_s - margin,
                                          margin_s=margin)
            return self._attempts

    def _renew_period(self) -> float:
        return max(0.3, self.cfg.attempt_lease_ttl_s / 3)

    async def _renew(self, lease: ProcessLease, bounded: bool = False) -> bool | None:
        """One keep-alive of the process lease: True renewed, False lost, None no answer.

        `bounded` (the keep-alive loop): the try's deadline is half the lease's local time
        left, so a frozen member is passed over before the lease lapses here. An admission's
        own renewal keeps the whole `timeout_s`: it is the admission's answer, and the
        gate's rows bound its tries (a short one left time for a try that outlived the
        attempt's first-delta limit: tests/e2e/test_fencing.py's frozen etcd at the fence
        answered 504 instead of 503 journal_unavailable)."""
        sent = time.monotonic()
        ttl = await self._keep_alive(
            lease.lease_id, "attempt",
            keep_alive_deadline(lease.deadline - sent, self.timeout) if bounded else None)
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
            # On the loop, not the Timers port: it races etcd's lease TTL, on etcd's clock.
            await asyncio.sleep(delay)
            lease = self._attempts
            if lease is None or lease.deadline <= 0:
                delay = period
                continue
            # After a failed keep-alive, try again soon (that member is passed over now):
            # sooner while the local deadline runs out, never in a tight loop.
            if await self._renew(lease, bounded=True) is not None:
                delay = period
            else:
                left = lease.deadline - time.monotonic()
                delay = min(period, 0.25) if left <= 0 else max(0.02, min(period, 0.25,
                                                                          left / 3))
