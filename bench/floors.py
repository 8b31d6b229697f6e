"""Message-path floors side by side: plain Envoy vs null processors on different gRPC stacks.

    .venv/bin/python -m bench.floors            # full: 3 repeats, 5,000 open streams, ~12 min
    .venv/bin/python -m bench.floors --quick    # 1 repeat, short windows, 1,000 streams, ~2 min
    .venv/bin/python -m bench.floors --floors grpcaio,grpclib --repeats 2

Every floor answers the same ext_proc messages with no logic (bench/nullproc.py's pattern:
the guard echoes every body message as FULL_DUPLEX_STREAMED, the gate answers its first body
message and leaves), behind the identical rendered Envoy config; only the gRPC server under
it differs (see FLOORS). Per repeat, each side in turn on fresh stacks, with bench/measure.py's
own figure code (measure_figure: idle wait, crash and disturbance re-measurement, CPU
accounting): delivered chunks/s at saturation (ratio to plain Envoy in the same repeat) and
per-chunk delivery latency at 5,000 chunks/s offered (added p50 / p99 over plain). Then, per
floor, the memory of one open guard stream: the null processor is driven directly over
ext_proc (bench/streams.py's guard messages: headers, body, response headers, two body
messages) with N streams held open; KiB = (RSS at N - RSS before) / N, and the slope from
N/2 to N. Last, per floor and repeat, its server CPU per ext_proc message with no Envoy in
the path: 32 guard streams driven directly, each writing its body messages back to back
(as Envoy does in FULL_DUPLEX_STREAMED), server utime+stime / messages; a CPU figure, so the
least disturbed by other load on the machine (`--micro` prints only this).
Prints a table and writes bench/results/floors.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from bench import measure, report
from bench.nullproc import NullStack
from bench.nullproc_grpclib import GrpclibNullStack
from bench.streams import MESSAGES, Held, rss_kib, warm_up
from devkit.devstack import Stack
from extproc.core.headers import ROLE_METADATA
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc


@dataclass(frozen=True)
class Floor:
    name: str
    what: str
    base: type[NullStack]
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def stack_class(self, kind: str) -> type[Stack]:
        attrs = {"processor_flags": self.flags}
        if kind == "ts":
            return type(f"Ts{self.base.__name__}", (self.base, measure.TsStack), attrs)
        return type(self.base.__name__, (self.base,), attrs)


# Each is one null processor. DEFAULT_FLOORS are measured by default; the other grpc.aio
# variants are the screened options that measured to make no difference (--floors).
FLOORS: dict[str, Floor] = {f.name: f for f in (
    Floor("grpcaio", "grpc.aio as bench/run.py's floor (bench/nullproc.py)", NullStack),
    # Tuned: of everything screened (the three below, measured with --micro and on the
    # Envoy figures: docs/benchmarks.md), only coalescing moved grpc.aio's cost per message.
    Floor("grpcaio-tuned", "grpc.aio, guard body messages already waiting answered as one "
          "(coalescing); no server option measured to matter", NullStack, ("--coalesce",)),
    Floor("grpcaio-throughput", "grpc.aio, grpc.optimization_target=throughput", NullStack,
          ("--option", "grpc.optimization_target=throughput")),
    Floor("grpcaio-poll", "grpc.aio, GRPC_POLL_STRATEGY=poll", NullStack,
          env=(("GRPC_POLL_STRATEGY", "poll"),)),
    Floor("grpcaio-nocompress", "grpc.aio, compression off explicitly, 1 MiB write buffer",
          NullStack, ("--option", "grpc.default_compression_algorithm=0",
                      "--option", "grpc.http2.write_buffer_size=1048576")),
    Floor("grpclib", "grpclib 0.4 over h2, uvloop (bench/nullproc_grpclib.py)",
          GrpclibNullStack),
    Floor("grpclib-coalesce", "grpclib, guard body messages already waiting answered as one",
          GrpclibNullStack, ("--coalesce",)),
)}
DEFAULT_FLOORS = ("grpcaio", "grpcaio-tuned", "grpclib", "grpclib-coalesce")


def _start_stack(kind: str, side: str, workdir: Path,
                 config: dict[str, Any] | None = None) -> Stack:
    """bench.measure.start_stack, knowing the floors too (installed in its place by `main`:
    bench.measure.measure_figure starts every stack through that module-level name)."""
    f = FLOORS.get(side)
    if f is None:
        return _MEASURE_START_STACK(kind, side, workdir, config)
    cls = f.stack_class(kind)
    return cls(workdir=workdir, config=config or {}, replicas=2,
               processor_env=dict(f.env) or None).start()


_MEASURE_START_STACK = measure.start_stack


# --- memory per open stream -----------------------------------------------------------------


async def _hold(addr: str, pid: int, n: int, log: Any) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)
        await warm_up(stub, 1.0, tolerate_errors=True)
        base = rss_kib(pid)
        release = asyncio.Event()
        held: list[Held] = []
        tasks = []
        rss: dict[int, int] = {}
        deadline = time.monotonic() + 120.0
        for target in (n // 2, n):
            while len(held) < target and time.monotonic() < deadline:
                batch = [Held(stub, release) for _ in range(min(250, target - len(held)))]
                held += batch
                tasks += [asyncio.ensure_future(h.run()) for h in batch]
                await asyncio.gather(*(h.opened.wait() for h in batch))
            await asyncio.sleep(1.0)
            rss[target] = rss_kib(pid)
        ok = sum(1 for h in held if h.ok)
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    log(f"    {ok}/{n} streams open: {(rss[n] - base) / max(1, ok):.2f} KiB/stream")
    return {"streams": n, "open_ok": ok, "baseline_rss_kib": base, "rss_half_kib": rss[n // 2],
            "rss_kib": rss[n], "kib_per_stream": (rss[n] - base) / max(1, ok),
            "kib_per_stream_marginal": (rss[n] - rss[n // 2]) / max(1, n - n // 2)}


def memory(floor: Floor, n: int, work: Path, log: Any) -> dict[str, Any]:
    stack = floor.stack_class("demo")(workdir=work / f"memory-{floor.name}", replicas=1,
                                      processor_env=dict(floor.env) or None).start()
    try:
        pid = stack.procs["processor"].pid
        assert pid is not None
        out: dict[str, Any] = measure.run_loop(_hold(stack.processor_addr, pid, n, log))
        out["processor_alive"] = stack.procs["processor"].alive()
    finally:
        stack.stop()
    return out


# --- server CPU per message, without Envoy ----------------------------------------------------


async def _pipelined(addr: str, pid: int, streams: int, k: int) -> dict[str, Any]:
    """`streams` guard streams at once; each sends the guard's first messages, then `k` body
    messages written back to back (FULL_DUPLEX_STREAMED: Envoy does not wait for answers),
    reading answers until the body's last byte came back. Server CPU over that phase."""
    chunk = MESSAGES[-1].response_body.body
    last = ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=True))
    body = ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=False))
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = ep_grpc.ExternalProcessorStub(ch)

        async def one(n: int) -> int:
            call = stub.Process(metadata=((ROLE_METADATA, "guard"),))
            for m in MESSAGES[:3]:
                await call.write(m)
                await call.read()

            async def writer() -> None:
                for i in range(n):
                    await call.write(last if i == n - 1 else body)

            w = asyncio.ensure_future(writer())
            got, answers = 0, 0
            while got < n * len(chunk):
                r = await call.read()
                if r is grpc.aio.EOF:
                    break
                answers += 1
                got += len(r.response_body.response.body_mutation.streamed_response.body)
            await w
            call.cancel()
            return answers

        await asyncio.gather(*(one(50) for _ in range(streams)))  # warm-up
        t0, c0 = time.perf_counter(), measure.proc_cpu_s(pid)
        answers = await asyncio.gather(*(one(k) for _ in range(streams)))
        dt, dc = time.perf_counter() - t0, measure.proc_cpu_s(pid) - c0
    n = streams * (k + 3)
    return {"streams": streams, "body_msgs_each": k, "msgs": n, "wall_s": dt,
            "server_cpu_us_per_msg": dc / n * 1e6, "server_cores": dc / dt,
            "answers_per_body_msg": sum(answers) / (streams * k)}


