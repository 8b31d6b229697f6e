"""The floor: what one ext_proc message costs in grpc.aio alone, with no processor logic.

    .venv/bin/python -m bench.grpc_floor

A bare grpc.aio server (uvloop, the same ExternalProcessor service and messages) that answers
every message with an empty body response, in its own process; a grpc.aio client in this one.
Prints the server's CPU per message (read + write) unbatched (one stream, ping-pong) and under
load (64 concurrent streams), and the resident memory per open stream that has exchanged five
messages and then waits (what a streaming guard stream has done). Our processor
cannot do a message for less than this, nor hold a stream in less memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench.measure import proc_cpu_s
from bench.streams import rss_kib
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc


class Echo(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, it: Any, ctx: Any) -> None:
        while True:
            m = await ctx.read()
            if m is grpc.aio.EOF:
                return
            await ctx.write(ep.ProcessingResponse(response_body=ep.BodyResponse()))


async def _serve(port: int) -> None:
    s = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000)])
    ep_grpc.add_ExternalProcessorServicer_to_server(Echo(), s)
    s.add_insecure_port(f"127.0.0.1:{port}")
    await s.start()
    await s.wait_for_termination()


async def _client(port: int, pid: int, streams: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    msg = ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x" * 200))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)

        async def pingpong(call: Any, k: int) -> None:
            for _ in range(k):
                await call.write(msg)
                await call.read()

        call = stub.Process()
        await pingpong(call, 2000)
        t0, c0 = time.perf_counter(), proc_cpu_s(pid)
        await pingpong(call, 10000)
        dt, dc = time.perf_counter() - t0, proc_cpu_s(pid) - c0
        out["pingpong"] = {"msgs_per_s": 10000 / dt, "server_cpu_us_per_msg": dc / 10000 * 1e6}
        call.cancel()
        calls = [stub.Process() for _ in range(64)]
        await asyncio.gather(*(pingpong(c, 100) for c in calls))
        t0, c0 = time.perf_counter(), proc_cpu_s(pid)
        await asyncio.gather(*(pingpong(c, 400) for c in calls))
        dt, dc = time.perf_counter() - t0, proc_cpu_s(pid) - c0
        n = 64 * 400
        out["concurrent64"] = {"msgs_per_s": n / dt, "server_cpu_us_per_msg": dc / n * 1e6,
                               "server_cores": dc / dt}
        for c in calls:
            c.cancel()
        await asyncio.sleep(1.0)
        base = rss_kib(pid)
        held = []
        half_rss = 0
        for i in range(streams):
            if i == streams // 2:
                await asyncio.sleep(1.0)
                half_rss = rss_kib(pid)
            c = stub.Process()
            # As many messages as a real guard stream has exchanged once it is streaming
            # (request headers, body, response headers, two body chunks): gRPC's per-call
            # memory grows with the first messages.
            for _ in range(5):
                await c.write(msg)
                await c.read()
            held.append(c)
        await asyncio.sleep(1.0)
        full_rss = rss_kib(pid)
        # The slope between N/2 and N streams: heap freed by the phases above and reused by
        # the first streams would otherwise make the average look cheaper than a stream is.
        out["idle_streams"] = {"streams": streams,
                               "kib_per_stream": (full_rss - base) / streams,
                               "kib_per_stream_marginal":
                                   (full_rss - half_rss) / (streams - streams // 2)}
        for c in held:
            c.cancel()
    return out


def measure(streams: int = 5000) -> dict[str, Any]:
    import uvloop

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the server: nothing else in this process
        try:
            uvloop.run(_serve(port))
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        return uvloop.run(_client(port, pid, streams))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 5000), indent=2))
