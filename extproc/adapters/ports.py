"""What the guard and gate sessions need from the world, declared by them (their consumer).

The sessions depend on these small Protocols only: `GatePorts` and `GuardPorts` (with the
parts their record, released attempt and agent link use), which `processor.Processor`
provides; journal_store.py implements the journal and the tool ledger once, over etcd or an
in-memory fake of it (tests, decision 0031); the access-log registry implements the cause
log; the clock and the ids are injected so a hermetic test can drive the sessions with no
sockets but Envoy's messages.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from ..core.credentials import digest
from ..core.journal import JournalView, new_request_id
from .leases import AdmitResult, AttemptLease, ProcessLease

if TYPE_CHECKING:
    from ..core.admission import Admitted, AttemptRequest
    from ..core.budget import BudgetDecision
    from ..core.config import Config
    from ..core.errors import GatewayError
    from ..core.events import IntakeCommitted
    from ..core.gate import GateMachine, GateParams
    from ..core.guard import GuardMachine
    from ..core.handoff import TraceSnapshot
    from .processor import HandedOff, Pending
    from .telemetry import Telemetry
    from .timers import Timers


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def wall(self) -> float: ...


class Ids(Protocol):
    def request_id(self) -> str: ...
    def attempt_id(self) -> str: ...
    def attempt_secret(self) -> str: ...
    def instance_id(self) -> str: ...


def credential(ids: Ids) -> tuple[str, str]:
    """A fresh attempt secret and the digest the journal keeps of it (decision 0028)."""
    secret = ids.attempt_secret()
    return secret, digest(secret)


class SystemClock:
    # The builtin itself: no Python frame per read (the stall timer reads it per chunk).
    monotonic = staticmethod(time.monotonic)

    def wall(self) -> float:
        """Seconds since the epoch, to the microsecond the clock is in (what records and
        logs write): from the integer microseconds, not `round(time.time(), 6)`, whose
        correctly rounded decimal conversion cost ~7k instructions a call."""
        return time.time_ns() // 1000 / 1e6


class RandomIds:
    """Ids from the system's clock and randomness: the only place they are read for ids."""

    def request_id(self) -> str:
        return new_request_id(int(time.time() * 1000), os.urandom(10))

    def attempt_id(self) -> str:
        return "att_" + self.request_id()[4:]

    def attempt_secret(self) -> str:
        """A live attempt's credential for its tool calls (decision 0028)."""
        return secrets.token_urlsafe(32)

    def instance_id(self) -> str:
        """This processor process's id, asked once at start (decision 0034): replica agents
        write their word under it, so one watch per process hears its own attempts."""
        return "proc_" + secrets.token_hex(8)


class Ledger(Protocol):
    """The tool-call ledger (journal_store.ToolLedger documents each call)."""

    async def credential(self, rid: str, attempt_id: str) -> tuple[str | None, int]: ...
    async def claim(self, key: str, rid: str, attempt_id: str,
                    entry: Mapping[str, Any], credential_rev: int
                    ) -> tuple[bool, dict[str, Any] | None, bool, bool]: ...
    async def undo_claim(self, key: str, entry: Mapping[str, Any]) -> bool: ...
    async def get(self, key: str) -> tuple[dict[str, Any] | None, bool]: ...
    async def record(self, key: str, entry: Mapping[str, Any]) -> None: ...


class GateJournal(Protocol):
    """The journal calls one attempt's gate makes: its lease or admission, the fence, the
    take-backs, its end (the consumer's own port: what `Journal` offers beyond is not its)."""

    async def attempt_lease(self, rid: str) -> AttemptLease: ...
    async def admit_attempt(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any], fence_wait_s: float,
                            never_started: Callable[[str], bool] | None = None,
                            first_attempt: int = 1,
                            credential: str | None = None,
                            cancel_ack: bool = True) -> AdmitResult: ...
    async def undo_admission(self, rid: str, attempt: int, attempt_id: str) -> bool: ...
    async def fence_first_delta(self, rid: str, attempt_id: str,
                                record: Mapping[str, Any]) -> bool: ...
    async def undo_fence(self, rid: str, record: Mapping[str, Any]) -> bool: ...
    async def end_attempt(self, rid: str, attempt: int, attempt_id: str,
                          record: Mapping[str, Any], expire: bool) -> None: ...
    async def update_attempt(self, rid: str, attempt: int,
                             record: Mapping[str, Any]) -> None: ...
    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]: ...
    # The replica's agent (decision 0034): its word, the cancel, the acknowledgement.
    def on_source_sent(self, processor: str, rid: str, attempt_id: str,
                       cb: Callable[[float], None]) -> Callable[[], None]: ...
    async def put_cancel(self, rid: str, attempt_id: str,
                         record: Mapping[str, Any]) -> None: ...
    def on_ack(self, rid: str, attempt_id: str,
               cb: Callable[[dict[str, Any]], None]) -> Callable[[], None]: ...
    async def revoke_fenced(self, rid: str, attempt: int, attempt_id: str,
                            record: Mapping[str, Any]) -> None: ...


