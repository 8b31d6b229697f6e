"""The gate's link to a replica's agent (decision 0034): its word, the cancel, its ack.

One per agent-fronted attempt, owned by the gate's session; it carries out `WatchSource`,
`PutCancel`, `AwaitAck` and `AckSettled` and feeds nothing itself: the session turns what it
hears into `SourceSent` and `AckLearned`. A replica without an agent never gets one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..core import events as E
from .ports import LinkPorts
from .processor import retrying


class AgentLink:
    __slots__ = ("_ack", "_unack", "_unsource", "aid", "p", "rid")

    def __init__(self, ports: LinkPorts, rid: str, aid: str) -> None:
        self.p, self.rid, self.aid = ports, rid, aid
        self._unsource: Callable[[], None] | None = None
        self._unack: Callable[[], None] | None = None
        # The acknowledgement of the cancel: its evidence when heard, None when not.
        self._ack: asyncio.Future[dict[str, Any] | None] | None = None

    def listen(self, heard: Callable[[float], None]) -> None:
        """The agent's word that the attempt's first content left the replica."""
        self._unsource = self.p.journal.on_source_sent(self.p.instance_id, self.rid,
                                                        self.aid, heard)

    def stop(self) -> None:
        if self._unsource is not None:
            self._unsource()
            self._unsource = None

    def put_cancel(self, gateway_id: str, bound_s: float) -> None:
        """Listen for the acknowledgement, then ask the agent to stop the attempt."""
        p, rid, aid = self.p, self.rid, self.aid
        fut: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._ack = fut

        def heard(evidence: dict[str, Any]) -> None:
            if not fut.done():
                fut.set_result(evidence)
        self._unack = p.journal.on_ack(rid, aid, heard)
        rec = {"at": p.clock.wall(), "gateway_id": gateway_id, "processor": p.instance_id}
        p.work.spawn(retrying(lambda: p.journal.put_cancel(rid, aid, rec), "put the cancel",
                              rid, aid, limit_s=bound_s, timers=p.timers,
                              now=p.clock.monotonic), f"gate-cancel-{aid}")

    async def await_ack(self, a: E.AwaitAck) -> E.Event:
        """The acknowledgement, or none within `a.seconds` (a Timers timer)."""
        fut, p = self._ack, self.p
        evidence: dict[str, Any] | None = None
        if fut is not None:
            if not fut.done():
                timer = p.timers.start(a.seconds,
                                       lambda: None if fut.done() else fut.set_result(None))
                try:
                    evidence = await fut
                finally:
                    timer.cancel()
            else:
                evidence = fut.result()
        if self._unack is not None:
            self._unack()
            self._unack = None
        return E.AckLearned(evidence is not None, evidence, p.clock.wall())

    async def settled(self, a: E.AckSettled) -> None:
        """Write what the acknowledgement changed (the trace is kept by KeepTrace before)."""
        p, rid, aid = self.p, self.rid, self.aid
        if a.record is None:
            return
        n, rec = a.attempt, a.record
        if a.revoke:
            await retrying(lambda: p.journal.revoke_fenced(rid, n, aid, rec),
                           "end the acknowledged attempt's fence", rid, aid, timers=p.timers,
                           now=p.clock.monotonic)
        else:
            await retrying(lambda: p.journal.update_attempt(rid, n, rec),
                           "add the engine's acknowledgement", rid, aid, timers=p.timers,
                           now=p.clock.monotonic)


__all__ = ["AgentLink", "LinkPorts"]
