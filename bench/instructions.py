"""Instructions per chunk: our processor's Python against the null processor's, counted.

    .venv/bin/python -m bench.instructions                  # both sides under callgrind
    .venv/bin/python -m bench.instructions --requests 20 --chunks 50
    .venv/bin/python -m bench.instructions --profile        # cProfile of our chunk phase
    .venv/bin/python -m bench.instructions --profile-start  # ... of our request starts
    make bench-instructions

Wall-clock figures on a shared machine are noise; instruction counts are not. This plays
Envoy's ext_proc messages for N requests of M chunks each through the processor's servicer
(`server.ExternalProcessor`: the real guard and gate sessions, journal_store's transactions
on the in-memory KV) and, as the floor, through the null processor (bench/nullproc.py), on
the same event loop (uvloop) and the same stand-in for grpc.aio's stream: each message is
parsed from its wire bytes and each answer serialized, as grpc.aio's (de)serializers do.

Each side runs in its own `valgrind --tool=callgrind` process, instrumentation off through
start-up and warm-up; a tiny C helper (bench/.instructions-marker.so, built with gcc from
valgrind's callgrind.h, a no-op outside valgrind) dumps the counts at the phase boundaries:

  start   request headers .. the first delta delivered by the guard (time to first delta's
          path: guard headers and body, the gate's headers, fence and hand-off, the guard's
          response headers and first chunk), per request
  chunk   every later chunk through the guard, per chunk
  end     the last chunk with end_of_stream, the stream's close and its outcome, per request

Both sides run with the collector as `server.serve` sets it (start-up objects frozen,
young ones collected every 20,000 allocations). `--part` counts one function inclusively
(a coroutine function while it runs, not while it waits).

What is not counted on either side: gRPC's C core and HTTP/2 (the same messages cross it
on both sides; `make bench` measures them), etcd's client (aetcd) and etcd itself.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PHASES = ("start", "chunk", "end")
GC_THRESHOLDS = (20_000, 50, 50)  # what server.serve sets once started
REPLICA = "127.0.0.1:8001"
# A stuck side fails the run instead of hanging it (per step; the whole play: 5 times
# this); generous: callgrind runs ~50x slower than the processor.
BOUND_S = 120.0
PROMPT_TOKENS = 4  # what the guard counts for CHAT's prompt (x-gateway-prompt-tokens)
DONE = b"data: [DONE]\n\n"
CHAT = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 1 << 20,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()

_MARKER_C = r"""
#include <valgrind/callgrind.h>
void ic_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void ic_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void ic_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""
MARKER_SO = (Path(__file__).resolve().parent /
             f".instructions-marker-{hashlib.sha256(_MARKER_C.encode()).hexdigest()[:8]}.so")


# --- the pure parts (tests/unit/test_bench_instructions.py) -------------------------------


def event(n: int, usage: bool, role: bool = False) -> bytes:
    """Token `n`'s event as the demo replica writes it (vLLM 0.32's chat chunk), with the
    running usage when the request asked for it (our guard does; the floor forwards the
    client's body unchanged, so its replica sends none)."""
    delta: dict[str, Any] = ({"role": "assistant", "content": "tok"} if role
                             else {"content": "tok"})
    chunk: dict[str, Any] = {"id": "chatcmpl-0123456789abcdef", "object":
                             "chat.completion.chunk", "created": 0, "model": "demo-model",
                             "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": None}]}
    if usage:
        chunk["usage"] = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + n,
                          "completion_tokens": n, "completion_tokens_details": None}
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()



@dataclass(frozen=True)
class Counts:
    """One side's instructions per phase, already divided by its units."""

    start: float  # per request
    chunk: float  # per chunk
    end: float  # per request


def per_unit(totals: dict[str, int], requests: int, chunks: int) -> Counts:
    """Phase totals (as dumped) -> per request start, per chunk, per request end."""
    missing = [p for p in PHASES if p not in totals]
    if missing:
        raise ValueError(f"no count for phase(s) {missing}")
    if requests <= 0 or chunks <= 0:
        raise ValueError("requests and chunks must be positive")
    return Counts(totals["start"] / requests, totals["chunk"] / (requests * chunks),
                  totals["end"] / requests)


_TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.M)
_TRIGGER = re.compile(r"^desc: Trigger: Client Request: (\S+)", re.M)


