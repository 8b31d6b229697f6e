"""One-command benchmark: plain Envoy vs Envoy + our processor, on this machine.

    .venv/bin/python -m bench.run            # full: 3 repeats, ~4-5 min
    .venv/bin/python -m bench.run --quick    # smoke: 1 repeat, short windows, ~40 s

Per repeat and per side (plain, then ours; the order alternates between repeats) it starts a
stack, measures, and stops it, so the two sides never share the cores:
  1. a demo-replica stack: added time-to-first-delta (sequential requests), then delivered
     chunks/s at saturation (C concurrent looping streams) with per-process CPU accounting;
  2. a timestamping-upstream stack (bench/tsupstream.py behind the same Envoy config): per-chunk
     delivery latency at a fixed moderate rate.
Prints a table (min/median/max over repeats) and writes bench/results/latest.json.
See docs/benchmarks.md for what each figure means and its error sources.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client import Conn, Outcome, Tally, build_request
from extproc.devstack import Proc, Stack, _bin

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
HOST = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- parameters ------------------------------------------------------------------------


@dataclass(frozen=True)
class Params:
    repeats: int = 3
    # saturation
    sat_clients: int = 32
    sat_tokens: int = 256
    sat_warmup_s: float = 1.0
    sat_duration_s: float = 8.0
    sat_max_requests: int = 20_000
    # per-chunk latency at a fixed rate
    lat_streams: int = 16
    lat_delay_ms: float = 4.0  # 16 streams x 1 chunk / 4 ms = 4000 chunks/s offered
    lat_tokens: int = 128
    lat_warmup_s: float = 1.0
    lat_duration_s: float = 6.0
    lat_max_requests: int = 5_000
    # time to first delta
    ttfd_requests: int = 200
    ttfd_warmup_requests: int = 10
    ttfd_tokens: int = 8
    ttfd_max_s: float = 15.0
    request_timeout_s: float = 30.0


QUICK = Params(repeats=1, sat_warmup_s=0.5, sat_duration_s=3.0, lat_warmup_s=0.5,
               lat_duration_s=3.0, ttfd_requests=60, ttfd_max_s=5.0)


# --- stacks -----------------------------------------------------------------------------


class TsStack(Stack):
    """The same stack (etcd, processor, Envoy config) with timestamping upstreams."""

    def replica_proc(self, i: int, port: int) -> Proc:
        name = f"r{i + 1}"
        argv = [sys.executable, "-m", "bench.tsupstream", "--host", HOST, "--port", str(port),
                "--name", name]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT.parent) + os.pathsep + env.get("PYTHONPATH", "")
        return Proc(name, argv, self.workdir / f"upstream-{name}.log", env=env)


def start_stack(kind: str, plain: bool, workdir: Path) -> Stack:
    cls = TsStack if kind == "ts" else Stack
    return cls(workdir=workdir, config={}, replicas=2, plain=plain).start()


# --- process accounting -------------------------------------------------------------------


def proc_cpu_s(pid: int | None) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone."""
    if pid is None:
        return 0.0
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14, 15 of stat(5)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + parts[4]
    total = sum(parts[:8])
    return total - idle, total


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_snapshot(stack: Stack) -> dict[str, float]:
    snap = {name: proc_cpu_s(p.pid) for name, p in stack.procs.items()}
    snap["client"] = self_cpu_s()
    busy, total = machine_jiffies()
    snap["_busy"], snap["_total"] = float(busy), float(total)
    return snap


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a if not k.startswith("_")}
    out = {"processor": d.get("processor", 0.0), "envoy": d.get("envoy", 0.0),
           "replicas": sum(v for k, v in d.items() if k.startswith("r")),
           "etcd": d.get("etcd", 0.0), "client": d.get("client", 0.0)}
    tot = b["_total"] - a["_total"]
    out["machine_busy_frac"] = (b["_busy"] - a["_busy"]) / tot if tot else 0.0
    return out


