"""The benchmark's measurement primitives, shared by every bench program.

Parameters (Params, QUICK), the stacks each side runs on (start_stack: plain Envoy, Envoy +
our processor + etcd, Envoy + the null processor of bench/nullproc.py), per-process CPU
accounting from /proc, the load loops (saturation, per-chunk latency, time to first delta,
failover before the first delta), run_loop, and measure_figure: one figure on a fresh stack,
re-measured when a stack process dies or other load disturbs the window. Where results go
(RESULTS) and what a result is tied to (machine_info, code_digest) live here too.
bench/report.py turns the results into tables; bench/run.py is the one-command program.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Conn, Outcome, Tally, build_request
from bench.nullproc import NullStack
from devkit.devstack import Proc, Stack, _bin

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
    lat_streams: int = 20
    # 20 streams x 1 chunk / 10 ms = 2000 chunks/s offered, and 1 / 4 ms = 5000 chunks/s
    # (the "moderate fixed rate"); paced, so every chunk is its own body message.
    lat_delays_ms: tuple[float, ...] = (10.0, 4.0)
    lat_tokens: int = 128
    lat_warmup_s: float = 1.0
    lat_duration_s: float = 6.0
    lat_max_requests: int = 5_000
    # time to first delta
    ttfd_requests: int = 200
    ttfd_warmup_requests: int = 10
    ttfd_tokens: int = 8
    ttfd_max_s: float = 15.0
    # failover before the first delta: the replica serving attempt 1 is killed after its
    # headers (SIGKILL); paired with a normal request each time
    failover_requests: int = 12
    failover_max_s: float = 90.0
    request_timeout_s: float = 30.0
    # before each figure, wait (bounded) until the machine is idle: other load skews everything
    idle_wait_s: float = 20.0
    idle_threshold: float = 0.10  # fraction of both cores busy
    # a saturation/latency window in which processes outside the benchmark used more than this
    # many cores is measured once more (crashes are retried up to `attempts` in total)
    other_load_limit: float = 0.15
    # after this long, no more idle waits or re-measurements of disturbed windows
    budget_s: float = 240.0
    # a figure whose stack lost a process mid-run is re-measured on a fresh stack
    attempts: int = 3


QUICK = Params(repeats=1, idle_wait_s=5.0, budget_s=45.0, sat_warmup_s=0.5, sat_duration_s=3.0,
               lat_warmup_s=0.5, lat_duration_s=3.0, ttfd_requests=60, ttfd_max_s=5.0,
               failover_requests=4, failover_max_s=20.0)


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


class NullTsStack(NullStack, TsStack):
    """The floor side with timestamping upstreams."""


# plain: Envoy alone; ours: Envoy + our processor + etcd; floor: Envoy + the null processor
# (bench/nullproc.py: the same ext_proc messages answered with no logic and no etcd).
SIDES = ("plain", "ours", "floor")


# Sides other bench programs add (bench/peers.py: the peer gateways): side -> factory
# (kind, workdir, token delay in ms of a paced figure, or None) -> a started stack.
EXTRA_SIDES: dict[str, Callable[[str, Path, float | None], Stack]] = {}


def start_stack(kind: str, side: str, workdir: Path,
                config: dict[str, Any] | None = None,
                token_delay_ms: float | None = None) -> Stack:
    if side in EXTRA_SIDES:
        return EXTRA_SIDES[side](kind, workdir, token_delay_ms)
    if side == "floor":
        cls: type[Stack] = NullTsStack if kind == "ts" else NullStack
    else:
        cls = TsStack if kind == "ts" else Stack
    return cls(workdir=workdir, config=config or {}, replicas=2, plain=side == "plain").start()


# The failover figure fails every other request on purpose: the default retry budget (20 %
# of requests, at least 3 per window) would refuse most of its retries, which is the budget
# doing its job, not the failover path we time.
FIGURE_CONFIG: dict[str, dict[str, Any]] = {
    "failover": {"policy": {"retry_budget": {"min_retry_concurrency": 1000}}}}


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


def machine_jiffies() -> tuple[int, int, int]:
    """(busy, steal, total) jiffies over all CPUs, from /proc/stat; busy excludes steal."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = parts[:8]
    return user + nice + system + irq + softirq, steal, sum(parts[:8])


