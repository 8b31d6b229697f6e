"""What the guard and gate sessions need from the world, declared by them (their consumer).

The sessions depend on these small Protocols only: the etcd store and the in-memory store
(tests) implement the journal and the tool ledger with the same compare semantics; the
access-log registry implements the cause log; the clock and the ids are injected so a
hermetic test can drive the sessions with no sockets but Envoy's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..core.journal import JournalView, new_request_id
from .leases import AdmitResult, AttemptLease, ProcessLease


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def wall(self) -> float: ...


class Ids(Protocol):
    def request_id(self) -> str: ...
    def attempt_id(self) -> str: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return round(time.time(), 6)


class RandomIds:
    def request_id(self) -> str:
        return new_request_id()

    def attempt_id(self) -> str:
        return "att_" + new_request_id()[4:]


class Journal(Protocol):
    """The request journal and its fence (etcd_store.EtcdStore documents each call)."""

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None
                           ) -> JournalView | None: ...
    async def get(self, rid: str) -> JournalView | None: ...
    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None
                            ) -> AdmitResult: ...
    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool: ...
    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool: ...
    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool: ...
    async def end_attempt(self, rid: str, attempt: int, attempt_id: str,
                          record: Mapping[str, Any], expire: bool) -> None: ...
    async def update_attempt(self, rid: str, attempt: int,
                             record: Mapping[str, Any]) -> None: ...
    async def progress(self, rid: str, record: Mapping[str, Any]) -> None: ...
    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None) -> bool: ...
    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool: ...
    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]: ...
    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None: ...
    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]: ...
    async def attempt_lease(self) -> AttemptLease: ...
    def current_process_lease(self) -> ProcessLease | None: ...
    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]: ...


class Ledger(Protocol):
    """The tool-call ledger (etcd_store.ToolLedger documents each call)."""

    async def claim(self, key: str, rid: str, attempt_id: str,
                    entry: Mapping[str, Any]
                    ) -> tuple[bool, dict[str, Any] | None, bool, bool]: ...
    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool: ...
    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]: ...
    async def record(self, key: str, entry: Mapping[str, Any]) -> None: ...


class CauseLog(Protocol):
    """Envoy's access-log entries, met halfway (causes.CauseRegistry)."""

    def seen(self, rid: str) -> bool: ...
    async def wait(self, rid: str, timeout_s: float) -> str: ...
    async def wait_entry(self, rid: str, timeout_s: float) -> str | None: ...