def read_dump(text: str) -> tuple[str | None, int]:
    """A callgrind dump -> (the label its client request gave, its instruction total)."""
    trig = _TRIGGER.search(text)
    tot = _TOTALS.search(text)
    if tot is None:
        raise ValueError("not a callgrind dump: no summary/totals line")
    return (trig.group(1) if trig else None), int(tot.group(1))


def phase_totals(dumps: list[str]) -> dict[str, int]:
    """Sum the dumps by label (a phase may be dumped more than once); unlabelled dumps
    (the final one at exit) are left out."""
    out: dict[str, int] = {}
    for text in dumps:
        label, n = read_dump(text)
        if label in PHASES:
            out[label] = out.get(label, 0) + n
    return out


def table(ours: Counts, floor: Counts, compiled: Counts | None = None) -> str:
    """The figures as docs/benchmarks.md shows them."""
    head = ["| per | ours | floor | ours / floor |" + (" compiled | compiled / floor |"
                                                      if compiled else ""),
            "|---|---|---|---|" + ("---|---|" if compiled else "")]
    rows = []
    for name, label in (("chunk", "chunk"), ("start", "request start (to first delta)"),
                        ("end", "request end")):
        o, f = getattr(ours, name), getattr(floor, name)
        row = f"| {label} | {o:,.0f} | {f:,.0f} | x{o / f:.2f} |"
        if compiled:
            c = getattr(compiled, name)
            row += f" {c:,.0f} | x{c / f:.2f} |"
        rows.append(row)
    return "\n".join(head + rows)


# --- the driver -----------------------------------------------------------------------------


def _marker() -> tuple[Callable[[], None], Callable[[str], None], Callable[[], None]]:
    """(start counting, dump the counts under a label, toggle collection): callgrind's
    client requests, no-ops outside valgrind."""
    if not MARKER_SO.exists():
        return (lambda: None), (lambda _label: None), (lambda: None)
    lib = ctypes.CDLL(str(MARKER_SO))
    lib.ic_dump.argtypes = [ctypes.c_char_p]
    return lib.ic_start, (lambda label: lib.ic_dump(label.encode())), lib.ic_toggle


def calibrate() -> None:
    """Called once per chunk by the driver: `--part bench.instructions:calibrate` counts
    what wrapping a function costs by itself (subtracted from every part)."""


def build_marker() -> None:
    """Compile the marker helper (gcc, valgrind's callgrind.h), once."""
    if MARKER_SO.exists():
        return
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "marker.c"
        src.write_text(_MARKER_C)
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(MARKER_SO), str(src)],
                       check=True)


class Stream:
    """grpc.aio's servicer context as the sessions use it: requests parsed from their wire
    bytes, answers serialized, the role in the invocation metadata."""

    def __init__(self, role: str) -> None:
        from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

        self._parse = ep.ProcessingRequest.FromString
        from extproc.core.headers import ROLE_METADATA

        self._md = ((ROLE_METADATA, role),) if role != "guard" else ()
        self._inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.out: list[bytes] = []
        self._grew = asyncio.Event()
        self._task: asyncio.Future[Any] | None = None

    async def read(self) -> Any:
        import grpc

        raw = await self._inbox.get()
        return grpc.aio.EOF if raw is None else self._parse(raw)

    async def write(self, resp: Any) -> None:
        self.out.append(resp.SerializeToString())
        self._grew.set()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._md

    def send(self, raw: bytes | None) -> None:
        self._inbox.put_nowait(raw)

    def watch(self, task: asyncio.Future[Any]) -> None:
        """`task` (this stream's handler) ending wakes a waiting `answers`."""
        self._task = task
        task.add_done_callback(lambda _t: self._grew.set())

    async def answers(self, n: int) -> list[bytes]:
        """Until `n` answers in all; a handler that ended first fails the run with its
        error. No timer per answer (it would be counted on both sides): `play` is bounded
        as a whole."""
        task = self._task
        while len(self.out) < n:
            if task is not None and task.done():
                err = None if task.cancelled() else task.exception()
                raise RuntimeError(f"the stream ended after {len(self.out)} answers of {n}"
                                   ) from err
            self._grew.clear()
            await self._grew.wait()
        return self.out