class GuardJournal(Protocol):
    """The journal calls a request's guard makes: its intake (and a repeat's re-open), the
    take-backs, a status read, the progress checkpoint, the record's end, and the watch on
    the released attempt's `live` key (the consumer's own port)."""

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None: ...
    async def reopen_request(self, rid: str, ended_outcome: Mapping[str, Any],
                             history: tuple[int, Mapping[str, Any]],
                             first_attempt: tuple[int, str, Mapping[str, Any]],
                             credential: str | None = None) -> JournalView | None: ...
    async def undo_reopen(self, rid: str, history: tuple[int, Mapping[str, Any]],
                          first_attempt: tuple[int, str]) -> bool: ...
    async def undo_intake(self, rid: str, attempt_id: str) -> bool: ...
    async def get(self, rid: str) -> JournalView | None: ...
    async def progress(self, rid: str, record: Mapping[str, Any]) -> None: ...
    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None,
                     nothing_released: bool = False) -> bool: ...
    def current_process_lease(self, rid: str) -> ProcessLease | None: ...
    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]: ...


class Journal(GateJournal, GuardJournal, Protocol):
    """The request journal and its fence, whole (journal_store.JournalStore documents each
    call): what the gate and the guard use, plus what only the process's background work
    and the operator's commands use."""

    async def settle_orphan(self, rid: str, outcome: Mapping[str, Any]) -> bool: ...
    async def exchange_budget(self, gateway_id: str, requests: int, retries: int
                              ) -> dict[str, tuple[int, int]]: ...
    async def put_trace(self, rid: str, name: str, trace: Mapping[str, Any]) -> None: ...
    async def get_traces(self, rid: str) -> dict[str, dict[str, Any]]: ...


class SentLog(Protocol):
    """Envoy's downstream access-log word, as the guard asks for it: why the stream ended and
    how many body bytes it sent (decision 0025), and the status the client got (0057)."""

    async def wait(self, rid: str, timeout_s: float) -> tuple[str, int, int] | None: ...


class EntryLog(Protocol):
    """Envoy's per-attempt access-log entries, as the gate asks for them: whether a
    pre-admitted attempt never reached a gate, and (AwaitCause) the cause of one that did
    (with the body bytes sent), answered once, or None when Envoy said nothing in time."""

    def no_gate_ran(self, attempt_id: str) -> bool: ...
    def expect(self, rid: str, timeout_s: float,
               answer: Callable[[tuple[str, int, int] | None], None]) -> None: ...


# --- the process's shared state, as the sessions reach it ------------------------------


class PoolView(Protocol):
    """The pool as the gate reads it, per request (membership may replace it)."""

    @property
    def enabled(self) -> bool: ...
    def fingerprint_of(self, address: str) -> str | None: ...
    def agent_of(self, address: str) -> int: ...


class Reach(Protocol):
    """Request id -> how many of its attempts reached a replica (`processor.Reached`)."""

    def of(self, rid: str) -> int: ...
    def mark(self, rid: str) -> None: ...


class Health(Protocol):
    """The hosts' passive health (`core.health.HostHealth`), as the gate reports to it."""

    def first_delta_timed_out(self, addr: str, now: float) -> bool: ...
    def overloaded(self, addr: str, until: float) -> None: ...


class Budget(Protocol):
    """The retry budget's counts of this process (`core.budget.RetryBudget`), and its
    latest decision (the observer's metric)."""

    @property
    def last(self) -> BudgetDecision | None: ...

    def request_started(self, request_id: str, now: float, run: str = "") -> None: ...
    def request_ended(self, request_id: str, run: str = "") -> None: ...
    def retry_ended(self, attempt_id: str) -> None: ...


class Work(Protocol):
    """Work that outlives the stream's handler, and the attempt's trace kept or not."""

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    def keep(self, rid: str, name: str, m: GateMachine, meta: dict[str, Any],
             clean: bool) -> None: ...


# --- the gate --------------------------------------------------------------------------


