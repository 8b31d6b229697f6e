"""The design's floor, end to end: the same ext_proc messages, answered with no logic at all.

    .venv/bin/python bench/nullproc.py --listen 127.0.0.1:50051    # what NullStack runs

A grpc.aio server (uvloop) with the ExternalProcessor and AccessLog services, behind the
identical rendered Envoy config (guard downstream, gate upstream, the access loggers). It
answers every message Envoy sends the way our processor's message pattern requires (guard:
request headers, buffered request body, response headers, every body message echoed back as
FULL_DUPLEX_STREAMED; gate: request and response headers, its first response body message,
then it leaves the stream, as our gate does at the hand-off), but decides nothing, keeps no
state, calls no etcd and logs nothing.

`bench.run` measures it as a third side, "floor", in the same run as plain and ours: what
Envoy's ext_proc and grpc.aio cost for this message pattern on this machine. No processor of
this design on grpc.aio can do better; the difference between "floor" and "ours" is our logic
and etcd.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from extproc.adapters import envoy_codec as codec
from extproc.core.headers import ROLE_METADATA
from extproc.devstack import Stack
from extproc.gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

_REQUEST_HEADERS = codec.continue_request_headers()
_REQUEST_BODY = codec.continue_request_body()
_RESPONSE_HEADERS = codec.continue_response_headers()
_RESPONSE_BODY = codec.continue_response_body()
_RESPONSE_TRAILERS = codec.trailers_response()
_REQUEST_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


class NullProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(self, it: Any, ctx: Any) -> None:
        gate = dict(ctx.invocation_metadata() or ()).get(ROLE_METADATA) == "gate"
        read, write = ctx.read, ctx.write
        while True:
            msg = await read()
            if msg is grpc.aio.EOF:
                return
            which = msg.WhichOneof("request")
            if which == "response_body":
                if gate:
                    await write(_RESPONSE_BODY)
                    return  # the hand-off: Envoy goes on without this stream
                body = msg.response_body
                await write(codec.streamed_response_body(body.body, body.end_of_stream))
            elif which == "request_headers":
                await write(_REQUEST_HEADERS)
            elif which == "request_body":
                await write(_REQUEST_BODY)
            elif which == "response_headers":
                await write(_RESPONSE_HEADERS)
            elif which == "response_trailers":
                await write(_RESPONSE_TRAILERS)
            elif which == "request_trailers":
                await write(_REQUEST_TRAILERS)


class NullAccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    async def StreamAccessLogs(self, it: Any, ctx: Any) -> als_pb2.StreamAccessLogsResponse:
        async for _ in it:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(listen: str) -> None:
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000),
                                      ("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(NullAccessLog(), server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    await server.wait_for_termination()


class NullStack(Stack):
    """The "ours" stack with the null processor in place of ours, and no etcd."""

    def _start(self) -> None:
        self.etcd_endpoint = "127.0.0.1:1"  # never dialled: the null processor has no store
        super()._start()

    def processor_argv(self, config_path: Path) -> list[str]:
        # The same config renders the same Envoy bootstrap; the null processor only listens.
        return [sys.executable, str(Path(__file__).resolve()), "--listen", self.processor_addr]

    def etcd_calls(self) -> dict[str, int]:
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/nullproc.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port (loopback)")
    a = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(a.listen))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
