"""Where a request's time to first delta goes, step by step (decision 0021).

`python -m bench.timeline` (`make bench-timeline`, ~30 s) starts the bench's "ours" stack
with the processor run under this module, which timestamps (wall clock, ns) every ext_proc
message a session reads and every answer it writes, and both etcd transactions before the
first byte (the intake and the fence), from outside the package: the processor's code is the
shipped one. It drives sequential 8-token requests, as the bench's TTFD figure does, matches
each request's steps to the client's send and first-content times, and prints the median and
mean of every step. Timestamping costs a few microseconds per message, so the total is a
little above `make bench`'s TTFD.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.client import Conn, build_request
from devkit.devstack import Stack

HOST = "127.0.0.1"
G, T = "GuardSession", "GateSession"
Row = tuple[int, str, int, "str | None", str, str]


# --- inside the processor ---------------------------------------------------------------


def serve(config: str, out: str) -> int:
    """Run the processor with its session reads and writes and its two etcd transactions
    before the first byte timestamped into `out` (flushed every 1,000 rows and on SIGUSR1)."""
    from extproc import cli
    from extproc.adapters import etcd_store, session

    buf: list[tuple[Any, ...]] = []

    def rec(*f: Any) -> None:
        buf.append((time.time_ns(), *f))
        if len(buf) >= 1000:
            flush()

    def flush(*_: Any) -> None:
        with open(out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in buf)
        buf.clear()

    signal.signal(signal.SIGUSR1, flush)
    Session = session.Session
    real_write, real_run = Session.write, Session.run

    async def write(self: Any, resp: Any) -> None:
        rec(type(self).__name__, id(self), self.rid, "out", resp.WhichOneof("response"))
        await real_write(self, resp)

    class Timed:
        """The session's stream, its reads timestamped."""

        def __init__(self, ctx: Any, s: Any) -> None:
            self._ctx, self._s = ctx, s

        def __getattr__(self, name: str) -> Any:
            return getattr(self._ctx, name)

        async def read(self) -> Any:
            msg = await self._ctx.read()
            if hasattr(msg, "WhichOneof"):
                s = self._s
                rec(type(s).__name__, id(s), s.rid, "in", msg.WhichOneof("request"))
            return msg

        async def write(self, resp: Any) -> None:
            await self._ctx.write(resp)

    async def run(self: Any) -> None:
        self.ctx = Timed(self.ctx, self)
        await real_run(self)

    def timed(cls: Any, name: str, label: str) -> None:
        real = getattr(cls, name)

        async def call(self: Any, rid: str, *a: Any, **kw: Any) -> Any:
            rec("etcd", 0, rid, "txn0", label)
            try:
                return await real(self, rid, *a, **kw)
            finally:
                rec("etcd", 0, rid, "txn1", label)
        setattr(cls, name, call)

    Session.write = write  # type: ignore[method-assign]
    Session.run = run  # type: ignore[method-assign]
    timed(etcd_store.EtcdStore, "open_request", "intake")
    timed(etcd_store.EtcdStore, "fence_first_delta", "fence")
    return cli.main(["serve", "--config", config])


class TimelineStack(Stack):
    out: str = ""

    def processor_argv(self, config_path: Path) -> list[str]:
        return [sys.executable, "-m", "bench.timeline", "--serve", str(config_path),
                "--out", self.out]


# --- the driver -----------------------------------------------------------------------------


