"""The chaos loop: seeded faults on the stack's processes, each healed after its time.

Every fault kind is drawn in rounds (each round a seeded permutation of the enabled kinds),
so a short run still exercises every kind. At most `max_concurrent` faults are active at
once, at most one on each etcd cluster (the journal's shard 0 and, with `--shards`, each
other shard's; decision 0042) and one on the processor, and never every replica; each fault
is healed when its time is up, and `heal_all` heals whatever is left at the end.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from devkit.devstack import Stack

FAULT_KINDS: tuple[str, ...] = (
    "replica_kill", "replica_freeze", "processor_kill", "etcd_leader_kill",
    "etcd_member_freeze", "etcd_quorum_loss",
)
# On a journal sharded over several clusters only (`--shards N`, N > 1): one member of
# another shard's cluster (a single-member cluster: its quorum) killed or frozen.
SHARD_FAULT_KINDS: tuple[str, ...] = ("etcd_shard_kill", "etcd_shard_freeze")
# Seconds each kind lasts before it is healed (drawn uniformly in the range).
DURATIONS: dict[str, tuple[float, float]] = {
    "replica_kill": (1.0, 4.0),
    "replica_freeze": (1.0, 4.0),
    "processor_kill": (0.3, 1.5),
    "etcd_leader_kill": (2.0, 5.0),
    "etcd_member_freeze": (2.0, 5.0),
    "etcd_quorum_loss": (1.0, 3.0),
    "etcd_shard_kill": (1.0, 4.0),
    "etcd_shard_freeze": (1.0, 4.0),
}


@dataclass
class Fault:
    kind: str
    target: str
    start: float  # wall clock
    planned_s: float
    end: float | None = None  # wall clock when healed
    note: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "start": self.start,
                "planned_s": round(self.planned_s, 3), "end": self.end, "note": self.note,
                "error": self.error}


@dataclass
class ChaosLoop:
    stack: Stack
    rng: random.Random
    kinds: tuple[str, ...] = FAULT_KINDS
    max_concurrent: int = 2
    interval_s: tuple[float, float] = (1.0, 3.0)
    log: Callable[[str], None] = print
    faults: list[Fault] = field(default_factory=list)
    _active: list[tuple[Fault, Callable[[], None], float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: list[str] = field(default_factory=list)

    # --- the loop ---------------------------------------------------------------------

    def run(self, until: float, stop: threading.Event) -> None:
        """Inject and heal until the monotonic time `until` (or `stop`), then heal all."""
        next_at = time.monotonic() + self.rng.uniform(*self.interval_s) / 2
        try:
            while not stop.is_set() and time.monotonic() < until:
                self._heal_due()
                if time.monotonic() >= next_at:
                    self._inject_next()
                    next_at = time.monotonic() + self.rng.uniform(*self.interval_s)
                stop.wait(0.05)
        finally:
            self.heal_all()

    def _next_kind(self) -> str | None:
        """The next kind of the current round that may start now (None: none may)."""
        if not self._queue:
            self._queue = list(self.kinds)
            self.rng.shuffle(self._queue)
        for i, kind in enumerate(self._queue):
            if self._allowed(kind):
                return self._queue.pop(i)
        return None

    def _allowed(self, kind: str) -> bool:
        if len(self._active) >= self.max_concurrent:
            return False
        active = [f.kind for f, _, _ in self._active]
        if kind in SHARD_FAULT_KINDS:  # one fault per cluster: shard 0's and the others'
            return not any(k in SHARD_FAULT_KINDS for k in active)
        if kind.startswith("etcd") and any(k.startswith("etcd") and k not in SHARD_FAULT_KINDS
                                           for k in active):
            return False
        if kind == "processor_kill" and "processor_kill" in active:
            return False
        if kind.startswith("replica"):
            down = sum(1 for k in active if k.startswith("replica"))
            return down < len(self.stack.replica_ports) - 1
        return True

    def _inject_next(self) -> None:
        kind = self._next_kind()
        if kind is None:
            return
        planned = self.rng.uniform(*DURATIONS[kind])
        fault = Fault(kind, "", time.time(), planned)
        try:
            heal = self._inject(kind, fault)
        except Exception as e:  # a fault that could not be injected is reported, not fatal
            fault.error = f"inject: {type(e).__name__}: {e}"
            fault.end = time.time()
            self.faults.append(fault)
            self.log(f"chaos: {kind} not injected: {fault.error}")
            return
        self.faults.append(fault)
        self._active.append((fault, heal, time.monotonic() + planned))
        self.log(f"chaos: {kind} {fault.target} for {planned:.1f}s {fault.note}".rstrip())

    def _heal_due(self) -> None:
        now = time.monotonic()
        for item in [a for a in self._active if a[2] <= now]:
            self._heal(item)

    def _heal(self, item: tuple[Fault, Callable[[], None], float]) -> None:
        fault, heal, _ = item
        self._active.remove(item)
        try:
            heal()
        except Exception as e:
            fault.error = f"heal: {type(e).__name__}: {e}"
            self.log(f"chaos: healing {fault.kind} {fault.target} failed: {fault.error}")
        fault.end = time.time()

    def heal_all(self) -> None:
        for item in list(self._active):
            self._heal(item)

    # --- the faults -------------------------------------------------------------------

    def _free_replica(self) -> str:
        busy = {f.target for f, _, _ in self._active if f.kind.startswith("replica")}
        names = [f"r{i + 1}" for i in range(len(self.stack.replica_ports))]
        return self.rng.choice([n for n in names if n not in busy])

    def _inject(self, kind: str, fault: Fault) -> Callable[[], None]:
        st = self.stack
        if kind == "replica_kill":
            name = fault.target = self._free_replica()
            st.hold_down(name)  # SIGKILL; the supervisor restarts it once released
            return lambda: st.release(name)
        if kind == "replica_freeze":
            name = fault.target = self._free_replica()
            st.freeze(name)
            return lambda: st.thaw(name)
        if kind == "processor_kill":
            fault.target = "processor"
            st.kill_processor()
            return st.restart_processor
        if kind == "etcd_leader_kill":
            leader = st.etcd_leader()
            if leader is None:
                leader = st.wait_etcd_leader(timeout_s=5.0)
            fault.target = leader
            st.kill_etcd_member(leader)
            return lambda: st.restart_etcd_member(leader, wait=True, timeout_s=30.0)
        if kind == "etcd_member_freeze":
            members = st.etcd_member_names()
            # Half the time the member the processor dials first (its first endpoint).
            name = fault.target = (members[0] if self.rng.random() < 0.5
                                   else self.rng.choice(members))
            st.freeze_etcd_member(name)
            return lambda: st.thaw_etcd_member(name)
        if kind == "etcd_quorum_loss":
            members = st.etcd_member_names()
            need = len(members) // 2 + 1
            chosen = self.rng.sample(members, need)
            fault.target = ",".join(chosen)
            st.lose_etcd_quorum(chosen)
            return lambda: st.restore_etcd_quorum(chosen, timeout_s=30.0)
        if kind in SHARD_FAULT_KINDS:
            name = fault.target = self.rng.choice(st.etcd_shard_names())
            if kind == "etcd_shard_freeze":
                st.freeze_etcd_member(name)
                return lambda: st.thaw_etcd_member(name)
            st.kill_etcd_member(name)
            return lambda: st.restart_etcd_member(name, wait=True, timeout_s=30.0)
        raise ValueError(f"unknown fault kind {kind!r}")
