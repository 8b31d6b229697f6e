"""Replica registrations in etcd: `<prefix>/pool/<address>`, each on its agent's lease.

The agent side (register, keep alive, withdraw) and the processor side (one listing, then
one watch from the listing's revision; listed again after the watch broke, so a missed event
cannot leave a departed replica in the pool). While etcd is unreachable the processor keeps
the pool it last saw: registrations lapse in etcd, and the next listing says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aetcd import rpc

from .etcd_store import EtcdStore, _prefix_end
from .leases import StoreUnavailable
from .timers import sleep

log = logging.getLogger("extproc.pool")
_NOID = {"request_id": None, "attempt_id": None}


class EtcdPoolRegistry:
    def __init__(self, store: EtcdStore) -> None:
        self.s = store
        self.prefix = store.prefix + b"/pool/"
        self._task: asyncio.Task[None] | None = None
        self.listed = asyncio.Event()

    def _key(self, address: str) -> bytes:
        return self.prefix + address.encode()

    # --- the agent -----------------------------------------------------------------

    async def register(self, address: str, record: Mapping[str, Any], ttl_s: int) -> int:
        """Write the registration on a new lease of `ttl_s`; its id, for keep-alives."""
        resp = await self.s._call(self.s._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl_s))
        lease_id = int(resp.ID)
        value = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
        await self.s._call(self.s._kv.Put, rpc.PutRequest(key=self._key(address), value=value,
                                                          lease=lease_id))
        return lease_id

    async def keep_alive(self, lease_id: int) -> bool | None:
        """True: renewed; False: etcd no longer has it; None: etcd did not answer."""
        ttl = await self.s._keep_alive(lease_id, "registration")
        return None if ttl is None else ttl > 0

    async def withdraw(self, lease_id: int) -> bool:
        """Revoke the lease: the registration goes at once (not after the TTL)."""
        try:
            await self.s._call(self.s._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except StoreUnavailable:
            return False
        return True

    # --- the processor ---------------------------------------------------------------

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        resp = await self.s._call(self.s._kv.Range, rpc.RangeRequest(
            key=self.prefix, range_end=_prefix_end(self.prefix)))
        return int(resp.header.revision), {
            bytes(kv.key)[len(self.prefix):].decode(): bytes(kv.value) for kv in resp.kvs}

    def watch(self, on_change: Callable[[dict[str, bytes]], None]) -> None:
        """Call `on_change(all registrations)` after the listing and after every change."""
        self._task = asyncio.ensure_future(self._loop(on_change))

    async def _loop(self, on_change: Callable[[dict[str, bytes]], None]) -> None:
        backoff = 0.05
        while True:
            try:
                rev, current = await self.snapshot()
                on_change(dict(current))
                self.listed.set()
                req = rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=self.prefix, range_end=_prefix_end(self.prefix),
                    start_revision=rev + 1))
                async for resp in self.s._watch.Watch(iter([req])):
                    if resp.canceled or resp.compact_revision:
                        break  # compacted past our revision: list again
                    if resp.created:
                        backoff = 0.05
                    changed = False
                    for ev in resp.events:
                        address = bytes(ev.kv.key)[len(self.prefix):].decode()
                        if ev.type == 1:  # DELETE: withdrawn or lapsed
                            changed |= current.pop(address, None) is not None
                        else:
                            current[address] = bytes(ev.kv.value)
                            changed = True
                    if changed:
                        on_change(dict(current))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd away: keep the last pool, list again when back
                log.warning("pool registrations watch lost; listing again",
                            extra={**_NOID, "error": repr(e)})
            await sleep(self.s.timers, backoff)
            backoff = min(backoff * 2, 2.0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
