"""The tool route: server-side tool calls go through the guard and the etcd ledger.

A call is forwarded to the tool server only by the one request that claims its ledger key,
and only if it carries its attempt's credential and that attempt is the live one: the
credential's digest is compared first (constant time), then the claim transaction checks
`live`, the ledger key and that the credential key is unchanged (decision 0028). Everyone
else gets the recorded result, waits for it (bounded), or a clear refusal. Rules:
`extproc.core.tools`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..core import headers as H
from ..core.config import Config
from ..core.credentials import matches
from ..core.errors import ErrorCode, GatewayError, tool_ledger_unavailable
from ..core.tools import (
    Replay,
    ResultCapture,
    ToolCall,
    answer_for,
    done_entry,
    fenced_error,
    in_progress_error,
    parse_tool_call,
    running_entry,
    unauthorized_error,
    unknown_entry,
)
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from .leases import UNDO_SETTLE_S, StoreUnavailable
from .logs import rlog
from .ports import Ledger

log = logging.getLogger("extproc.tools")


class ToolCallHandler:
    def __init__(self, cfg: Config, ledger: Ledger,
                 write: Callable[[ep.ProcessingResponse], Awaitable[None]],
                 spawn: Callable[[Awaitable[Any], str], Any],
                 retrying: Callable[..., Awaitable[bool]]) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.write = write
        self.spawn = spawn
        self.retrying = retrying
        self.call: ToolCall | None = None
        self.entry: dict[str, Any] | None = None  # our running entry, if we execute
        self.status = 0
        self.resp_headers: dict[str, str] = {}
        self.result = ResultCapture(cfg.tools.max_result_bytes)
        self.recorded = False

    @property
    def rid(self) -> str | None:
        return self.call.request_id if self.call else None

    @property
    def aid(self) -> str | None:
        return self.call.attempt_id if self.call else None

    async def on_request_headers(self, hd: dict[str, str]) -> None:
        call = parse_tool_call(hd, self.cfg.tools.path_prefix)
        if isinstance(call, GatewayError):
            if call.code is ErrorCode.TOOL_CALL_UNAUTHORIZED:
                rlog(log, logging.WARNING, "tool call refused: no attempt credential",
                     call.request_id, hd.get(H.ATTEMPT_ID), path=hd.get(":path"))
            await self.write(codec.immediate(call))
            return
        self.call = call
        # The credential first, for every call (a first one, a repeat, a replay): nothing
        # of the ledger is read or claimed for a caller that is not the attempt's worker.
        try:
            stored, cred_rev = await self.ledger.credential(call.request_id, call.attempt_id)
        except StoreUnavailable as e:
            await self._refuse_unavailable(e)
            return
        if not matches(call.secret, stored):
            rlog(log, logging.WARNING, "tool call refused: attempt credential missing or "
                 "wrong", call.request_id, call.attempt_id, tool=call.tool, key=call.key,
                 stored=stored is not None)
            await self.write(codec.immediate(unauthorized_error(call)))
            return
        entry = running_entry(call, time.time())
        try:
            claimed, existing, is_live, executor_alive = await self.ledger.claim(
                call.key, call.request_id, call.attempt_id, entry, cred_rev)
        except StoreUnavailable as e:
            await self._refuse_unavailable(e)
            # The claim may still apply when etcd wakes; take it back, or it would block
            # every later call of this key as "in progress" with nothing executing.
            ledger, key = self.ledger, call.key
            self.spawn(self.retrying(lambda: ledger.undo_claim(key, entry),
                                     "undo an unconfirmed tool claim", call.request_id,
                                     call.attempt_id, settle_s=UNDO_SETTLE_S),
                       f"tool-undo-{key}")
            return
        if claimed:
            self.entry = entry
            rlog(log, logging.INFO, "tool call executing", call.request_id, call.attempt_id,
                 tool=call.tool, key=call.key)
            # The secret stops here: the tool server never sees it.
            await self.write(codec.continue_request_headers({"idempotency-key": call.key},
                                                            remove=(H.ATTEMPT_SECRET,)))
            return
        if not is_live:
            rlog(log, logging.WARNING, "tool call refused: attempt is fenced", call.request_id,
                 call.attempt_id, key=call.key)
            await self.write(codec.immediate(fenced_error(call)))
            return
        assert existing is not None
        await self._answer_repeat(call, existing, executor_alive)

    async def _answer_repeat(self, call: ToolCall, entry: dict[str, Any],
                             executor_alive: bool) -> None:
        deadline = time.monotonic() + self.cfg.tools.wait_s
        delay = 0.01
        while True:
            ans = answer_for(entry, call, executor_alive)
            if isinstance(ans, Replay):
                rlog(log, logging.INFO, "tool call replayed from the ledger", call.request_id,
                     call.attempt_id, key=call.key, status=ans.status)
                await self.write(codec.immediate_raw(ans.status, ans.body, ans.headers))
                return
            if isinstance(ans, GatewayError):
                rlog(log, logging.WARNING, "tool call refused", call.request_id,
                     call.attempt_id, key=call.key, code=str(ans.code))
                await self.write(codec.immediate(ans))
                return
            # Another call is executing it right now: wait (bounded) for its result.
            if time.monotonic() + delay > deadline:
                await self.write(codec.immediate(in_progress_error(call)))
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            try:
                got, executor_alive = await self.ledger.get(call.key)
            except StoreUnavailable as e:
                await self._refuse_unavailable(e)
                return
            if got is not None:
                entry = got

    async def _refuse_unavailable(self, e: Exception) -> None:
        rlog(log, logging.WARNING, "tool ledger unavailable: not executing", self.rid,
             self.aid, error=str(e))
        # Fail closed: no execution without a ledger record.
        await self.write(codec.immediate(tool_ledger_unavailable(self.rid)))

    async def on_response_headers(self, hd: dict[str, str], end_of_stream: bool) -> None:
        self.status = int(hd.get(":status", "0") or 0)
        self.resp_headers = hd
        await self.write(codec.continue_response_headers(remove=(H.ATTEMPT_SECRET,)))
        if end_of_stream:
            await self._record_done()

    async def on_response_body(self, data: bytes, end_of_stream: bool) -> None:
        if self.entry is None:
            await self.write(codec.streamed_response_body(data, end_of_stream))
            return
        self.result.add(data)
        if end_of_stream:
            # Recorded before the caller sees the end of the result: a caller that got it
            # and retries finds it in the ledger.
            await self._record_done()
        await self.write(codec.streamed_response_body(data, end_of_stream))

    async def _record_done(self) -> None:
        if self.entry is None or self.recorded or self.call is None:
            return
        self.recorded = True
        entry = done_entry(self.entry, self.status, self.resp_headers, self.result,
                           time.time())
        key, rid, aid = self.call.key, self.rid, self.aid
        ok = await self.retrying(lambda: self.ledger.record(key, entry),
                                 "record a tool result", rid, aid, 5.0)
        if not ok:
            # Keep trying in the background; the caller still gets the result it caused.
            self.spawn(self.retrying(lambda: self.ledger.record(key, entry),
                                     "record a tool result", rid, aid),
                       f"tool-record-{key}")
        rlog(log, logging.INFO, "tool result recorded", rid, aid, key=key,
             status=self.status, size=self.result.size, truncated=self.result.too_large)

    async def on_closed(self) -> None:
        """The stream ended; if we executed and never saw the whole result, say so."""
        if self.entry is None or self.recorded or self.call is None:
            return
        self.recorded = True
        entry = unknown_entry(self.entry, "the tool call ended before its result was complete",
                              time.time())
        key, rid, aid = self.call.key, self.rid, self.aid
        rlog(log, logging.WARNING, "tool call outcome unknown", rid, aid, key=key)
        await self.retrying(lambda: self.ledger.record(key, entry),
                            "record an unknown tool outcome", rid, aid)
