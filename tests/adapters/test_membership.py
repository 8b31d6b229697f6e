"""The EDS service, played as Envoy plays it: a real server (grpc.aio or grpclib), a real
client stream.

State of the world: an answer when Envoy subscribes, one per membership change, none for
an ACK; nothing before the processor's first listing of the registrations. That nothing was
sent is read from the service's own count (its `EDS requests handled` line), once it has acted
on the request: no real wait for an answer that does not come.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from extproc.adapters.grpclib_server import GrpclibServer, HealthBoard, Services
from extproc.adapters.membership import CLA_TYPE, EndpointDiscovery, LiveMembership
from extproc.core.pool import Pool
from extproc.gen.envoy.config.endpoint.v3 import endpoint_pb2
from extproc.gen.envoy.service.discovery.v3 import discovery_pb2 as ds
from extproc.gen.envoy.service.endpoint.v3 import eds_pb2_grpc

FP = {"weights_revision": "m@sha256:1"}


def _reg(address: str, fp: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"address": address, "fingerprint": fp or FP, "models": []}).encode()


class _Envoy:
    """One EDS stream from the client side."""

    def __init__(self, stub: Any) -> None:
        self.out: asyncio.Queue[ds.DiscoveryRequest | None] = asyncio.Queue()
        self.call = stub.StreamEndpoints(self._requests())
        self.answers: asyncio.Queue[ds.DiscoveryResponse] = asyncio.Queue()
        # One reader for the stream's life (cancelling a read would cancel the call).
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for resp in self.call:
            self.answers.put_nowait(resp)

    async def _requests(self) -> AsyncIterator[ds.DiscoveryRequest]:
        while (req := await self.out.get()) is not None:
            yield req

    def send(self, names: list[str], version: str = "", nonce: str = "") -> None:
        self.out.put_nowait(ds.DiscoveryRequest(type_url=CLA_TYPE, resource_names=names,
                                                version_info=version, response_nonce=nonce))

    async def answer(self) -> ds.DiscoveryResponse:
        """The next answer, which must come: bounded far above its real time (a busy CI
        machine once took over 2 s)."""
        try:
            return await asyncio.wait_for(self.answers.get(), 10.0)
        except TimeoutError:
            raise AssertionError("no EDS answer within 10 s") from None


class _Handled(logging.Handler):
    """The service's `EDS requests handled` lines as it logs them (its servers run on the
    test's loop): after acting on what a stream read, its counts of requests and answers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: asyncio.Queue[logging.LogRecord] = asyncio.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "EDS requests handled":
            self.lines.put_nowait(record)

    async def after(self, requests: int) -> logging.LogRecord:
        """The first line once the stream's first `requests` requests are handled."""
        async def line() -> logging.LogRecord:
            while (r := await self.lines.get()).requests < requests:
                pass
            return r
        try:
            return await asyncio.wait_for(line(), 10.0)
        except TimeoutError:
            raise AssertionError(f"EDS request {requests} not handled within 10 s") from None


@pytest.fixture
def handled() -> Iterator[_Handled]:
    pool_log = logging.getLogger("extproc.pool")
    h, level = _Handled(), pool_log.level
    pool_log.addHandler(h)
    pool_log.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        pool_log.removeHandler(h)
        pool_log.setLevel(level)


def _hosts(resp: ds.DiscoveryResponse) -> list[str]:
    out = []
    for res in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert res.Unpack(cla)
        assert cla.cluster_name == "replicas"
        for loc in cla.endpoints:
            for e in loc.lb_endpoints:
                sa = e.endpoint.address.socket_address
                out.append(f"{sa.address}:{sa.port_value}")
    return out


async def _nothing(*args: Any) -> None:
    return None


@pytest.fixture(params=["grpcio", "grpclib"])
async def eds(request: pytest.FixtureRequest
              ) -> AsyncIterator[tuple[LiveMembership, Any, list[Pool]]]:
    """The EDS service on either gRPC stack (server.transport), asked by a grpc.aio client."""
    pools: list[Pool] = []
    m = LiveMembership(on_pool=pools.append)
    server: Any
    if request.param == "grpclib":
        server = GrpclibServer(Services(_nothing, _nothing, EndpointDiscovery(m),
                                        HealthBoard()))
        await server.start("127.0.0.1:0")
        target = server.address
    else:
        server = grpc.aio.server()
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(EndpointDiscovery(m),
                                                                    server)
        target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
    ch = grpc.aio.insecure_channel(target)
    try:
        yield m, eds_pb2_grpc.EndpointDiscoveryServiceStub(ch), pools
    finally:
        await ch.close()
        if request.param == "grpclib":
            await server.stop(0.0, lambda: 0)
        else:
            await server.stop(None)