STEPS = [
    ("client sends", None),
    ("guard reads request headers", (G, "in", "request_headers")),
    ("guard answers them", (G, "out", "request_headers")),
    ("guard reads the body", (G, "in", "request_body")),
    ("intake transaction starts", ("etcd", "txn0", "intake")),
    ("guard answers the body", (G, "out", "request_body")),
    ("intake transaction ends", ("etcd", "txn1", "intake")),
    ("gate reads attempt 1's request headers", (T, "in", "request_headers")),
    ("gate answers them (goes upstream)", (T, "out", "request_headers")),
    ("gate reads the response headers", (T, "in", "response_headers")),
    ("gate reads the first body", (T, "in", "response_body")),
    ("fence transaction starts", ("etcd", "txn0", "fence")),
    ("fence transaction ends", ("etcd", "txn1", "fence")),
    ("gate releases the headers", (T, "out", "response_headers")),
    ("guard reads the response headers", (G, "in", "response_headers")),
    ("guard reads the first body", (G, "in", "response_body")),
    ("guard answers it", (G, "out", "response_body")),
    ("client reads the first content", None),
]


def by_request(rows: list[list[Any]]) -> dict[str, list[tuple[int, str, str, str]]]:
    """Rows grouped by request id; a session's rows before it knew its id join it later."""
    by: dict[str, list[tuple[int, str, str, str]]] = collections.defaultdict(list)
    pending: dict[int, list[tuple[int, str, str, str]]] = collections.defaultdict(list)
    for t, role, sid, rid, what, which in rows:
        ev = (t, role, what, which)
        if rid is None:
            pending[sid].append(ev)
            continue
        by[rid].extend(pending.pop(sid, []))
        by[rid].append(ev)
    return by


def analyze(rows: list[list[Any]], client: list[tuple[int, int]]) -> dict[str, list[float]]:
    by = by_request(rows)
    starts = sorted((min(e[0] for e in evs), rid) for rid, evs in by.items())
    steps: dict[str, list[float]] = collections.defaultdict(list)
    for sent, first in client:
        i = bisect.bisect_left(starts, (sent, ""))
        if i >= len(starts) or starts[i][0] - sent > 5_000_000:
            continue
        evs = sorted(by[starts[i][1]])
        times: list[int | None] = []
        for name, key in STEPS:
            if key is None:
                times.append(sent if name == "client sends" else first)
                continue
            times.append(next((e[0] for e in evs if (e[1], e[2], e[3]) == key), None))
        if any(x is None for x in times):
            continue
        t0 = times[0]
        assert t0 is not None
        for (name, _), t in zip(STEPS, times, strict=True):
            assert t is not None
            steps[name].append((t - t0) / 1e6)
    return steps


async def drive(port: int, warmup: int, n: int, max_s: float) -> list[tuple[int, int]]:
    req = build_request(HOST, port, 8, None)
    conn = Conn(HOST, port)
    out: list[tuple[int, int]] = []
    deadline = time.monotonic() + max_s
    try:
        for i in range(warmup + n):
            if time.monotonic() > deadline:
                break
            o = await conn.request(req, timeout_s=10.0)
            if i >= warmup and o.status == 200 and o.first_content_ns:
                out.append((o.t_sent_ns, o.first_content_ns))
    finally:
        await conn.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-s", type=float, default=30.0)
    a = ap.parse_args(argv)
    if a.serve:
        return serve(a.serve, a.out)
    work = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    stack = TimelineStack(workdir=work, config={}, replicas=2)
    stack.out = str(work / "timeline.jsonl")
    stack.start()
    try:
        client = asyncio.run(drive(stack.envoy_port, 30, a.requests, a.max_s))
        proc = stack.procs["processor"]
        proc.signal(signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        stack.stop()
    rows = [json.loads(line) for line in Path(stack.out).read_text().splitlines()]
    steps = analyze(rows, client)
    n = len(steps.get("client sends", []))
    print(f"time to first delta, step by step: {n} of {len(client)} sequential 8-token "
          f"requests matched (ms since the client sent; median, then the median step)")
    prev = 0.0
    for name, _ in STEPS:
        xs = steps.get(name)
        if not xs:
            continue
        med = statistics.median(xs)
        print(f"  {med:7.3f}  +{max(0.0, med - prev):6.3f}  {name}")
        prev = med
    print(f"(rows in {stack.out})")
    return 0 if n else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