def micro(floor: Floor, work: Path, streams: int = 32, k: int = 2000) -> dict[str, Any]:
    stack = floor.stack_class("demo")(workdir=work / f"micro-{floor.name}", replicas=1,
                                      processor_env=dict(floor.env) or None).start()
    try:
        pid = stack.procs["processor"].pid
        assert pid is not None
        out: dict[str, Any] = measure.run_loop(_pipelined(stack.processor_addr, pid, streams, k))
    finally:
        stack.stop()
    return out


# --- the run --------------------------------------------------------------------------------


FIGS = ("saturation", "latency@5000")


def summarize(runs: list[dict[str, Any]], sides: list[str]) -> dict[str, dict[str, Any]]:
    by: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in sides}
    for r in runs:
        by[r["side"]][r["repeat"]] = r
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        reps = sorted(set(by["plain"]) & set(by[side]))

        def vals(fig: str, path: tuple[str, ...], op: str, side: str = side,
                 reps: list[int] = reps) -> list[float] | None:
            xs = []
            for rep in reps:
                b = report._get(by[side][rep], fig, path)
                a = report._get(by["plain"][rep], fig, path)
                if b is not None and op == "abs":
                    xs.append(b)
                elif b is not None and a:
                    xs.append(b / a if op == "ratio" else b - a)
            return report.mmm(xs)

        out[side] = {
            "chunks_per_s": vals("saturation", ("chunks_per_s",), "abs"),
            "sat_ratio": vals("saturation", ("chunks_per_s",), "ratio"),
            "proc_us_per_chunk": vals("saturation", ("cpu_us_per_chunk", "processor"), "abs"),
            "p50_added_ms": vals("latency@5000", ("p50_ms",), "delta"),
            "p99_added_ms": vals("latency@5000", ("p99_ms",), "delta"),
            "p50_ms": vals("latency@5000", ("p50_ms",), "abs"),
            "p99_ms": vals("latency@5000", ("p99_ms",), "abs"),
            "proc_cores_5000": vals("latency@5000", ("cpu_cores", "processor"), "abs"),
            # cores used by processes outside the benchmark, worst window of the side
            "other_cores": max((report._get(by[side][rep], f, ("cpu_cores", "unaccounted")) or 0.0
                                for rep in by[side] for f in FIGS), default=0.0),
            "errors": {k: sum(int(by[side][rep][f][k]) for rep in by[side] for f in FIGS)
                       for k in (*measure.ERROR_KEYS, "crashes")},
        }
    return out