def envoy_counters(stack: Stack) -> dict[str, int]:
    """Non-zero Envoy counters that reveal errors/retries (ext_proc, 5xx, resets, retries)."""
    url = f"http://{HOST}:{stack.admin_port}/stats?format=json"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            stats = json.loads(r.read())["stats"]
    except (OSError, ValueError, KeyError):
        return {}
    keep = ("ext_proc", "rq_retry", "rq_5xx", "rq_4xx", "rq_timeout", "cx_destroy_local_with",
            "rq_reset", "rq_pending_overflow", "rx_reset", "tx_reset")
    out: dict[str, int] = {}
    for s in stats:
        name, value = s.get("name"), s.get("value")
        if isinstance(name, str) and isinstance(value, int) and value and any(
                k in name for k in keep):
            out[name] = value
    return out


def log_levels(path: Path) -> dict[str, int]:
    """Count processor log lines by level (JSON lines); non-JSON lines count as 'other'."""
    counts: dict[str, int] = {}
    if not path.exists():
        return counts
    with open(path, "rb") as f:
        for line in f:
            try:
                level = str(json.loads(line).get("level", "other"))
            except ValueError:
                level = "other"
            counts[level] = counts.get(level, 0) + 1
    return counts


# --- measurements ---------------------------------------------------------------------------