class Messages:
    """Envoy's messages for one request, as wire bytes."""

    def __init__(self) -> None:
        from extproc.gen.envoy.config.core.v3 import base_pb2 as core
        from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

        self.ep, self.core = ep, core
        self._bodies: dict[tuple[str, bytes, bool], bytes] = {}
        self.chunks: list[bytes] = []  # token n's body message at [n]

    def build_chunks(self, last: int, usage: bool) -> None:
        """Tokens 1..last as body messages, built before counting: Envoy's work."""
        self.chunks = [b""] + [self.body("response_body", event(n, usage, role=n == 1), False)
                               for n in range(1, last + 1)]

    def headers(self, which: str, h: dict[str, str], attrs: dict[str, str] | None = None
                ) -> bytes:
        from google.protobuf import struct_pb2

        ep, core = self.ep, self.core
        hm = core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode())
                                     for k, v in h.items()])
        m = ep.ProcessingRequest(**{which: ep.HttpHeaders(headers=hm)})
        if attrs:
            st = struct_pb2.Struct()
            st.update(attrs)
            m.attributes["envoy.filters.http.ext_proc"].CopyFrom(st)
        return bytes(m.SerializeToString())

    def body(self, which: str, b: bytes, eos: bool) -> bytes:
        """Built once per kind: Envoy's work is not the processor's."""
        key = (which, b, eos)
        if (raw := self._bodies.get(key)) is not None:
            return raw
        ep = self.ep
        msg = ep.ProcessingRequest(**{which: ep.HttpBody(body=b, end_of_stream=eos)})
        raw = self._bodies[key] = bytes(msg.SerializeToString())
        return raw

    def set_headers(self, raw: bytes, which: str) -> dict[str, str]:
        r = self.ep.ProcessingResponse.FromString(raw)
        mut = getattr(r, which).response.header_mutation
        return {h.header.key: h.header.raw_value.decode() for h in mut.set_headers}


class Request:
    """One request's two streams (guard, then its first attempt's gate), played in order."""

    def __init__(self, serve: Callable[[Stream], Any], msgs: Messages, n: int) -> None:
        self.serve, self.msgs, self.n = serve, msgs, n
        self.token = 1  # the next chunk's token number (its running usage)
        self.guard = Stream("guard")
        self.task = asyncio.ensure_future(serve(self.guard))
        self.guard.watch(self.task)
        self.sent = 0  # guard answers expected so far

    async def _guard(self, raw: bytes | None) -> list[bytes]:
        self.guard.send(raw)
        self.sent += 1
        return await self.guard.answers(self.sent)

    async def start(self) -> None:
        """To the first delta delivered by the guard."""
        from extproc.core import headers as H

        m = self.msgs
        down = {":method": "POST", ":path": "/v1/chat/completions",
                "content-type": "application/json", "x-request-id": f"envoy-{self.n}"}
        rid = m.set_headers((await self._guard(m.headers("request_headers", down)))[-1],
                            "request_headers").get(H.REQUEST_ID, f"r{self.n}")
        sent = m.set_headers((await self._guard(m.body("request_body", CHAT, True)))[-1],
                             "request_body")
        gate = Stream("gate")
        gate_task = asyncio.ensure_future(self.serve(gate))
        gate.watch(gate_task)
        gh = {H.REQUEST_ID: rid, H.ENVOY_ATTEMPT_COUNT: "1", **sent}
        gate.send(m.headers("request_headers", gh, {"upstream.address": REPLICA}))
        await gate.answers(1)
        gate.send(m.headers("response_headers",
                            {":status": "200", "content-type": "text/event-stream"}))
        gate.send(m.chunks[1])
        out = await gate.answers(3)
        await asyncio.wait_for(gate_task, BOUND_S)  # both leave the stream after one body
        handoff = m.set_headers(out[1], "response_headers")
        await self._guard(m.headers("response_headers", {
            ":status": "200", "content-type": "text/event-stream", **handoff}))
        await self._guard(m.chunks[1])

    async def chunk(self) -> None:
        calibrate()
        self.token += 1
        await self._guard(self.msgs.chunks[self.token])

    def check(self, chunks: int) -> None:
        """Every answer came, the last one the stream's end passed on: a side that
        refused or cut the stream would be counted for work it did not do."""
        out = self.guard.out
        last = self.msgs.ep.ProcessingResponse.FromString(out[-1]) if out else None
        if len(out) != 5 + chunks or last is None or \
                not last.response_body.response.body_mutation.streamed_response.end_of_stream:
            raise RuntimeError(f"request {self.n}: {len(out)} answers, the last {last}")

    async def end(self) -> None:
        await self._guard(self.msgs.body("response_body", DONE, True))
        self.guard.send(None)
        await asyncio.wait_for(self.task, BOUND_S)