def wait_idle(p: Params, log: Any) -> dict[str, float]:
    """Sample /proc/stat in 0.5 s slices until a slice is below the idle threshold, for at
    most p.idle_wait_s; returns how long it waited and the busy fraction of the last slice."""
    t0 = time.monotonic()
    warned = False
    while True:
        b0, _, t_0 = machine_jiffies()
        time.sleep(0.5)
        b1, _, t_1 = machine_jiffies()
        busy = (b1 - b0) / (t_1 - t_0) if t_1 > t_0 else 0.0
        waited = time.monotonic() - t0
        if busy <= p.idle_threshold or waited >= p.idle_wait_s:
            return {"waited_s": round(waited, 1), "busy_before": round(busy, 3)}
        if not warned:
            log(f"  machine busy ({busy:.0%} of both cores) with other load: waiting up to "
                f"{p.idle_wait_s:g} s for it to go idle")
            warned = True


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_snapshot(stack: Stack) -> dict[str, float]:
    snap = {name: proc_cpu_s(p.pid) for name, p in stack.procs.items()}
    snap["client"] = self_cpu_s()
    busy, steal, total = machine_jiffies()
    snap["_busy"], snap["_steal"], snap["_total"] = float(busy), float(steal), float(total)
    return snap


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    d = {k: b[k] - a[k] for k in a if not k.startswith("_")}
    # Cells (decision 0019): `processor-c2`, `envoy-c2`, ... count with the first cell's.
    out = {"processor": sum(v for k, v in d.items() if k.startswith("processor")),
           "envoy": sum(v for k, v in d.items() if k.startswith("envoy")),
           "replicas": sum(v for k, v in d.items() if k.startswith("r")),
           "etcd": d.get("etcd", 0.0), "client": d.get("client", 0.0),
           # A peer gateway's process(es) (bench/peers.py names them gw-*).
           "gateway": sum(v for k, v in d.items() if k.startswith("gw"))}
    tot = b["_total"] - a["_total"]
    out["machine_busy_frac"] = (b["_busy"] - a["_busy"]) / tot if tot else 0.0
    out["steal_frac"] = (b["_steal"] - a["_steal"]) / tot if tot else 0.0
    # CPU time nobody we started (nor this process) used: other load on the machine, plus
    # kernel work not charged to a process. Jiffies of /proc/stat are USER_HZ, like stat(5).
    known = sum(v for k, v in d.items())
    out["unaccounted"] = max(0.0, (b["_busy"] - a["_busy"]) / CLK_TCK - known)
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
        self.t0 = time.monotonic()

    def check(self) -> bool:
        """True (and remembered) once a stack process has died; cheap: waitpid(WNOHANG)."""
        if not self.dead:
            self.dead = [n for n in ("envoy", "processor", "etcd")
                         if n in self.stack.procs and not self.stack.procs[n].alive()]
            if self.dead:
                self.died_after_s = round(time.monotonic() - self.t0, 2)
        return bool(self.dead)

    async def run(self, *coros: Any) -> None:
        t0 = time.monotonic()
        work = asyncio.gather(*coros)

        self.t0 = t0

        async def watch() -> None:
            while not work.done():  # bounded by the load's own window
                if self.check():
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
                if o.transport_error is not None and not watch.check():
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
                    for k, v in cpu.items() if not k.endswith("_frac")}
    cores = {k: (v / p.sat_duration_s if not k.endswith("_frac") else v)
             for k, v in cpu.items()}
    return {"chunks_per_s": chunks / p.sat_duration_s, "counted_chunks": chunks,
            "window_s": p.sat_duration_s, "budget_exhausted": budget[0] <= 0,
            "died": watch.dead, "died_after_s": watch.died_after_s,
            "cpu_s": cpu, "cpu_cores": cores, "cpu_us_per_chunk": per_chunk_us, **tally.as_dict()}


def lat_rate(p: Params, delay_ms: float) -> int:
    return round(p.lat_streams * 1000.0 / delay_ms)


