"""Per delivered chunk, in the processor under the paced load: GC, CPU stretches, calls.

    PYTHONPATH=TREE python bench/gcstats.py [--delay-ms 4] [--seconds 20]
        [--garbage-seconds 5] [--calls-seconds 3] [--out FILE.json]

Figures that do not depend on how busy the machine is, to compare two trees of the
processor (the per-chunk p99 of bench.run is wall-clock and moves with other load). It
starts the benchmark's "ours" stack with the timestamping upstreams (TREE's own bench
code, so a tree from before bench/measure.py works too), runs this file as the processor's
wrapper (`--probe`: it installs the counters, then runs `python -m extproc` unchanged),
drives the paced per-chunk latency load and reads, over the measured window:
  - garbage collections per generation: count, and main-thread CPU time of each (gc.callbacks);
  - the loop's longest CPU stretches: a 1 ms ticker on the loop notes the main thread's CPU
    time between two ticks (what one turn of the loop ran without yielding, GC included);
  - net memory blocks, tracked objects by type made since start-up, loop timer handles
    (`loop._scheduled`; None on uvloop, the processor's loop);
  - with --garbage-seconds, another window ended by a full collection that keeps what it
    found (gc.DEBUG_SAVEALL): reference-cycle garbage per request, by type;
  - with --calls-seconds, a last window under sys.setprofile: Python and C calls per guard
    body message (slows the processor: its call counts are per message, not its timings).
The load's own p50/p99 and the processor's CPU per chunk are printed too (wall-clock, noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
GENS = (0, 1, 2)
TICK_S = 0.001

# --- the probe, inside the processor ----------------------------------------------------


class _Probe:
    """Counters the processor keeps; SIGUSR1 appends a snapshot, SIGUSR2 toggles the call
    counts, SIGURG counts the cyclic garbage since the SIGURG before."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.gc_n = [0, 0, 0]
        self.gc_cpu_ns = [0, 0, 0]
        self.gc_max_ns = [0, 0, 0]
        self.gc_cpu_all: list[list[int]] = [[], [], []]
        self._gc_t0 = 0
        self.stretches: list[int] = []  # thread CPU ns between two ticks (since snapshot)
        self._last_cpu = 0
        self.calls: collections.Counter[str] | None = None

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.thread_time_ns()
            return
        g = int(info["generation"])
        d = time.thread_time_ns() - self._gc_t0
        self.gc_n[g] += 1
        self.gc_cpu_ns[g] += d
        self.gc_max_ns[g] = max(self.gc_max_ns[g], d)
        if len(self.gc_cpu_all[g]) < 100_000:
            self.gc_cpu_all[g].append(d)

    def tick(self) -> None:
        now = time.thread_time_ns()
        if self._last_cpu and len(self.stretches) < 2_000_000:
            self.stretches.append(now - self._last_cpu)
        self._last_cpu = now
        asyncio.get_running_loop().call_later(TICK_S, self.tick)

    def garbage(self, *_: Any) -> None:
        """SIGURG: collect everything once, keeping what was cyclic garbage, and count it by
        type (the first call only clears; each later one counts since the one before)."""
        import gc

        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.set_debug(0)
        found = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        gc.garbage.clear()
        with self.out.open("a") as f:
            f.write(json.dumps({"garbage": dict(found), "mono": time.monotonic(),
                                "only": "garbage"}) + "\n")

    def snapshot(self, *_: Any) -> None:
        loop = asyncio._get_running_loop()
        scheduled = getattr(loop, "_scheduled", None)
        import gc

        rec = {"mono": time.monotonic(), "cpu": time.process_time(),
               "thread_cpu": time.thread_time(), "blocks": sys.getallocatedblocks(),
               "gc_n": list(self.gc_n), "gc_cpu_ns": list(self.gc_cpu_ns),
               "gc_max_ns": list(self.gc_max_ns), "gc_cpu_all": self.gc_cpu_all,
               "gc_threshold": list(gc.get_threshold()), "gc_count": list(gc.get_count()),
               "gc_frozen": gc.get_freeze_count(),
               "scheduled": len(scheduled) if scheduled is not None else None,
               "tasks": len(asyncio.all_tasks(loop)) if loop is not None else None,
               "stretches": self.stretches,
               # Tracked objects made since start-up (gc.freeze() put those away), by type.
               "census": dict(collections.Counter(
                   type(o).__qualname__ for o in gc.get_objects()).most_common(80))}
        self.gc_max_ns = [0, 0, 0]
        self.gc_cpu_all = [[], [], []]
        self.stretches = []
        with self.out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self._last_cpu = time.thread_time_ns()  # the snapshot's own time is no stretch

    def toggle_calls(self, *_: Any) -> None:
        if self.calls is None:
            self.calls = collections.Counter()
            calls = self.calls

            def prof(frame: Any, event: str, arg: Any) -> None:
                if event == "call":
                    co = frame.f_code
                    calls[f"{Path(co.co_filename).name}:{co.co_name}"] += 1
                elif event == "c_call":
                    calls["C:" + getattr(arg, "__qualname__", "?")] += 1

            sys.setprofile(prof)
            return
        sys.setprofile(None)
        with self.out.open("a") as f:
            f.write(json.dumps({"calls": dict(self.calls)}) + "\n")
        self.calls = None