class GatePorts(Protocol):
    """What one attempt's gate needs from its process (read-only members): the rows'
    parameters, the clock, ids and timers, the journal calls of an attempt, Envoy's
    entries, the pool's view, its health, the retry budget, the count of attempts that
    reached a replica, the intake in flight and the hand-off (the request's other stream),
    telemetry, background work; and two answers: the intake's wait (with the pool's view
    then) and the admission's verdict (with the retry budget, which it may charge)."""

    @property
    def gate_params(self) -> GateParams: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def ids(self) -> Ids: ...
    @property
    def timers(self) -> Timers: ...
    @property
    def journal(self) -> GateJournal: ...
    @property
    def causes(self) -> EntryLog: ...
    @property
    def pool(self) -> PoolView: ...
    @property
    def health(self) -> Health: ...
    @property
    def budget(self) -> Budget: ...
    @property
    def reached(self) -> Reach: ...
    @property
    def intakes(self) -> Pending[asyncio.Future[GatewayError | None]]: ...
    @property
    def handoffs(self) -> Pending[HandedOff]: ...
    @property
    def tel(self) -> Telemetry: ...
    @property
    def work(self) -> Work: ...
    @property
    def instance_id(self) -> str: ...

    async def intake_committed(self, rid: str, replica: str) -> IntakeCommitted: ...
    def decide(self, request: AttemptRequest, now: float) -> Admitted | GatewayError: ...


class LinkPorts(Protocol):
    """What the gate's link to a replica's agent uses of its process."""

    @property
    def clock(self) -> Clock: ...
    @property
    def timers(self) -> Timers: ...
    @property
    def journal(self) -> GateJournal: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def work(self) -> Work: ...


# --- the guard -------------------------------------------------------------------------


class RecordJournal(Protocol):
    """The journal calls of a request's record: its intake (or a repeat's re-open for its
    re-run), their take-backs, a status read, the progress checkpoint, the outcome."""

    async def open_request(self, rid: str, meta: Mapping[str, Any],
                           first_attempt: tuple[str, Mapping[str, Any]] | None = None,
                           credential: str | None = None) -> JournalView | None: ...
    async def reopen_request(self, rid: str, ended_outcome: Mapping[str, Any],
                             history: tuple[int, Mapping[str, Any]],
                             first_attempt: tuple[int, str, Mapping[str, Any]],
                             credential: str | None = None) -> JournalView | None: ...
    async def undo_intake(self, rid: str, attempt_id: str) -> bool: ...
    async def undo_reopen(self, rid: str, history: tuple[int, Mapping[str, Any]],
                          first_attempt: tuple[int, str]) -> bool: ...
    async def get(self, rid: str) -> JournalView | None: ...
    async def progress(self, rid: str, record: Mapping[str, Any]) -> None: ...
    async def finish(self, rid: str, outcome: Mapping[str, Any],
                     attempt_end: tuple[int, Mapping[str, Any]] | None = None,
                     nothing_released: bool = False) -> bool: ...


class RecordPorts(Protocol):
    """What a request's record needs (`request_record`): its journal calls and the Timers
    port of the intake's pause, the clock, the intakes in flight that gates wait on, the
    count of attempts that reached a replica (which a re-run starts again), background
    work and the traces kept."""

    @property
    def cfg(self) -> Config: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def timers(self) -> Timers: ...
    @property
    def journal(self) -> RecordJournal: ...
    @property
    def reached(self) -> MutableMapping[str, int]: ...
    @property
    def intakes(self) -> Pending[asyncio.Future[GatewayError | None]]: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    async def settled(self, view: JournalView | None) -> JournalView | None: ...
    def keep_trace(self, clean: bool) -> bool: ...
    async def save_trace(self, rid: str, name: str, m: GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None: ...


class ReleaseJournal(Protocol):
    """The journal calls of a released attempt: the process lease, the `live` watch."""

    def current_process_lease(self, rid: str) -> ProcessLease | None: ...
    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]: ...


class ReleasePorts(Protocol):
    """What owning a released attempt needs from its process (`released`)."""

    @property
    def journal(self) -> ReleaseJournal: ...
    @property
    def handoffs(self) -> Pending[HandedOff]: ...
    @property
    def tel(self) -> Telemetry: ...
    @property
    def pool(self) -> Any: ...  # core.pool.Pool: bounds the fence metric's replica label

    def keep_trace(self, clean: bool) -> bool: ...
    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    async def save_trace(self, rid: str, name: str, m: GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None: ...


class GuardPorts(RecordPorts, ReleasePorts, Protocol):
    """What a request's guard needs from its process: its record's and its released
    attempt's ports (one journal serves both), the tool route's (the ledger), and its own:
    the ids, the pool's view and the tokenizers the body's reading takes, Envoy's word on
    what it sent, the retry budget, the trace budget and telemetry."""

    @property
    def journal(self) -> GuardJournal: ...
    @property
    def ids(self) -> Ids: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def pool(self) -> Any: ...  # core.pool.Pool: the body's route is chosen from it
    @property
    def tokenizers(self) -> Mapping[str, Callable[[str], int]]: ...
    @property
    def causes(self) -> SentLog: ...
    @property
    def budget(self) -> Budget: ...

    def host_order(self, hosts: list[str]) -> list[str]: ...
    def trace_budget(self) -> int: ...