async def latency(stack: Stack, p: Params, delay_ms: float) -> dict[str, Any]:
    req = build_request(HOST, stack.envoy_port, p.lat_tokens, delay_ms)
    tally = Tally()
    lats: list[int] = []
    t0 = time.time_ns()
    w0 = t0 + int(p.lat_warmup_s * 1e9)
    w1 = w0 + int(p.lat_duration_s * 1e9)
    budget = [p.lat_max_requests]

    watch = Watch(stack)
    snaps: dict[str, dict[str, float]] = {}

    async def sampler() -> None:
        await asyncio.sleep(max(0.0, (w0 - time.time_ns()) / 1e9))
        snaps["a"] = cpu_snapshot(stack)
        await asyncio.sleep(max(0.0, (w1 - time.time_ns()) / 1e9))
        snaps["b"] = cpu_snapshot(stack)

    async def client(i: int) -> None:
        # Spread the streams' token ticks evenly over one token period.
        await asyncio.sleep(i * delay_ms / 1000.0 / p.lat_streams)
        conn = Conn(HOST, stack.envoy_port)
        try:
            while time.time_ns() < w1 and budget[0] > 0 and not watch.dead:
                budget[0] -= 1
                o = await conn.request(req, window=(w0, w1), want_ts=True,
                                       timeout_s=p.request_timeout_s)
                tally.add(o, p.lat_tokens)
                lats.extend(o.latencies_ns)
                if o.transport_error is not None and not watch.check():
                    await asyncio.sleep(0.05)
        finally:
            await conn.close()

    await watch.run(sampler(), *(client(i) for i in range(p.lat_streams)))
    if "b" not in snaps:
        snaps["b"] = cpu_snapshot(stack)
    cpu = cpu_delta(snaps["a"], snaps["b"])
    ms = [x / 1e6 for x in lats]
    return {"achieved_chunks_per_s": tally.counted_chunks / p.lat_duration_s,
            "offered_chunks_per_s": p.lat_streams * 1000.0 / delay_ms,
            "cpu_cores": {k: (v / p.lat_duration_s if not k.endswith("_frac") else v)
                          for k, v in cpu.items()},
            "samples": len(ms), "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90),
            "p99_ms": pct(ms, 99), "max_ms": max(ms) if ms else float("nan"),
            "budget_exhausted": budget[0] <= 0, "died": watch.dead,
            "died_after_s": watch.died_after_s, **tally.as_dict()}


ETCD_CALLS = ("Range", "Put", "DeleteRange", "Txn", "Compact", "LeaseGrant", "LeaseRevoke",
              "LeaseKeepAlive")


def etcd_calls(stack: Stack) -> dict[str, int]:
    """etcd's own per-method call counts, for the methods that are round trips of ours."""
    return {k: v for k, v in stack.etcd_calls().items() if k in ETCD_CALLS}


async def ttfd(stack: Stack, p: Params) -> dict[str, Any]:
    req = build_request(HOST, stack.envoy_port, p.ttfd_tokens, None)
    tally = Tally()
    samples: list[float] = []
    conn = Conn(HOST, stack.envoy_port)
    deadline = time.monotonic() + p.ttfd_max_s
    dead: list[str] = []
    calls0: dict[str, int] = {}
    t_measured = 0.0
    try:
        for i in range(p.ttfd_warmup_requests + p.ttfd_requests):
            dead = [n for n in ("envoy", "processor", "etcd")
                    if n in stack.procs and not stack.procs[n].alive()]
            if time.monotonic() >= deadline or dead:
                break
            if i == p.ttfd_warmup_requests:
                await asyncio.sleep(0.3)  # the warm-up's last records are written
                calls0, t_measured = etcd_calls(stack), time.monotonic()
            o: Outcome = await conn.request(req, timeout_s=p.request_timeout_s)
            if i < p.ttfd_warmup_requests:
                continue
            tally.add(o, p.ttfd_tokens)
            if o.first_content_ns and o.status == 200:
                samples.append((o.first_content_ns - o.t_sent_ns) / 1e6)
    finally:
        await conn.close()
    out = {"samples": len(samples), "p50_ms": pct(samples, 50), "p99_ms": pct(samples, 99),
           "mean_ms": statistics.fmean(samples) if samples else float("nan"),
           "died": dead, "died_after_s": None, "budget_exhausted": False, **tally.as_dict()}
    if calls0:
        await asyncio.sleep(0.3)  # the last request's finish transaction lands
        calls1, secs = etcd_calls(stack), time.monotonic() - t_measured
        by = {k: calls1.get(k, 0) - calls0.get(k, 0) for k in calls1}
        n = max(1, tally.requests)
        # Background calls (lease keep-alives every TTL/3, the retry-budget exchange once a
        # second) are not per request: counted apart, over the same window.
        background = by.get("LeaseKeepAlive", 0) + round(secs)  # 1 budget Txn per second
        per_req = (sum(by.values()) - background) / n
        out["etcd"] = {"calls": by, "window_s": round(secs, 2), "requests": tally.requests,
                       "background_calls": background, "round_trips_per_request": per_req}
    return out