class Watch:
    """Runs the load; stops it early (and says so) if Envoy, the processor or etcd dies."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.dead: list[str] = []
        self.died_after_s: float | None = None

    async def run(self, *coros: Any) -> None:
        t0 = time.monotonic()
        work = asyncio.gather(*coros)

        async def watch() -> None:
            while not work.done():  # bounded by the load's own window
                self.dead = [n for n in ("envoy", "processor", "etcd")
                             if n in self.stack.procs and not self.stack.procs[n].alive()]
                if self.dead:
                    self.died_after_s = round(time.monotonic() - t0, 2)
                    return
                await asyncio.sleep(0.1)

        w = asyncio.ensure_future(watch())
        try:
            await work
        finally:
            w.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


async def saturation(stack: Stack, p: Params) -> dict[str, Any]:
    req = build_request(HOST, stack.envoy_port, p.sat_tokens, None)
    tally = Tally()
    t0 = time.time_ns()
    w0 = t0 + int(p.sat_warmup_s * 1e9)
    w1 = w0 + int(p.sat_duration_s * 1e9)
    budget = [p.sat_max_requests]
    snaps: dict[str, dict[str, float]] = {}

    watch = Watch(stack)

    async def client() -> None:
        conn = Conn(HOST, stack.envoy_port)
        try:
            while time.time_ns() < w1 and budget[0] > 0 and not watch.dead:
                budget[0] -= 1
                o = await conn.request(req, window=(w0, w1), timeout_s=p.request_timeout_s)
                tally.add(o, p.sat_tokens)
                if o.transport_error is not None:
                    await asyncio.sleep(0.05)  # never spin on a dead listener
        finally:
            await conn.close()

    async def sampler() -> None:
        await asyncio.sleep(max(0.0, (w0 - time.time_ns()) / 1e9))
        snaps["a"] = cpu_snapshot(stack)
        await asyncio.sleep(max(0.0, (w1 - time.time_ns()) / 1e9))
        snaps["b"] = cpu_snapshot(stack)

    await watch.run(sampler(), *(client() for _ in range(p.sat_clients)))
    if "b" not in snaps:
        snaps["b"] = cpu_snapshot(stack)
    chunks = tally.counted_chunks
    cpu = cpu_delta(snaps["a"], snaps["b"])
    per_chunk_us = {k: (v / chunks * 1e6 if chunks else float("nan"))
                    for k, v in cpu.items() if k != "machine_busy_frac"}
    return {"chunks_per_s": chunks / p.sat_duration_s, "counted_chunks": chunks,
            "window_s": p.sat_duration_s, "budget_exhausted": budget[0] <= 0,
            "died": watch.dead, "died_after_s": watch.died_after_s,
            "cpu_s": cpu, "cpu_us_per_chunk": per_chunk_us, **tally.as_dict()}


async def latency(stack: Stack, p: Params) -> dict[str, Any]:
    req = build_request(HOST, stack.envoy_port, p.lat_tokens, p.lat_delay_ms)
    tally = Tally()
    lats: list[int] = []
    t0 = time.time_ns()
    w0 = t0 + int(p.lat_warmup_s * 1e9)
    w1 = w0 + int(p.lat_duration_s * 1e9)
    budget = [p.lat_max_requests]

    watch = Watch(stack)

    async def client(i: int) -> None:
        # Spread the streams' token ticks evenly over one token period.
        await asyncio.sleep(i * p.lat_delay_ms / 1000.0 / p.lat_streams)
        conn = Conn(HOST, stack.envoy_port)
        try:
            while time.time_ns() < w1 and budget[0] > 0 and not watch.dead:
                budget[0] -= 1
                o = await conn.request(req, window=(w0, w1), want_ts=True,
                                       timeout_s=p.request_timeout_s)
                tally.add(o, p.lat_tokens)
                lats.extend(o.latencies_ns)
                if o.transport_error is not None:
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    await watch.run(*(client(i) for i in range(p.lat_streams)))
    ms = [x / 1e6 for x in lats]
    return {"achieved_chunks_per_s": tally.counted_chunks / p.lat_duration_s,
            "offered_chunks_per_s": p.lat_streams * 1000.0 / p.lat_delay_ms,
            "samples": len(ms), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90),
            "p99_ms": pct(ms, 99), "max_ms": max(ms) if ms else float("nan"),
            "budget_exhausted": budget[0] <= 0, "died": watch.dead,
            "died_after_s": watch.died_after_s, **tally.as_dict()}


async def ttfd(stack: Stack, p: Params) -> dict[str, Any]:
    req = build_request(HOST, stack.envoy_port, p.ttfd_tokens, None)
    tally = Tally()
    samples: list[float] = []
    conn = Conn(HOST, stack.envoy_port)
    deadline = time.monotonic() + p.ttfd_max_s
    dead: list[str] = []
    try:
        for i in range(p.ttfd_warmup_requests + p.ttfd_requests):
            dead = [n for n in ("envoy", "processor", "etcd")
                    if n in stack.procs and not stack.procs[n].alive()]
            if time.monotonic() >= deadline or dead:
                break
            o: Outcome = await conn.request(req, timeout_s=p.request_timeout_s)
            if i < p.ttfd_warmup_requests:
                continue
            tally.add(o, p.ttfd_tokens)
            if o.first_content_ns and o.status == 200:
                samples.append((o.first_content_ns - o.t_sent_ns) / 1e6)
    finally:
        await conn.close()
    return {"samples": len(samples), "p50_ms": pct(samples, 50), "p99_ms": pct(samples, 99),
            "mean_ms": statistics.fmean(samples) if samples else float("nan"),
            "died": dead, "died_after_s": None, **tally.as_dict()}


def run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def check_alive(stack: Stack, where: str) -> list[str]:
    dead = [n for n, pr in stack.procs.items() if not pr.alive()]
    return [f"{where}: {n} died" for n in dead]


def measure_side(side: str, p: Params, work: Path, log: Any) -> dict[str, Any]:
    plain = side == "plain"
    out: dict[str, Any] = {"side": side, "problems": []}
    wd = work / f"{side}-demo"
    stack = start_stack("demo", plain, wd)
    try:
        time.sleep(0.3)
        log(f"  {side}: ttfd ...")
        out["ttfd"] = run_loop(ttfd(stack, p))
        log(f"  {side}: saturation ...")
        out["saturation"] = run_loop(saturation(stack, p))
        out["envoy_counters_demo"] = envoy_counters(stack)
        out["problems"] += check_alive(stack, "demo stack")
    finally:
        stack.stop()
    out["processor_log_levels_demo"] = log_levels(wd / "processor.log")
    wd = work / f"{side}-ts"
    stack = start_stack("ts", plain, wd)
    try:
        time.sleep(0.3)
        log(f"  {side}: per-chunk latency ...")
        out["latency"] = run_loop(latency(stack, p))
        out["envoy_counters_ts"] = envoy_counters(stack)
        out["problems"] += check_alive(stack, "ts stack")
    finally:
        stack.stop()
    out["processor_log_levels_ts"] = log_levels(wd / "processor.log")
    return out


# --- reporting --------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        ev = subprocess.run([_bin("envoy"), "--version"], capture_output=True, text=True,
                            timeout=10).stdout.strip()
        envoy = ev.split("version:", 1)[-1].strip()
    except (OSError, subprocess.SubprocessError):
        envoy = "unknown"
    return {"date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "nproc": os.cpu_count(), "cpu_model": model, "envoy": envoy,
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg()}


def mmm(xs: list[float]) -> tuple[float, float, float]:
    return (min(xs), statistics.median(xs), max(xs)) if xs else (float("nan"),) * 3


def fmt3(xs: list[float], spec: str, signed: bool = False) -> str:
    lo, med, hi = mmm(xs)
    f = "{:+" + spec + "}" if signed else "{:" + spec + "}"
    return " / ".join(f.format(v) for v in (lo, med, hi))


def summarize(runs: list[dict[str, Any]], p: Params) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {"plain": [], "ours": []}
    for r in runs:
        by[r["side"]].append(r)
    pairs = list(zip(by["plain"], by["ours"], strict=True))

    def col(side: str, path: tuple[str, ...]) -> list[float]:
        vals = []
        for r in by[side]:
            v: Any = r
            for k in path:
                v = v[k]
            vals.append(float(v))
        return vals

    def rel(path: tuple[str, ...], op: str) -> list[float]:
        out = []
        for a, b in pairs:
            va: Any = a
            vb: Any = b
            for k in path:
                va, vb = va[k], vb[k]
            out.append(vb / va if op == "ratio" else vb - va)
        return out

    figs = [
        ("delivered chunks/s at saturation", ("saturation", "chunks_per_s"), ".0f", "ratio"),
        ("per-chunk latency p50 (ms)", ("latency", "p50_ms"), ".3f", "delta"),
        ("per-chunk latency p99 (ms)", ("latency", "p99_ms"), ".3f", "delta"),
        ("  achieved rate (chunks/s)", ("latency", "achieved_chunks_per_s"), ".0f", "ratio"),
        ("time to first delta p50 (ms)", ("ttfd", "p50_ms"), ".3f", "delta"),
        ("time to first delta p99 (ms)", ("ttfd", "p99_ms"), ".3f", "delta"),
        ("envoy CPU us/chunk (saturation)",
         ("saturation", "cpu_us_per_chunk", "envoy"), ".1f", "delta"),
        ("replicas CPU us/chunk (saturation)",
         ("saturation", "cpu_us_per_chunk", "replicas"), ".1f", "delta"),
        ("client CPU us/chunk (saturation)",
         ("saturation", "cpu_us_per_chunk", "client"), ".1f", "delta"),
        ("machine busy (saturation, frac)",
         ("saturation", "cpu_s", "machine_busy_frac"), ".2f", "delta"),
    ]
    rows = []
    for label, path, spec, op in figs:
        rows.append({"figure": label, "plain": mmm(col("plain", path)),
                     "ours": mmm(col("ours", path)), op: mmm(rel(path, op)), "spec": spec})
    extra = [
        ("processor CPU us/chunk (saturation)", ("saturation", "cpu_us_per_chunk", "processor")),
        ("etcd CPU us/chunk (saturation)", ("saturation", "cpu_us_per_chunk", "etcd")),
    ]
    for label, path in extra:
        rows.append({"figure": label, "plain": None, "ours": mmm(col("ours", path)),
                     "spec": ".1f"})
    errors = {}
    for side in ("plain", "ours"):
        e: dict[str, int] = {}
        for r in by[side]:
            for fig in ("saturation", "latency", "ttfd"):
                for k in ("requests", "ok", "non_200", "transport_errors", "error_events",
                          "incomplete"):
                    e[k] = e.get(k, 0) + int(r[fig][k])
        errors[side] = e
    return {"rows": rows, "errors": errors}


def render_table(meta: dict[str, Any], p: Params, summary: dict[str, Any],
                 runs: list[dict[str, Any]]) -> str:
    lines = [
        f"extproc benchmark  {meta['date_utc']}",
        f"machine: {meta['nproc']} CPUs, {meta['cpu_model']}, kernel {meta['kernel']}; "
        f"Envoy {meta['envoy']}; Python {meta['python']}",
        f"repeats={p.repeats}; saturation: C={p.sat_clients} streams x {p.sat_tokens} tokens, "
        f"no delay, {p.sat_duration_s:g}s window; latency: {p.lat_streams} streams x "
        f"{p.lat_tokens} tokens @ {p.lat_delay_ms:g} ms/token "
        f"(offered {p.lat_streams * 1000 / p.lat_delay_ms:.0f} chunks/s), "
        f"{p.lat_duration_s:g}s window; TTFD: {p.ttfd_requests} sequential x "
        f"{p.ttfd_tokens} tokens",
        "values: min / median / max over repeats; ratio and delta are per repeat (paired "
        "back-to-back runs) then min / median / max",
        "",
    ]
    w0, w1 = 38, 30
    lines.append(f"{'figure':<{w0}} {'plain':<{w1}} {'ours':<{w1}} ours vs plain")
    lines.append("-" * (w0 + 2 * w1 + 26))
    for r in summary["rows"]:
        spec = r["spec"]
        plain = fmt3(list(r["plain"]), spec) if r["plain"] else "-"
        ours = fmt3(list(r["ours"]), spec)
        if "ratio" in r:
            vs = "x " + fmt3(list(r["ratio"]), ".3f")
        elif "delta" in r:
            vs = fmt3(list(r["delta"]), spec, signed=True)
        else:
            vs = ""
        lines.append(f"{r['figure']:<{w0}} {plain:<{w1}} {ours:<{w1}} {vs}")
    lines.append("")
    for side in ("plain", "ours"):
        e = summary["errors"][side]
        lines.append(f"errors {side:<5}: requests={e['requests']} ok={e['ok']} "
                     f"non_200={e['non_200']} transport={e['transport_errors']} "
                     f"error_events={e['error_events']} incomplete={e['incomplete']}")
    for r in runs:
        notes = list(r["problems"])
        for fig in ("saturation", "latency", "ttfd"):
            f = r[fig]
            if f["non_200_statuses"]:
                notes.append(f"{fig} statuses {f['non_200_statuses']}")
            if f["transport_samples"]:
                notes.append(f"{fig} transport {f['transport_samples'][:2]}")
            if f.get("budget_exhausted"):
                notes.append(f"{fig}: request budget exhausted before the window ended")
        levels = {}
        for k in ("processor_log_levels_demo", "processor_log_levels_ts"):
            for lv, n in r.get(k, {}).items():
                if lv not in ("INFO", "DEBUG"):
                    levels[lv] = levels.get(lv, 0) + n
        if levels:
            notes.append(f"processor log {levels}")
        bad = {k: v for k, v in {**r.get("envoy_counters_demo", {}),
                                  **r.get("envoy_counters_ts", {})}.items()
               if any(s in k for s in ("5xx", "retry", "reset", "failed", "timeout",
                                       "overflow", "error"))
               and not k.endswith("_limit") and "per_try" not in k}
        if bad:
            notes.append(f"envoy {bad}")
        if notes:
            lines.append(f"  repeat {r['repeat']} {r['side']}: " + "; ".join(notes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows (~40 s)")
    ap.add_argument("--repeats", type=int, help="repeats (default 3; 1 with --quick)")
    ap.add_argument("--clients", type=int, help="saturation concurrency (default 32)")
    ap.add_argument("--duration", type=float, help="saturation window seconds (default 8)")
    ap.add_argument("--out", default=str(RESULTS / "latest.json"))
    a = ap.parse_args(argv)
    p = QUICK if a.quick else Params()
    over: dict[str, Any] = {}
    if a.repeats is not None:
        over["repeats"] = max(1, min(a.repeats, 20))
    if a.clients is not None:
        over["sat_clients"] = max(1, min(a.clients, 512))
    if a.duration is not None:
        over["sat_duration_s"] = max(0.5, min(a.duration, 120.0))
    if over:
        p = Params(**{**p.__dict__, **over})

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    meta = machine_info()
    work = RESULTS / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    for rep in range(p.repeats):
        order = ("plain", "ours") if rep % 2 == 0 else ("ours", "plain")
        log(f"repeat {rep + 1}/{p.repeats} ({' then '.join(order)})")
        for side in order:
            r = measure_side(side, p, work / f"rep{rep + 1}", log)
            r["repeat"] = rep + 1
            runs.append(r)
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    summary = summarize(runs, p)
    table = render_table(meta, p, summary, runs)
    print(table)
    print(f"\n(total {meta['elapsed_s']} s; logs in {work}; json in {a.out})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "params": p.__dict__, "summary": summary,
                               "runs": runs, "table": table}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
