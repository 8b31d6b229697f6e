"""A demo tool server that logs every execution, so tests can count side effects.

`POST /tools/<name>` executes "the action": it appends one JSON line to the log (with the
`Idempotency-Key` the gateway derived, `<request_id>:<tool_call_id>`) and answers with a
result that names the execution number. Per-request knobs (headers):

  x-tool-delay-ms: N        take N ms to execute (to overlap concurrent duplicates)
  x-tool-status: S          answer with HTTP status S (a failing tool)
  x-tool-result-bytes: N    pad the result to N bytes (a result too large to record)
  x-tool-fault: die-after-execute   log the execution, then SIGKILL itself mid-answer

Run: python -m devkit.demo.tool_server --port P --log-file F
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
import time

from aiohttp import web

from devkit.demo.serving import until_signalled


class ToolServer:
    def __init__(self, log_file: str) -> None:
        self.log_file = log_file
        self.executions = 0

    def _log(self, rec: dict[str, object], fsync: bool = False) -> None:
        with open(self.log_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    async def call(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = await request.read()
        delay = float(request.headers.get("x-tool-delay-ms", "0") or 0) / 1000
        status = int(request.headers.get("x-tool-status", "200") or 200)
        pad = int(request.headers.get("x-tool-result-bytes", "0") or 0)
        fault = request.headers.get("x-tool-fault", "")
        if delay:
            await asyncio.sleep(min(delay, 60.0))
        self.executions += 1
        n = self.executions
        key = request.headers.get("idempotency-key")
        self._log({"ts": time.time(), "tool": name, "key": key, "execution": n,
                   "body_sha256": hashlib.sha256(body).hexdigest()},
                  fsync=fault == "die-after-execute")
        result = {"tool": name, "key": key, "execution": n,
                  "result": f"{name}:{hashlib.sha256(body).hexdigest()[:8]}:{n}"}
        if pad:
            result["padding"] = "x" * pad
        data = json.dumps(result, separators=(",", ":")).encode()
        if fault == "die-after-execute":
            resp = web.StreamResponse(status=status,
                                      headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            await asyncio.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return web.Response(status=status, body=data, content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "executions": self.executions})


async def serve(host: str, port: int, log_file: str) -> None:
    srv = ToolServer(log_file)
    app = web.Application()
    app.router.add_post("/tools/{name}", srv.call)
    app.router.add_get("/health", srv.health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"demo tool server on http://{host}:{port} (log: {log_file})", file=sys.stderr,
          flush=True)
    await until_signalled(runner)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tool_server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log-file", required=True)
    a = ap.parse_args(argv)
    asyncio.run(serve(a.host, a.port, a.log_file))


if __name__ == "__main__":
    main()
