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
import asyncio
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from devkit.devstack import Stack
from extproc.adapters import envoy_codec as codec
from extproc.core.headers import ROLE_METADATA
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


_ANSWERS = {"request_headers": _REQUEST_HEADERS, "request_body": _REQUEST_BODY,
            "response_headers": _RESPONSE_HEADERS, "response_trailers": _RESPONSE_TRAILERS,
            "request_trailers": _REQUEST_TRAILERS}  # every answer but the body's


async def answer_queue(q: asyncio.Queue[Any], send: Any) -> None:
    """The guard's answers to the messages in `q` (None ends it), with every run of body
    messages already queued when the previous write finished answered by ONE streamed body
    response carrying their bytes in order: FULL_DUPLEX_STREAMED lets the processor re-chunk
    the body. (bench/floors.py measures this as the "coalesce" variants.)"""
    pending: Any = None
    while True:
        msg = pending if pending is not None else await q.get()
        pending = None
        if msg is None:
            return
        which = msg.WhichOneof("request")
        if which != "response_body":
            if which in _ANSWERS:
                await send(_ANSWERS[which])
            continue
        parts, eos = [msg.response_body.body], msg.response_body.end_of_stream
        while not eos and not q.empty():
            nxt = q.get_nowait()
            if nxt is None or nxt.WhichOneof("request") != "response_body":
                if nxt is None:
                    q.put_nowait(None)  # the end, after this answer
                else:
                    pending = nxt
                break
            parts.append(nxt.response_body.body)
            eos = nxt.response_body.end_of_stream
        await send(codec.streamed_response_body(b"".join(parts), eos))


class CoalescingNullProcessor(NullProcessor):
    """NullProcessor whose guard reads in its own task and coalesces waiting body messages
    (answer_queue); the gate is NullProcessor's (one body message, then it leaves)."""

    async def Process(self, it: Any, ctx: Any) -> None:
        if dict(ctx.invocation_metadata() or ()).get(ROLE_METADATA) == "gate":
            await super().Process(it, ctx)
            return
        q: asyncio.Queue[Any] = asyncio.Queue()

        async def reader() -> None:
            try:
                while (m := await ctx.read()) is not grpc.aio.EOF:
                    q.put_nowait(m)
            finally:
                q.put_nowait(None)

        task = asyncio.ensure_future(reader())
        try:
            await answer_queue(q, ctx.write)
        finally:
            task.cancel()


DEFAULT_OPTIONS: list[tuple[str, Any]] = [("grpc.max_concurrent_streams", 100000),
                                          ("grpc.so_reuseport", 0)]


async def serve(listen: str, options: list[tuple[str, Any]] | None = None,
                coalesce: bool = False) -> None:
    """`options` are added to (and override) DEFAULT_OPTIONS; bench/floors.py's tuned
    variants pass them with --option."""
    opts = dict(DEFAULT_OPTIONS)
    opts.update(options or [])
    server = grpc.aio.server(options=list(opts.items()))
    processor = CoalescingNullProcessor() if coalesce else NullProcessor()
    ep_grpc.add_ExternalProcessorServicer_to_server(processor, server)
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

    # Extra command-line flags for the null processor (bench/floors.py's variants set them
    # on subclasses); none: the floor bench/run.py measures.
    processor_flags: tuple[str, ...] = ()

    def processor_argv(self, config_path: Path) -> list[str]:
        # The same config renders the same Envoy bootstrap; the null processor only listens.
        return [sys.executable, str(Path(__file__).resolve()), "--listen", self.processor_addr,
                *self.processor_flags]

    def etcd_calls(self) -> dict[str, int]:
        return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/nullproc.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port (loopback)")
    ap.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a grpc.aio server option (channel arg), e.g. "
                    "grpc.optimization_target=throughput; integers are passed as int")
    ap.add_argument("--coalesce", action="store_true",
                    help="one streamed answer per run of waiting guard body messages")
    a = ap.parse_args(argv)
    options: list[tuple[str, Any]] = []
    for o in a.option:
        name, sep, value = o.partition("=")
        if not sep:
            ap.error(f"--option {o!r}: expected NAME=VALUE")
        options.append((name, int(value) if value.lstrip("-").isdigit() else value))
    try:
        import uvloop

        uvloop.run(serve(a.listen, options, a.coalesce))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
