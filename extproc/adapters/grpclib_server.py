"""The processor's services on grpclib: pure-asyncio gRPC over h2 (`server.transport: grpclib`).

grpclib serves any object with a `__mapping__` of method path -> Handler, so the generated
message classes stay ours and no second codegen is needed. What grpc.aio gave for free and
this module provides: a stream concurrency limit Envoy will not hit (h2 allows 100 per
connection), the health service (Check and Watch, the statuses `readiness.py` sets), and a
drain that lets open streams finish before anything is cancelled (grpclib's own close cancels
every handler at once). Decision 0020.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, cast

from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from grpclib.server import Server, Stream
from h2.settings import SettingCodes

from ..gen.envoy.service.accesslog.v3 import als_pb2
from ..gen.envoy.service.discovery.v3 import discovery_pb2 as ds
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .membership import EndpointDiscovery
from .timers import LoopTimers, Timers, sleep

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOGS = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
STREAM_ENDPOINTS = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
# Envoy opens every ext_proc stream of its worker on one connection: grpc.aio is given the
# same limit (grpc.max_concurrent_streams).
MAX_CONCURRENT_STREAMS = 100_000

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

log = logging.getLogger("extproc")
# grpclib logs every stream Envoy resets ("Request was cancelled") at INFO: that is a client
# going away, which the sessions log themselves with the request's ids.
logging.getLogger("grpclib").setLevel(logging.WARNING)


class StreamMessages:
    """A grpclib stream as the sessions' `Messages`: read() is None at the end."""

    __slots__ = ("read", "write")

    def __init__(self, stream: Stream[Any, Any]) -> None:
        self.read = stream.recv_message
        self.write = stream.send_message


class HealthBoard:
    """grpc.health.v1 on grpclib, with grpc_health's semantics: Check of an unknown service is
    NOT_FOUND, Watch sends the status now and at every change, and after
    `enter_graceful_shutdown` every service is NOT_SERVING for good."""

    def __init__(self) -> None:
        self._status: dict[str, Any] = {"": _SERVING}
        self._changed: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._final = False
        self._watches: dict[int, tuple[str, Any]] = {}  # per Watch: service, status last sent
        self._next = 0

    async def set(self, service: str, status: Any) -> None:
        if self._final:
            return
        self._status[service] = status
        if service in self._changed:
            self._changed.pop(service).set()

    async def enter_graceful_shutdown(self) -> None:
        if self._final:
            return
        for service in list(self._status):
            await self.set(service, _NOT_SERVING)
        self._final = True

    def delivered(self) -> bool:
        """Every Watch has sent its service's current status (the drain waits for it: the
        readiness NOT_SERVING it just set must reach watchers before they are cancelled)."""
        return all(self._status.get(svc, _UNKNOWN) == last for svc, last in
                   self._watches.values())

    async def check(self, stream: Stream[Any, Any]) -> None:
        req = await stream.recv_message()
        status = self._status.get(req.service if req is not None else "")
        if status is None:
            raise GRPCError(Status.NOT_FOUND, "unknown service")
        await stream.send_message(health_pb2.HealthCheckResponse(status=status))

    async def watch(self, stream: Stream[Any, Any]) -> None:
        req = await stream.recv_message()
        service = req.service if req is not None else ""
        key, self._next = self._next, self._next + 1
        self._watches[key] = (service, None)
        try:
            while True:
                changed = self._changed[service]
                status = self._status.get(service, _UNKNOWN)
                if status != self._watches[key][1]:
                    await stream.send_message(health_pb2.HealthCheckResponse(status=status))
                    self._watches[key] = (service, status)
                await changed.wait()
        finally:
            del self._watches[key]


