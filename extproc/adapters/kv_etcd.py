"""The `KV` port on a real etcd, over etcd_client's channels (TLS, auth, endpoint failover).

Every call carries its own deadline (`etcd.timeout_s`; aetcd's client has none by default:
a frozen etcd would hang a stream forever) and turns gRPC's error into StoreUnavailable. A
watch is one stream, re-created with a backoff after it broke; while it is down nobody is
told of changes (the journal's lease deadlines protect meanwhile, docs/fencing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from aetcd import rpc

from ..core.config import EtcdConfig
from .etcd_client import EtcdClient
from .kv import (
    Cmp,
    Compare,
    Delete,
    Get,
    KeyValue,
    Lease,
    Op,
    Put,
    Target,
    Txn,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from .leases import StoreUnavailable
from .timers import LoopTimers, Timers, sleep

__all__ = ["EtcdKV"]

log = logging.getLogger("extproc.etcd")

_NOID = {"request_id": None, "attempt_id": None}

_TARGET = {Target.VALUE: rpc.Compare.VALUE, Target.VERSION: rpc.Compare.VERSION,
           Target.MOD: rpc.Compare.MOD}
_RESULT = {Cmp.EQUAL: rpc.Compare.EQUAL, Cmp.LESS: rpc.Compare.LESS,
           Cmp.GREATER: rpc.Compare.GREATER}


# The request is built in place, each message added to its parent (`add()`, a sub-message's
# fields set where they are): a message given to a constructor is copied into it, level by
# level (decision 0048). Setting a field of a oneof's sub-message selects that member, as
# the constructor did, even when the value set is the default.


def _compare(m: Any, c: Compare) -> None:
    m.key = c.key
    m.target = _TARGET[c.target]
    m.result = _RESULT[c.result]
    if c.target is Target.VALUE:
        m.value = c.value
    elif c.target is Target.VERSION:
        m.version = c.value
    else:
        m.mod_revision = c.value


def _op(m: Any, op: Op) -> None:
    if isinstance(op, Put):
        r = m.request_put
        r.key = op.key
        r.value = op.value
        r.lease = op.lease
    elif isinstance(op, Delete):
        r = m.request_delete_range
        r.key = op.key
        if op.prefix:
            r.range_end = prefix_end(op.key)
    elif isinstance(op, Get):
        r = m.request_range
        r.key = op.key
        if op.prefix:
            r.range_end = prefix_end(op.key)
    else:
        r = m.request_txn
        r.SetInParent()  # an empty transaction is still the member chosen
        _fill(r, op)


def _fill(req: Any, t: Txn) -> None:
    add = req.compare.add
    for c in t.compare:
        _compare(add(), c)
    add = req.success.add
    for o in t.success:
        _op(add(), o)
    add = req.failure.add
    for o in t.failure:
        _op(add(), o)


def _txn(t: Txn) -> Any:
    req = rpc.TxnRequest()
    _fill(req, t)
    return req


def _kv(kv: Any) -> KeyValue:
    return KeyValue(bytes(kv.key), bytes(kv.value), int(kv.create_revision),
                    int(kv.mod_revision), int(kv.version), int(kv.lease))


class EtcdKV:
    def __init__(self, cfg: EtcdConfig, timers: Timers | None = None) -> None:
        self.cfg = cfg
        self.timers: Timers = timers or LoopTimers()  # a lost watch's backoff
        self.timeout = cfg.timeout_s
        self.client: EtcdClient | None = None
        # Monotonic time etcd last answered any call of ours (None: never): readiness.
        self.last_answer: float | None = None
        self._watches: list[asyncio.Task[None]] = []

    def open(self) -> None:
        """Open the channels (no call yet: etcd may come up later).

        Reads etcd.tls's and etcd.auth's files now: ConfigError naming the field and path.
        """
        self.client = EtcdClient(self.cfg)
        self.client.open()

    async def call(self, fn: Any, req: Any, deadline_s: float | None = None) -> Any:
        """One unary call of etcd's stub-shaped services, its gRPC error a StoreUnavailable."""
        try:
            resp = await fn(req, timeout=deadline_s or self.timeout)
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd {e.code().name}: {e.details()}") from e
        self.last_answer = time.monotonic()  # readiness (adapters/readiness.py)
        return resp

    def _c(self) -> EtcdClient:
        if self.client is None:
            raise StoreUnavailable("etcd CANCELLED: the etcd client is not open")
        return self.client

    # --- the port --------------------------------------------------------------------------

    async def txn(self, t: Txn) -> TxnResult:
        c = self.client
        if c is None:
            raise StoreUnavailable("etcd CANCELLED: the etcd client is not open")
        try:
            resp = await c.kv.Txn(_txn(t), timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd {e.code().name}: {e.details()}") from e
        self.last_answer = time.monotonic()  # readiness (adapters/readiness.py)
        succeeded = bool(resp.succeeded)
        responses = resp.responses
        if any(isinstance(o, Get) for o in (t.success if succeeded else t.failure)):
            reads = tuple(tuple(_kv(kv) for kv in r.response_range.kvs)
                          if r.WhichOneof("response") == "response_range" else ()
                          for r in responses)
        else:  # only a Get is answered with a range: one empty read per answer
            reads = ((),) * len(responses)
        return TxnResult(succeeded, reads, int(resp.header.revision))

    async def grant(self, ttl_s: float) -> Lease:
        resp = await self.call(self._c().lease.LeaseGrant,
                               rpc.LeaseGrantRequest(TTL=int(ttl_s)))
        return Lease(int(resp.ID), int(resp.TTL))

    async def keep_alive(self, lease_id: int, deadline_s: float | None = None) -> int:
        """One keep-alive on its own short stream (not counted as an answer for readiness)."""
        try:
            call = self._c().lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                timeout=deadline_s or self.timeout)
            async for reply in call:
                return max(0, int(reply.TTL))
        except grpc.aio.AioRpcError as e:
            raise StoreUnavailable(f"etcd {e.code().name}: {e.details()}") from e
        raise StoreUnavailable("etcd: the keep-alive stream ended without an answer")

    async def time_to_live(self, lease_id: int) -> int:
        resp = await self.call(self._c().lease.LeaseTimeToLive,
                               rpc.LeaseTimeToLiveRequest(ID=lease_id))
        return int(resp.TTL)

    async def revoke(self, lease_id: int) -> None:
        await self.call(self._c().lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))

    def watch(self, prefix: bytes, on_event: Callable[[WatchEvent], None],
              on_state: Callable[[bool], None] | None = None,
              name: str = "watch") -> Callable[[], None]:
        """One watch of `prefix` (call inside the event loop), re-created on failure."""
        task = asyncio.ensure_future(self._watch_loop(prefix, on_event,
                                                      on_state or (lambda up: None), name))
        self._watches.append(task)

        def stop() -> None:
            task.cancel()
        return stop

    async def close(self) -> None:
        for t in self._watches:
            t.cancel()
        for t in self._watches:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._watches.clear()
        if self.client is not None:
            await self.client.close(grace=None)
            self.client = None

    async def _watch_loop(self, prefix: bytes, on_event: Callable[[WatchEvent], None],
                          on_state: Callable[[bool], None], name: str) -> None:
        backoff = 0.05
        while True:
            try:
                req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=prefix, range_end=prefix_end(prefix), prev_kv=True))
                async for resp in self._c().watch.Watch(iter([req])):
                    if resp.canceled:
                        # etcd refused the watch (with auth on: a user without permission
                        # on the prefix): created and canceled at once, never an event.
                        raise StoreUnavailable(f"etcd refused the {name}: "
                                               f"{resp.cancel_reason}")
                    if resp.created:
                        on_state(True)
                        backoff = 0.05
                    for ev in resp.events:  # (bytes fields are bytes already)
                        kv = ev.kv
                        deleted = ev.type == 1
                        if ev.HasField("prev_kv"):
                            prev, known = ev.prev_kv.value, True
                        else:  # a put that created the key replaced nothing
                            prev, known = None, not deleted and kv.version == 1
                        on_event(WatchEvent(kv.key, None if deleted else kv.value,
                                            prev, known))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd down: the local lease deadlines still protect
                log.warning(f"{name} lost; re-creating", extra={**_NOID, "error": repr(e)})
            on_state(False)
            await sleep(self.timers, backoff)
            backoff = min(backoff * 2, 2.0)
