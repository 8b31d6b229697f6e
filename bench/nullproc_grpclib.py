"""The null processor of bench/nullproc.py on grpclib (pure asyncio gRPC over h2), on uvloop.

    .venv/bin/python bench/nullproc_grpclib.py --listen 127.0.0.1:50051
    .venv/bin/python bench/nullproc_grpclib.py --listen 127.0.0.1:50051 --coalesce

The same two services (ExternalProcessor/Process, AccessLogService/StreamAccessLogs), the
same message pattern as bench/nullproc.py's NullProcessor (guard: request headers, buffered
request body, response headers, every body message echoed as FULL_DUPLEX_STREAMED; gate:
request and response headers and its first response body message, then it leaves the
stream), the same generated protobuf classes (extproc/gen), no codegen: grpclib serves any
object with a `__mapping__` of method path -> grpclib.const.Handler.

`--coalesce`: the guard answers every run of body messages that have already arrived when it
is ready to write with one FULL_DUPLEX_STREAMED response carrying their bytes in order (Envoy
lets the processor re-chunk the body in that mode), instead of one response per message;
it looks at the stream's receive buffer, so it needs no task or queue per stream.

`GrpclibNullStack` runs it behind the identical rendered Envoy config (bench/floors.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpclib.protocol
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream
from h2.connection import H2Connection
from h2.settings import SettingCodes, Settings

from bench.nullproc import _ANSWERS, _RESPONSE_BODY, NullStack
from extproc.adapters import envoy_codec as codec
from extproc.core.headers import ROLE_METADATA
from extproc.gen.envoy.service.accesslog.v3 import als_pb2
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ACCESS_LOGS = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
# h2 advertises 100 concurrent streams per connection by default; Envoy (and the memory
# figure's client) open far more on one connection. grpc.aio's nullproc allows 100,000.
MAX_CONCURRENT_STREAMS = 100_000


class NullServices:
    """Both services; `coalesce` re-chunks waiting guard body messages into one answer."""

    def __init__(self, coalesce: bool = False) -> None:
        self.coalesce = coalesce

    def __mapping__(self) -> dict[str, Handler]:
        process = self.process_coalescing if self.coalesce else self.process
        return {
            PROCESS: Handler(process, Cardinality.STREAM_STREAM, ep.ProcessingRequest,
                             ep.ProcessingResponse),
            ACCESS_LOGS: Handler(self.access_logs, Cardinality.STREAM_UNARY,
                                 als_pb2.StreamAccessLogsMessage,
                                 als_pb2.StreamAccessLogsResponse),
        }

    async def process(self, stream: Stream[Any, Any]) -> None:
        gate = stream.metadata is not None and stream.metadata.get(ROLE_METADATA) == "gate"
        recv, send = stream.recv_message, stream.send_message
        while True:
            msg = await recv()
            if msg is None:
                return
            which = msg.WhichOneof("request")
            if which == "response_body":
                if gate:
                    await send(_RESPONSE_BODY)
                    return  # the hand-off: Envoy goes on without this stream
                body = msg.response_body
                await send(codec.streamed_response_body(body.body, body.end_of_stream))
            elif which in _ANSWERS:
                await send(_ANSWERS[which])

    async def process_coalescing(self, stream: Stream[Any, Any]) -> None:
        """The guard, answering every run of body messages that have already arrived when
        it is ready to write with one streamed response. No reader task: the stream's own
        receive buffer says whether more data has arrived (grpclib's private
        `Stream._stream.buffer`; Envoy writes each message in one DATA frame)."""
        gate = stream.metadata is not None and stream.metadata.get(ROLE_METADATA) == "gate"
        if gate:  # the gate answers one body message and leaves: nothing to coalesce
            await self.process(stream)
            return
        buf = stream._stream.buffer
        recv, send = stream.recv_message, stream.send_message
        msg = await recv()
        while msg is not None:
            which = msg.WhichOneof("request")
            if which != "response_body":
                if which in _ANSWERS:
                    await send(_ANSWERS[which])
                msg = await recv()
                continue
            parts, eos = [msg.response_body.body], msg.response_body.end_of_stream
            msg, ended = None, False
            while not eos and (buf._acked_size or not buf._unacked.empty()):
                nxt = await recv()
                if nxt is None:
                    ended = True
                    break
                if nxt.WhichOneof("request") != "response_body":
                    msg = nxt  # answered next, after this body's answer
                    break
                parts.append(nxt.response_body.body)
                eos = nxt.response_body.end_of_stream
            await send(codec.streamed_response_body(b"".join(parts), eos))
            if msg is None and not ended:
                msg = await recv()

    async def access_logs(self, stream: Stream[Any, Any]) -> None:
        while await stream.recv_message() is not None:
            pass
        await stream.send_message(als_pb2.StreamAccessLogsResponse())


class _H2Connection(H2Connection):
    """h2's connection with MAX_CONCURRENT_STREAMS raised in its first SETTINGS frame."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config=config)
        self.local_settings = Settings(client=self.config.client_side, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            SettingCodes.MAX_HEADER_LIST_SIZE: self.DEFAULT_MAX_HEADER_LIST_SIZE})


async def serve(listen: str, coalesce: bool = False) -> None:
    host, _, port = listen.rpartition(":")
    # grpclib builds each connection's H2Connection by this module-level name; this process
    # is the null processor alone, so the swap touches nothing else.
    grpclib.protocol.H2Connection = _H2Connection  # type: ignore[attr-defined]
    server = Server([NullServices(coalesce)])
    await server.start(host, int(port))
    await server.wait_closed()


class GrpclibNullStack(NullStack):
    """The floor stack with this grpclib null processor in bench/nullproc.py's place."""

    def processor_argv(self, config_path: Path) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--listen", self.processor_addr,
                *self.processor_flags]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/nullproc_grpclib.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port (loopback)")
    ap.add_argument("--coalesce", action="store_true",
                    help="one streamed answer per run of waiting guard body messages")
    a = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(a.listen, a.coalesce))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
