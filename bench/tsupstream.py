"""A timestamping OpenAI-style SSE upstream, for the per-chunk latency figure only.

Every content event carries `"ts":<time.time_ns()>` taken just before the event is written to
the socket, so a client on the same host can compute per-chunk delivery latency (client
receive time minus upstream send time; both read CLOCK_REALTIME). The wire shape otherwise
mirrors the demo replica (role event, one content event per token, finish event, [DONE]) so
the processor classifies it exactly like real traffic.

Tokens are paced on an absolute schedule (start + i * delay) that never bursts to catch up:
if the loop falls behind, the schedule restarts from "now". The per-request delay comes from
`x-replica-token-delay-ms` (or `--token-delay-ms` when a gateway in front does not forward that
header: bench/peers.py), the token count from `max_tokens`.

Run: python -m bench.tsupstream --host 127.0.0.1 --port PORT --name r1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

from aiohttp import web

from devkit.demo.serving import until_signalled

DELAY_HEADER = "x-replica-token-delay-ms"
MAX_TOKENS_CAP = 4096
DEFAULT_DELAY_MS = ["0"]  # --token-delay-ms: the delay when the request has no header


def _event(ts: int, rid: str, delta: str, finish: str = "null") -> bytes:
    return (f'data: {{"ts":{ts},"id":"{rid}","object":"chat.completion.chunk","created":0,'
            f'"model":"demo-model","choices":[{{"index":0,"delta":{delta},"logprobs":null,'
            f'"finish_reason":{finish}}}]}}\n\n').encode()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    """The model list gateways read to register a worker (the SGLang model gateway does)."""
    return web.json_response({"object": "list", "data": [
        {"id": "demo-model", "object": "model", "created": 0, "owned_by": "bench"}]})


async def chat(request: web.Request) -> web.StreamResponse:
    try:
        body = json.loads(await request.read())
        n = int(body.get("max_tokens") or 16)
        delay_s = float(request.headers.get(DELAY_HEADER, DEFAULT_DELAY_MS[0])) / 1000.0
    except (ValueError, TypeError, AttributeError):
        return web.json_response({"error": {"message": "bad request"}}, status=400)
    if not 1 <= n <= MAX_TOKENS_CAP or not 0 <= delay_s <= 10:
        return web.json_response({"error": {"message": "bad request"}}, status=400)
    rid = "chatcmpl-ts-" + (request.headers.get("x-gateway-request-id") or "none")
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
    loop = asyncio.get_running_loop()
    try:
        await resp.prepare(request)
        await resp.write(_event(time.time_ns(), rid, '{"role":"assistant","content":""}'))
        nxt = loop.time()
        for i in range(n):
            if i and delay_s:
                nxt += delay_s
                now = loop.time()
                if nxt > now:
                    await asyncio.sleep(nxt - now)
                else:
                    nxt = now  # behind schedule: do not burst to catch up
            await resp.write(_event(time.time_ns(), rid, f'{{"content":"t{i % 10} "}}'))
        await resp.write(_event(time.time_ns(), rid, "{}", '"length"'))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def serve(host: str, port: int) -> None:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=False,
                           shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    await until_signalled(runner)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tsupstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="ts")
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="delay between tokens when the request has no delay header")
    a = p.parse_args()
    DEFAULT_DELAY_MS[0] = f"{a.token_delay_ms:g}"
    with contextlib.suppress(ImportError):
        import uvloop  # same event loop family as the processor; lower noise

        uvloop.install()
    asyncio.run(serve(a.host, a.port))


if __name__ == "__main__":
    main()
