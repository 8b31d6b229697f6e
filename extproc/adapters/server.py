"""The processor's gRPC server: role routing, Envoy's access log, and `serve`.

One process serves Envoy's two ext_proc filters (the role comes from each stream's initial
metadata) and its gRPC access-log service. `serve` is the only place that names the etcd
store: everything else depends on the ports in `ports.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from ..core import headers as H
from ..core.config import Config
from ..gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from ..gen.envoy.service.endpoint.v3 import eds_pb2_grpc
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from .etcd_pool import EtcdPoolRegistry
from .etcd_store import EtcdStore, ToolLedger
from .gate import UNSAFE_RELEASE_WITHOUT_FENCE, GateSession
from .guard import GuardSession
from .membership import EndpointDiscovery, LiveMembership
from .readiness import HealthReporter, export_gauges
from .session import Processor, log

# --- gRPC services ---------------------------------------------------------------------


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> None:
        md = dict(context.invocation_metadata() or ())
        role = md.get(H.ROLE_METADATA, "guard")
        session: GuardSession | GateSession
        session = GateSession(self.p, context) if role == "gate" else GuardSession(self.p, context)
        # The metadata is only read again for trace context: do not keep it per stream.
        session.md = md if self.p.tel.tracing else {}
        self.p.open_streams += 1
        try:
            await session.run()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("processing stream failed",
                          extra={"request_id": session.rid, "attempt_id":
                                 getattr(session, "aid", None), "role": role})
            raise
        finally:
            self.p.open_streams -= 1


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            if msg.WhichOneof("log_entries") == "http_logs":
                for entry in msg.http_logs.log_entry:
                    self.p.causes.offer(entry)
        return als_pb2.StreamAccessLogsResponse()


async def serve(cfg: Config, ready: Callable[[str], None] | None = None) -> None:
    store = EtcdStore(cfg.etcd, owner=f"{cfg.server.gateway_id}/{os.getpid()}")
    await store.connect()
    store.start_background()
    proc = Processor(cfg, store, ToolLedger(store, cfg.tools.ledger_ttl_s))
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
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000),
                                      ("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(proc), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(proc), server)
    if live:
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(
            EndpointDiscovery(membership), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(cfg.server.listen)
    if port == 0 and not cfg.server.listen.startswith("unix:"):
        raise OSError(f"cannot listen on {cfg.server.listen}")
    await server.start()
    # "" is readiness (etcd answered lately), "liveness" the event loop (decision 0016).
    health_rep = HealthReporter(hs, store, cfg.server.readiness_grace_s)
    await health_rep.start()
    export_gauges(proc.tel, health_rep, lambda: proc.open_streams)
    # Everything allocated at start-up lives for the process: keep it out of every future
    # collection, and collect young objects less often (fewer pauses in the chunk path).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
    listen = cfg.server.listen
    addr = listen if port == 0 or listen.startswith("unix:") else (
        listen.rsplit(":", 1)[0] + f":{port}")
    if UNSAFE_RELEASE_WITHOUT_FENCE:
        log.critical("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE=1: the first-delta fence is OFF; "
                     "this is a test-only sabotage", extra={"request_id": None,
                                                           "attempt_id": None})
    log.info("processor listening", extra={"listen": addr, "pid": os.getpid(),
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
    await server.stop(grace=5.0)
    await proc.drain()
    proc.tel.shutdown()
    if registry is not None:
        await registry.close()
    await store.close()
    await health_rep.stop()
