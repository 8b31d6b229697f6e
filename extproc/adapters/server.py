"""The processor's gRPC server: role routing, Envoy's access log, and `serve`.

One process serves Envoy's two ext_proc filters (the role comes from each stream's initial
metadata) and its gRPC access-log service, on grpc.aio or grpclib (`server.transport`,
decision 0020): both stacks call the same handlers. `serve` is the only place that names the etcd
store: everything else depends on the ports in `ports.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpclib.exceptions import StreamTerminatedError

from ..core import headers as H
from ..core.config import Config
from ..gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from ..gen.envoy.service.endpoint.v3 import eds_pb2_grpc
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from .etcd_pool import EtcdPoolRegistry
from .etcd_store import EtcdStore
from .gate import UNSAFE_RELEASE_WITHOUT_FENCE, GateSession
from .grpclib_server import GrpclibServer, HealthBoard, Services
from .guard import GuardSession
from .loop_lag import LoopLag
from .membership import EndpointDiscovery, LiveMembership
from .processor import Processor, log
from .readiness import HealthReporter, export_gauges
from .session import NO_METADATA, Messages
from .shards import journal_for

# --- the handlers both gRPC stacks serve -----------------------------------------------


async def process_stream(proc: Processor, md: Mapping[str, str], io: Messages) -> None:
    """One ext_proc stream; the role comes from its initial metadata."""
    role = sys.intern(md.get(H.ROLE_METADATA, "guard"))  # one string per role name
    session: GuardSession | GateSession
    # `gate`: an attempt's upstream stream; `tools`: the tool listener's filter, a guard that
    # serves only the tool route; anything else: the client listener's guard, which never
    # serves it (decision 0028).
    session = (GateSession(proc, io) if role == "gate"
               else GuardSession(proc, io, tools=role == "tools"))
    # The metadata is only read again for trace context: do not keep it per stream.
    session.md = dict(md) if proc.tel.tracing else NO_METADATA
    # Nor held by this frame while the stream is open (grpc.aio's metadata is a new tuple
    # of new strings for each stream: ~0.6 KiB with the dict made of it).
    del md
    proc.open_streams += 1
    try:
        await session.run()
    except (asyncio.CancelledError, StreamTerminatedError):
        # Envoy reset the stream (it ends every side stream so); on_closed has run. The
        # stack that cancelled the handler expects to see it cancelled.
        raise
    except Exception:
        log.exception("processing stream failed",
                      extra={"request_id": session.rid, "attempt_id":
                             getattr(session, "aid", None), "role": role})
        raise
    finally:
        proc.open_streams -= 1


async def take_access_logs(proc: Processor, messages: AsyncIterator[Any]) -> None:
    async for msg in messages:
        if msg.WhichOneof("log_entries") == "http_logs":
            for entry in msg.http_logs.log_entry:
                proc.causes.offer(entry)


# --- grpc.aio ----------------------------------------------------------------------------


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # grpc.aio: quietly, as before
            await process_stream(self.p, dict(context.invocation_metadata() or ()), context)


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        await take_access_logs(self.p, request_iterator)
        return als_pb2.StreamAccessLogsResponse()


class GrpcAioServer:
    """grpc.aio (`server.transport: grpcio`): the running server, as GrpclibServer is."""

    def __init__(self, proc: Processor, eds: EndpointDiscovery | None) -> None:
        self._server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000),
                                                ("grpc.so_reuseport", 0)])
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(proc), self._server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(proc), self._server)
        if eds is not None:
            eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(eds, self._server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.address = ""

    async def start(self, listen: str) -> None:
        port = self._server.add_insecure_port(listen)
        if port == 0 and not listen.startswith("unix:"):
            raise OSError(f"cannot listen on {listen}")
        await self._server.start()
        # The port bound (a requested port 0 is the one the kernel chose); a unix socket's
        # name as given.
        self.address = listen if listen.startswith("unix:") else (
            listen.rsplit(":", 1)[0] + f":{port}")

    async def stop(self, grace_s: float, open_streams: Callable[[], int]) -> None:
        await self._server.stop(grace=grace_s)


async def serve(cfg: Config, ready: Callable[[str], None] | None = None) -> None:
    # One store per etcd cluster of the journal (decision 0042); shard 0 is `etcd` itself.
    stores = [EtcdStore(c, owner=f"{cfg.server.gateway_id}/{os.getpid()}")
              for c in cfg.etcd.clusters()]
    for store in stores:
        await store.connect()
        store.start_background()
    store = stores[0]  # the pool-wide keys: registrations, the retry budget; readiness
    proc = Processor(cfg, *journal_for(stores, cfg.tools.ledger_ttl_s))
    proc.tel.serve_metrics()  # server.metrics_listen (a port in use stops us here)
    proc.spawn(proc.share_budget(), "budget-exchange")
    registry = None
    live = cfg.pool.discovery == "registry"
    if live:
        # The pool is whatever registered (decision 0014): the guard's host lists and
        # Envoy's EDS answers follow the same registrations.
        membership = LiveMembership(on_pool=proc.set_pool)
        registry = EtcdPoolRegistry(store)
        registry.watch(membership.update)
    if (proc.pool.enabled or live) and cfg.pool.health_check.enabled:
        proc.spawn(proc.probe_pool(), "pool-probe")
    eds = EndpointDiscovery(membership) if live else None
    server: GrpcAioServer | GrpclibServer
    if cfg.server.transport == "grpclib":
        server = GrpclibServer(Services(partial(process_stream, proc),
                                        partial(take_access_logs, proc), eds, HealthBoard()))
    else:
        server = GrpcAioServer(proc, eds)
    await server.start(cfg.server.listen)
    # "" is readiness (etcd answered lately), "liveness" the event loop (decision 0016).
    health_rep = HealthReporter(server.health, store, cfg.server.readiness_grace_s)
    await health_rep.start()
    lag = LoopLag()
    lag.start()
    export_gauges(proc.tel, health_rep, lambda: proc.open_streams, lag.worst, stores)
    # Everything allocated at start-up lives for the process: keep it out of every future
    # collection, and collect young objects less often (fewer pauses in the chunk path).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
    addr = server.address
    if UNSAFE_RELEASE_WITHOUT_FENCE:
        log.critical("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE=1: the first-delta fence is OFF; "
                     "this is a test-only sabotage", extra={"request_id": None,
                                                           "attempt_id": None})
    # `instance_id`: the replicas' agents address their word to this process by it
    # (decision 0034).
    log.info("processor listening", extra={"listen": addr, "pid": os.getpid(),
                                           "transport": cfg.server.transport,
                                           "instance_id": proc.instance_id,
                                           "request_id": None, "attempt_id": None})
    if ready is not None:
        ready(addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: report NOT_SERVING first so Envoy's health checks move traffic away, then let
    # open streams finish for a bounded time.
    await health_rep.drain()
    await server.stop(5.0, lambda: proc.open_streams)
    await proc.drain()
    proc.tel.shutdown()
    if registry is not None:
        await registry.close()
    for store in stores:
        await store.close()
    await lag.stop()
    await health_rep.stop()