def _quiet_logging() -> None:
    """The processor's own logging set-up (one JSON line per event), written to /dev/null."""
    from extproc.adapters import logs

    saved, sys.stderr = sys.stderr, open(os.devnull, "w")  # noqa: SIM115 (kept for the run)
    try:
        logs.setup("INFO")
    finally:
        sys.stderr = saved


def _server(side: str) -> tuple[Callable[[Stream], Any], Callable[[], Any]]:
    """(serve one stream, drain) for `side`."""
    if side == "floor":
        from bench.nullproc import NullProcessor

        null = NullProcessor()

        async def nothing() -> None:
            return None
        return (lambda s: null.Process(None, s)), nothing
    from extproc.adapters.memory_store import MemoryLedger, MemoryStore
    from extproc.adapters.processor import Processor
    from extproc.adapters.server import ExternalProcessor
    from extproc.core.config import load_config

    # No checkpoint falls due while counting: callgrind runs ~50x slower, so a 2 s interval
    # would fire many times more per chunk than at the real rate and make the count depend
    # on the machine's load. The chunk path is the same (the timer is still moved).
    cfg = load_config({"timeouts": {"access_log_wait_s": 0.01,
                                    "progress_interval_s": 3600.0}})
    store = MemoryStore(cfg.etcd, owner="gw-1/bench")
    p = Processor(cfg, store, MemoryLedger(store, cfg.tools.ledger_ttl_s))
    servicer = ExternalProcessor(p)
    # The request iterator is unused: the sessions read through the context, as in production.
    return (lambda s: servicer.Process(None, s)), p.drain  # type: ignore[arg-type]


async def play(side: str, requests: int, chunks: int, warmup: int,
               mark: Callable[[str], None], begin: Callable[[], None],
               profile: Any = None, profiled: str = "chunk") -> None:
    """Warm up, then N requests: all started, M chunks each round-robin, all ended; `mark`
    after each phase, `profile` (a cProfile.Profile) enabled over the `profiled` phase.

    The collector is set as `server.serve` sets it once started, on both sides: start-up
    objects frozen out of every collection, young objects collected every 20,000
    allocations (the interpreter's default, 700, would count collections the processor
    does not make)."""
    saved = gc.get_threshold()
    _quiet_logging()
    serve, drain = _server(side)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        await _play(serve, drain, side, requests, chunks, warmup, mark, begin,
                    {ph: profile if profiled == ph else None for ph in PHASES})
    finally:  # as it was (a test plays in its own process)
        gc.unfreeze()
        gc.set_threshold(*saved)


async def _play(serve: Callable[[Stream], Any], drain: Callable[[], Any], side: str,
                requests: int, chunks: int, warmup: int, mark: Callable[[str], None],
                begin: Callable[[], None], prof: dict[str, Any]) -> None:
    msgs, usage = Messages(), side == "ours"
    msgs.build_chunks(chunks + 1, usage)
    for i in range(warmup):
        r = Request(serve, msgs, -1 - i)
        await r.start()
        for _ in range(chunks):
            await r.chunk()
        await r.end()
    await drain()
    begin()
    reqs = [Request(serve, msgs, i) for i in range(requests)]
    if prof["start"] is not None:
        prof["start"].enable()
    for r in reqs:
        await r.start()
    if prof["start"] is not None:
        prof["start"].disable()
    mark("start")
    if prof["chunk"] is not None:
        prof["chunk"].enable()
    for _ in range(chunks):
        for r in reqs:
            await r.chunk()
    if prof["chunk"] is not None:
        prof["chunk"].disable()
    mark("chunk")
    if prof["end"] is not None:
        prof["end"].enable()
    for r in reqs:
        await r.end()
    await drain()
    if prof["end"] is not None:
        prof["end"].disable()
    mark("end")
    for r in reqs:
        r.check(chunks)


