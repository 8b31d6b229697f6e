"""A cheap, correct HTTP/1.1 streaming client for the benchmarks (raw asyncio streams).

The load generator shares the two cores with Envoy, the replicas and the processor, so it
avoids a general HTTP library: one keep-alive connection per client, a minimal response-head
parser, an incremental chunked-transfer decoder, and an SSE splitter that only looks at the
bytes it must. Correctness rules (the brief's): events are split on b"\\n\\n"; an event is a
content event iff it starts with b"data: {" and contains b'"delta":{"content":"' followed by a
non-empty value; b'data: {"error"' is an in-band error event; b"data: [DONE]" ends a stream.
Every request must end with a 200, [DONE], no error event and exactly the expected number of
content events, or it is counted (never dropped) in one of the error buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

CONTENT_PAT = b'"delta":{"content":"'
_CLEN = len(CONTENT_PAT)
_QUOTE = 0x22
TS_PREFIX = b'data: {"ts":'
_TSLEN = len(TS_PREFIX)
TS_FIELD = b'"ts":'
READ_SIZE = 1 << 16


def build_request(host: str, port: int, max_tokens: int, token_delay_ms: float | None,
                  prompt: str = "benchmark prompt") -> bytes:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": prompt}]},
                      separators=(",", ":")).encode()
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}",
            "Content-Type: application/json", "Accept: text/event-stream",
            f"Content-Length: {len(body)}"]
    if token_delay_ms is not None:
        head.append(f"x-replica-token-delay-ms: {token_delay_ms:g}")
    # No Idempotency-Key: the processor assigns a random request id to each request.
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@dataclass
class Outcome:
    """What one request produced, as the client saw it."""

    status: int = 0
    content: int = 0  # content events received (all of them, in or out of a window)
    counted: int = 0  # content events received inside the measurement window
    done: bool = False
    error_events: int = 0
    transport_error: str | None = None
    t_sent_ns: int = 0
    first_content_ns: int = 0
    latencies_ns: list[int] = field(default_factory=list)


@dataclass
class Tally:
    """Aggregate over many requests; every request lands in exactly one bucket."""

    requests: int = 0
    ok: int = 0
    non_200: int = 0
    transport_errors: int = 0
    error_events: int = 0  # requests whose stream carried an in-band error event
    incomplete: int = 0  # 200, no error event, but not exactly max_tokens contents + [DONE]
    counted_chunks: int = 0
    content_events: int = 0  # all content events received, in or out of the window
    statuses: dict[int, int] = field(default_factory=dict)
    transport_samples: list[str] = field(default_factory=list)

    def add(self, o: Outcome, expected_content: int) -> None:
        self.requests += 1
        self.counted_chunks += o.counted
        self.content_events += o.content
        if o.transport_error is not None:
            self.transport_errors += 1
            if len(self.transport_samples) < 5:
                self.transport_samples.append(o.transport_error)
        elif o.status != 200:
            self.non_200 += 1
            self.statuses[o.status] = self.statuses.get(o.status, 0) + 1
        elif o.error_events:
            self.error_events += 1
        elif not o.done or o.content != expected_content:
            self.incomplete += 1
        else:
            self.ok += 1

    def errors(self) -> int:
        return self.non_200 + self.transport_errors + self.error_events + self.incomplete

    def as_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "ok": self.ok, "non_200": self.non_200,
                "content_events": self.content_events,
                "non_200_statuses": {str(k): v for k, v in self.statuses.items()},
                "transport_errors": self.transport_errors, "error_events": self.error_events,
                "incomplete": self.incomplete, "transport_samples": self.transport_samples}


class Conn:
    """One keep-alive HTTP/1.1 connection; reopened after any error or Connection: close."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.buf = bytearray()

    async def close(self) -> None:
        w, self.reader, self.writer = self.writer, None, None
        self.buf.clear()
        if w is not None:
            w.close()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(w.wait_closed(), 1.0)

    async def _read(self) -> bytes:
        assert self.reader is not None
        data = await self.reader.read(READ_SIZE)
        if not data:
            raise ConnectionError("connection closed by peer mid-response")
        return data

    async def request(self, req: bytes, window: tuple[int, int] | None = None,
                      want_ts: bool = False, timeout_s: float = 30.0) -> Outcome:
        o = Outcome()
        try:
            await asyncio.wait_for(self._request(req, o, window, want_ts), timeout_s)
        except (OSError, ConnectionError, TimeoutError, ValueError, IndexError) as e:
            o.transport_error = f"{type(e).__name__}: {e}"[:200]
            await self.close()
        return o

    async def _request(self, req: bytes, o: Outcome, window: tuple[int, int] | None,
                       want_ts: bool) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.buf.clear()
        o.t_sent_ns = time.time_ns()
        self.writer.write(req)
        buf = self.buf
        while (idx := buf.find(b"\r\n\r\n")) < 0:
            buf += await self._read()
        head = bytes(buf[:idx]).lower()
        del buf[:idx + 4]
        o.status = int(head[9:12])
        close = b"\r\nconnection: close" in head
        chunked = b"\r\ntransfer-encoding: chunked" in head
        clen = -1
        k = head.find(b"\r\ncontent-length:")
        if k >= 0:
            end = head.find(b"\r\n", k + 2)
            clen = int(head[k + 17:end if end >= 0 else len(head)].strip())
        body = bytearray()
        now = time.time_ns()
        if chunked:
            while True:
                done = _dechunk(buf, body)
                if body:
                    self._events(body, o, now, window, want_ts)
                if done:
                    break
                buf += await self._read()
                now = time.time_ns()
        elif clen >= 0:
            while len(buf) < clen:
                buf += await self._read()
                now = time.time_ns()
            body += buf[:clen]
            del buf[:clen]
            self._events(body, o, now, window, want_ts)
        else:  # body delimited by connection close
            close = True
            while True:
                data = await self.reader.read(READ_SIZE) if self.reader else b""
                if not data:
                    break
                buf += data
            body += buf
            buf.clear()
            self._events(body, o, time.time_ns(), window, want_ts)
        if body.strip() and o.status == 200:
            self._events(body + b"\n\n", o, now, window, want_ts)  # unterminated last event
        if close:
            await self.close()

    @staticmethod
    def _events(body: bytearray, o: Outcome, now: int, window: tuple[int, int] | None,
                want_ts: bool) -> None:
        start = 0
        in_window = window is None or window[0] <= now < window[1]
        while (j := body.find(b"\n\n", start)) >= 0:
            if body.startswith(b"data: {", start):
                k = body.find(CONTENT_PAT, start, j)
                if k >= 0:
                    if body[k + _CLEN] != _QUOTE:
                        o.content += 1
                        if in_window:
                            o.counted += 1
                        if not o.first_content_ns:
                            o.first_content_ns = now
                        elif want_ts and body.startswith(TS_PREFIX, start):
                            # The first content event is excluded: the gate holds it (and the
                            # role event) for the fence; that cost is the TTFD figure's.
                            e = body.find(b",", start + _TSLEN, j)
                            o.latencies_ns.append(now - int(body[start + _TSLEN:e]))
                        elif want_ts and (t := body.find(TS_FIELD, start, j)) >= 0:
                            # A gateway that re-encodes each event (LiteLLM, bench/peers.py)
                            # moves "ts" to the end of the object.
                            t += len(TS_FIELD)
                            e = t
                            while e < j and 48 <= body[e] <= 57:
                                e += 1
                            o.latencies_ns.append(now - int(body[t:e]))
                elif body.startswith(b'data: {"error"', start):
                    o.error_events += 1
            elif body.startswith(b"data: [DONE]", start):
                o.done = True
            start = j + 2
        if start:
            del body[:start]


def _dechunk(buf: bytearray, out: bytearray) -> bool:
    """Move complete chunks from `buf` to `out`; True once the terminal chunk is consumed."""
    pos = 0
    try:
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                return False
            size = int(bytes(buf[pos:nl]).split(b";", 1)[0], 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", nl)  # "0\r\n" [trailers] "\r\n"
                if end < 0:
                    return False
                pos = end + 4
                return True
            start = nl + 2
            if len(buf) < start + size + 2:
                return False
            out += buf[start:start + size]
            pos = start + size + 2
    finally:
        if pos:
            del buf[:pos]