async def failover(stack: Stack, p: Params) -> dict[str, Any]:
    """Attempt 1's replica dies after sending its headers (before any delta); Envoy retries
    on the other replica. Each failover request is paired with a normal one right before
    it, so "beyond" = failover TTFD - the surviving path's own TTFD, measured alike."""
    tally = Tally()
    pairs: list[tuple[float, float]] = []
    dead: list[str] = []
    if stack.plain:
        # Plain Envoy cannot fail over once headers arrived (the client sees a cut stream):
        # there is nothing to compare against.
        return {"skipped": "plain Envoy has no failover after headers", "died": [],
                "died_after_s": None, "budget_exhausted": False, **tally.as_dict()}
    normal = build_request(HOST, stack.envoy_port, p.ttfd_tokens, None)
    killed = normal.replace(b"\r\n\r\n", b"\r\nx-replica-fault: kill-after-headers\r\n\r\n", 1)
    deadline = time.monotonic() + p.failover_max_s
    for _ in range(p.failover_requests):
        dead = [n for n in ("envoy", "processor", "etcd")
                if n in stack.procs and not stack.procs[n].alive()]
        if time.monotonic() >= deadline or dead:
            break
        try:
            # Both replicas up and healthy in Envoy's view, its checks caught up with the
            # last kill (Stack.wait_replicas_healthy).
            await asyncio.to_thread(stack.wait_replicas_healthy, 15.0)
        except Exception:  # a replica that stays down ends the figure
            break
        got: list[float] = []
        for req in (normal, killed):
            conn = Conn(HOST, stack.envoy_port)  # fresh: the kill closes pooled upstreams
            try:
                o: Outcome = await conn.request(req, timeout_s=p.request_timeout_s)
            finally:
                await conn.close()
            tally.add(o, p.ttfd_tokens)
            if o.first_content_ns and o.status == 200:
                got.append((o.first_content_ns - o.t_sent_ns) / 1e6)
        if len(got) == 2:
            pairs.append((got[0], got[1]))
    beyond = [b - a for a, b in pairs]
    return {"pairs": len(pairs), "normal_p50_ms": pct([a for a, _ in pairs], 50),
            "failover_p50_ms": pct([b for _, b in pairs], 50),
            "beyond_p50_ms": pct(beyond, 50), "beyond_max_ms": max(beyond, default=float("nan")),
            "died": dead, "died_after_s": None, "budget_exhausted": False, **tally.as_dict()}


def run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def figures(p: Params, side: str = "ours") -> dict[str, tuple[str, Any]]:
    """figure -> (upstream kind, measurement(stack, params)); the floor cannot fail over."""
    out: dict[str, tuple[str, Any]] = {"ttfd": ("demo", ttfd)}
    if side != "floor":
        out["failover"] = ("demo", failover)
    out["saturation"] = ("demo", saturation)
    for d in p.lat_delays_ms:
        out[f"latency@{lat_rate(p, d)}"] = ("ts", functools.partial(latency, delay_ms=d))
    return out
ERROR_KEYS = ("requests", "ok", "non_200", "transport_errors", "error_events", "incomplete")