def probe_main(out: Path, argv: list[str]) -> None:
    """Run `python -m extproc ARGV` with the probe installed."""
    import gc
    import runpy

    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:
        sys.path.pop(0)  # bench/ itself must not shadow top-level modules
    probe = _Probe(out)
    gc.callbacks.append(probe.on_gc)
    signal.signal(signal.SIGUSR1, probe.snapshot)
    signal.signal(signal.SIGUSR2, probe.toggle_calls)
    signal.signal(signal.SIGURG, probe.garbage)
    orig_run = asyncio.run

    def run(main: Any, **kw: Any) -> Any:
        """The ticker starts on the processor's own loop (asyncio's or uvloop's)."""
        async def with_ticker() -> Any:
            asyncio.get_running_loop().call_soon(probe.tick)
            return await main
        return orig_run(with_ticker(), **kw)

    asyncio.run = run
    sys.argv = ["extproc", *argv]
    runpy.run_module("extproc", run_name="__main__", alter_sys=True)


# --- the guard's per-chunk path alone, in this process ----------------------------------


class _Tel:
    enabled = False  # nothing per chunk unless metrics are exported (the bench's config)


class _Clock:
    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def wall() -> float:
        return time.time()


class _Timers:
    def start(self, seconds: float, fire: Any) -> Any:
        return asyncio.get_running_loop().call_later(seconds, fire)


class _Proc:
    """What a GuardSession reads on its per-chunk path (either tree), nothing more."""

    def __init__(self) -> None:
        from extproc.core.config import Config

        self.cfg = Config()
        self.tel = _Tel()
        self.clock = _Clock()
        self.timers = _Timers()

    def spawn(self, coro: Any, name: str) -> Any:
        return asyncio.ensure_future(coro)


class _Ctx:
    async def write(self, msg: Any) -> None:
        return None


def hotpath(chunks: int) -> dict[str, Any]:
    """CPU and calls per chunk of GuardSession.on_message(response_body) on a streaming
    response already past its first delta (the lock taken as Session.run takes it), with
    the trace budget of the default config: loop-free work, no sockets, no Envoy."""
    import gc

    from extproc.adapters.guard import GuardSession
    from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    try:
        from extproc.core.events import ResponseHeaders
        from extproc.core.guard import GuardMachine
    except ImportError:  # before each role's rows had their own file (decision 0032)
        from extproc.core.machine import GuardMachine, ResponseHeaders  # type: ignore
    event = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
             b'"delta":{"content":"tok"},"finish_reason":null}]}\n\n')
    msg = ep.ProcessingRequest(response_body=ep.HttpBody(body=event, end_of_stream=False))

    async def run() -> dict[str, Any]:
        s = GuardSession(_Proc(), _Ctx())  # type: ignore[arg-type]
        m = GuardMachine.new("req_0123456789abcdefghjkmnpqrs", 15.0)
        m.trace_budget = s.cfg.telemetry.max_trace_bytes
        m.handle(ResponseHeaders(status=200, content_type="text/event-stream"))
        s.m, s.rid, s.first_delta_evented = m, m.request_id, True
        lock = s.lock

        async def feed(n: int) -> None:
            for _ in range(n):
                async with lock:
                    await s.on_message(msg)

        await feed(1000)  # warm: past the trace budget, timers started
        gc.collect()
        gc.disable()
        c0, t0, b0 = gc.get_count()[0], time.process_time(), sys.getallocatedblocks()
        await feed(chunks)
        t1, c1, b1 = time.process_time(), gc.get_count()[0], sys.getallocatedblocks()
        gc.enable()
        calls: collections.Counter[str] = collections.Counter()

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                calls["py"] += 1
                co = frame.f_code
                calls[f"{Path(co.co_filename).name}:{co.co_name}"] += 1
            elif event == "c_call":
                calls["C"] += 1
                calls["C:" + getattr(arg, "__qualname__", "?")] += 1

        sys.setprofile(prof)
        await feed(1000)
        sys.setprofile(None)
        return {"chunks": chunks, "cpu_us_per_chunk": round(1e6 * (t1 - t0) / chunks, 3),
                "gc_tracked_net_per_chunk": round((c1 - c0) / chunks, 3),
                "blocks_net_per_chunk": round((b1 - b0) / chunks, 3),
                "py_calls_per_chunk": calls["py"] / 1000, "c_calls_per_chunk": calls["C"] / 1000,
                "delivered": m.delivered, "trace_events": len(m.trace),
                "calls_per_chunk": {k: v / 1000 for k, v in calls.most_common()
                                    if k not in ("py", "C")}}

    try:
        import uvloop

        return uvloop.run(run())
    except ImportError:
        return asyncio.run(run())


