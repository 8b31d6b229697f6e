"""An in-memory fake of etcd behind the `KV` port, on an injected clock.

Modelled as etcd does it (tests/adapters/test_kv_memory.py runs the same suite on a real
etcd): one store revision, one more per transaction that changes a key (all of its writes
share it); each key's create_revision, mod_revision and version (a delete forgets them);
compares on an absent key (VALUE fails, VERSION and MOD see 0); a transaction's compares
judged before any of it applies, nested ones included, then its branch applied all or
nothing, a read seeing the writes before it; a put on a lease that no longer exists
refuses the whole transaction ("requested lease not found"); leases that expire on the
clock's monotonic time (lazily at every call, and at `expire()`), taking their keys with
them in one revision; prefix watches told of every change with the value it replaced,
synchronously, right after the transaction (or expiry) that made it.

Not modelled: compaction, watch from a past revision, more than one client (one MemoryKV is
one process's view of its etcd), an answer lost after the transaction applied
(memory_store.MemoryStore simulates that for the intake).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .kv import (
    LEASE_NOT_FOUND,
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
)
from .leases import StoreUnavailable
from .ports import Clock

__all__ = ["MemoryKV"]

_Watcher = tuple[bytes, Callable[[WatchEvent], None]]


class MemoryKV:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        # While True every call raises StoreUnavailable, as with etcd down or partitioned.
        self.unavailable = False
        self.closed = False
        self._failures = 0
        self._kv: dict[bytes, KeyValue] = {}
        self.revision = 1
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, expiry); inf: kept
        self._next_lease = 0x7E57_0000
        self._watchers: list[_Watcher] = []

    # --- test controls -------------------------------------------------------------------

    def fail_next(self, n: int = 1) -> None:
        """The next n transactions raise StoreUnavailable, applying nothing."""
        self._failures += n

    def expire(self) -> None:
        """Apply every lease expiry due on the clock now."""
        now = self.clock.monotonic()
        due = {lid for lid, (_, expiry) in self._leases.items() if expiry <= now}
        if due:
            self.drop_leases(due)

    def drop_leases(self, ids: set[int]) -> None:
        """The leases end now (revoked or expired): their keys go, in one revision."""
        for lid in ids:
            self._leases.pop(lid, None)
        self._apply([Delete(k) for k, kv in self._kv.items() if kv.lease in ids])

    def has_lease(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def value(self, key: bytes) -> bytes | None:
        kv = self._kv.get(key)
        return None if kv is None else kv.value

    # --- the port --------------------------------------------------------------------------

    def check_up(self) -> None:
        if self.closed:
            raise StoreUnavailable("etcd CANCELLED: the store is closed")
        if self.unavailable:
            raise StoreUnavailable("etcd UNAVAILABLE: the memory store is switched off")

    async def txn(self, t: Txn) -> TxnResult:
        self.check_up()
        if self._failures > 0:
            self._failures -= 1
            raise StoreUnavailable("etcd DEADLINE_EXCEEDED: fail_next")
        self.expire()
        ok = self._holds_all(t.compare)
        path = self._path(t)
        self._check_leases(path)
        return TxnResult(ok, self._apply(path), self.revision)

    async def grant(self, ttl_s: float) -> Lease:
        self.check_up()
        self._next_lease += 1
        self._leases[self._next_lease] = (ttl_s, self.clock.monotonic() + ttl_s)
        return Lease(self._next_lease, _seconds(ttl_s))

    async def keep_alive(self, lease_id: int, deadline_s: float | None = None) -> int:
        self.check_up()
        self.expire()
        if lease_id not in self._leases:
            return 0
        ttl, _ = self._leases[lease_id]
        self._leases[lease_id] = (ttl, self.clock.monotonic() + ttl)
        return _seconds(ttl)

    async def time_to_live(self, lease_id: int) -> int:
        self.check_up()
        self.expire()
        if lease_id not in self._leases:
            return -1
        # Whole seconds left, cut as etcd cuts them: less than one left is 0.
        return _seconds(self._leases[lease_id][1] - self.clock.monotonic())

    async def revoke(self, lease_id: int) -> None:
        self.check_up()
        self.expire()
        if lease_id not in self._leases:
            raise StoreUnavailable(f"etcd NOT_FOUND: etcdserver: {LEASE_NOT_FOUND}")
        self.drop_leases({lease_id})

    def watch(self, prefix: bytes, on_event: Callable[[WatchEvent], None],
              on_state: Callable[[bool], None] | None = None,
              name: str = "watch") -> Callable[[], None]:
        entry = (prefix, on_event)
        self._watchers.append(entry)
        if on_state is not None:
            on_state(True)

        def stop() -> None:
            if entry in self._watchers:
                self._watchers.remove(entry)
        return stop

    async def close(self) -> None:
        self._watchers.clear()
        self.closed = True

    # --- inside a transaction ------------------------------------------------------------

    def _holds(self, c: Compare) -> bool:
        kv = self._kv.get(c.key)
        if c.target is Target.VALUE:
            if kv is None:
                return False  # etcd: a value compare on an absent key always fails
            have: bytes | int = kv.value
        elif c.target is Target.VERSION:
            have = 0 if kv is None else kv.version
        else:
            have = 0 if kv is None else kv.mod_revision
        want = c.value
        if isinstance(have, bytes) != isinstance(want, bytes):
            raise TypeError(f"compare of {c.target} with {want!r}")
        if c.result is Cmp.EQUAL:
            return have == want
        if c.result is Cmp.LESS:
            return have < want  # type: ignore[operator]
        return have > want  # type: ignore[operator]

    def _holds_all(self, compares: Sequence[Compare]) -> bool:
        return all(self._holds(c) for c in compares)

    def _path(self, t: Txn) -> list[Op]:
        """The operations this transaction runs, nested branches chosen now, on the state
        before any of it applies (as etcd judges every compare first)."""
        out: list[Op] = []
        for op in t.success if self._holds_all(t.compare) else t.failure:
            out.append(Txn(success=self._path(op)) if isinstance(op, Txn) else op)
        return out

    def _check_leases(self, ops: Sequence[Op]) -> None:
        for op in ops:
            if isinstance(op, Txn):
                self._check_leases(op.success)
            elif isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise StoreUnavailable(f"etcd NOT_FOUND: etcdserver: {LEASE_NOT_FOUND}")

    def _apply(self, ops: Sequence[Op]) -> tuple[tuple[KeyValue, ...], ...]:
        """Run a chosen path: one revision for all its writes, then the watchers hear."""
        events: list[WatchEvent] = []
        reads = self._run(ops, self.revision + 1, events)
        if events:
            self.revision += 1
        self._notify(events)
        return reads

    def _run(self, ops: Sequence[Op], rev: int, events: list[WatchEvent]
             ) -> tuple[tuple[KeyValue, ...], ...]:
        reads: list[tuple[KeyValue, ...]] = []
        for op in ops:
            found: tuple[KeyValue, ...] = ()
            if isinstance(op, Put):
                old = self._kv.get(op.key)
                self._kv[op.key] = KeyValue(
                    op.key, op.value, rev if old is None else old.create_revision, rev,
                    1 if old is None else old.version + 1, op.lease)
                events.append(WatchEvent(op.key, op.value, None if old is None else old.value,
                                         True))
            elif isinstance(op, Delete):
                for k in self._keys(op.key, op.prefix):
                    events.append(WatchEvent(k, None, self._kv.pop(k).value, True))
            elif isinstance(op, Get):
                found = tuple(self._kv[k] for k in self._keys(op.key, op.prefix))
            else:  # a nested transaction, its branch already chosen (_path)
                self._run(op.success, rev, events)
            reads.append(found)
        return tuple(reads)

    def _keys(self, key: bytes, prefix: bool) -> list[bytes]:
        if not prefix:
            return [key] if key in self._kv else []
        return sorted(k for k in self._kv if k.startswith(key))

    def _notify(self, events: list[WatchEvent]) -> None:
        for ev in events:
            for prefix, cb in list(self._watchers):
                if ev.key.startswith(prefix):
                    cb(ev)


def _seconds(s: float) -> int:
    """A TTL as etcd states it: whole seconds (a kept-alive lease: a large number)."""
    return 2**31 - 1 if math.isinf(s) else max(0, int(s))