class Terminated(BaseException):
    """SIGTERM/SIGHUP: unwind through every `finally`, so every stack is stopped by PID."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signum}")


DEADLINE = [float("inf")]  # monotonic time after which the run stops being patient


def measure_figure(fig: str, side: str, p: Params, work: Path, log: Any) -> dict[str, Any]:
    """Measure one figure on a fresh stack. If a stack process dies mid-run (Envoy has been
    seen to segfault under load with the processor), the attempt is kept - its errors count -
    and the figure is retried on a fresh stack, up to `p.attempts` times."""
    kind, fn = figures(p, side)[fig]
    attempts: list[dict[str, Any]] = []
    for n in range(1, p.attempts + 1):
        wd = work / f"{fig}-{side}-a{n}"
        patient = time.monotonic() < DEADLINE[0]
        idle = wait_idle(p, log) if patient else {"waited_s": 0.0, "busy_before": -1.0}
        stack = start_stack(kind, side, wd, FIGURE_CONFIG.get(fig),
                            getattr(fn, "keywords", {}).get("delay_ms"))
        try:
            time.sleep(0.3)
            log(f"  {side}: {fig}" + (f" (attempt {n})" if n > 1 else "") + " ...")
            r = run_loop(fn(stack, p))
            r["envoy_counters"] = c = envoy_counters(stack)
            msgs = sum(v for k, v in c.items() if k.endswith("ext_proc.stream_msgs_sent"))
            r["extproc_msgs_per_content_event"] = (msgs / r["content_events"]
                                                   if r["content_events"] else 0.0)
            # The failover figure kills replicas on purpose (the supervisor restarts them).
            r["died"] = sorted(set(r["died"]) | {k for k, pr in stack.procs.items()
                                                 if not pr.alive() and not (
                                                     fig == "failover" and k.startswith("r"))})
        finally:
            stack.stop()
        r["processor_log_levels"] = log_levels(wd / "processor.log")
        r["idle_check"] = idle
        r["workdir"] = str(wd)
        other = r.get("cpu_cores", {}).get("unaccounted", 0.0)
        r["disturbed"] = other > p.other_load_limit
        attempts.append(r)
        if r["died"]:
            log(f"  !! {side} {fig}: {', '.join(r['died'])} died after {r['died_after_s']} s; "
                f"logs in {wd}")
        elif r["disturbed"]:
            again = (sum(1 for a in attempts if a["disturbed"]) < 2 and n < p.attempts
                     and time.monotonic() < DEADLINE[0])
            log(f"  !! {side} {fig}: {other:.2f} cores used by other processes during the "
                "window" + ("; measuring again" if again else "; keeping it (flagged)"))
            if not again:
                break
        else:
            break
    # The figure comes from the last attempt where no stack process died (a disturbed one is
    # kept only when no clean one exists, and is flagged in the table).
    alive = [a for a in attempts if not a["died"]]
    final = dict(alive[-1] if alive else attempts[-1])
    final["valid"] = not final["died"]
    final["attempts"] = [{k: a.get(k) for k in ("died", "died_after_s", "workdir", "disturbed",
                                                "budget_exhausted", *ERROR_KEYS)}
                         for a in attempts]
    for k in ERROR_KEYS:  # errors of every attempt count, including the crashed ones
        final[k] = sum(int(a[k]) for a in attempts)
    final["crashes"] = sum(1 for a in attempts if a["died"])
    return final


def measure_side(side: str, p: Params, work: Path, log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"side": side}
    for fig in figures(p, side):
        out[fig] = measure_figure(fig, side, p, work, log)
    return out


# --- what a result is tied to ---------------------------------------------------------------


def code_digest() -> str:
    """sha256 of the processor's sources (extproc/**/*.py), to tie numbers to code."""
    h = hashlib.sha256()
    for f in sorted((ROOT.parent / "extproc").rglob("*.py")):
        h.update(str(f.relative_to(ROOT.parent)).encode() + b"\0")
        with contextlib.suppress(OSError):
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


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
            "loadavg_at_start": os.getloadavg(), "code_sha256_start": code_digest()}