# --- the driver, in the benchmark's process ---------------------------------------------


def _pct(xs: list[int], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q / 100 * len(s)))])


def _window(a: dict[str, Any], b: dict[str, Any], chunks: int) -> dict[str, Any]:
    """Figures between two snapshots, per 10k delivered chunks where a count."""
    per = 10_000 / max(1, chunks)
    st: list[int] = b["stretches"]
    out: dict[str, Any] = {"chunks": chunks, "seconds": round(b["mono"] - a["mono"], 2),
                           "cpu_us_per_chunk": round(1e6 * (b["cpu"] - a["cpu"]) / max(1, chunks),
                                                     2),
                           "main_thread_cpu_us_per_chunk": round(
                               1e6 * (b["thread_cpu"] - a["thread_cpu"]) / max(1, chunks), 2),
                           "blocks_delta": b["blocks"] - a["blocks"],
                           "scheduled_handles": b["scheduled"], "tasks": b["tasks"],
                           "gc_threshold": b["gc_threshold"]}
    for g in GENS:
        n = b["gc_n"][g] - a["gc_n"][g]
        cpu = (b["gc_cpu_ns"][g] - a["gc_cpu_ns"][g]) / 1e6
        each: list[int] = b["gc_cpu_all"][g]
        out[f"gen{g}"] = {"per_10k_chunks": round(n * per, 2),
                          "cpu_ms_per_10k": round(cpu * per, 3),
                          "p50_ms": round(_pct(each, 50) / 1e6, 3),
                          "max_ms": round(b["gc_max_ns"][g] / 1e6, 3), "n": n}
    ms = [x / 1e6 for x in st]
    out["stretch_ms"] = {"n": len(st), "p50": round(_pct(st, 50) / 1e6, 3),
                         "p99": round(_pct(st, 99) / 1e6, 3),
                         "p99.9": round(_pct(st, 99.9) / 1e6, 3),
                         "max": round(max(ms), 3) if ms else None,
                         "over_1ms_per_10k": round(sum(1 for x in ms if x > 1) * per, 1),
                         "over_2ms_per_10k": round(sum(1 for x in ms if x > 2) * per, 1),
                         "over_5ms_per_10k": round(sum(1 for x in ms if x > 5) * per, 1)}
    return out


