"""A request's journal record, as its guard's actions ask for it: opened, read, ended.

The guard's record port. `run_intake` executes `core.guard.IntakeFlow`'s actions (the intake
written, sent again after a pause on the Timers port, a repeat's record settled and read, a
re-run re-opened, what never got its answer taken back later) and feeds each answer back,
until the flow answers; its log lines are `observer.guard_intake`'s. `read_status`,
`write_progress` and `write_outcome` are the status lookup, the progress checkpoint and the
terminal record (with the released attempt's end). What they need from the process is
`ports.RecordPorts`. (The body itself is read by the machine: `core.guard.read_body`.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from ..core import events as E
from ..core import guard as G
from ..core import records
from ..core.errors import GatewayError
from ..core.guard import GuardMachine
from ..core.intake import Generation, Prepared, StatusLookup
from ..core.journal import Outcome, Rerun
from . import observer
from .leases import UNDO_SETTLE_S, StoreUnavailable
from .ports import RecordPorts
from .processor import retrying
from .released import Released
from .timers import sleep


class IntakeRun:
    """A generation's intake transaction in flight (decision 0021): started by the row's
    `OpenIntake`, offered to the request's gates by `RegisterIntake` (each of them waits
    for it), its answer the `RequestOpened` that `AwaitIntake` waits for; and the re-run a
    repeat's re-open started (decision 0027), which the body's answer carries."""

    __slots__ = ("cred", "envoy_request_id", "gen", "opening", "p", "prep", "rerun", "rid")

    def __init__(self, p: RecordPorts, gen: Generation, prep: Prepared, cred: str,
                 envoy_request_id: str | None) -> None:
        self.p, self.rid, self.gen, self.cred = p, gen.request_id, gen, cred
        self.prep: Prepared | None = prep
        self.envoy_request_id = envoy_request_id
        self.opening: asyncio.Task[GatewayError | None] | None = None
        self.rerun: Rerun | None = None

    def open(self) -> None:
        self.opening = self.p.spawn(self._run(), f"guard-intake-{self.rid}")

    async def _run(self) -> GatewayError | None:
        """The intake, to its answer: None when the request is recorded (or re-opened)."""
        assert self.prep is not None
        got = await run_intake(self.p, self.rid, self.gen, self.prep, self.cred,
                               self.envoy_request_id)
        # What the intake wrote (the record, attempt 1, the credential's digest) is read
        # nowhere else from here: not held for the rest of the stream (decision 0055).
        self.prep, self.cred = None, ""
        if got.rerun is not None:
            self.rerun = got.rerun
        return got.error

    def register(self) -> None:
        assert self.opening is not None
        self.p.intakes.put(self.rid, self.opening)

    async def opened(self) -> E.RequestOpened:
        assert self.opening is not None
        err = await asyncio.shield(self.opening)
        self.opening = None
        return E.RequestOpened(err is None, err)

    def close(self) -> None:
        """The stream closed after the answer (CloseIntake): a failed intake was offered
        to the request's gates while its stream was open; none comes after it."""
        self.p.intakes.take(self.rid)

    def late(self) -> Awaitable[E.RequestOpened]:
        """The stream closed with the intake in flight (AwaitLateIntake): its answer."""
        opening, self.opening = self.opening, None
        assert opening is not None
        return self._late(opening)

    async def _late(self, opening: asyncio.Task[GatewayError | None]) -> E.RequestOpened:
        err = await opening
        if err is not None:
            self.p.intakes.take(self.rid)
        return E.RequestOpened(err is None)