class _Protocol(H2Protocol):
    """grpclib's connection, announcing the stream limit right after its first SETTINGS.
    Envoy applies it on receipt and acknowledges it before opening more than h2's default
    100 streams, and h2 counts the limit from that acknowledgement: TCP keeps the order."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        h2c = self.connection._connection
        h2c.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS})
        self.connection.flush()


class _Server(Server):
    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        proto.__class__ = _Protocol
        return proto


async def _requests(stream: Stream[Any, Any]) -> AsyncIterator[Any]:
    while (msg := await stream.recv_message()) is not None:
        yield msg


class Services:
    """The four services' grpclib mapping, each handler the shared one (server.py)."""

    def __init__(self, process: Callable[[Mapping[str, str], Any], Awaitable[None]],
                 access_logs: Callable[[AsyncIterator[Any]], Awaitable[None]],
                 eds: EndpointDiscovery | None, health: HealthBoard) -> None:
        self._process = process
        self._access_logs = access_logs
        self._eds = eds
        self.health = health

    def __mapping__(self) -> dict[str, Handler]:
        m = {
            PROCESS: Handler(self.process, Cardinality.STREAM_STREAM, ep.ProcessingRequest,
                             ep.ProcessingResponse),
            ACCESS_LOGS: Handler(self.access_logs, Cardinality.STREAM_UNARY,
                                 als_pb2.StreamAccessLogsMessage,
                                 als_pb2.StreamAccessLogsResponse),
            HEALTH_CHECK: Handler(self.health.check, Cardinality.UNARY_UNARY,
                                  health_pb2.HealthCheckRequest,
                                  health_pb2.HealthCheckResponse),
            HEALTH_WATCH: Handler(self.health.watch, Cardinality.UNARY_STREAM,
                                  health_pb2.HealthCheckRequest,
                                  health_pb2.HealthCheckResponse),
        }
        if self._eds is not None:
            m[STREAM_ENDPOINTS] = Handler(self.endpoints, Cardinality.STREAM_STREAM,
                                          ds.DiscoveryRequest, ds.DiscoveryResponse)
        return m

    async def process(self, stream: Stream[Any, Any]) -> None:
        # A MultiDict: `get` gives a key's first value (Envoy sends one per key).
        md = cast(Mapping[str, str], stream.metadata or {})
        await self._process(md, StreamMessages(stream))

    async def access_logs(self, stream: Stream[Any, Any]) -> None:
        await self._access_logs(_requests(stream))
        await stream.send_message(als_pb2.StreamAccessLogsResponse())

    async def endpoints(self, stream: Stream[Any, Any]) -> None:
        assert self._eds is not None
        await self._eds.answer(_requests(stream), stream.send_message)


def _unix_path(listen: str) -> str:
    # grpc's forms: unix:relative/or/absolute, unix:///absolute.
    rest = listen[len("unix:"):]
    return rest[2:] if rest.startswith("///") else rest


class GrpclibServer:
    """The running server: its address, its health statuses, and its drain."""

    def __init__(self, services: Services, timers: Timers | None = None) -> None:
        self.health = services.health
        self.timers: Timers = timers or LoopTimers()  # the drain's polls
        self._server = _Server([services])
        self.address = ""
        # Set once `stop` closed the listener: no new connection from then on.
        self.draining = asyncio.Event()

    async def start(self, listen: str) -> None:
        if listen.startswith("unix:"):
            # asyncio removes a socket file a dead process left behind (and only a socket).
            await self._server.start(path=_unix_path(listen))
            self.address = listen
            return
        host, _, port = listen.rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, int(port)), family=family)
        await self._server.start(sock=sock)
        bound = sock.getsockname()[1]
        self.address = listen if int(port) else listen.rsplit(":", 1)[0] + f":{bound}"

    async def stop(self, grace_s: float, open_streams: Callable[[], int]) -> None:
        """Stop accepting connections, let open streams end (and health watchers hear the
        drain) for `grace_s`, then cancel. Streams Envoy opens meanwhile on its connection
        are served (readiness is already NOT_SERVING, so a pool moves traffic away)."""
        listener = self._server._server
        if listener is not None:
            listener.close()
        self.draining.set()
        for _ in range(max(1, int(grace_s / 0.05))):  # polled: the count lives in Processor
            if open_streams() == 0 and self.health.delivered():
                break
            await sleep(self.timers, 0.05)
        self._server.close()
        await self._server.wait_closed()