class _Counted:
    """A coroutine counted only while it runs: collection on around each step of it,
    off while it waits (another task's work is not its own)."""

    def __init__(self, coro: Any, on: Callable[[], None], off: Callable[[], None]) -> None:
        self.coro, self.on, self.off = coro, on, off

    def __await__(self) -> Any:
        coro, on, off = self.coro, self.on, self.off
        val: Any = None
        exc: BaseException | None = None
        while True:
            on()
            try:
                out = coro.send(val) if exc is None else coro.throw(exc)
            except StopIteration as e:
                return e.value
            finally:
                off()
            try:
                val, exc = (yield out), None
            except BaseException as e:  # thrown into the coroutine: passed on to it
                val, exc = None, e


def wrap_part(target: str, toggle: Callable[[], None]) -> None:
    """Count only inside `target` ('module:Class.method' or 'module:function'): collection
    is toggled on at its entry and off at its return (nested and recursive calls counted
    once); a coroutine function is counted while it runs, not while it waits. What holds
    the function itself (a dict of handlers built at import) still calls the original."""
    import importlib

    mod_name, _, qual = target.partition(":")
    owner: Any = importlib.import_module(mod_name)
    *path, name = qual.split(".")
    for p in path:
        owner = getattr(owner, p)
    fn = getattr(owner, name)
    depth = [0]

    def on() -> None:
        if depth[0] == 0:
            toggle()
        depth[0] += 1

    def off() -> None:
        depth[0] -= 1
        if depth[0] == 0:
            toggle()

    if asyncio.iscoroutinefunction(fn):
        async def counted_async(*args: Any, **kw: Any) -> Any:
            return await _Counted(fn(*args, **kw), on, off)
        setattr(owner, name, counted_async)
        return

    def counted(*args: Any, **kw: Any) -> Any:
        on()
        try:
            return fn(*args, **kw)
        finally:
            off()
    setattr(owner, name, counted)


def _loop_run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def measure(side: str, requests: int, chunks: int, warmup: int, out_dir: Path,
            part: str | None = None) -> Counts:
    """One side under callgrind -> its instructions per unit (with `part`: only inside
    that function, see wrap_part)."""
    vg = shutil.which("valgrind")
    if vg is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    build_marker()
    for f in out_dir.glob(f"callgrind.{side}.*"):
        f.unlink()
    argv = [vg, "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
            *(("--collect-atstart=no",) if part else ()),
            "--compress-strings=no", "--compress-pos=no",
            f"--callgrind-out-file={out_dir}/callgrind.{side}.%p",
            # Imported, not run as __main__: --part names this module's functions.
            sys.executable, "-c", "import sys; from bench.instructions import main; "
            "sys.exit(main(sys.argv[1:]))", "--play", side,
            "--requests", str(requests), "--chunks", str(chunks), "--warmup", str(warmup),
            *(("--part", part) if part else ())]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(argv, check=False, cwd=root, env=env, timeout=900,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{side} under callgrind failed ({res.returncode}):\n"
                         + "\n".join(res.stderr.splitlines()[-25:]))
    dumps = [f.read_text() for f in sorted(out_dir.glob(f"callgrind.{side}.*"))]
    return per_unit(phase_totals(dumps), requests, chunks)


def short(fn: str) -> str:
    """'(12.3%)  /long/path/file.c:func [/long/lib.so]' -> '(12.3%)  func  file.c  lib.so'."""
    m = re.match(r"(\(\s*[\d.]+%\))\s+(?:(.*?):)?([^:\s]+)(?:\s+\[(.*)\])?$", fn)
    if not m:
        return fn
    share, file, func, lib = m.groups()
    return "  ".join(x for x in (share, func, Path(file or "").name,
                                 Path(lib or "").name) if x)


def top_functions(out_dir: Path, side: str, phase: str, units: int, n: int) -> str:
    """callgrind_annotate's top functions (self) of one phase's dump, per unit."""
    ann = shutil.which("callgrind_annotate")
    for f in sorted(out_dir.glob(f"callgrind.{side}.*")):
        label, _ = read_dump(f.read_text())
        if label == phase and ann:
            res = subprocess.run([ann, "--threshold=100", str(f)], capture_output=True,
                                 text=True, check=False)
            lines = [ln for ln in res.stdout.splitlines() if re.match(r"^\s*[\d,]+ \(", ln)]
            out = []
            for ln in lines[1:n + 1]:
                count, _, rest = ln.strip().partition(" ")
                out.append(f"  {int(count.replace(',', '')) / units:>10,.0f}  {short(rest)}")
            return "\n".join(out)
    return "  (no dump)"


