"""The key-value-transaction port the journal is written over (decision 0031).

The journal and the tool ledger (journal_store.py) need only what etcd's v3 API offers:
a transaction of compares and puts, deletes and reads on a branch; leases that take their
keys with them; a watch of a prefix. `KV` is that much and no more. Two implementations:
kv_etcd.EtcdKV (a real etcd over etcd_client) and kv_memory.MemoryKV (an in-memory fake of
etcd on an injected clock, for hermetic tests). tests/adapters/test_kv_memory.py runs one
suite on both, so the fake is held to etcd's semantics where the journal relies on them.

Compare semantics are etcd's: a VALUE compare on an absent key fails whatever the operator;
VERSION and MOD compare an absent key as 0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["KV", "LEASE_NOT_FOUND", "Cmp", "Compare", "Delete", "Get", "KeyValue", "Lease",
           "Op", "Put", "Target", "Txn", "TxnResult", "WatchEvent", "absent", "mod_is",
           "prefix_end", "present", "value_below", "value_is", "version_is"]

# etcd's answer to a put on a lease it no longer has (it expired while we could not reach
# it); both implementations raise StoreUnavailable with it in the message.
LEASE_NOT_FOUND = "requested lease not found"


class Target(enum.Enum):
    VALUE = "value"
    VERSION = "version"
    MOD = "mod"  # the key's mod_revision


class Cmp(enum.Enum):
    EQUAL = "="
    LESS = "<"
    GREATER = ">"


@dataclass(frozen=True, slots=True)
class Compare:
    key: bytes
    target: Target
    result: Cmp
    value: bytes | int  # bytes for VALUE, an int for the others


def value_is(key: bytes, value: bytes) -> Compare:
    return Compare(key, Target.VALUE, Cmp.EQUAL, value)


def value_below(key: bytes, value: bytes) -> Compare:
    """The key's value sorts before `value` (an absent key: false, as in etcd)."""
    return Compare(key, Target.VALUE, Cmp.LESS, value)


def version_is(key: bytes, version: int) -> Compare:
    return Compare(key, Target.VERSION, Cmp.EQUAL, version)


def absent(key: bytes) -> Compare:
    return version_is(key, 0)


def present(key: bytes) -> Compare:
    return Compare(key, Target.VERSION, Cmp.GREATER, 0)


def mod_is(key: bytes, revision: int) -> Compare:
    return Compare(key, Target.MOD, Cmp.EQUAL, revision)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0  # 0: none


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False  # every key that starts with `key`


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Txn:
    """If every compare holds, `success` runs, else `failure`; all or nothing.

    A Txn is also an operation of another one (etcd's nested transaction)."""

    compare: Sequence[Compare] = ()
    success: Sequence[Op] = ()
    failure: Sequence[Op] = ()


Op = Put | Delete | Get | Txn


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Whether the compares held, and per operation of the branch that ran: the keys a
    Get found, sorted by key (a Put's, a Delete's and a nested Txn's: none)."""

    succeeded: bool
    reads: tuple[tuple[KeyValue, ...], ...] = field(default=())
    revision: int = 0  # the store's revision after the transaction


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of a watched key: `value` None is a delete (also by a lease's end).

    `prev` is the value it replaced when `prev_known` (a put that created the key replaced
    nothing: prev None, known)."""

    key: bytes
    value: bytes | None
    prev: bytes | None
    prev_known: bool


class KV(Protocol):
    """etcd's transactions, leases and prefix watch; every call may raise StoreUnavailable."""

    async def txn(self, t: Txn) -> TxnResult: ...
    async def grant(self, ttl_s: float) -> Lease: ...
    async def keep_alive(self, lease_id: int, deadline_s: float | None = None) -> int:
        """One keep-alive: the lease's TTL now, 0 when it is gone (`deadline_s`: the call's
        own, shorter than the store's when the lease's local deadline is near)."""
        ...
    async def time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left; 0 or less when it is gone."""
        ...
    async def revoke(self, lease_id: int) -> None: ...
    def watch(self, prefix: bytes, on_event: Callable[[WatchEvent], None],
              on_state: Callable[[bool], None] | None = None,
              name: str = "watch") -> Callable[[], None]:
        """Call `on_event` for every change under `prefix` from now on, and `on_state(up)`
        when the watch is (re-)established or lost (`name` says which in logs); returns
        a stop."""
        ...
    async def close(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"
