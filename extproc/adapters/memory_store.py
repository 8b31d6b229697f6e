"""The journal and the tool ledger in memory: journal_store's transactions over kv_memory.

For hermetic tests of the guard and gate sessions: no etcd process, no sockets, and time on
an injected clock (a fake one jumps a `fenced:` marker's lease past its TTL at once). Every
transaction is journal_store.JournalStore's and ToolLedger's, the code EtcdStore runs; only
etcd is replaced, by kv_memory.MemoryKV (an in-memory fake of etcd whose likeness
tests/adapters/test_kv_memory.py checks against a real etcd). tests/adapters/
test_journal_store.py runs one suite on both stores with identical assertions.

Modelled: what MemoryKV models (revisions, compares, leases expiring on the clock, the prefix
watch told synchronously, "requested lease not found"); `admit_attempt` waits up to
fence_wait_s on the injected clock, woken by the watch and by `expire_leases()`, polling as
on etcd (real seconds: asyncio sleeps).

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

import math
from collections.abc import Mapping
from typing import Any

from ..core.config import EtcdConfig
from ..core.journal import JournalView
from .journal_store import JournalStore, ToolLedger
from .kv_memory import MemoryKV
from .leases import ProcessLease, StoreUnavailable
from .ports import Clock, SystemClock
from .timers import Timers

__all__ = ["MemoryLedger", "MemoryStore"]

# The ledger is the same code on both stores.
MemoryLedger = ToolLedger


class MemoryStore(JournalStore):
    """EtcdStore's journal, fence and leases over an in-memory etcd (one process's)."""

    def __init__(self, cfg: EtcdConfig, clock: Clock | None = None, owner: str = "gw",
                 timers: Timers | None = None) -> None:
        clock = clock if clock is not None else SystemClock()
        self.memory = MemoryKV(clock)
        super().__init__(cfg, self.memory, clock, owner, timers)
        self._lost_intake_answers = 0
        self._watch_live()  # callbacks run inline from the first transaction on

    # --- test controls ----------------------------------------------------------------

    @property
    def unavailable(self) -> bool:
        """While True every call raises StoreUnavailable, as with etcd down or partitioned."""
        return self.memory.unavailable

    @unavailable.setter
    def unavailable(self, down: bool) -> None:
        self.memory.unavailable = down

    def fail_next(self, n: int = 1) -> None:
        """The next n store transactions raise StoreUnavailable, applying nothing.

        Each Journal/Ledger call is one transaction; each poll of a waiting admission is one
        more, and a take-over one more (as each is one etcd call).
        """
        self.memory.fail_next(n)

    def lose_next_intake_answer(self, n: int = 1) -> None:
        """The next n intakes (open_request) apply, then raise StoreUnavailable: etcd
        applied the transaction but the caller's deadline passed first."""
        self._lost_intake_answers += n

    def expire_leases(self) -> None:
        """Apply every lease expiry due on the clock now (the callbacks of the `live` keys that
        go run), and wake waiting admissions so they look at the clock again at once."""
        self.memory.expire()
        self._wake_waiters()

    def revoke_lease(self, lease_id: int) -> None:
        """etcd's LeaseRevoke: the lease and every key on it go now (the session or process
        lease too: what etcd does to them after keep-alives failed for their TTL)."""
        if self.memory.has_lease(lease_id):
            self.memory.drop_leases({lease_id})
        if lease_id == self._session:
            self._session = 0
        if self._attempts is not None and self._attempts.lease_id == lease_id:
            self._attempts.lost()  # every key on it is gone: its attempts are fenced

    # --- connection and the process's leases -----------------------------------------

    async def connect(self) -> None:
        return None

    async def session_lease(self) -> int:
        """This processor's liveness lease, kept alive (see the module docstring)."""
        if not self._session:
            self._session = (await self.kv.grant(math.inf)).id
        return self._session

    async def process_lease(self) -> ProcessLease:
        """The lease this process's live attempts hang on (granted on first use)."""
        cur = self._attempts
        if cur is not None and cur.deadline > 0:
            return cur
        ttl = self.cfg.attempt_lease_ttl_s
        lease = await self.kv.grant(math.inf)
        self._attempts = ProcessLease(lease_id=lease.id, ttl_s=ttl, deadline=math.inf,
                                      margin_s=min(1.0, ttl / 5))
        return self._attempts

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None:
        view = await super().open_request(rid, meta, first_attempt, credential)
        if view is None and self._lost_intake_answers > 0:
            self._lost_intake_answers -= 1
            raise StoreUnavailable("etcd DEADLINE_EXCEEDED: the intake applied, its answer "
                                   "was lost")
        return view