def profile_phase(requests: int, chunks: int, warmup: int, top: int,
                  phase: str = "chunk") -> str:
    """cProfile over one of our phases: where its Python goes (share of the phase's
    time by own time, and by inclusive time), calls per unit (chunk or request)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    _loop_run(play("ours", requests, chunks, warmup, lambda _l: None, lambda: None, prof,
                   phase))
    st = pstats.Stats(prof)
    units = requests * chunks if phase == "chunk" else requests
    rows = list(st.stats.items())  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    out = [f"cProfile, our {phase} phase ({units} {phase}s): own-time share, calls per "
           f"{phase}"]
    for key, idx, head in ((2, "own", "by own time"), (3, "inclusive", "by inclusive time")):
        out.append(f" {head} ({idx}):")
        for (file, line, fn), v in sorted(rows, key=lambda kv: -kv[1][key])[:top]:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
            out.append(f"  {100 * v[key] / total:5.1f}%  {v[1] / units:6.2f}  {fn}  ({where})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=50, help="chunks per request after the first")
    ap.add_argument("--warmup", type=int, default=3, help="requests before counting")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--sides", default="ours,floor")
    ap.add_argument("--profile", action="store_true", help="cProfile our chunk phase (no valgrind)")
    ap.add_argument("--profile-start", action="store_true",
                    help="cProfile our request start phase (no valgrind)")
    ap.add_argument("--profile-end", action="store_true",
                    help="cProfile our request end phase (no valgrind)")
    ap.add_argument("--part", action="append", default=[], metavar="MODULE:QUALNAME",
                    help="count only inside this function of ours (a coroutine: while it "
                    "runs), per chunk and per request start "
                    "(repeatable: one callgrind run each), e.g. "
                    "extproc.core.machine:GuardMachine.handle")
    ap.add_argument("--play", choices=("ours", "floor"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    requests, chunks = max(1, min(a.requests, 1000)), max(1, min(a.chunks, 10000))
    if a.play:
        begin, mark, toggle = _marker()
        for target in a.part:
            wrap_part(target, toggle)
        _loop_run(asyncio.wait_for(play(a.play, requests, chunks, a.warmup, mark, begin),
                                   BOUND_S * 5))
        return 0
    if a.profile or a.profile_start or a.profile_end:
        phase = "start" if a.profile_start else "end" if a.profile_end else "chunk"
        print(profile_phase(requests, chunks, a.warmup, a.top, phase))
        return 0
    from bench.measure import RESULTS

    out_dir = RESULTS / "instructions"
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.part:
        base = measure("ours", requests, chunks, a.warmup, out_dir,
                       part="bench.instructions:calibrate").chunk
        print(f"inclusive; per chunk less the wrapper's own {base:,.0f} (per request start: "
              "with the wrapper's, once per call):")
        for target in a.part:
            c = measure("ours", requests, chunks, a.warmup, out_dir, part=target)
            print(f"  per chunk {c.chunk - base:>10,.0f}  per start {c.start:>10,.0f}  {target}")
        return 0
    counts = {side: measure(side, requests, chunks, a.warmup, out_dir)
              for side in a.sides.split(",")}
    compiled = compiled_core()
    print(f"instructions (callgrind Ir), {requests} requests x {chunks} chunks, "
          f"core {'compiled (mypyc)' if compiled else 'pure Python'}")
    if "ours" in counts and "floor" in counts:
        print(table(counts["ours"], counts["floor"]))
    else:
        for side, c in counts.items():
            print(f"{side}: start {c.start:,.0f} chunk {c.chunk:,.0f} end {c.end:,.0f}")
    for side in counts:
        print(f"\ntop functions by self instructions per chunk ({side}):")
        print(top_functions(out_dir, side, "chunk", requests * chunks, a.top))
    return 0


def compiled_core() -> list[str]:
    """The extproc.core modules loaded from mypyc-built extensions (`make compiled`)."""
    import importlib.machinery
    import importlib.util
    import pkgutil

    import extproc.core as core

    out = []
    for mod in pkgutil.iter_modules(core.__path__):
        spec = importlib.util.find_spec(f"extproc.core.{mod.name}")
        if spec and spec.origin and spec.origin.endswith(
                tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            out.append(mod.name)
    return out


if __name__ == "__main__":
    sys.exit(main())