async def test_subscribe_ack_change_and_nothing_before_the_first_listing(
        eds: tuple[LiveMembership, Any, list[Pool]], handled: _Handled) -> None:
    m, stub, pools = eds
    envoy = _Envoy(stub)
    envoy.send(["replicas"])
    line = await handled.after(1)  # no listing yet: not answered, Envoy waits (as at start-up)
    assert (line.requests, line.answers, line.version) == (1, 0, None)
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001")})
    first = await envoy.answer()
    assert first.type_url == CLA_TYPE and first.nonce
    assert _hosts(first) == ["127.0.0.1:8001"]
    assert [r.address for r in pools[-1].replicas] == ["127.0.0.1:8001"]
    envoy.send(["replicas"], version=first.version_info, nonce=first.nonce)  # ACK
    line = await handled.after(2)  # an ACK is not answered
    assert (line.requests, line.answers, line.version) == (2, 1, first.version_info)
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001"), "[::1]:8002": _reg("[::1]:8002")})
    second = await envoy.answer()
    assert second.version_info != first.version_info
    assert second.nonce != first.nonce
    assert sorted(_hosts(second)) == ["127.0.0.1:8001", "::1:8002"]
    envoy.send(["replicas"], version=second.version_info, nonce=second.nonce)
    # The same registrations listed again (the watch re-listed after a break) before the
    # service read that ACK: no change, no answer, by the time the ACK is handled.
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001"), "[::1]:8002": _reg("[::1]:8002")})
    assert m.version == second.version_info
    line = await handled.after(3)
    assert (line.requests, line.answers, line.version) == (3, 2, second.version_info)
    m.update({})  # every registration lapsed: Envoy is told the pool is empty
    third = await envoy.answer()
    assert _hosts(third) == []
    assert not pools[-1].enabled
    envoy.out.put_nowait(None)


async def test_a_refused_registration_reaches_neither_envoy_nor_the_pool(
        eds: tuple[LiveMembership, Any, list[Pool]], caplog: pytest.LogCaptureFixture) -> None:
    m, stub, pools = eds
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001"),
              "127.0.0.1:8009": b'{"address": "127.0.0.1:8009"}'})
    envoy = _Envoy(stub)
    envoy.send(["replicas"])
    resp = await envoy.answer()
    assert _hosts(resp) == ["127.0.0.1:8001"]
    assert [r.address for r in pools[-1].replicas] == ["127.0.0.1:8001"]
    assert any("registration refused" in r.message and "8009" in str(r.__dict__)
               for r in caplog.records)
    envoy.out.put_nowait(None)


async def test_a_changed_fingerprint_is_a_change(
        eds: tuple[LiveMembership, Any, list[Pool]]) -> None:
    m, stub, pools = eds
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001")})
    envoy = _Envoy(stub)
    envoy.send(["replicas"])
    first = await envoy.answer()
    envoy.send(["replicas"], version=first.version_info, nonce=first.nonce)
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001", {"weights_revision": "m@sha256:2"})})
    # Same address, other weights: the pool changes (its fingerprint), Envoy is re-told.
    again = await envoy.answer()
    assert _hosts(again) == ["127.0.0.1:8001"]
    assert pools[-1].replicas[0].fingerprint.weights_revision == "m@sha256:2"
    envoy.out.put_nowait(None)


async def test_a_nack_is_logged_and_names_for_other_clusters_get_nothing(
        eds: tuple[LiveMembership, Any, list[Pool]], caplog: pytest.LogCaptureFixture) -> None:
    m, stub, _ = eds
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001")})
    envoy = _Envoy(stub)
    envoy.send(["other"])
    resp = await envoy.answer()
    assert list(resp.resources) == []
    envoy.send(["replicas"], version="", nonce=resp.nonce)  # NACK of that answer ...
    resp2 = await envoy.answer()  # ... and a subscription to ours: answered
    assert _hosts(resp2) == ["127.0.0.1:8001"]
    assert any("rejected" in r.message for r in caplog.records)
    envoy.out.put_nowait(None)


async def test_envoys_reply_read_before_our_write_returned(
        caplog: pytest.LogCaptureFixture) -> None:
    """Envoy's reply to an answer can be read before that answer's write has returned (on a
    busy machine the reader can run first). Here it refuses the answer (for a cluster we do
    not serve) and subscribes to ours: a NACK all the same, and ours is answered. Without
    gRPC: the write itself waits until the service has read the reply."""
    m = LiveMembership(on_pool=lambda pool: None)
    m.update({"127.0.0.1:8001": _reg("127.0.0.1:8001")})
    requests: asyncio.Queue[ds.DiscoveryRequest | None] = asyncio.Queue()
    asked = asyncio.Event()  # the service asks for the next request: it read the last one

    async def envoy() -> AsyncIterator[ds.DiscoveryRequest]:
        while True:
            if requests.empty():
                asked.set()
            if (req := await requests.get()) is None:
                return
            yield req

    written: list[ds.DiscoveryResponse] = []

    async def write(resp: ds.DiscoveryResponse) -> None:
        written.append(resp)
        if len(written) == 1:  # refused, and ours asked for, before this write returns
            asked.clear()
            requests.put_nowait(ds.DiscoveryRequest(
                type_url=CLA_TYPE, resource_names=["replicas"], response_nonce=resp.nonce))
            await asyncio.wait_for(asked.wait(), 10.0)
        else:
            requests.put_nowait(None)  # Envoy goes

    requests.put_nowait(ds.DiscoveryRequest(type_url=CLA_TYPE, resource_names=["other"]))
    await asyncio.wait_for(EndpointDiscovery(m).answer(envoy(), write), 10.0)
    assert [r.message for r in caplog.records if "rejected" in r.message] == [
        "Envoy rejected the replicas' endpoints"]
    assert [_hosts(r) for r in written] == [[], ["127.0.0.1:8001"]]
