"""adapters/server: one process serves Envoy's two ext_proc filters and its access log. The
role comes from each stream's initial metadata (the gate; the tool listener's guard, which
serves only the tool route; else the client listener's guard, which never serves it); the
open streams are counted while they run; access-log entries reach the cause registry; the
grpc.aio server answers on loopback."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.server import GrpcAioServer, process_stream, take_access_logs
from extproc.core import headers as H
from extproc.gen.envoy.data.accesslog.v3 import accesslog_pb2 as al
from extproc.gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from .test_sessions import FakeContext, immediate, proc, req_headers

CHAT = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


async def _first_answer(md: dict[str, str], path: str) -> tuple[ep.ProcessingResponse, int]:
    p, _ = proc()
    ctx = FakeContext()
    task = asyncio.ensure_future(process_stream(p, md, ctx))
    ctx.send(req_headers({**CHAT, ":path": path}))
    (r,) = await ctx.wait_for(1)
    during = p.open_streams
    ctx.close()
    await task
    assert p.open_streams == 0  # counted down when the stream ended
    return r, during


@pytest.mark.parametrize(("role", "path", "said"), [
    (None, "/tools/search", "the tool route is not served on the client listener"),
    ("guard", "/tools/search", "the tool route is not served on the client listener"),
    ("router", "/tools/search", "the tool route is not served on the client listener"),
    ("tools", "/v1/chat/completions", "this listener serves only the tool route"),
])
async def test_the_tool_route_is_served_only_by_the_tools_role(role: str | None, path: str,
                                                              said: str) -> None:
    r, during = await _first_answer({} if role is None else {H.ROLE_METADATA: role}, path)
    status, body = immediate(r)
    assert (status, body["error"]["code"]) == (404, "tool_route_not_here")
    assert body["error"]["message"].startswith(said)
    assert during == 1


async def test_the_gate_role_gets_a_gate_not_a_guard() -> None:
    """A guard strips every owned header from a client's request; a gate's upstream request
    carries them (here none: an attempt without the guard's ids is passed as it is)."""
    r, _ = await _first_answer({H.ROLE_METADATA: "gate"}, "/v1/chat/completions")
    assert r.WhichOneof("response") == "request_headers"
    assert not r.request_headers.response.header_mutation.remove_headers
    r, _ = await _first_answer({H.ROLE_METADATA: "guard"}, "/v1/models")
    assert set(r.request_headers.response.header_mutation.remove_headers) == set(H.OWNED)


def _log(rid: str) -> als_pb2.StreamAccessLogsMessage:
    e = al.HTTPAccessLogEntry()
    e.request.request_headers[H.REQUEST_ID] = rid
    e.common_properties.response_flags.downstream_remote_reset = True
    m = als_pb2.StreamAccessLogsMessage()
    m.http_logs.log_entry.append(e)
    return m


async def test_access_log_entries_reach_the_cause_registry() -> None:
    p, _ = proc()

    async def messages():  # type: ignore[no-untyped-def]
        yield als_pb2.StreamAccessLogsMessage()  # no http logs: nothing
        yield _log("req_a")
    await take_access_logs(p, messages())
    assert p.causes.seen("req_a")
    heard = await p.causes.wait("req_a", 1.0)
    assert heard is not None and heard[0] == "client"


async def test_the_grpc_aio_server_serves_the_access_log_and_health_on_loopback() -> None:
    p, _ = proc()
    server = GrpcAioServer(p, None)
    await server.start("127.0.0.1:0")
    try:
        assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
        await server.health.set("", health_pb2.HealthCheckResponse.SERVING)
        async with grpc.aio.insecure_channel(server.address) as ch:
            got = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING

            async def entries():  # type: ignore[no-untyped-def]
                yield _log("req_b")
            await als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(entries(), timeout=5)
        assert p.causes.seen("req_b")
    finally:
        await server.stop(0.5, lambda: 0)


async def test_an_open_stream_does_not_hold_its_initial_metadata() -> None:
    """The role is read from the metadata, and trace context when tracing is on; the
    handler's frame lets the metadata go while the stream stays open (decision 0059): each
    stream's metadata is grpc.aio's new strings."""
    p, _ = proc()
    ctx = FakeContext()
    md = {"x-extproc-role": "guard", "user-agent": "grpc-c++/1.2"}
    task = asyncio.ensure_future(process_stream(p, dict(md), ctx))
    ctx.send(req_headers(CHAT))
    await ctx.wait_for(1)
    frame = task.get_coro().cr_frame
    assert frame is not None and p.open_streams == 1
    held = frame.f_locals
    assert "md" not in held and held["role"] == "guard"
    assert held["role"] is sys.intern("guard")
    assert not [v for v in held.values() if isinstance(v, dict)]
    ctx.close()
    await task
    assert p.open_streams == 0
