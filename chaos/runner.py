"""One chaos run: a devstack, client workers, the chaos loop, a settle phase, the checks.

Bounded everywhere: the traffic stops starting requests at the duration and every request
has its own bound; the loop heals every fault when the duration is up; the settle phase,
the journal look-ups and the repeats each have a deadline; the stack is stopped (every
process by PID) whatever happens.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from devkit.devstack import Stack, wait_until
from extproc.adapters.shards import shard_of
from extproc.core.intake import DEFAULT_TENANT
from extproc.core.journal import request_id_for_key

from .checks import (
    Availability,
    Break,
    ReplicaTimeline,
    Transcript,
    check,
    client_outcome,
    no_replica_verdict,
    view,
)
from .faults import FAULT_KINDS, SHARD_FAULT_KINDS, ChaosLoop, Fault
from .traffic import make_spec, reference, send

# The processor's config for a chaos run: short limits, so faults end in seconds and a
# run sees many of them (every value documented in docs/configuration.md; docs/chaos.md).
CHAOS_CONFIG: dict[str, Any] = {
    "timeouts": {"first_delta_s": 3.0, "soft_first_delta_s": 2.0,
                 "stall_after_first_delta_s": 1.5, "fence_wait_s": 3.0,
                 "access_log_wait_s": 0.5},
    "etcd": {"attempt_lease_ttl_s": 2, "session_ttl_s": 5},
}
LOG_FILES = ("processor.log", "envoy-access.jsonl", "replica-r*.jsonl")


@dataclass
class Options:
    duration_s: float = 60.0
    seed: int = 1
    etcd_members: int = 3
    # The journal sharded over this many etcd clusters (decision 0042): shard 0 has the
    # members above, each other shard one member; the shard faults need two or more.
    shards: int = 1
    replicas: int = 3
    workers: int = 6
    max_requests: int = 20000
    fault_share: float = 0.3  # requests with an x-replica-fault header
    keyed_share: float = 0.5  # requests with an Idempotency-Key
    kinds: tuple[str, ...] = FAULT_KINDS
    max_concurrent_faults: int = 2
    fault_interval_s: tuple[float, float] = (1.0, 3.0)
    hang_bound_s: float = 30.0
    repeat_window_s: float = 25.0
    error_backoff_s: float = 0.25  # a worker's pause after an error or a cut
    out: Path | None = None
    config: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(
        CHAOS_CONFIG)))
    keep_stack_dir: bool = True
    log: Callable[[str], None] = print


@dataclass
class Report:
    options: dict[str, Any]
    transcripts: list[Transcript]
    faults: list[Fault]
    breaks: list[tuple[Transcript, Break]]
    workdir: Path
    started_at: float
    wall_s: float
    harness_errors: list[str] = field(default_factory=list)
    availability: Availability | None = None
    sampler: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.harness_errors

    def summary(self) -> dict[str, Any]:
        by_kind = Counter(
            f"{t.spec.family}/{'stream' if t.spec.stream else 'unary'}"
            f"/{'keyed' if t.spec.key else 'keyless'}"
            f"/{'fault' if t.spec.fault else 'clean'}" for t in self.transcripts)
        clean = [t for t in self.transcripts if t.spec.fault is None]
        return {
            "requests": len(self.transcripts),
            "clean_requests_complete": f"{sum(client_outcome(t) == 'complete' for t in clean)}"
                                       f"/{len(clean)}",
            "requests_by_kind": dict(sorted(by_kind.items())),
            "requests_by_outcome": dict(sorted(Counter(
                client_outcome(t) for t in self.transcripts).items())),
            "request_faults": dict(sorted(Counter(
                (t.spec.fault or "none").split(":")[0] for t in self.transcripts).items())),
            "faults_injected": dict(sorted(Counter(
                f.kind for f in self.faults if not f.error.startswith("inject")).items())),
            "faults_not_injected": sum(1 for f in self.faults if f.error.startswith("inject")),
            "fault_heal_errors": sum(1 for f in self.faults if f.error.startswith("heal")),
            "keyed_repeats": sum(len(t.repeats) for t in self.transcripts),
            # Fault-free "no replica served it" answers, by the healthy_replica_passed_over
            # rule's verdict (docs/chaos.md).
            "no_replica_answers_fault_free": dict(sorted(Counter(
                verdict[0] for verdict in map(no_replica_verdict, self.transcripts)
                if verdict is not None).items())),
            "breaks": len(self.breaks),
            "breaks_by_kind": dict(sorted(Counter(b.kind for _, b in self.breaks).items())),
            "harness_errors": self.harness_errors,
        }

    def to_dict(self) -> dict[str, Any]:
        broken = {t.index for t, _ in self.breaks}
        logs = collect_logs(self.workdir, {t.request_id for t, _ in self.breaks
                                           if t.request_id})
        return {
            "options": self.options, "started_at": self.started_at,
            "wall_s": round(self.wall_s, 1), "workdir": str(self.workdir),
            "summary": self.summary(),
            "faults": [f.to_dict() for f in self.faults],
            "sampler": self.sampler,
            "availability": self.availability.to_dict() if self.availability else None,
            "breaks": [{"kind": b.kind, "detail": b.detail, "request_id": t.request_id,
                        "index": t.index, "spec": t.spec.to_dict(),
                        "client_saw": {**t.seen.to_dict(),
                                       "events": view(t.spec, t.seen).events},
                        "record_status": t.record_status, "record": t.record,
                        "repeats": [r.to_dict() for r in t.repeats],
                        "processor_fault": t.processor_fault,
                        "logs": logs.get(t.request_id, [])}
                       for t, b in self.breaks],
            "requests": [{"index": t.index, "request_id": t.request_id,
                          "family": t.spec.family, "stream": t.spec.stream,
                          "keyed": t.spec.key is not None, "fault": t.spec.fault,
                          "started_at": t.seen.started_at,
                          "elapsed_s": round(t.seen.elapsed_s, 4),
                          "outcome": client_outcome(t),
                          "record_outcome": (t.record or {}).get("outcome"),
                          "repeats": [r.status for r in t.repeats],
                          "no_replica_verdict": (no_replica_verdict(t) or (None,))[0],
                          # The attempts of a fault-free "no replica served it" answer,
                          # to judge it again from the report alone.
                          "attempts": (t.record or {}).get("attempts")
                          if no_replica_verdict(t) is not None else None,
                          "broken": t.index in broken}
                         for t in self.transcripts],
        }


def collect_logs(workdir: Path, rids: set[str], per_rid: int = 200) -> dict[str, list[str]]:
    """Every log line naming one of `rids` (processor, Envoy's access log, replicas)."""
    out: dict[str, list[str]] = {r: [] for r in rids}
    if not rids:
        return out
    files: list[Path] = []
    for pattern in LOG_FILES:
        files += sorted(workdir.glob(pattern))
    for path in files:
        with open(path, errors="replace") as f:
            for line in f:
                for rid in rids:
                    if rid in line and len(out[rid]) < per_rid:
                        out[rid].append(f"{path.name}: {line.rstrip()}")
    return out


class _Sampler:
    """The replicas' availability while the traffic runs: every `interval_s`, each
    replica's process alive and accepting a connection; Envoy's health_flags, connect
    failures and requests for it (admin /clusters) and its membership_healthy gauge, each
    kept when it changes. Bounded: one thread, stopped with the traffic; each probe has a
    short timeout."""

    def __init__(self, stack: Stack, interval_s: float = 0.1) -> None:
        self.stack, self.interval_s = stack, interval_s
        self.names = [f"r{i + 1}" for i in range(len(stack.replica_ports))]
        self.samples: dict[str, list[tuple[float, bool]]] = {n: [] for n in self.names}
        self.envoy: dict[str, list[tuple[float, str]]] = {}
        self.dialed: dict[str, list[tuple[float, int, int]]] = {}
        self.membership: list[tuple[float, int]] = []
        self.envoy_failures = 0
        self.rounds = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    @staticmethod
    def _accepts(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.rounds += 1
            for name, port in zip(self.names, self.stack.replica_ports, strict=True):
                p = self.stack.procs.get(name)
                ok = p is not None and p.alive() and self._accepts(port)
                self.samples[name].append((time.time(), ok))
            at = time.time()
            healthy = self._membership_healthy()
            if healthy is not None and (not self.membership
                                        or self.membership[-1][1] != healthy):
                self.membership.append((round(at, 3), healthy))
            at = time.time()
            hosts = self.stack.envoy_replica_stats(timeout_s=0.5)
            if hosts is None:
                self.envoy_failures += 1
                continue
            for addr, h in hosts.items():
                f = h.get("health_flags", "")
                seen = self.envoy.setdefault(addr, [])
                if not seen or seen[-1][1] != f:
                    seen.append((at, f))
                # Which hosts Envoy dialed: its connect failures and requests, when they
                # changed (evidence for a "passed over" request; not judged).
                counts = (int(h.get("cx_connect_fail", 0)), int(h.get("rq_total", 0)))
                dialed = self.dialed.setdefault(addr, [])
                if not dialed or dialed[-1][1:] != counts:
                    dialed.append((round(at, 3), *counts))

    def _membership_healthy(self) -> int | None:
        """Envoy's count of the replicas cluster's healthy hosts (its cluster's view, as
        the per-host flags; the workers' load balancers may take a change later)."""
        url = (f"http://127.0.0.1:{self.stack.admin_port}/stats"
               "?filter=^cluster\\.replicas\\.membership_healthy$")
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name == "cluster.replicas.membership_healthy" and value.strip().isdigit():
                return int(value)
        return None

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(5.0)

    def stats(self) -> dict[str, Any]:
        gaps = [b[0] - a[0] for s in self.samples.values() for a, b in pairwise(s)]
        return {"interval_s": self.interval_s, "rounds": self.rounds,
                "max_gap_s": round(max(gaps), 3) if gaps else None,
                "gaps_over_0.5s": sum(1 for g in gaps if g > 0.5),
                "envoy_admin_failures": self.envoy_failures,
                # Envoy's cx_connect_fail and rq_total per replica host, when they changed.
                "envoy_host_counters": {a: [list(x) for x in v]
                                        for a, v in self.dialed.items()},
                # Envoy's cluster.replicas.membership_healthy gauge, when it changed.
                "envoy_membership_healthy": [list(x) for x in self.membership]}

    def availability(self) -> Availability:
        st = self.stack
        events: dict[str, list[tuple[float, str]]] = {n: [] for n in self.names}
        for at, name, ev in list(st.replica_events):
            if name in events:
                events[name].append((at, ev))
        addrs = [f"127.0.0.1:{p}" for p in st.front_ports()]
        return Availability(
            replicas=tuple(ReplicaTimeline(n, a, tuple(self.samples[n]),
                                           tuple(sorted(events[n])),
                                           tuple(self.envoy.get(a, ())))
                           for n, a in zip(self.names, addrs, strict=True)),
            lag_s=st.health_settle_s(),
            max_attempts=st.cfg.policy.max_attempts if st.cfg is not None else 1)


def _journal_cluster(request_id: str, shards: int) -> str:
    """The etcd cluster a request's record lives on: "" for shard 0's, `etcd-shard<k>`
    for shard k's (devstack's member names; decision 0042). No id: shard 0's."""
    k = shard_of(request_id, shards) if request_id and shards > 1 else 0
    return f"etcd-shard{k}" if k else ""


def _cluster_of(fault_target: str) -> str:
    """The cluster a quorum fault hit: another shard's member name, or shard 0's."""
    return fault_target if fault_target.startswith("etcd-shard") else ""


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    return a0 <= b1 and b0 <= a1


class _Traffic:
    def __init__(self, stack: Stack, opts: Options, run_tag: str) -> None:
        self.stack, self.opts, self.run_tag = stack, opts, run_tag
        self.transcripts: list[Transcript] = []
        self.lock = threading.Lock()
        self.count = 0

    def worker(self, k: int, deadline: float, stop: threading.Event) -> None:
        rng = random.Random(f"{self.opts.seed}/worker/{k}")
        with httpx.Client(base_url=self.stack.base_url,
                          limits=httpx.Limits(max_connections=4,
                                              max_keepalive_connections=4)) as client:
            n = 0
            while not stop.is_set() and time.monotonic() < deadline:
                with self.lock:
                    if self.count >= self.opts.max_requests:
                        return
                    self.count += 1
                index = k * 1_000_000 + n
                spec = make_spec(rng, index, self.run_tag, self.opts.fault_share,
                                 self.opts.keyed_share)
                n += 1
                seen = send(client, spec, self.opts.hang_bound_s)
                t = Transcript(index=index, spec=spec, seen=seen, reference=reference(spec),
                               hang_bound_s=self.opts.hang_bound_s)
                t.request_id = seen.request_id or (
                    request_id_for_key(DEFAULT_TENANT, spec.key) if spec.key else "")
                with self.lock:
                    self.transcripts.append(t)
                if seen.status != 200 or seen.transport_error is not None:
                    stop.wait(self.opts.error_backoff_s)  # as a client would, not a storm


def _settle(stack: Stack, opts: Options, harness_errors: list[str]) -> None:
    """Every part whole again: etcd members, the processor, the replicas."""
    for name in stack.etcd_shard_names():  # a shard's member killed and never restarted
        try:
            stack.restart_etcd_member(name, wait=False)
        except Exception as e:
            harness_errors.append(f"settle: {name}: {e}")
    try:
        stack.wait_etcd_healthy(60.0)
    except Exception as e:
        harness_errors.append(f"settle: etcd not whole: {e}")
    p = stack.procs.get("processor")
    if p is not None and not p.alive():
        try:
            stack.restart_processor()
        except Exception as e:
            harness_errors.append(f"settle: processor: {e}")
    for i in range(len(stack.replica_ports)):
        name = f"r{i + 1}"
        stack.thaw(name)
        stack.release(name)
    try:
        stack.wait_replicas_healthy(timeout_s=60.0)
    except Exception as e:
        harness_errors.append(f"settle: replicas: {e}")
    # Records whose processor died settle once its session lease is gone; attempt leases
    # of fenced attempts expire too: wait them out.
    etcd_cfg = opts.config.get("etcd") or {}
    time.sleep(float(etcd_cfg.get("session_ttl_s", 15)) + float(
        etcd_cfg.get("attempt_lease_ttl_s", 10)) + 1.0)


def _lookup(client: httpx.Client, t: Transcript, wait_s: float = 3.0) -> None:
    if not t.request_id:
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = client.get(f"/v1/requests/{t.request_id}", timeout=10.0)
        except httpx.HTTPError:
            t.record_status = 0
        else:
            t.record_status = r.status_code
            t.record = r.json() if r.status_code == 200 else None
            if r.status_code == 404 or (t.record or {}).get("outcome") is not None:
                return
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _needs_repeat(t: Transcript) -> bool:
    if not t.repeats:
        return True
    last = t.repeats[-1]
    code = ((view(t.spec, last).error) or {}).get("code")
    return (last.status == 409 and code == "request_in_progress") or (
        last.status in (0, 500, 502, 503) and code in (None, "journal_unavailable"))


def _repeat_keys(stack: Stack, opts: Options, transcripts: list[Transcript]) -> None:
    """Repeat every keyed request's key (same body, no fault) until it is answered as an
    end or the window is over; one repeat per key per round, rounds 1 s apart."""
    keyed = [t for t in transcripts if t.spec.key is not None]
    deadline = time.monotonic() + opts.repeat_window_s
    clients = [httpx.Client(base_url=stack.base_url) for _ in range(opts.workers)]
    try:
        while True:
            todo = [t for t in keyed if _needs_repeat(t)]
            if not todo or time.monotonic() > deadline:
                return

            def one(pair: tuple[int, Transcript]) -> None:
                i, t = pair
                t.repeats.append(send(clients[i % len(clients)], t.spec,
                                      opts.hang_bound_s, with_fault=False))
            with ThreadPoolExecutor(max_workers=len(clients)) as ex:
                list(ex.map(one, enumerate(todo)))
            if any(_needs_repeat(t) for t in keyed):
                time.sleep(1.0)
    finally:
        for c in clients:
            c.close()


def run(opts: Options) -> Report:
    started_at, t0 = time.time(), time.monotonic()
    out = opts.out or Path(f"chaos-out/seed{opts.seed}-{int(started_at)}")
    workdir = out / "stack"
    if workdir.exists():
        shutil.rmtree(workdir)
    out.mkdir(parents=True, exist_ok=True)
    log = opts.log
    options = {"duration_s": opts.duration_s, "seed": opts.seed,
               "etcd_members": opts.etcd_members, "shards": opts.shards,
               "replicas": opts.replicas,
               "workers": opts.workers, "max_requests": opts.max_requests,
               "fault_share": opts.fault_share, "keyed_share": opts.keyed_share,
               "kinds": list(opts.kinds), "max_concurrent_faults": opts.max_concurrent_faults,
               "hang_bound_s": opts.hang_bound_s, "config": opts.config}
    stack = Stack(workdir=workdir, config=opts.config, replicas=opts.replicas,
                  etcd_members=opts.etcd_members, etcd_shards=opts.shards)
    harness_errors: list[str] = []
    traffic = _Traffic(stack, opts, f"s{opts.seed}-{int(started_at)}")
    # A shard fault needs another shard to fault: on one cluster those kinds are left out.
    kinds = tuple(k for k in opts.kinds if opts.shards > 1 or k not in SHARD_FAULT_KINDS)
    loop = ChaosLoop(stack, random.Random(f"{opts.seed}/chaos"), kinds=kinds,
                     max_concurrent=opts.max_concurrent_faults,
                     interval_s=opts.fault_interval_s, log=log)
    try:
        stack.start()
        stack.wait_replicas_healthy(timeout_s=30.0)
        if opts.etcd_members > 1:
            log(f"chaos: etcd leader {stack.wait_etcd_leader()}")
        log(f"chaos: stack up in {workdir}; traffic and faults for {opts.duration_s:.0f}s "
            f"(seed {opts.seed})")
        stop = threading.Event()
        sampler = _Sampler(stack)
        sampler.start()
        deadline = time.monotonic() + opts.duration_s
        workers = [threading.Thread(target=traffic.worker, args=(k, deadline, stop),
                                    name=f"chaos-client-{k}", daemon=True)
                   for k in range(opts.workers)]
        for w in workers:
            w.start()
        try:
            loop.run(deadline, stop)
        finally:
            for w in workers:
                w.join(opts.hang_bound_s + 15.0)
            if any(w.is_alive() for w in workers):
                stop.set()
                harness_errors.append("a client worker outlived its bound")
            sampler.finish()
        availability = sampler.availability()
        log(f"chaos: {len(traffic.transcripts)} requests sent; settling")
        _settle(stack, opts, harness_errors)
        # A processor fault covers the request if it overlaps it (the kill's wall-clock
        # stamp is taken just before the signal; 0.25 s either side for the two clocks),
        # until 1 s after the processor is back.
        processor_down = [(f.start - 0.25, (f.end or time.time()) + 1.0) for f in loop.faults
                          if f.kind == "processor_kill" and not f.error.startswith("inject")]
        # A journal cluster without quorum: shard 0's majority killed, or another shard's
        # one member killed or frozen; until 2 s after it is healed (an election).
        quorum_lost = [(f.target, f.start - 0.25, (f.end or time.time()) + 2.0)
                       for f in loop.faults
                       if f.kind in ("etcd_quorum_loss", *SHARD_FAULT_KINDS)
                       and not f.error.startswith("inject")]
        transcripts = sorted(traffic.transcripts, key=lambda t: t.seen.started_at)
        for t in transcripts:
            a0 = t.seen.started_at
            t.processor_fault = any(_overlaps(a0, a0 + t.seen.elapsed_s, s, e)
                                    for s, e in processor_down)
            cluster = _journal_cluster(t.request_id, opts.shards)
            t.journal_down = any(_overlaps(a0, a0 + t.seen.elapsed_s, s, e)
                                 and _cluster_of(target) == cluster
                                 for target, s, e in quorum_lost)
            t.processor_killed_after_start = any(s >= a0 - 0.5 for s, _ in processor_down)
            t.availability = availability
        with httpx.Client(base_url=stack.base_url) as client:
            wait_until(lambda: client.get("/v1/requests/req_" + "0" * 26).status_code == 404,
                       30.0, "the status endpoint answering")

            def look(t: Transcript) -> None:
                _lookup(client, t)
            with ThreadPoolExecutor(max_workers=4) as ex:
                list(ex.map(look, transcripts))
        log("chaos: journal read; repeating every Idempotency-Key")
        _repeat_keys(stack, opts, transcripts)
        breaks = [(t, b) for t in transcripts for b in check(t)]
        report = Report(options, transcripts, loop.faults, breaks, workdir, started_at,
                        time.monotonic() - t0, harness_errors, availability,
                        sampler.stats())
    finally:
        stack.stop()
    (out / "report.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return report


def render_summary(report: Report, out: Path | None = None, max_breaks: int = 40) -> str:
    s = report.summary()
    lines = [f"chaos run: {s['requests']} requests in {report.wall_s:.0f}s "
             f"(seed {report.options['seed']}, etcd members "
             f"{report.options['etcd_members']}, journal shards "
             f"{report.options.get('shards', 1)})", "", "requests by kind:"]
    lines += [f"  {k:45s} {v}" for k, v in s["requests_by_kind"].items()]
    lines += ["", f"requests without a replica fault answered completely: "
                  f"{s['clean_requests_complete']}", "", "requests by outcome:"]
    lines += [f"  {k:45s} {v}" for k, v in s["requests_by_outcome"].items()]
    lines += ["", "per-request replica faults:"]
    lines += [f"  {k:45s} {v}" for k, v in s["request_faults"].items()]
    if s["no_replica_answers_fault_free"]:
        lines += ["", "fault-free \"no replica served it\" answers, judged:"]
        lines += [f"  {k:45s} {v}" for k, v in s["no_replica_answers_fault_free"].items()]
    lines += ["", "faults injected:"]
    lines += [f"  {k:45s} {v}" for k, v in s["faults_injected"].items()]
    if s["faults_not_injected"] or s["fault_heal_errors"]:
        lines.append(f"  (not injected: {s['faults_not_injected']}, heal errors: "
                     f"{s['fault_heal_errors']})")
    lines += ["", f"breaks: {s['breaks']}"]
    lines += [f"  {k:45s} {v}" for k, v in s["breaks_by_kind"].items()]
    for e in report.harness_errors:
        lines.append(f"harness error: {e}")
    for t, b in report.breaks[:max_breaks]:
        lines.append(f"- {b.kind} {t.request_id or '(no request id)'} "
                     f"[{t.spec.family} {'stream' if t.spec.stream else 'unary'} "
                     f"fault={t.spec.fault}]: {b.detail}")
    if len(report.breaks) > max_breaks:
        lines.append(f"  ... {len(report.breaks) - max_breaks} more in the report")
    if out is not None:
        lines.append(f"\nreport: {out / 'report.json'}; logs: {report.workdir}")
    return "\n".join(lines)


def render_evidence(report: Report, per_kind: int = 1, max_lines: int = 14) -> str:
    """The first break(s) of each kind with their evidence: what the client saw, the
    record, the log lines naming the request (the whole of it is in report.json)."""
    seen: Counter[str] = Counter()
    chosen = []
    for t, b in report.breaks:
        if seen[b.kind] < per_kind:
            seen[b.kind] += 1
            chosen.append((t, b))
    logs = collect_logs(report.workdir, {t.request_id for t, _ in chosen if t.request_id})
    out: list[str] = []
    for t, b in chosen:
        s = t.seen
        out.append(f"== {b.kind} {t.request_id or '(no request id)'}: {b.detail}")
        out.append(f"   sent: {json.dumps(t.spec.to_dict())}")
        hdrs = {k: v for k, v in s.headers.items() if k.startswith("x-") or k == "content-type"}
        out.append(f"   client saw: status {s.status} {hdrs} after {s.elapsed_s:.3f}s"
                   + (f", transport error: {s.transport_error}" if s.transport_error else ""))
        evs = view(t.spec, s).events
        if evs:
            out.append(f"   events ({len(evs)}): " + "; ".join(
                (n or "data") + ("=" + json.dumps(d)[:90] if n is None else "")
                for n, d in evs[:8]) + (" ..." if len(evs) > 8 else ""))
        elif s.body:
            out.append(f"   body: {s.body[:200]!r}")
        rec = t.record
        if rec is not None:
            keys = ("phase", "outcome", "cause", "first_delta_sent", "delivered_output_tokens",
                    "delivered_output_tokens_exact", "first_delta_at")
            out.append(f"   record: {json.dumps({k: rec.get(k) for k in keys})}")
            for a in rec.get("attempts") or []:
                out.append("     attempt " + json.dumps({k: a.get(k) for k in (
                    "attempt", "replica", "admitted_at", "released", "failure_class",
                    "fence", "envoy_cause", "http_status")}))
        else:
            out.append(f"   record: none (lookup status {t.record_status})")
        for r in t.repeats[:3]:
            out.append(f"   repeat: {r.status} {r.body[:160]!r}")
        for line in logs.get(t.request_id, [])[:max_lines]:
            out.append(f"   log {line[:300]}")
    return "\n".join(out)