def _snapshots(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def drive(delay_ms: float, seconds: float, calls_seconds: float, garbage_seconds: float,
          work: Path) -> dict[str, Any]:
    try:  # the tree's own bench code: bench.measure now, bench.run before it was split
        import bench.measure as bm
    except ImportError:
        import bench.run as bm  # type: ignore[no-redef]
    out = work / "probe.jsonl"
    out.unlink(missing_ok=True)

    class ProbeStack(bm.TsStack):
        def processor_argv(self, config_path: Path) -> list[str]:
            return [sys.executable, str(HERE), "--probe", str(out), "--", "serve", "--config",
                    str(config_path)]

    p = bm.Params(repeats=1, lat_warmup_s=1.0, lat_duration_s=seconds)
    stack = ProbeStack(workdir=work, config={}, replicas=2, plain=False).start()
    res: dict[str, Any] = {"tree": str(Path(bm.__file__).resolve().parent.parent),
                           "delay_ms": delay_ms}
    try:
        pid = stack.procs["processor"].pid
        assert pid is not None

        async def window(sig: int, p: Any) -> Any:
            task = asyncio.ensure_future(bm.latency(stack, p, delay_ms))
            await asyncio.sleep(p.lat_warmup_s)
            os.kill(pid, sig)
            await asyncio.sleep(p.lat_duration_s)
            os.kill(pid, sig)
            return await task

        r = bm.run_loop(window(signal.SIGUSR1, p))
        time.sleep(0.3)
        snaps = [s for s in _snapshots(out) if "gc_n" in s]
        chunks = round(r["achieved_chunks_per_s"] * p.lat_duration_s)
        res["load"] = {k: r[k] for k in ("achieved_chunks_per_s", "p50_ms", "p99_ms", "max_ms",
                                         "requests", "ok")}
        res["load"]["processor_us_per_chunk"] = round(
            1e6 * r["cpu_cores"]["processor"] / max(1.0, r["achieved_chunks_per_s"]), 2)
        res["load"]["machine_busy_frac"] = round(r["cpu_cores"]["machine_busy_frac"], 3)
        if len(snaps) >= 2:
            res["window"] = _window(snaps[-2], snaps[-1], chunks)
        if garbage_seconds > 0:
            pg = bm.Params(repeats=1, lat_warmup_s=0.5, lat_duration_s=garbage_seconds)
            rg = bm.run_loop(window(signal.SIGURG, pg))
            time.sleep(0.3)
            g = [s for s in _snapshots(out) if "garbage" in s]
            if g:
                # Requests in the window: its chunks over the tokens of one request.
                reqs = max(1, round(rg["achieved_chunks_per_s"] * garbage_seconds
                                    / pg.lat_tokens))
                res["cyclic_garbage_per_request"] = {
                    "requests": reqs, "total": round(sum(g[-1]["garbage"].values()) / reqs, 1),
                    "by_type": {k: round(v / reqs, 2) for k, v in collections.Counter(
                        g[-1]["garbage"]).most_common(40)}}
        if calls_seconds > 0:
            pc = bm.Params(repeats=1, lat_warmup_s=0.5, lat_duration_s=calls_seconds)
            bm.run_loop(window(signal.SIGUSR2, pc))
            time.sleep(0.3)
            calls = [s["calls"] for s in _snapshots(out) if "calls" in s]
            if calls:
                c = calls[-1]
                bodies = sum(v for k, v in c.items() if k.endswith(":_guard_body"))
                res["calls"] = {"guard_bodies": bodies,
                                "py_calls_per_body": round(sum(
                                    v for k, v in c.items() if not k.startswith("C:"))
                                    / max(1, bodies), 1),
                                "c_calls_per_body": round(sum(
                                    v for k, v in c.items() if k.startswith("C:"))
                                    / max(1, bodies), 1),
                                "per_body": {k: round(v / max(1, bodies), 3) for k, v in
                                             collections.Counter(c).most_common()}}
    finally:
        stack.stop()
    return res


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--probe"]:
        rest = args[3:] if args[2:3] == ["--"] else args[2:]
        probe_main(Path(args[1]), rest)
        return 0
    if sys.path and Path(sys.path[0]).resolve() == HERE.parent:
        sys.path.pop(0)
    ap = argparse.ArgumentParser(prog="python bench/gcstats.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-ms", type=float, default=4.0, help="4: 5,000 chunks/s; 10: 2,000")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--calls-seconds", type=float, default=0.0)
    ap.add_argument("--garbage-seconds", type=float, default=0.0)
    ap.add_argument("--hotpath", type=int, default=0, metavar="CHUNKS",
                    help="only the guard's per-chunk path, in this process (no stack)")
    ap.add_argument("--work", default="/tmp/gcstats-work")
    ap.add_argument("--out", default="")
    a = ap.parse_args(args)
    if a.hotpath:
        print(json.dumps(hotpath(max(1000, min(a.hotpath, 10_000_000)))))
        return 0
    res = drive(a.delay_ms, max(1.0, min(a.seconds, 60.0)), max(0.0, min(a.calls_seconds, 30.0)),
                max(0.0, min(a.garbage_seconds, 30.0)),
                Path(a.work))
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