async def run_intake(p: RecordPorts, rid: str, gen: Generation, prep: Prepared,
                     credential: str | None, envoy_request_id: str | None) -> G.IntakeAnswer:
    """The intake transaction, to its answer (error None: recorded, or re-opened to run
    again with `rerun`)."""
    journal, clock, first = p.journal, p.clock, prep.first
    flow = G.IntakeFlow(rid, str(first["attempt_id"]), prep.meta.request_digest,
                        gen.idempotency_key, p.cfg.etcd.resend_deadline_s,
                        p.cfg.server.gateway_id, envoy_request_id)
    pending: list[G.IntakeEvent] = [G.IntakeStart(clock.monotonic())]
    while pending:
        ev = pending.pop()
        acts = flow.handle(ev)
        observer.guard_intake(flow, ev, acts)
        for a in acts:
            try:
                if isinstance(a, G.WriteIntake):
                    pending.append(G.IntakeWritten(await journal.open_request(
                        rid, prep.record, (flow.attempt_id, first), credential=credential)))
                elif isinstance(a, G.SettleView):
                    pending.append(G.ViewSettled(await p.settled(a.view), clock.wall()))
                elif isinstance(a, G.Reopen):
                    pending.append(G.ReopenAnswered(await journal.reopen_request(
                        rid, a.outcome, a.history, a.first, credential=credential)))
            except StoreUnavailable as e:
                pending.append(G.IntakeDown(str(e), clock.monotonic()))
            if isinstance(a, G.PauseIntake):
                await sleep(p.timers, a.seconds)
                pending.append(G.IntakePauseOver())
            elif isinstance(a, G.TakeBackIntake | G.UndoReopenLater):
                take_back(p, rid, a)
            elif isinstance(a, G.IntakeAnswer):
                if a.error is None:
                    # Recorded: a gate that comes from now on need not wait.
                    p.intakes.take(rid)
                if a.rerun is not None:
                    # Envoy counts this request's attempts from 1 again, and so does the
                    # count of attempts that reached a replica (max_attempts is per run).
                    p.reached.pop(rid, None)
                return a
    raise AssertionError("the intake ended without an answer")


def take_back(p: RecordPorts, rid: str, a: G.TakeBackIntake | G.UndoReopenLater) -> None:
    """An intake (or a re-open) whose answer never came may still apply: taken back once
    etcd answers (nothing ran for it: the client is told journal_unavailable)."""
    journal = p.journal
    if isinstance(a, G.TakeBackIntake):
        what, aid = "intake", a.attempt_id
        undo: Callable[[], Awaitable[Any]] = lambda: journal.undo_intake(rid, aid)  # noqa: E731
    else:
        what, (history, (n, aid)) = "reopen", (a.history, a.first)
        undo = lambda: journal.undo_reopen(rid, history, (n, aid))  # noqa: E731
    p.spawn(retrying(undo, "take back an unconfirmed " + what.replace("reo", "re-o"),
                     rid, aid, settle_s=UNDO_SETTLE_S, timers=p.timers, now=p.clock.monotonic),
            f"guard-undo-{what}-{rid}")


async def read_status(p: RecordPorts, q: StatusLookup) -> E.StatusRead:
    """The record a status lookup asks for (a dead processor's settled first)."""
    try:
        return E.StatusRead(await p.settled(await p.journal.get(q.request_id)), q.tenant)
    except StoreUnavailable as e:
        return E.StatusRead(None, q.tenant, str(e))


async def write_progress(p: RecordPorts, rid: str, n: int) -> E.ProgressWritten:
    """The delivered count's checkpoint; a missed one only weakens the bound it gives."""
    with contextlib.suppress(StoreUnavailable):
        await p.journal.progress(rid, {"delivered_output_tokens": n, "at": p.clock.wall()})
    return E.ProgressWritten()


async def write_outcome(p: RecordPorts, rid: str, f: E.Finish, m: GuardMachine | None,
                        released: Released | None) -> E.RecordWritten:
    """The terminal record, with the released attempt's end in the same transaction; the
    guard's trace kept. Written False: etcd never answered within the bounded retry. The
    released attempt's watch stops first: our own finish deletes its `live` key."""
    if released is not None:
        released.stop_watching()
    wall, gw = p.clock.wall(), p.cfg.server.gateway_id
    body = records.outcome(outcome=str(f.outcome),
                           delivered_output_tokens=f.delivered_output_tokens, cause=f.cause,
                           finished_at=wall, gateway_id=gw, exact=f.exact, source=f.source,
                           bound=f.bound)
    if m is not None and p.keep_trace(f.outcome is Outcome.COMPLETED):
        p.spawn(p.save_trace(rid, "guard", m, {"outcome": str(f.outcome), "gateway_id": gw}),
                f"trace-{rid}")
    end = released.end(f.upstream_finished, f.cause, wall) if released is not None else None
    # etcd may be briefly away (frozen, electing a leader): keep trying for a bounded time.
    # Until it lands, the record shows no outcome rather than a wrong one.
    return E.RecordWritten(await retrying(lambda: p.journal.finish(rid, body, end,
                                                                   f.nothing_released),
                                          "record the outcome", rid, None, timers=p.timers,
                                          now=p.clock.monotonic))