def cell(v: list[float] | None, spec: str) -> str:
    """median [min..max] over repeats; one value when they agree (or one repeat)."""
    if v is None:
        return "n/a"
    lo, med, hi = (format(x, spec) for x in v)
    return med if lo == hi else f"{med} [{lo}..{hi}]"


def render(meta: dict[str, Any], p: measure.Params, sides: list[str], summ: dict[str, Any],
           mem: dict[str, Any], mic: dict[str, list[dict[str, Any]]],
           runs: list[dict[str, Any]]) -> str:
    w = (20, 24, 25, 25, 15, 17, 18)
    heads = ("side", "saturation vs plain", "added p50 ms @5000/s", "added p99 ms @5000/s",
             "KiB/stream avg", "KiB/stream N/2..N", "proc us/chunk sat.")
    lines = [
        f"message-path floors  {meta['date_utc']}",
        f"machine: {meta['nproc']} CPUs, {meta['cpu_model']}, kernel {meta['kernel']}; "
        f"Envoy {meta['envoy']}; Python {meta['python']}; extproc sources sha256 "
        f"{meta['code_sha256_start']}; load average at start "
        + " ".join(f"{x:.2f}" for x in meta["loadavg_at_start"]),
        f"repeats={p.repeats}; saturation: C={p.sat_clients} x {p.sat_tokens} tokens, "
        f"{p.sat_duration_s:g} s window; latency: {p.lat_streams} streams x {p.lat_tokens} "
        f"tokens @ 4 ms/token (offered 5000 chunks/s), {p.lat_duration_s:g} s window",
        "cells: median [min..max] over repeats; ratios and deltas are paired with plain per "
        "repeat; memory: one run, N open guard streams driven directly; other load: the most "
        "cores used by processes outside the benchmark in any of the side's windows",
        "",
        " ".join(f"{h:<{n}}" for h, n in zip(heads, w, strict=True))
        + " server us/msg direct  other load",
        "-" * (sum(w) + len(w) + 33),
    ]
    for side in sides:
        s = summ[side]
        if side == "plain":
            cols = ["plain Envoy", cell(s["chunks_per_s"], ".0f") + " chunks/s",
                    "p50 " + cell(s["p50_ms"], ".3f"), "p99 " + cell(s["p99_ms"], ".3f"),
                    "-", "-", "-", "-"]
            cols[-1] = f"{cols[-1]:<21} {s['other_cores']:.2f}"
        else:
            m = mem.get(side)
            us = [x["server_cpu_us_per_msg"] for x in mic.get(side, [])]
            cols = [side, "x " + cell(s["sat_ratio"], ".3f"), cell(s["p50_added_ms"], "+.3f"),
                    cell(s["p99_added_ms"], "+.3f"),
                    f"{m['kib_per_stream']:.2f}" if m else "n/a",
                    f"{m['kib_per_stream_marginal']:.2f}" if m else "n/a",
                    cell(s["proc_us_per_chunk"], ".1f"),
                    f"{cell(report.mmm(us), '.1f'):<21} {s['other_cores']:.2f}"]
        lines.append(" ".join(f"{c:<{n}}" for c, n in zip(cols, (*w, 0), strict=True))
                     .rstrip())
    lines.append("")
    for side in sides:
        if side in FLOORS:
            lines.append(f"  {side}: {FLOORS[side].what}")
        elif side == "ours":
            lines.append("  ours: Envoy + our processor + etcd (bench/run.py's 'ours')")
    lines.append("")
    for side in sides:
        e = summ[side]["errors"]
        lines.append(f"errors {side:<18}: requests={e['requests']} ok={e['ok']} "
                     f"non_200={e['non_200']} transport={e['transport_errors']} "
                     f"error_events={e['error_events']} incomplete={e['incomplete']} "
                     f"stack_crashes={e['crashes']}")
    for side, m in mem.items():
        if m["open_ok"] < m["streams"] or not m["processor_alive"]:
            lines.append(f"  memory {side}: only {m['open_ok']}/{m['streams']} streams opened"
                         + ("" if m["processor_alive"] else "; the processor died"))
    for r in runs:
        for fig in FIGS:
            f = r[fig]
            if f["idle_check"]["busy_before"] > p.idle_threshold:
                lines.append(f"  repeat {r['repeat']} {r['side']} {fig}: machine still "
                             f"{f['idle_check']['busy_before']:.0%} busy with other load")
            if any(a["disturbed"] for a in f["attempts"]):
                lines.append(f"  repeat {r['repeat']} {r['side']} {fig}: other processes used "
                             f"> {p.other_load_limit:g} cores during an attempt")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows, 1,000 "
                    "streams (~2 min)")
    ap.add_argument("--floors", default=",".join(DEFAULT_FLOORS),
                    help="comma-separated, of: " + ", ".join(FLOORS))
    ap.add_argument("--ours", action="store_true",
                    help="also measure ours (Envoy + our processor + etcd) on the same figures")
    ap.add_argument("--repeats", type=int, help="default 3 (1 with --quick)")
    ap.add_argument("--streams", type=int, help="open streams for the memory figure "
                    "(default 5000; 1000 with --quick)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--micro", action="store_true",
                    help="only each floor's server CPU per ext_proc message, driven directly "
                    "(no Envoy in the path; robust to other load), then exit")
    ap.add_argument("--no-micro", action="store_true",
                    help="skip the server-CPU-per-message figure in the full table")
    ap.add_argument("--out", default=str(measure.RESULTS / "floors.json"))
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.floors.split(",") if n.strip()]
    bad = [n for n in names if n not in FLOORS]
    if bad:
        ap.error(f"--floors: unknown {', '.join(bad)} (known: {', '.join(FLOORS)})")
    p = measure.QUICK if a.quick else measure.Params()
    p = dataclasses.replace(p, lat_delays_ms=(4.0,),
                            repeats=max(1, min(a.repeats or p.repeats, 10)))
    n_streams = max(10, min(a.streams or (1000 if a.quick else 5000), 10_000))
    sides = ["plain", *(["ours"] if a.ours else []), *names]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    meta = measure.machine_info()
    work = measure.RESULTS / "work-floors"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if a.micro:
        for rep in range(p.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                m = micro(FLOORS[name], work)
                print(f"{rep + 1} {name:<20} {m['server_cpu_us_per_msg']:6.1f} us server CPU "
                      f"per message, {m['msgs'] / m['wall_s']:7.0f} msgs/s, "
                      f"{m['server_cores']:.2f} cores, "
                      f"{m['answers_per_body_msg']:.2f} answers per body message", flush=True)
        return 0
    started = time.monotonic()
    measure.DEADLINE[0] = started + p.budget_s * max(1, len(sides) // 3)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, measure._terminate)
    measure.start_stack = _start_stack
    runs: list[dict[str, Any]] = []
    mem: dict[str, Any] = {}
    mic: dict[str, list[dict[str, Any]]] = {}
    try:
        for rep in range(p.repeats):
            order = sides if rep % 2 == 0 else sides[::-1]
            log(f"repeat {rep + 1}/{p.repeats} ({', '.join(order)})")
            for side in order:
                r: dict[str, Any] = {"side": side, "repeat": rep + 1}
                for fig in FIGS:
                    r[fig] = measure.measure_figure(fig, side, p, work / f"rep{rep + 1}", log)
                runs.append(r)
        if not a.no_memory:
            for name in names:
                log(f"  memory: {name}, {n_streams} open streams ...")
                mem[name] = memory(FLOORS[name], n_streams, work, log)
        for rep in range(0 if a.no_micro else p.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                log(f"  server CPU per message, driven directly: {name} ...")
                mic.setdefault(name, []).append(
                    micro(FLOORS[name], work, k=500 if a.quick else 2000))
    finally:
        measure.start_stack = _MEASURE_START_STACK
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    summ = summarize(runs, sides)
    table = render(meta, p, sides, summ, mem, mic, runs)
    print(table)
    print(f"\n(total {meta['elapsed_s']} s; logs in {work}; json in {a.out})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "params": p.__dict__, "sides": sides,
                               "summary": summ, "memory": mem, "micro": mic, "runs": runs,
                               "table": table},
                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
