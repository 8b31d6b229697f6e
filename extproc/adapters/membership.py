"""The live pool in the processor, and Envoy's replicas cluster served from it over EDS.

`LiveMembership` holds the pool the registrations make (extproc.core.membership decides
what a registration means) and tells the EDS streams when it changed. `EndpointDiscovery`
answers Envoy's state-of-the-world EDS stream (`StreamEndpoints`) for the replicas cluster:
one response at subscription, one per change, none for an ACK. The guard's host lists and
Envoy's endpoints come from the same registrations, so a replica Envoy can reach is one
whose fingerprint the processor knows (decision 0014).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2

from ..core.membership import endpoints, pool_from_registrations
from ..core.pool import Pool
from ..gen.envoy.config.core.v3 import address_pb2
from ..gen.envoy.config.endpoint.v3 import endpoint_components_pb2 as ec
from ..gen.envoy.config.endpoint.v3 import endpoint_pb2
from ..gen.envoy.service.discovery.v3 import discovery_pb2 as ds
from ..gen.envoy.service.endpoint.v3 import eds_pb2_grpc

log = logging.getLogger("extproc.pool")
_NOID = {"request_id": None, "attempt_id": None}

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
REPLICAS_CLUSTER = "replicas"


def _shape(pool: Pool) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    return tuple((r.address, r.fingerprint.digest, r.models) for r in pool.replicas)


class LiveMembership:
    def __init__(self, on_pool: Callable[[Pool], None]) -> None:
        self._on_pool = on_pool
        self.pool = Pool()
        # Versions are unique per process: a restarted processor never repeats an old one.
        self._epoch = f"{os.getpid():x}{int(time.time() * 1000):x}"
        self.generation = 0
        self.ready = asyncio.Event()
        self._waiters: set[asyncio.Event] = set()
        self._refused: set[str] = set()

    @property
    def version(self) -> str:
        return f"{self._epoch}-{self.generation}"

    def update(self, registrations: dict[str, bytes]) -> None:
        pool, refused = pool_from_registrations(registrations)
        for why in sorted(set(refused) - self._refused):
            log.error("replica registration refused", extra={**_NOID, "problem": why})
        self._refused = set(refused)
        if _shape(pool) != _shape(self.pool) or not self.ready.is_set():
            before = {r.address for r in self.pool.replicas}
            after = {r.address for r in pool.replicas}
            self.pool = pool
            self.generation += 1
            self._on_pool(pool)
            log.info("pool membership changed", extra={
                **_NOID, "joined": sorted(after - before), "left": sorted(before - after),
                "replicas": len(after), "version": self.version})
            for w in self._waiters:
                w.set()
        self.ready.set()

    def subscribe(self, wake: asyncio.Event) -> Callable[[], None]:
        self._waiters.add(wake)
        return lambda: self._waiters.discard(wake)

    def load_assignment(self, cluster: str = REPLICAS_CLUSTER) -> Any:
        return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster, endpoints=[
            ec.LocalityLbEndpoints(lb_endpoints=[
                ec.LbEndpoint(endpoint=ec.Endpoint(address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address=h, port_value=p))))
                for h, p in endpoints(self.pool)])])


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, membership: LiveMembership) -> None:
        self.m = membership
        self._nonce = 0
        self._streams = 0

    async def StreamEndpoints(self, request_iterator: AsyncIterator[Any],
                              context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await self.answer(request_iterator, context.write)

    async def answer(self, request_iterator: AsyncIterator[Any],
                     write: Callable[[Any], Awaitable[None]]) -> None:
        """One EDS stream, on either gRPC stack: its requests in, our responses out.

        Every request read wakes the writer, which answers or finds nothing to answer (an
        ACK, a repeated subscription, no listing yet), then logs `EDS requests handled`
        (debug) with the stream's counts: `requests` read and acted on, `answers` sent."""
        self._streams += 1
        stream = self._streams
        wake = asyncio.Event()
        unsubscribe = self.m.subscribe(wake)
        names: tuple[str, ...] | None = None
        sent: tuple[str, tuple[str, ...]] | None = None  # (version, names) last sent
        nonce = ""
        requests = answers = 0
        closed = False

        async def read() -> None:
            nonlocal names, closed, requests
            try:
                async for req in request_iterator:
                    requests += 1
                    wake.set()
                    if req.type_url and req.type_url != CLA_TYPE:
                        log.warning("EDS request for another type ignored",
                                    extra={**_NOID, "type_url": req.type_url})
                        continue
                    if (req.response_nonce and req.response_nonce == nonce and sent
                            and req.version_info != sent[0]):
                        # Envoy refused our answer (NACK) and keeps its previous endpoints.
                        log.error("Envoy rejected the replicas' endpoints", extra={
                            **_NOID, "version": sent[0], "kept": req.version_info})
                    names = tuple(sorted(req.resource_names))
            finally:
                closed = True
                wake.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                await wake.wait()
                wake.clear()
                if closed:
                    return
                handled = requests  # each read in full: `names` is what they asked
                # Never an answer before the first listing: Envoy waits (the listing wakes us).
                if (self.m.ready.is_set() and names is not None
                        and sent != (self.m.version, names)):
                    version = self.m.version
                    served = [n for n in names if n == REPLICAS_CLUSTER] or (
                        [REPLICAS_CLUSTER] if not names else [])
                    resources = []
                    for n in served:
                        packed = any_pb2.Any()
                        packed.Pack(self.m.load_assignment(n))
                        resources.append(packed)
                    self._nonce += 1
                    nonce = str(self._nonce)
                    # What this answer serves, before the write: Envoy's reply to it (a NACK,
                    # new names) can be read before the write returns.
                    sent = (version, names)
                    await write(ds.DiscoveryResponse(version_info=version, resources=resources,
                                                     type_url=CLA_TYPE, nonce=nonce))
                    answers += 1
                log.debug("EDS requests handled", extra={
                    **_NOID, "stream": stream, "requests": handled, "answers": answers,
                    "version": sent[0] if sent else None,
                    "replicas": len(self.m.pool.replicas)})
        finally:
            unsubscribe()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
