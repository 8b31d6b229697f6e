"""The journal and the fence, in etcd.

Uses aetcd's generated etcd v3 stubs directly over one grpc.aio channel so that every call
carries its own deadline (aetcd's client has none by default: a frozen etcd would hang a
stream forever). Layout under `<prefix>/req/<request_id>/` is described in
`extproc.core.journal`; the two transactions that make failover honest are
`admit_attempt` (a new attempt only while nothing was delivered and no other attempt holds
a live lease) and `fence_first_delta` (release only while this attempt is the live one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from ..core.config import EtcdConfig
from ..core.journal import JournalView

log = logging.getLogger("extproc.etcd")


class StoreUnavailable(Exception):
    """etcd did not answer within the deadline (down, frozen, or partitioned)."""


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass(slots=True)
class AttemptLease:
    """An attempt's permission to publish: valid while etcd holds it AND locally unexpired.

    The local deadline is computed from the monotonic time *before* the grant was sent, minus
    a safety margin, so a slow etcd or a paused process can only make us stop early.
    """

    lease_id: int
    ttl_s: int
    deadline: float  # monotonic
    revoked: bool = False
    margin_s: float = 1.0

    def valid(self, now: float | None = None) -> bool:
        return not self.revoked and (time.monotonic() if now is None else now) < self.deadline

    def renewed(self, sent_at: float, ttl_s: int) -> None:
        self.deadline = sent_at + ttl_s - self.margin_s


@dataclass(frozen=True, slots=True)
class AdmitResult:
    admitted: bool
    reason: str
    lease: AttemptLease | None = None
    waited_s: float = 0.0


class EtcdStore:
    def __init__(self, cfg: EtcdConfig) -> None:
        self.cfg = cfg
        self.timeout = cfg.timeout_s
        self.prefix = cfg.prefix.encode()
        self._channel: grpc.aio.Channel | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._retention: tuple[int, float] | None = None  # (lease id, monotonic granted)
        self._retention_lock = asyncio.Lock()

    # --- connection ---------------------------------------------------------------

    async def connect(self) -> None:
        eps = self.cfg.endpoints
        target = eps[0] if len(eps) == 1 else "ipv4:" + ",".join(eps)
        self._channel = grpc.aio.insecure_channel(
            target, options=[("grpc.lb_policy_name", "round_robin"),
                             ("grpc.keepalive_time_ms", 10000)])
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    async def _call(self, fn: Any, req: Any, deadline_s: float | None = None) -> Any:
        try:
            return await fn(req, timeout=deadline_s or self.timeout)
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd {e.code().name}: {e.details()}") from e

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

    # --- leases ----------------------------------------------------------------------

    async def _retention_lease(self) -> int:
        """Journal keys share one lease per window, so retention costs no call per request."""
        window = max(60.0, self.cfg.journal_retention_s / 10)
        now = time.monotonic()
        cur = self._retention
        if cur is not None and now - cur[1] < window:
            return cur[0]
        async with self._retention_lock:
            cur = self._retention
            if cur is not None and time.monotonic() - cur[1] < window:
                return cur[0]
            resp = await self._call(self._lease.LeaseGrant,
                                    rpc.LeaseGrantRequest(TTL=self.cfg.journal_retention_s))
            self._retention = (int(resp.ID), time.monotonic())
            return int(resp.ID)

    async def grant_attempt_lease(self) -> AttemptLease:
        sent = time.monotonic()
        ttl = self.cfg.attempt_lease_ttl_s
        resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        margin = min(1.0, ttl / 5)
        return AttemptLease(lease_id=int(resp.ID), ttl_s=int(resp.TTL),
                            deadline=sent + int(resp.TTL) - margin, margin_s=margin)

    async def refresh(self, lease: AttemptLease) -> bool:
        """One keep-alive; False if etcd says the lease is gone (revoked or expired)."""
        sent = time.monotonic()
        try:
            call = self._lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease.lease_id)]),
                                              timeout=self.timeout)
            async for reply in call:
                if reply.TTL <= 0:
                    lease.revoked = True
                    return False
                lease.renewed(sent, int(reply.TTL))
                return True
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd keepalive {e.code().name}") from e
        return False

    async def revoke(self, lease: AttemptLease) -> None:
        lease.revoked = True
        try:
            await self._call(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease.lease_id))
        except StoreUnavailable as e:
            if "NOT_FOUND" not in str(e):
                raise

    # --- journal ---------------------------------------------------------------------

    async def open_request(self, rid: str, meta: Mapping[str, Any]) -> JournalView | None:
        """Create the record; if it exists already (a repeat), return it instead."""
        rl = await self._retention_lease()
        key = self._k(rid, "meta")
        pfx = self._req_prefix(rid)
        req = rpc.TxnRequest(
            compare=[rpc.Compare(key=key, target=rpc.Compare.VERSION,
                                 result=rpc.Compare.EQUAL, version=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=_dumps(meta),
                                                              lease=rl))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(
                key=pfx, range_end=_prefix_end(pfx)))],
        )
        resp = await self._call(self._kv.Txn, req)
        if resp.succeeded:
            return None
        return self._assemble(rid, resp.responses[0].response_range.kvs)

    async def get(self, rid: str) -> JournalView | None:
        pfx = self._req_prefix(rid)
        resp = await self._call(self._kv.Range,
                                rpc.RangeRequest(key=pfx, range_end=_prefix_end(pfx)))
        if not resp.kvs:
            return None
        return self._assemble(rid, resp.kvs)

    def _assemble(self, rid: str, kvs: Any) -> JournalView | None:
        pfx = self._req_prefix(rid)
        meta: dict[str, Any] | None = None
        attempts: list[dict[str, Any]] = []
        live: str | None = None
        delivery = None
        outcome = None
        for kv in kvs:
            name = bytes(kv.key)[len(pfx):].decode()
            if name == "live":
                live = bytes(kv.value).decode()
                continue
            val = json.loads(kv.value)
            if name == "meta":
                meta = val
            elif name.startswith("attempts/"):
                attempts.append(val)
            elif name == "delivery":
                delivery = val
            elif name == "outcome":
                outcome = val
        if meta is None:
            return None
        attempts.sort(key=lambda a: int(a.get("attempt", 0)))
        return JournalView(request_id=rid, meta=meta, attempts=tuple(attempts),
                           live_attempt_id=live, delivery=delivery, outcome=outcome)

    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float) -> AdmitResult:
        """Admit attempt n only if nothing was delivered and no other attempt is live.

        If another attempt still holds a live lease, wait (bounded) for it to be revoked or
        to expire: that is the mission's `wait_for: cancel_ack_or_lease_expiry`.
        """
        lease = await self.grant_attempt_lease()
        rl = await self._retention_lease()
        live_k, deliv_k = self._k(rid, "live"), self._k(rid, "delivery")
        att_k, meta_k = self._k(rid, f"attempts/{attempt:03d}"), self._k(rid, "meta")
        start = time.monotonic()
        delay = 0.005
        try:
            while True:
                req = rpc.TxnRequest(
                    compare=[
                        rpc.Compare(key=meta_k, target=rpc.Compare.VERSION,
                                    result=rpc.Compare.GREATER, version=0),
                        rpc.Compare(key=deliv_k, target=rpc.Compare.VERSION,
                                    result=rpc.Compare.EQUAL, version=0),
                        rpc.Compare(key=live_k, target=rpc.Compare.VERSION,
                                    result=rpc.Compare.EQUAL, version=0),
                        rpc.Compare(key=att_k, target=rpc.Compare.VERSION,
                                    result=rpc.Compare.EQUAL, version=0),
                    ],
                    success=[
                        rpc.RequestOp(request_put=rpc.PutRequest(
                            key=live_k, value=attempt_id.encode(), lease=lease.lease_id)),
                        rpc.RequestOp(request_put=rpc.PutRequest(
                            key=att_k, value=_dumps(record), lease=rl)),
                    ],
                    failure=[
                        rpc.RequestOp(request_range=rpc.RangeRequest(key=meta_k)),
                        rpc.RequestOp(request_range=rpc.RangeRequest(key=deliv_k)),
                        rpc.RequestOp(request_range=rpc.RangeRequest(key=live_k)),
                        rpc.RequestOp(request_range=rpc.RangeRequest(key=att_k)),
                    ],
                )
                resp = await self._call(self._kv.Txn, req)
                waited = time.monotonic() - start
                if resp.succeeded:
                    return AdmitResult(True, "admitted", lease, waited)
                has = [len(r.response_range.kvs) > 0 for r in resp.responses]
                if not has[0]:
                    reason = "unknown request (no journal record)"
                elif has[1]:
                    reason = "first delta already sent: no second attempt"
                elif has[3]:
                    reason = f"attempt {attempt} was already admitted"
                else:
                    # Another attempt still holds a live lease: wait for its revocation or
                    # expiry, never run two attempts at once.
                    if waited + delay > fence_wait_s:
                        reason = "previous attempt is not fenced (lease still live)"
                    else:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.1)
                        continue
                await self.revoke(lease)
                return AdmitResult(False, reason, None, waited)
        except BaseException:
            lease.revoked = True
            raise

    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool:
        """Record first_delta_sent, only while this attempt is the live one."""
        rl = await self._retention_lease()
        live_k, deliv_k = self._k(rid, "live"), self._k(rid, "delivery")
        req = rpc.TxnRequest(
            compare=[
                rpc.Compare(key=live_k, target=rpc.Compare.VALUE, result=rpc.Compare.EQUAL,
                            value=attempt_id.encode()),
                rpc.Compare(key=deliv_k, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL,
                            version=0),
            ],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(
                key=deliv_k, value=_dumps(record), lease=rl))],
        )
        resp = await self._call(self._kv.Txn, req)
        return bool(resp.succeeded)

    async def end_attempt(self, rid: str, attempt: int, record: Mapping[str, Any]) -> None:
        rl = await self._retention_lease()
        await self._call(self._kv.Put, rpc.PutRequest(
            key=self._k(rid, f"attempts/{attempt:03d}"), value=_dumps(record), lease=rl))

    async def finish(self, rid: str, outcome: Mapping[str, Any]) -> bool:
        """Write the outcome once; a second writer (e.g. a restarted processor) loses."""
        rl = await self._retention_lease()
        key = self._k(rid, "outcome")
        req = rpc.TxnRequest(
            compare=[rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL,
                                 version=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=_dumps(outcome),
                                                              lease=rl))],
        )
        resp = await self._call(self._kv.Txn, req)
        return bool(resp.succeeded)


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
