"""Leases and store errors shared by every journal store (etcd, and the in-memory one).

Pure data with the monotonic clock read only when no time is passed in; the stores fill
them, the sessions consult them before every publish (docs/fencing.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("extproc.leases")

__all__ = ["UNDO_SETTLE_S", "AdmitResult", "AttemptLease", "LiveListeners", "ProcessLease",
           "StoreUnavailable"]


class StoreUnavailable(Exception):
    """etcd did not answer within the deadline (down, frozen, or partitioned)."""


# How long a take-back of a timed-out write (undo_fence, undo_admission, a tool ledger's
# undo_claim) keeps being applied after etcd first answered it. A transaction queued in a
# frozen etcd and our take-back, sent after it, may be applied in either order when etcd
# wakes (each is its own stream); a take-back applied first finds nothing, and the late write
# would then stay (seen in the tool tests: a claim nobody executes, "in progress" forever).
# Applying it again for a while catches that write: etcd applies its backlog within
# milliseconds of waking.
UNDO_SETTLE_S = 3.0

@dataclass(slots=True)
class ProcessLease:
    """One etcd lease per processor process that every `live/<rid>` key it writes hangs on.

    A lease per attempt would cost a grant and a revoke per request and one keep-alive per
    open stream; one shared lease costs one keep-alive per TTL/3 for the whole process
    (docs/decisions/0007-process-lease.md). Its local deadline is computed from the monotonic
    time *before* the grant (or keep-alive) was sent, minus a safety margin: etcd starts the
    TTL when it receives the request, later than we sent it, so our deadline always falls
    before etcd's expiry (docs/fencing.md).
    """

    lease_id: int
    ttl_s: int
    deadline: float  # monotonic
    margin_s: float = 1.0

    def valid(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.deadline

    def renewed(self, sent_at: float, ttl_s: int) -> None:
        if self.deadline > 0:
            self.deadline = sent_at + ttl_s - self.margin_s

    def lost(self) -> None:
        self.deadline = 0.0


@dataclass(slots=True)
class AttemptLease:
    """An attempt's permission to publish: its process lease is locally unexpired, and
    nobody revoked, replaced or fenced its `live` key.

    Its one owner of the loss: `lose(why)` is the only way it ends (the revocation watch,
    the attempt's own end, its local expiry noticed), said once; whoever must hear of it
    registers with `on_lost` (etcd's concurrency.Session.Done() is the model)."""

    process: ProcessLease
    lost_because: str | None = None
    _listeners: list[Callable[[str], None]] = field(default_factory=list)

    @property
    def revoked(self) -> bool:
        return self.lost_because is not None

    def lose(self, why: str) -> bool:
        """End the permission; True only for the call that ended it (its listeners run)."""
        if self.lost_because is not None:
            return False
        self.lost_because = why
        listeners, self._listeners = self._listeners, []
        for cb in listeners:
            try:
                cb(why)
            except Exception:
                log.exception("lease loss listener failed")
        return True

    def on_lost(self, cb: Callable[[str], None]) -> None:
        """Call `cb(why)` once, when the permission ends (at once if it has)."""
        if self.lost_because is not None:
            cb(self.lost_because)
        else:
            self._listeners.append(cb)

    @property
    def lease_id(self) -> int:
        return self.process.lease_id

    @property
    def ttl_s(self) -> int:
        return self.process.ttl_s

    def valid(self, now: float | None = None) -> bool:
        # Checked with every chunk a guard forwards: the process lease's test inlined.
        return self.lost_because is None and (
            time.monotonic() if now is None else now) < self.process.deadline


@dataclass(frozen=True, slots=True)
class AdmitResult:
    admitted: bool
    reason: str
    lease: AttemptLease | None = None
    waited_s: float = 0.0
    # The earlier attempt whose release never left Envoy, taken back on the way (0057).
    reclaimed: str | None = None


class LiveListeners:
    """Who wants to hear that `live/<rid>` changed (the revocation watch's subscribers).

    A subscriber for one attempt (`mine`) hears only changes of the key while it named that
    attempt: etcd's watch can deliver a change made before the attempt was admitted (the
    previous attempt's revocation) after the admission returned, and that is no
    revocation of this one (the fault sweep found it: a recoverable attempt refused).
    """

    def __init__(self) -> None:
        self._by_rid: dict[str, list[tuple[Callable[[str | None], None], str | None]]] = {}

    def subscribe(self, rid: str, cb: Callable[[str | None], None],
                  mine: str | None = None) -> Callable[[], None]:
        """Call `cb(new_value_or_None)` when live/<rid> changes (with `mine`: only from
        that value); returns an unsubscribe."""
        entry = (cb, mine)
        self._by_rid.setdefault(rid, []).append(entry)

        def off() -> None:
            cbs = self._by_rid.get(rid)
            if cbs and entry in cbs:
                cbs.remove(entry)
                if not cbs:
                    del self._by_rid[rid]
        return off

    def fire(self, rid: str, value: str | None, prev: str | None = None,
             prev_known: bool = False) -> None:
        """One change of live/<rid>; `prev` is the value it replaced, when the store
        knows it (an unknown one is told to every subscriber: deafness would be unsafe)."""
        for cb, mine in list(self._by_rid.get(rid, ())):
            if mine is not None and prev_known and prev != mine:
                continue
            try:
                cb(value)
            except Exception:
                log.exception("live change callback failed",
                              extra={"request_id": rid, "attempt_id": mine})

    def clear(self) -> None:
        self._by_rid.clear()
