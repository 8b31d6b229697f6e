"""The attempt a gate released to its request's guard: taken over, fenced, and ended.

The guard's `TakeOver(handoff)` makes one `Released`: the frozen hand-off record (with the
gate's trace and open span when the gate ran in this process), its permission to publish
(`AttemptLease` on the process lease that admitted it) and the watch on its `live` key,
whose change is the guard machine's `Fenced`. At the request's end `end` closes the
attempt's record (`records.released_end`), says so through `observer.attempt_ended` and
keeps the gate's trace; the guard writes that record with the request's own, in one
transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.trace import Span

from ..core import records
from ..core.failure import FailureClass
from ..core.handoff import HandOff
from . import observer
from .leases import AttemptLease, ProcessLease
from .ports import ReleasePorts


class Released:
    __slots__ = ("handoff", "lease", "p", "rid", "span", "trace", "unwatch")

    def __init__(self, p: ReleasePorts, rid: str, ho: HandOff, span: Span | None) -> None:
        self.p, self.rid, self.handoff, self.span, self.trace = p, rid, ho, span, ho.trace
        pl = p.journal.current_process_lease(rid)
        # The attempt's `live` key hangs on the lease of the process that admitted it; when
        # that is us, its local deadline also bounds publishing (etcd unreachable).
        self.lease = AttemptLease(pl if pl is not None and pl.lease_id == ho.lease_id
                                  else ProcessLease(0, 0, float("inf")))
        self.unwatch: Callable[[], None] | None = None

    @classmethod
    def take_over(cls, p: ReleasePorts, rid: str, ho: HandOff,
                  fenced: Callable[[], None]) -> Released:
        """The gate released its attempt to us: own its end, its record and its fence
        (`fenced` when its `live` key is revoked or replaced)."""
        aid = ho.attempt_id
        got = p.handoffs.take(aid)
        # In-process, the same record with the gate's trace and its open span.
        r = cls(p, rid, got.handoff if got is not None else ho,
                got.span if got is not None else None)
        r.unwatch = p.journal.on_live_change(rid, lambda v: None if v == aid else fenced(),
                                             aid)
        return r

    def expired(self) -> bool:
        """The lease port's answer with each chunk: no longer valid (its deadline moves with
        keep-alives, which are not events)."""
        return not self.lease.valid()

    def lose(self, why: str) -> None:
        self.lease.lose(why)

    def stop_watching(self) -> None:
        """Our own finish deletes `live`, and a closed stream has nothing to fence."""
        if self.unwatch is not None:
            self.unwatch()
            self.unwatch = None

    def end(self, upstream_finished: bool, cause: str | None, wall: float
            ) -> tuple[int, dict[str, Any]]:
        """The attempt's record, now that its end is known (said and traced once)."""
        info = self.handoff.record()
        n, aid = int(info["attempt"]), str(info["attempt_id"])
        cls, record = records.released_end(info, upstream_finished=upstream_finished,
                                           cause=cause, ended_at=wall)
        span, self.span = self.span, None
        observer.attempt_ended(self.p.tel, span, self.rid, aid, attempt=n, released=True,
                               failure_class=str(cls), fence="ended_with_request",
                               cause=cause, envoy_cause=record["envoy_cause"],
                               model_revision=record.get("model_revision"), http_status=200,
                               replica=self.handoff.replica, pool=self.p.pool)
        gm, self.trace = self.trace, None
        if gm is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.p.spawn(self.p.save_trace(self.rid, f"attempt-{n:03d}", gm, {
                "attempt_id": aid, "replica": info.get("replica"),
                "failure_class": str(cls)}), f"trace-{aid}")
        return n, record
