"""The journal sharded by request id over several etcd clusters (decision 0042).

Every compare the journal makes is on keys of one request (`req/<rid>/...`, `live/<rid>`,
`cred/<rid>/...`, `tools/<rid>:<call>`, `trace/<rid>/...`, `cancel/`, `ack/`, `src/...`), so
each request's keys can live on one cluster of several, chosen by its request id, with no
transaction across clusters. `ShardedJournal` and `ShardedLedger` implement the `Journal`
and `Ledger` ports by handing each call to the store of the request's shard; the pool-wide
keys (`budget/<gateway>`, `pool/<address>`) stay on shard 0. With one shard this is the
store itself (`journal_for`): the same calls, keys and behaviour as before sharding.

Each shard's store is a whole `JournalStore`: its own channels, session lease, process lease,
retention leases, `live/` revocation watch and `src/<processor>/` watch. A shard that does
not answer fails only the calls of its own requests (StoreUnavailable, so 503
`journal_unavailable`); readiness follows shard 0 (server.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core.journal import JournalView
from .journal_store import JournalStore, ToolLedger
from .leases import AdmitResult, AttemptLease, ProcessLease

if TYPE_CHECKING:
    from .ports import Journal, Ledger

__all__ = ["ShardedJournal", "ShardedLedger", "journal_for", "shard_of"]


def shard_of(request_id: str, count: int) -> int:
    """The shard of a request: blake2b of its id modulo the shard count.

    Stable across processes, restarts and Python versions (Python's `hash()` of a str is
    salted per process), so the processor, the replica agent and `extproc inspect` agree.
    The request id follows from the idempotency key, so a repeat lands on the same shard.
    """
    if count <= 1:
        return 0
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


class ShardedJournal:
    """The `Journal` port over one store per shard; each call goes to its request's."""

    def __init__(self, stores: Sequence[JournalStore]) -> None:
        if not stores:
            raise ValueError("a sharded journal needs at least one store")
        self.stores = tuple(stores)
        self.count = len(self.stores)

    def of(self, rid: str) -> JournalStore:
        return self.stores[shard_of(rid, self.count)]

    # --- pool-wide: shard 0 -------------------------------------------------------------

    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]:
        return await self.stores[0].exchange_budget(gateway_id, requests, retries)

    # --- per request ----------------------------------------------------------------

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None:
        return await self.of(rid).open_request(rid, meta, first_attempt, credential)

    async def reopen_request(self, rid: str, ended_outcome: Mapping[str, Any],
                             history: tuple[int, Mapping[str, Any]],
                             first_attempt: tuple[int, str, Mapping[str, Any]],
                             credential: str | None = None) -> JournalView | None:
        return await self.of(rid).reopen_request(rid, ended_outcome, history, first_attempt,
                                                 credential)

    async def undo_reopen(self, rid: str, history: tuple[int, Mapping[str, Any]],
                          first_attempt: tuple[int, str]) -> bool:
        return await self.of(rid).undo_reopen(rid, history, first_attempt)

    async def get(self, rid: str) -> JournalView | None:
        return await self.of(rid).get(rid)

    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None,
                            first_attempt: int = 1,
                            credential: str | None = None,
                            cancel_ack: bool = True) -> AdmitResult:
        return await self.of(rid).admit_attempt(rid, attempt, attempt_id, record, fence_wait_s,
                                                never_started, first_attempt, credential,
                                                cancel_ack)

    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool:
        return await self.of(rid).fence_first_delta(rid, attempt_id, record)

    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool:
        return await self.of(rid).undo_fence(rid, record)

    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool:
        return await self.of(rid).undo_admission(rid, attempt, attempt_id)

    async def undo_intake(self, rid: str, attempt_id: str) -> bool:
        return await self.of(rid).undo_intake(rid, attempt_id)

    async def end_attempt(self, rid: str, attempt: int, attempt_id: str,
                          record: Mapping[str, Any], expire: bool) -> None:
        await self.of(rid).end_attempt(rid, attempt, attempt_id, record, expire)

    async def update_attempt(self, rid: str, attempt: int, record: Mapping[str, Any]) -> None:
        await self.of(rid).update_attempt(rid, attempt, record)

    async def progress(self, rid: str, record: Mapping[str, Any]) -> None:
        await self.of(rid).progress(rid, record)

    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None,
                     nothing_released: bool = False) -> bool:
        return await self.of(rid).finish(rid, outcome, attempt_end, nothing_released)

    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool:
        return await self.of(rid).settle_orphan(rid, outcome)

    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None:
        await self.of(rid).put_trace(rid, name, trace)

    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]:
        return await self.of(rid).get_traces(rid)

    async def attempt_lease(self, rid: str) -> AttemptLease:
        return await self.of(rid).attempt_lease(rid)

    def current_process_lease(self, rid: str) -> ProcessLease | None:
        return self.of(rid).current_process_lease(rid)

    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]:
        return self.of(rid).on_live_change(rid, cb, mine)

    def on_source_sent(self, processor: str, rid: str, attempt_id: str,
                       cb: Callable[[float], None]) -> Callable[[], None]:
        return self.of(rid).on_source_sent(processor, rid, attempt_id, cb)

    async def put_cancel(self, rid: str, attempt_id: str, record: Mapping[str, Any]) -> None:
        await self.of(rid).put_cancel(rid, attempt_id, record)

    def on_ack(self, rid: str, attempt_id: str,
               cb: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        return self.of(rid).on_ack(rid, attempt_id, cb)

    async def revoke_fenced(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any]) -> None:
        await self.of(rid).revoke_fenced(rid, attempt, attempt_id, record)


class ShardedLedger:
    """The `Ledger` port over one ledger per shard; a key is `<request id>:<call id>`."""

    def __init__(self, ledgers: Sequence[ToolLedger]) -> None:
        self.ledgers = tuple(ledgers)
        self.count = len(self.ledgers)

    def of(self, rid: str) -> ToolLedger:
        return self.ledgers[shard_of(rid, self.count)]

    def _by_key(self, key: str) -> ToolLedger:
        return self.of(key.partition(":")[0])

    async def credential(self, rid: str, attempt_id: str) -> tuple[str | None, int]:
        return await self.of(rid).credential(rid, attempt_id)

    async def claim(self, key: str, rid: str, attempt_id: str, entry: Mapping[str, Any],
                    credential_rev: int) -> tuple[bool, dict[str, Any] | None, bool, bool]:
        return await self.of(rid).claim(key, rid, attempt_id, entry, credential_rev)

    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool:
        return await self._by_key(key).undo_claim(key, entry)

    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]:
        return await self._by_key(key).get(key)

    async def record(self, key: str, entry: Mapping[str, Any]) -> None:
        await self._by_key(key).record(key, entry)


def journal_for(stores: Sequence[JournalStore], ledger_ttl_s: int
                ) -> tuple[Journal, Ledger]:
    """The processor's journal and ledger: the store itself with one shard (no hop), else
    the routers."""
    if len(stores) == 1:
        return stores[0], ToolLedger(stores[0], ledger_ttl_s)
    return (ShardedJournal(stores),
            ShardedLedger([ToolLedger(s, ledger_ttl_s) for s in stores]))


if TYPE_CHECKING:
    # mypy --strict proves the structural fit with the ports the sessions consume.
    def _fits_the_ports(j: ShardedJournal, ledger: ShardedLedger) -> tuple[Journal, Ledger]:
        return j, ledger
