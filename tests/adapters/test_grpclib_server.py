"""The grpclib transport (server.transport: grpclib), asked by grpc.aio clients as Envoy asks.

What grpclib does not give for free and `extproc.adapters.grpclib_server` adds: more than
h2's 100 concurrent streams on one connection, grpc.health.v1 with grpc_health's semantics,
a drain that lets open streams end before cancelling, and the listen forms of
`server.listen` (port 0, IPv6, a Unix socket with a stale file). The ext_proc handler here is
a small echo: the point is the transport; the real handler runs in tests/e2e.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.adapters.grpclib_server import GrpclibServer, HealthBoard, Services
from extproc.adapters.session import Messages
from extproc.gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from .support import FakeClock, FakeTimers, idle

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Echo:
    """Answers each request-headers message with a headers response naming the role and a
    sequence number; counts open streams as Processor.open_streams does."""

    def __init__(self) -> None:
        self.open = 0
        self.roles: list[str] = []
        self.ended: list[str] = []  # "eof" or "cancelled", per stream
        self.logs: list[Any] = []

    async def process(self, md: Mapping[str, str], io: Messages) -> None:
        self.open += 1
        self.roles.append(md.get("x-llmgw-role", "guard"))
        n = 0
        try:
            while (msg := await io.read()) is not None:
                assert msg.WhichOneof("request") == "request_headers"
                n += 1
                await io.write(ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(status=ep.CommonResponse.CONTINUE))),)
            self.ended.append("eof")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        finally:
            self.open -= 1

    async def access_logs(self, messages: AsyncIterator[Any]) -> None:
        async for m in messages:
            self.logs.append(m)


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpclibServer, Echo, HealthBoard]]:
    echo, board = Echo(), HealthBoard()
    server = GrpclibServer(Services(echo.process, echo.access_logs, None, board))
    await server.start("127.0.0.1:0")
    try:
        yield server, echo, board
    finally:
        await server.stop(0.0, lambda: 0)


def _headers() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders())


class _Stream:
    """One client ext_proc stream, written and read one message at a time."""

    def __init__(self, stub: Any, role: str = "guard") -> None:
        self.out: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests(), metadata=(("x-llmgw-role", role),))

    async def _requests(self) -> AsyncIterator[ep.ProcessingRequest]:
        while (m := await self.out.get()) is not None:
            yield m

    async def ask(self) -> ep.ProcessingResponse:
        self.out.put_nowait(_headers())
        return await asyncio.wait_for(self.call.read(), 5)

    async def end(self) -> Any:
        self.out.put_nowait(None)
        return await asyncio.wait_for(self.call.code(), 5)


async def test_the_server_answers_and_says_where_it_listens(
        served: tuple[GrpclibServer, Echo, HealthBoard]) -> None:
    server, echo, _ = served
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # port 0 resolved to the bound port
    async with grpc.aio.insecure_channel(server.address) as ch:
        s = _Stream(ep_grpc.ExternalProcessorStub(ch), role="gate")
        r = await s.ask()
        assert r.WhichOneof("response") == "request_headers"
        assert await s.end() == grpc.StatusCode.OK
        assert echo.roles == ["gate"] and echo.ended == ["eof"] and echo.open == 0
        # The access-log service: a client stream, answered once at its end.
        log_stub = als_pb2_grpc.AccessLogServiceStub(ch)
        msgs = [als_pb2.StreamAccessLogsMessage(), als_pb2.StreamAccessLogsMessage()]
        resp = await asyncio.wait_for(log_stub.StreamAccessLogs(iter(msgs)), 5)
        assert isinstance(resp, als_pb2.StreamAccessLogsResponse) and len(echo.logs) == 2


async def test_more_than_h2s_100_streams_on_one_connection(
        served: tuple[GrpclibServer, Echo, HealthBoard]) -> None:
    """Envoy multiplexes every ext_proc stream of a worker on one connection: with h2's
    default limit the 101st would be refused."""
    server, echo, _ = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        streams = [_Stream(stub) for _ in range(300)]
        answers = await asyncio.gather(*(s.ask() for s in streams))
        assert all(a.WhichOneof("response") == "request_headers" for a in answers)
        assert echo.open == 300  # all open at once
        codes = await asyncio.gather(*(s.end() for s in streams))
        assert set(codes) == {grpc.StatusCode.OK} and echo.open == 0


async def _check(ch: grpc.aio.Channel, service: str) -> Any:
    stub = health_pb2_grpc.HealthStub(ch)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def test_health_check_and_watch_follow_the_statuses(
        served: tuple[GrpclibServer, Echo, HealthBoard]) -> None:
    server, _, board = served
    async with grpc.aio.insecure_channel(server.address) as ch:
        assert await _check(ch, "") == SERVING  # as grpc_health: "" is SERVING at first
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _check(ch, "liveness")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="liveness"))
        assert (await asyncio.wait_for(watch.read(), 5)).status == UNKNOWN
        await board.set("liveness", SERVING)
        await board.set("", NOT_SERVING)
        assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
        assert await _check(ch, "liveness") == SERVING
        assert await _check(ch, "") == NOT_SERVING
        await board.enter_graceful_shutdown()
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        await board.set("liveness", SERVING)  # after shutdown began: ignored, for good
        assert await _check(ch, "liveness") == NOT_SERVING
        assert await _check(ch, "") == NOT_SERVING
        watch.cancel()


async def test_a_watcher_hears_the_drain_before_it_is_cancelled() -> None:
    """The drain sets readiness NOT_SERVING and stops the server right after: the watcher,
    woken by the change, must send it before its handler is cancelled."""
    echo, board = Echo(), HealthBoard()
    server = GrpclibServer(Services(echo.process, echo.access_logs, None, board))
    await server.start("127.0.0.1:0")
    async with grpc.aio.insecure_channel(server.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await board.set("", NOT_SERVING)
        await server.stop(5.0, lambda: echo.open)
        assert loop.time() - t0 < 1.0  # no open ext_proc stream: no need for the grace
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING


def _refused(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) != 0


async def test_drain_lets_open_streams_end_then_cancels_the_rest() -> None:
    echo, board = Echo(), HealthBoard()
    timers = FakeTimers(FakeClock())
    server = GrpclibServer(Services(echo.process, echo.access_logs, None, board), timers)
    await server.start("127.0.0.1:0")
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        finishing, stuck = _Stream(stub), _Stream(stub)
        await finishing.ask()
        await stuck.ask()
        stop = asyncio.ensure_future(server.stop(1.5, lambda: echo.open))
        await asyncio.wait_for(server.draining.wait(), 5)
        assert _refused(server.address)  # no new connection once the drain began
        r = await finishing.ask()  # an open stream is still served...
        assert r.WhichOneof("response") == "request_headers"
        assert await finishing.end() == grpc.StatusCode.OK  # ...to its end
        assert not stop.done()  # the other one is still open
        # The grace is on the Timers port (a fake clock here: no time passed while real
        # clients spoke over the socket): the drain polls the open streams every 0.05 s
        # and cancels the rest once the whole grace has passed, not a poll sooner.
        for _ in range(29):
            assert timers.advance(0.05) == 1
            await idle()
            assert not stop.done() and echo.open == 1
        assert timers.advance(0.05) == 1
        await asyncio.wait_for(stop, 5)
        assert timers.clock.now == pytest.approx(1.5) and timers.pending() == 0
        assert sorted(echo.ended) == ["cancelled", "eof"] and echo.open == 0
        # The stuck stream's client hears nothing more: grpclib's close cancels the handler
        # without resetting its stream, and the connection stays until the process exits.


async def test_drain_returns_as_soon_as_the_last_stream_ends() -> None:
    echo, board = Echo(), HealthBoard()
    timers = FakeTimers(FakeClock())
    server = GrpclibServer(Services(echo.process, echo.access_logs, None, board), timers)
    await server.start("127.0.0.1:0")
    async with grpc.aio.insecure_channel(server.address) as ch:
        s = _Stream(ep_grpc.ExternalProcessorStub(ch))
        await s.ask()
        stop = asyncio.ensure_future(server.stop(5.0, lambda: echo.open))
        await asyncio.wait_for(server.draining.wait(), 5)  # the stream ends during the drain
        assert await s.end() == grpc.StatusCode.OK  # (its handler returned before its status)
        assert echo.open == 0 and not stop.done() and timers.pending() == 1
        assert timers.advance(0.05) == 1  # the drain's next poll sees no stream open ...
        await asyncio.wait_for(stop, 5)
        # ... and it is over then, 0.05 s into a 5 s grace.
        assert timers.clock.now == 0.05 and timers.pending() == 0 and echo.ended == ["eof"]


async def test_a_unix_socket_with_a_stale_file_and_ipv6(tmp_path: Path) -> None:
    path = tmp_path / "extproc.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # a socket file left behind by a process that died
    stale.close()
    assert path.exists()
    board = HealthBoard()
    echo = Echo()
    unix = GrpclibServer(Services(echo.process, echo.access_logs, None, board))
    await unix.start(f"unix:{path}")
    assert unix.address == f"unix:{path}"
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        assert await _check(ch, "") == SERVING
    await unix.stop(0.0, lambda: 0)
    if not socket.has_ipv6:
        return
    try:
        v6 = GrpclibServer(Services(echo.process, echo.access_logs, None, board))
        await v6.start("[::1]:0")
    except OSError as e:  # a kernel without ::1 configured
        pytest.skip(f"no IPv6 loopback here: {e}")
    assert v6.address.startswith("[::1]:") and not v6.address.endswith(":0")
    async with grpc.aio.insecure_channel(v6.address) as ch:
        assert await _check(ch, "") == SERVING
    await v6.stop(0.0, lambda: 0)


def test_a_socket_file_that_is_not_a_socket_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("data")

    async def go() -> None:
        s = GrpclibServer(Services(Echo().process, Echo().access_logs, None, HealthBoard()))
        await s.start(f"unix:{path}")

    with pytest.raises(OSError):
        asyncio.run(go())
    assert path.read_text() == "data" and os.path.isfile(path)
