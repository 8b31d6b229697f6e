"""One attempt's journal record, as its gate's actions ask for it: the gate's record port.

The counterpart of the guard's `request_record`. It holds what the attempt's writes need
and no row should see: the permission they are made under (its `AttemptLease`) and, once
admitted, the attempt's credential (decision 0028: the secret goes upstream, the journal
keeps its digest). Each conditioned write is tried once and answered as the next event
(`NotConfirmed` when etcd did not answer: the rows decide whether to send it again); the
writes only this process holds (the attempt's end, the take-backs) are retried in the
background for a bounded time (`processor.retrying`). Nothing here decides.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..core import events as E
from ..core.credentials import digest
from .leases import UNDO_SETTLE_S, AttemptLease, StoreUnavailable
from .ports import GateJournal, GatePorts
from .processor import retrying
from .telemetry import end_span


class AttemptRecord:
    __slots__ = ("aid", "lease", "p", "rid", "secret", "unwatch")

    def __init__(self, p: GatePorts, rid: str, aid: str, secret: str | None) -> None:
        self.p, self.rid, self.aid = p, rid, aid
        self.lease: AttemptLease | None = None
        # Attempt 1's secret from the guard; any other's minted at its admission. Sent
        # upstream only; never logged, traced or handed off.
        self.secret = secret
        self.unwatch: Callable[[], None] | None = None

    async def confirmed(self, write: Awaitable[E.Event]) -> E.Event:
        """One try of a conditioned write; not answered: NotConfirmed (the rows decide)."""
        clock = self.p.clock
        sent = clock.monotonic()
        try:
            return await write
        except StoreUnavailable as e:
            return E.NotConfirmed(str(e), sent, clock.monotonic(), clock.wall())

    async def take_lease(self) -> E.Event:
        """Attempt 1, admitted with its request: its permission is the process lease."""
        self.lease = await self.p.journal.attempt_lease(self.rid)
        return E.AdmitDecided(True, mono=self.p.clock.monotonic(), wall=self.p.clock.wall())

    async def admit(self, a: E.Admit, never_started: Callable[[str], bool]) -> E.Event:
        """The admission transaction. It makes the attempt live with its own credential,
        the same on every try: a try that applied unseen is found as this attempt's."""
        p = self.p
        self.secret = self.secret or p.ids.attempt_secret()
        res = await p.journal.admit_attempt(
            self.rid, a.attempt, self.aid, a.record, a.fence_wait_s, never_started,
            first_attempt=a.first_attempt, credential=digest(self.secret),
            cancel_ack=p.gate_params.cancel_ack)
        self.lease = res.lease
        if res.reclaimed is not None and (lost := p.handoffs.take(res.reclaimed)):
            # Its release never reached the guard, which would have ended its span.
            end_span(lost.span, "release_lost")
        return E.AdmitDecided(res.admitted, res.reason, res.waited_s, p.clock.monotonic(),
                              p.clock.wall())

    async def fence(self, a: E.Fence) -> E.Event:
        if self.lease is None or not self.lease.valid() or a.facts is None:
            return E.FenceDecided(False)  # the lease's answer: no permission to fence
        return E.FenceDecided(await self.p.journal.fence_first_delta(
            self.rid, self.aid, a.record(self.p.clock.wall())))

    @property
    def lease_id(self) -> int:
        """The lease its `live` key hangs on (0: none), which the hand-off carries."""
        return self.lease.lease_id if self.lease is not None else 0

    def expired(self) -> bool:
        """The lease port's answer with each chunk: no longer valid (its deadline moves with
        keep-alives, which are not events)."""
        return self.lease is not None and not self.lease.valid()

    def watch(self, changed: Callable[[str | None], None]) -> None:
        """The attempt's `live` key: `changed` with its new value (None: deleted)."""
        self.unwatch = self.p.journal.on_live_change(self.rid, changed, self.aid)

    def stop(self) -> None:
        if self.unwatch is not None:
            self.unwatch()
            self.unwatch = None

    def lose(self, why: str) -> None:
        if self.lease is not None:  # said once, by its owner (the observer says a fence)
            self.lease.lose(why)

    async def end_early(self, a: E.RevokeEarly) -> E.Event:
        """Over before release, its end confirmed: revoked now, not left to expire."""
        self.lose("ended")
        return E.Revoked(await self.ended(a.attempt, a.record, False))

    async def close(self, a: E.CloseAttempt) -> None:
        """The attempt's record closed. etcd may be briefly away: retried for a bounded
        time, so the record does not keep an attempt without its end (the fault sweep)."""
        self.lose("ended")
        rid, journal = self.rid, self.p.journal
        if a.update_only:
            await retrying(lambda: journal.update_attempt(rid, a.attempt, a.record),
                           "close the attempt record", rid, self.aid, timers=self.p.timers,
                           now=self.p.clock.monotonic)
        else:
            await self.ended(a.attempt, a.record, a.expire)

    async def ended(self, n: int, rec: Mapping[str, Any], expire: bool) -> bool:
        rid, aid, p = self.rid, self.aid, self.p
        journal = p.journal
        return await retrying(lambda: journal.end_attempt(rid, n, aid, rec, expire),
                              "fence the ended attempt", rid, aid, timers=p.timers,
                              now=p.clock.monotonic)

    def undo_admission(self, a: E.UndoAdmission) -> None:
        self.settle(lambda j, rid, aid: j.undo_admission(rid, a.attempt, aid),
                    "undo an unconfirmed admission", "undo-admit", UNDO_SETTLE_S)

    def give_back(self, a: E.GiveBack) -> None:
        self.settle(lambda j, rid, aid: j.end_attempt(rid, a.attempt, aid, a.record, False),
                    "give back a refused attempt", "refused")

    def undo_fence(self, a: E.UndoFence) -> None:
        self.settle(lambda j, rid, aid: j.undo_fence(rid, a.record(self.p.clock.wall())),
                    "undo an unconfirmed fence", "undo-fence", UNDO_SETTLE_S)

    def settle(self, call: Callable[[GateJournal, str, str], Awaitable[Any]], what: str,
               name: str, settle_s: float = 0.0) -> None:
        """A take-back or give-back, retried in the background while etcd is away."""
        p, rid, aid = self.p, self.rid, self.aid
        p.work.spawn(retrying(lambda: call(p.journal, rid, aid), what, rid, aid,
                              settle_s=settle_s, timers=p.timers, now=p.clock.monotonic),
                     f"gate-{name}-{aid}")


__all__ = ["AttemptRecord"]
