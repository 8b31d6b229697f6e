"""A TCP proxy between Envoy and one replica that can partition a connection on demand.

A real partition, not a flag in the replica: once a connection is cut, no byte crosses in
either direction and no close is propagated, so the replica keeps decoding into a void
(exactly what a broken network does), while Envoy sees silence. Which request is cut is
chosen by headers the client sends and Envoy forwards upstream:

  x-partition: after-request | after-deltas:N     where to cut
  x-partition-attempt: <n>                         only on Envoy's attempt n (default 1)

`after-request` forwards the request, then drops everything; `after-deltas:N` forwards the
response until N content deltas went through, then drops everything. Each cut is logged as
one JSON line: what was dropped after the cut, and when the replica itself finished.

Run: python -m devkit.demo.partition_proxy --listen 127.0.0.1:P --upstream 127.0.0.1:Q
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_MARK = re.compile(rb"\r\nx-partition:\s*([^\r\n]+)", re.IGNORECASE)
_MARK_ATTEMPT = re.compile(rb"\r\nx-partition-attempt:\s*(\d+)", re.IGNORECASE)
_ATTEMPT = re.compile(rb"\r\nx-envoy-attempt-count:\s*(\d+)", re.IGNORECASE)
_RID = re.compile(rb"\r\nx-gateway-request-id:\s*([^\r\n]+)", re.IGNORECASE)
_CLEN = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:\s*chunked", re.IGNORECASE)
_CONTENT = re.compile(rb'"(?:content|text)":"(?:[^"\\]|\\.)+"')


@dataclass
class Conn:
    mode: str | None = None  # "after-request" | "after-deltas"
    deltas: int = 0
    cut: bool = False
    cut_at: float = 0.0
    request_id: str | None = None
    attempt: int = 1
    forwarded_deltas: int = 0
    dropped_up: int = 0  # bytes from the replica dropped after the cut
    dropped_down: int = 0  # bytes from Envoy dropped after the cut
    envoy_closed_at: float | None = None
    replica_closed_at: float | None = None
    head: bytearray = field(default_factory=bytearray)
    resp_buf: bytearray = field(default_factory=bytearray)
    request_bytes: int = 0  # forwarded so far on this connection
    request_total: int | None = None  # head + body length, once known
    chunked: bool = False
    tail: bytes = b""
    resp_tail: bytes = b""


class Proxy:
    def __init__(self, upstream: tuple[str, int], log_file: str | None) -> None:
        self.upstream = upstream
        self.log_file = log_file
        # Each connection's handler, held until it ends. asyncio (3.11) drops its own
        # reference when Envoy's side closes; a cut connection's handler then lived only in
        # a reference cycle, the garbage collector took it, and StreamWriter.__del__ closed
        # the replica's side: a close the partition must not pass on (bench/abandoned.py
        # found 8 of 100 cut replicas seeing their peer gone, and no cut logged).
        self._handlers: set[asyncio.Task[Any]] = set()

    def _log(self, c: Conn) -> None:
        rec: dict[str, Any] = {
            "ts": time.time(), "request_id": c.request_id, "attempt": c.attempt,
            "mode": c.mode, "cut_at": c.cut_at, "forwarded_deltas": c.forwarded_deltas,
            "dropped_replica_bytes": c.dropped_up, "dropped_envoy_bytes": c.dropped_down,
            "envoy_closed_at": c.envoy_closed_at, "replica_closed_at": c.replica_closed_at,
        }
        if self.log_file:
            with open(self.log_file, "a") as f:
                f.write(json.dumps(rec) + "\n")

    async def handle(self, d_reader: asyncio.StreamReader,
                     d_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            await self._handle(d_reader, d_writer)
        finally:
            if task is not None:
                self._handlers.discard(task)

    async def _handle(self, d_reader: asyncio.StreamReader,
                      d_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            d_writer.close()
            return
        c = Conn()
        up = asyncio.ensure_future(self._envoy_to_replica(c, d_reader, u_writer))
        down = asyncio.ensure_future(self._replica_to_envoy(c, u_reader, d_writer))
        await asyncio.wait([up, down], return_when=asyncio.ALL_COMPLETED)
        for w in (u_writer, d_writer):
            with contextlib.suppress(Exception):
                w.close()
        if c.cut:
            self._log(c)

    def _inspect_request(self, c: Conn, data: bytes) -> None:
        if c.mode is not None or len(c.head) > 65536:
            return
        c.head += data
        if b"\r\n\r\n" not in c.head:
            return
        head_end = bytes(c.head).index(b"\r\n\r\n") + 4
        head = bytes(c.head[:head_end])
        c.head.clear()
        clen = _CLEN.search(head)
        c.chunked = bool(_CHUNKED.search(head))
        c.request_total = head_end + (int(clen.group(1)) if clen else 0)
        m = _MARK.search(head)
        if not m:
            return
        want = _MARK_ATTEMPT.search(head)
        got = _ATTEMPT.search(head)
        c.attempt = int(got.group(1)) if got else 1
        rid = _RID.search(head)
        c.request_id = rid.group(1).decode().strip() if rid else None
        if want and int(want.group(1)) != c.attempt:
            return
        spec = m.group(1).decode().strip().lower()
        if spec == "after-request":
            c.mode = "after-request"
        elif spec.startswith("after-deltas:"):
            c.mode, c.deltas = "after-deltas", int(spec.split(":", 1)[1])

    async def _envoy_to_replica(self, c: Conn, r: asyncio.StreamReader,
                                w: asyncio.StreamWriter) -> None:
        while True:
            data = await r.read(65536)
            if not data:
                c.envoy_closed_at = time.time()
                if not c.cut:
                    # No partition: propagate the close as a real network would.
                    with contextlib.suppress(Exception):
                        w.close()
                return  # partitioned: Envoy's FIN never reaches the replica
            if c.cut:
                c.dropped_down += len(data)
                continue
            self._inspect_request(c, data)
            w.write(data)
            c.request_bytes += len(data)
            c.tail = (c.tail + data)[-5:]
            with contextlib.suppress(ConnectionError):
                await w.drain()
            if c.mode == "after-request" and not c.cut and self._request_complete(c):
                c.cut, c.cut_at = True, time.time()

    @staticmethod
    def _request_complete(c: Conn) -> bool:
        if c.chunked:
            return c.tail.endswith(b"0\r\n\r\n")
        return c.request_total is not None and c.request_bytes >= c.request_total

    async def _replica_to_envoy(self, c: Conn, r: asyncio.StreamReader,
                                w: asyncio.StreamWriter) -> None:
        while True:
            data = await r.read(65536)
            if not data:
                c.replica_closed_at = time.time()
                if not c.cut:
                    with contextlib.suppress(Exception):
                        w.close()
                return
            if c.cut:
                c.dropped_up += len(data)
                c.resp_tail = (c.resp_tail + data)[-5:]
                if c.resp_tail.endswith(b"0\r\n\r\n"):
                    # The replica finished its response into the void; it would now idle
                    # on keep-alive, so the cut connection can be closed and logged.
                    c.replica_closed_at = time.time()
                    return
                continue
            if c.mode == "after-deltas":
                data = self._forward_until(c, data)
                if c.cut and c.resp_tail.endswith(b"0\r\n\r\n"):
                    c.replica_closed_at = time.time()  # finished in the very chunk cut
                    return
            if data:
                w.write(data)
                with contextlib.suppress(ConnectionError):
                    await w.drain()

    def _forward_until(self, c: Conn, data: bytes) -> bytes:
        """Forward whole SSE events until N content deltas went through, then cut."""
        c.resp_buf += data
        out = bytearray()
        while True:
            end = c.resp_buf.find(b"\n\n")
            if end < 0:
                break
            ev = bytes(c.resp_buf[: end + 2])
            del c.resp_buf[: end + 2]
            is_content = _CONTENT.search(ev) is not None
            if is_content and c.forwarded_deltas >= c.deltas:
                # Cut just before the (N+1)th content delta: headers and the role event
                # may have crossed, no more content will.
                c.cut, c.cut_at = True, time.time()
                rest = ev + bytes(c.resp_buf)
                c.dropped_up += len(rest)
                c.resp_tail = rest[-5:]
                c.resp_buf.clear()
                break
            out += ev
            if is_content:
                c.forwarded_deltas += 1
        return bytes(out)


async def main_async(listen: tuple[str, int], upstream: tuple[str, int],
                     log_file: str | None) -> None:
    proxy = Proxy(upstream, log_file)
    server = await asyncio.start_server(proxy.handle, *listen)
    port = server.sockets[0].getsockname()[1]
    print(json.dumps({"partition_proxy": f"{listen[0]}:{port}",
                      "upstream": f"{upstream[0]}:{upstream[1]}"}), file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


def _hp(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if host not in ("127.0.0.1", "::1", "localhost") and not host.startswith("127."):
        raise SystemExit(f"only loopback addresses are allowed, got {host}")
    return host, int(port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="partition_proxy")
    ap.add_argument("--listen", required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--log-file")
    a = ap.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main_async(_hp(a.listen), _hp(a.upstream), a.log_file))


if __name__ == "__main__":
    main()
