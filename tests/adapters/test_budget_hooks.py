"""The retry budget's ends, as the gate and the guard report them (decision 0023).

Sessions played as Envoy plays them, on the in-memory store: a re-prefill stops counting
when its gate's stream closes before release; a request, and every re-prefill of it (the
released one too), when its guard's stream ends; another stream of the same request id
(a repeat answered 409) ends nothing.
"""

from __future__ import annotations

import asyncio

from extproc.adapters.gate import GateSession
from extproc.adapters.guard import GuardSession
from extproc.core import headers as H

from .support import RID, SSE_CONTENT, SSE_DONE, SSE_ROLE, idle
from .test_sessions import (
    CHAT,
    DOWN,
    gate_headers,
    immediate,
    proc,
    req_body,
    req_headers,
    resp_body,
    resp_headers,
    set_headers,
    start,
)

FLOOR_1 = {"policy": {"retry_budget": {"min_retry_concurrency": 1, "fraction": 0.0},
                      "on_upstream_failure": {"before_first_delta": {"max_attempts": 3}}}}


async def test_a_re_prefill_over_before_release_gives_its_place_back() -> None:
    p, store = proc(FLOOR_1)
    await store.open_request(RID, {"request_id": RID}, None)
    p.mark_reached(RID)  # an earlier attempt reached a replica: attempt 2 is a re-prefill
    p.budget.request_started(RID, p.clock.monotonic(), "run")
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(2, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    assert r.WhichOneof("response") == "request_headers"  # admitted: it goes upstream
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 1)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE))  # no content yet: held
    await idle()
    ctx.close()  # the upstream went away before any delta: over, never released
    await asyncio.wait_for(task, 3)
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 0)
    await p.drain()
    # Its place is back: with a floor of 1, the request's next re-prefill is admitted.
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(3, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    assert r.WhichOneof("response") == "request_headers", r
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 1)
    ctx.close()
    await asyncio.wait_for(task, 3)
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 0)


async def test_a_released_re_prefill_counts_until_its_request_ends() -> None:
    p, store = proc(FLOOR_1)
    await store.open_request(RID, {"request_id": RID}, None)
    p.mark_reached(RID)
    p.budget.request_started(RID, p.clock.monotonic(), "run")
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(2, p.clock.wall()))
    await ctx.wait_for(1)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_CONTENT))
    await ctx.wait_for(3)  # released: headers and the held chunk
    await asyncio.wait_for(task, 3)  # the gate left the stream (hand-off)
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 1)  # still streaming
    p.budget.request_ended(RID, "run")  # what the guard does at its stream's end
    assert p.budget.snapshot(p.clock.monotonic()) == (0, 0)


async def test_the_guard_counts_its_request_from_acceptance_to_its_streams_end() -> None:
    p, _ = proc()
    ctx, _, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    (r,) = await ctx.wait_for(1)
    rid = set_headers(r, "request_headers")[H.REQUEST_ID]
    assert p.budget.snapshot(p.clock.monotonic()) == (0, 0)  # not accepted yet
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 0)
    # A re-prefill of it that was released: the gate never ends it.
    assert p.budget.try_retry(p.clock.monotonic(), "att_released", rid).allowed
    # A repeat of the same key while it runs is answered 409; its end ends nothing.
    rep, _, rtask = start(GuardSession, p)
    rep.send(req_headers(DOWN))
    await rep.wait_for(1)
    rep.send(req_body(CHAT))
    status, body = immediate((await rep.wait_for(2))[1])
    assert status == 409 and body["error"]["code"] == "request_in_progress"
    rep.close()
    await asyncio.wait_for(rtask, 3)
    assert p.budget.snapshot(p.clock.monotonic()) == (1, 1)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE + SSE_CONTENT))
    ctx.send(resp_body(SSE_DONE, eos=True))
    await ctx.wait_for(5)
    ctx.close()
    await asyncio.wait_for(task, 3)
    assert p.budget.snapshot(p.clock.monotonic()) == (0, 0)  # with its re-prefill
    await p.drain()
