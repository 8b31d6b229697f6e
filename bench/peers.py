"""The gateways users would pick instead, measured beside plain Envoy and ours in one run.

    make bench-peers                                  # = python -m bench.peers, ~15 min
    .venv/bin/python -m bench.peers --quick           # 1 repeat, short windows, ~5 min
    .venv/bin/python -m bench.peers --peers smg --no-faults --no-memory

Sides: plain (Envoy alone), ours (Envoy + processor + etcd), ours+agent (the same with
`extproc agent` in front of each replica: the fault figure only), and each peer gateway from
.venv-peers (bench/peers/requirements.txt, `make peers-install`): LiteLLM proxy, the SGLang
model gateway (smg) and vllm-router, each in front of the same two demo replicas, set up as
its documentation recommends for streaming (PEERS below; docs/benchmarks.md, "Peers").
Per side, on fresh stacks, with bench/measure.py's code (measure_figure, the same client):
time to first delta, saturation (chunks/s and the gateway's CPU per chunk), per-chunk
latency at paced rates (bench/tsupstream.py upstreams); then, on stacks of this module:
memory per open stream (RSS of the gateway's processes with N streams open past their first
delta, minus before, over N) and what a client sees when the replica serving it dies
before / after the first delta (bench/peers_replica.py arms the demo replica's own fault
hooks from outside, since not every gateway forwards the fault header): complete, clean
error, cut, hang or wrong (a stream that ends normally with the wrong number of deltas).
Prints a table (min / median / max over repeats) and writes bench/results/peers.json.
Every process is started in its own session and stopped by PID with its stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/peers.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml

from bench import measure
from bench.client import Conn, Outcome, build_request
from bench.measure import (
    DEADLINE,
    FIGURE_CONFIG,
    HOST,
    QUICK,
    RESULTS,
    Params,
    TsStack,
    _terminate,
    machine_info,
    measure_figure,
    run_loop,
)
from devkit.devstack import Proc, Stack, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = Path(os.environ.get("PEERS_VENV", ROOT / ".venv-peers"))
BASE_SIDES = ("plain", "ours")
# Ours with `extproc agent` in front of each replica (issue 26): measured in the fault figure
# only; the agent's own cost per chunk is `make bench-agent`'s figure.
AGENT_SIDE = "ours+agent"


# --- the peers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    package: str  # distribution whose version the table prints
    # (listen port, upstream base URLs, workdir) -> (argv, extra environment)
    command: Callable[[int, list[str], Path], tuple[list[str], dict[str, str]]]
    how: str  # one line for the table: how it was set up


def _litellm(port: int, upstreams: list[str], work: Path) -> tuple[list[str], dict[str, str]]:
    # One deployment per replica in one model group; the router's retries move a failed
    # call to another deployment of the group (LiteLLM docs, "Reliability": num_retries,
    # allowed_fails, cooldown_time).
    cfg = {"model_list": [{"model_name": "demo-model",
                           "litellm_params": {"model": "openai/demo-model",
                                              "api_base": f"{u}/v1", "api_key": "none"}}
                          for u in upstreams],
           "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 2,
                               "allowed_fails": 3, "cooldown_time": 30, "timeout": 30},
           "litellm_settings": {"num_retries": 2, "request_timeout": 30}}
    path = work / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [str(PEERS_VENV / "bin" / "litellm"), "--config", str(path), "--host", HOST,
            "--port", str(port), "--num_workers", "1"]
    # No master key (the client sends no Authorization, as with the others; this spares
    # LiteLLM its key check), no network for the model cost map, no telemetry.
    env = {"LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    return argv, env


def _rust_router(binary: str) -> Callable[[int, list[str], Path],
                                         tuple[list[str], dict[str, str]]]:
    def command(port: int, upstreams: list[str], work: Path) -> tuple[list[str], dict[str, str]]:
        # Round robin over the workers; retries and circuit breaker at their defaults
        # (retries on, 5 attempts), metrics on a free port of their own.
        return ([str(PEERS_VENV / "bin" / binary), *(["launch"] if binary == "smg" else []),
                 "--host", HOST, "--port", str(port), "--worker-urls", *upstreams,
                 "--policy", "round_robin", "--prometheus-port", str(free_port())], {})
    return command


PEERS: dict[str, Peer] = {
    "litellm": Peer("litellm", "litellm", _litellm,
                    "litellm proxy, 1 worker, 2 deployments, simple-shuffle, num_retries 2"),
    "smg": Peer("smg", "smg", _rust_router("smg"),
                "smg launch --policy round_robin, retries/circuit breaker default"),
    "vllm-router": Peer("vllm-router", "vllm-router", _rust_router("vllm-router"),
                        "vllm-router --policy round_robin, retries/circuit breaker default"),
}


def peer_version(package: str) -> str:
    try:
        out = subprocess.run([str(PEERS_VENV / "bin" / "python"), "-c",
                              f"import importlib.metadata as m; print(m.version({package!r}))"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "missing"
    return out.stdout.strip() or "missing"


# --- stacks ---------------------------------------------------------------------------------


def _stream_ok(port: int) -> bool:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "ready?"}]}).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200 and b"[DONE]" in r.read()
    except OSError:
        return False


class PeerStack(Stack):
    """The devkit Stack's replicas (supervised, restarted when killed) with a peer gateway
    in Envoy's place. Its process is `gw-<peer>` (bench/measure.py's cpu_delta counts it)."""

    peer: Peer
    delay_ms: float | None = None
    arm_file: str = ""

    def replica_proc(self, i: int, port: int) -> Proc:
        p = super().replica_proc(i, port)
        if self.delay_ms is not None and p.argv[2] == "bench.tsupstream":
            p.argv += ["--token-delay-ms", f"{self.delay_ms:g}"]
        return p

    def _start_envoy(self) -> None:
        self.envoy_port = self.envoy_port or free_port()
        argv, env = self.peer.command(self.envoy_port,
                                      [f"http://{HOST}:{p}" for p in self.front_ports()],
                                      self.workdir)
        p = Proc(f"gw-{self.peer.name}", argv, self.workdir / f"{self.peer.name}.log",
                 env={**os.environ, **env})
        p.start()
        self.procs[p.name] = p
        wait_until(lambda: _stream_ok(self.envoy_port) or not p.alive(), 90,
                   f"{self.peer.name} serving a stream")
        if not p.alive():
            raise RuntimeError(f"{self.peer.name} exited: see {p.log_path}")

    def stop(self) -> None:
        for name, p in self.procs.items():
            if name.startswith("gw-"):
                p.stop()
        super().stop()


class PeerTsStack(PeerStack, TsStack):
    """A peer in front of timestamping upstreams, paced by --token-delay-ms."""


def armed_factory(arm_file: str) -> Callable[[int, int, Path], Proc]:
    """Demo replicas that take a fault armed in `arm_file` (bench/peers_replica.py)."""

    def make(i: int, port: int, workdir: Path) -> Proc:
        name = f"r{i + 1}"
        argv = [sys.executable, "-m", "bench.peers_replica", "--arm-file", arm_file,
                "--host", HOST, "--port", str(port), "--name", name,
                "--log-file", str(workdir / f"replica-{name}.jsonl"),
                "--token-delay-ms", str(FAULT_TOKEN_DELAY_MS)]
        return Proc(name, argv, workdir / f"replica-{name}.log")

    return make


def start_side(side: str, kind: str, workdir: Path, delay_ms: float | None = None,
               arm_file: str = "", token_delay_ms: float = 0.0) -> Stack:
    """A started stack of any side: `kind` "demo" (demo replicas, or armed ones with
    `arm_file`) or "ts" (timestamping upstreams)."""
    workdir.mkdir(parents=True, exist_ok=True)
    factory = armed_factory(arm_file) if arm_file else None
    if side in (*BASE_SIDES, AGENT_SIDE):
        if kind == "ts":
            return measure.start_stack("ts", side, workdir)
        cfg = FIGURE_CONFIG["failover"] if arm_file and side != "plain" else {}
        return Stack(workdir=workdir, config=cfg, replicas=2, plain=side == "plain",
                     agents=side == AGENT_SIDE, replica_factory=factory,
                     token_delay_ms=token_delay_ms).start()
    cls: type[PeerStack] = PeerTsStack if kind == "ts" else PeerStack
    s = cls(workdir=workdir, replicas=2, plain=True, replica_factory=factory,
            token_delay_ms=token_delay_ms)
    s.peer, s.delay_ms, s.arm_file = PEERS[side], delay_ms, arm_file
    return s.start()


for _name in PEERS:
    measure.EXTRA_SIDES[_name] = (
        lambda kind, wd, delay, _n=_name: start_side(_n, kind, wd, delay))


def gateway_procs(stack: Stack) -> list[str]:
    """The processes that make the gateway: ours is Envoy, the processor and etcd."""
    return [n for n in stack.procs if n == "envoy" or n.startswith(("gw-", "processor"))
            or n == "etcd"]


# --- faults: what a client sees when its replica dies ----------------------------------------

FAULT_TOKENS = 16
FAULT_TOKEN_DELAY_MS = 20.0
FAULT_TIMEOUT_S = 20.0  # no end of the response by then: a hang
CASES = {"before": "kill-after-headers", "after": "kill-after-deltas:3"}
OUTCOMES = ("complete", "clean_error", "cut", "hang", "wrong")


def classify(o: Outcome, expected: int, timed_out: bool) -> str:
    """What the client saw, as one word.

    complete: 200, exactly `expected` deltas, [DONE], no error event. clean_error: the
    client was told: a non-200 response that ended properly, or an in-band error event.
    hang: nothing ended the response within FAULT_TIMEOUT_S. cut: the response stopped
    with no error (EOF or reset mid-stream, or an ended stream without [DONE]). wrong: a
    stream that ended normally with [DONE] and no error but the wrong number of deltas
    (a silent re-run from the start, or a silent truncation)."""
    if o.error_events:
        return "clean_error"
    if timed_out:
        return "hang"
    if o.transport_error is not None:
        return "cut"
    if o.status != 200:
        return "clean_error" if o.status else "cut"
    if not o.done:
        return "cut"
    return "complete" if o.content == expected else "wrong"


async def _one(port: int, timeout_s: float, tokens: int = FAULT_TOKENS) -> tuple[Outcome, bool]:
    req = build_request(HOST, port, tokens, None).replace(
        b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    conn, o = Conn(HOST, port), Outcome()
    timed_out = False
    try:
        await asyncio.wait_for(conn._request(req, o, None, False), timeout_s)
    except TimeoutError:
        timed_out = True
    except (OSError, ConnectionError, ValueError, IndexError) as e:
        o.transport_error = f"{type(e).__name__}: {e}"[:200]
    finally:
        await conn.close()
    return o, timed_out


def faults(stack: Stack, arm_file: str, per_case: int, log: Any) -> dict[str, Any]:
    """`per_case` requests per case, one at a time, each with the fault armed for whichever
    replica the gateway picks; both replicas healthy again before each."""
    out: dict[str, Any] = {}
    for case, spec in CASES.items():
        counts = dict.fromkeys(OUTCOMES, 0)
        rows: list[dict[str, Any]] = []
        for _ in range(per_case):
            try:
                stack.wait_replicas_healthy(15.0)
            except Exception:  # a replica that stays down ends the case
                break
            time.sleep(0.5)  # the restarted replica's listener settles; gateways reconnect
            tmp = arm_file + ".new"
            Path(tmp).write_text(spec)
            os.replace(tmp, arm_file)
            t0 = time.monotonic()
            o, timed_out = run_loop(_one(stack.envoy_port, FAULT_TIMEOUT_S))
            armed_left = os.path.exists(arm_file)
            with contextlib.suppress(OSError):
                os.unlink(arm_file)
            word = classify(o, FAULT_TOKENS, timed_out) if not armed_left else "not_armed"
            counts[word] = counts.get(word, 0) + 1
            rows.append({"outcome": word, "status": o.status, "content": o.content,
                         "done": o.done, "error_events": o.error_events,
                         "transport_error": o.transport_error,
                         "took_s": round(time.monotonic() - t0, 3)})
        out[case] = {"fault": spec, "counts": counts, "requests": rows}
        log(f"    {case} the first delta: " + ", ".join(f"{k} {v}" for k, v in counts.items()
                                                     if v))
    return out


# --- memory per open stream -------------------------------------------------------------------


def rss_kib(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def gateway_rss(stack: Stack) -> dict[str, int]:
    return {n: rss_kib(stack.procs[n].pid) for n in gateway_procs(stack)}


async def memory(stack: Stack, n: int, settle_s: float = 20.0) -> dict[str, Any]:
    """RSS of the gateway's processes with `n` streams open past their first delta, minus
    before (after a few complete requests), over n. Replicas pace 1 token a second."""
    for _ in range(5):  # one token each: the replicas pace only after the first
        await _one(stack.envoy_port, 10.0, tokens=1)
    await asyncio.sleep(0.5)
    before = gateway_rss(stack)
    req = build_request(HOST, stack.envoy_port, 64, None)
    conns = [Conn(HOST, stack.envoy_port) for _ in range(n)]
    outs = [Outcome() for _ in range(n)]
    tasks = [asyncio.ensure_future(c._request(req, o, None, False))
             for c, o in zip(conns, outs, strict=True)]
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and sum(1 for o in outs if o.first_content_ns) < n:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # polled: the client's Outcome has no event to wait on
    opened = sum(1 for o in outs if o.first_content_ns)
    await asyncio.sleep(0.5)
    during = gateway_rss(stack)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in conns:
        await c.close()
    delta = sum(during.values()) - sum(before.values())
    return {"streams": n, "open_past_first_delta": opened, "rss_before_kib": before,
            "rss_open_kib": during,
            "kib_per_stream": delta / opened if opened else float("nan")}


# --- the run ------------------------------------------------------------------------------------


def figure_names(p: Params) -> list[str]:
    return ["ttfd", "saturation", *(f"latency@{measure.lat_rate(p, d)}"
                                    for d in p.lat_delays_ms)]


def measure_extras(side: str, work: Path, a: argparse.Namespace, log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not a.no_memory and side != AGENT_SIDE:
        log(f"  {side}: memory per open stream ({a.streams}) ...")
        stack = start_side(side, "demo", work / f"memory-{side}", token_delay_ms=1000.0)
        try:
            out["memory"] = run_loop(memory(stack, a.streams))
        finally:
            stack.stop()
    if not a.no_faults:
        log(f"  {side}: a replica killed before / after the first delta ...")
        wd = work / f"faults-{side}"
        wd.mkdir(parents=True, exist_ok=True)
        arm = str(wd / "fault.armed")
        stack = start_side(side, "demo", wd, arm_file=arm)
        try:
            out["faults"] = faults(stack, arm, a.per_case, log)
        finally:
            stack.stop()
    return out


def _get(r: dict[str, Any], *path: str) -> float | None:
    v: Any = r
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, (int, float)) and v == v else None


def gateway_cpu_us(sat: dict[str, Any]) -> float | None:
    """CPU per delivered chunk of the gateway's own processes (ours: Envoy + processor +
    etcd; a peer: its gw-* process)."""
    per = sat.get("cpu_us_per_chunk") or {}
    vals = [per.get(k) for k in ("envoy", "processor", "etcd", "gateway")]
    nums = [float(v) for v in vals if isinstance(v, (int, float)) and v == v]
    return sum(nums) if nums else None


def summarize(runs: list[dict[str, Any]], sides: list[str], rates: list[int]
              ) -> dict[str, dict[str, Any]]:
    """side -> figure -> [min, median, max] over repeats (None: no value), plus the fault
    outcomes summed over repeats and the ratio / difference to plain per repeat."""
    plain = {r["repeat"]: r for r in runs if r["side"] == "plain"}
    out: dict[str, dict[str, Any]] = {}
    for side in sides:
        mine = [r for r in runs if r["side"] == side]
        vals: dict[str, list[float]] = {}

        def add(key: str, v: float | None, vals: dict[str, list[float]] = vals) -> None:
            if v is not None:
                vals.setdefault(key, []).append(v)

        for r in mine:
            base = plain.get(r["repeat"])
            sat = r.get("saturation") or {}
            add("sat_chunks_s", _get(sat, "chunks_per_s") if sat.get("valid", True) else None)
            if base is not None and sat.get("valid", True):
                b = _get(base.get("saturation") or {}, "chunks_per_s")
                s = _get(sat, "chunks_per_s")
                add("sat_vs_plain", s / b if s is not None and b else None)
            add("cpu_us_chunk", gateway_cpu_us(sat))
            add("ttfd_p50_ms", _get(r, "ttfd", "p50_ms"))
            if base is not None:
                t, bt = _get(r, "ttfd", "p50_ms"), _get(base, "ttfd", "p50_ms")
                add("ttfd_added_ms", t - bt if t is not None and bt is not None else None)
            for rate in rates:
                lat = r.get(f"latency@{rate}") or {}
                add(f"p50@{rate}", _get(lat, "p50_ms"))
                add(f"p99@{rate}", _get(lat, "p99_ms"))
                add(f"achieved@{rate}", _get(lat, "achieved_chunks_per_s"))
            add("kib_per_stream", _get(r, "memory", "kib_per_stream"))
        summary: dict[str, Any] = {k: [min(v), statistics.median(v), max(v)]
                                   for k, v in vals.items()}
        errs = 0
        for r in mine:
            for f in r.values():
                if isinstance(f, dict) and "requests" in f and "ok" in f:
                    errs += int(f["requests"]) - int(f["ok"])
        summary["load_errors"] = errs
        for case in CASES:
            tot = dict.fromkeys(OUTCOMES, 0)
            for r in mine:
                for k, v in ((r.get("faults") or {}).get(case, {}).get("counts") or {}).items():
                    tot[k] = tot.get(k, 0) + int(v)
            summary[f"faults_{case}"] = tot
        out[side] = summary
    return out


def _f3(v: list[float] | None, spec: str) -> str:
    if not v:
        return "n/a"
    if v[0] == v[2]:
        return format(v[1], spec)
    return "/".join(format(x, spec) for x in v)


def _faults(c: dict[str, int]) -> str:
    n = sum(c.values())
    if not n:
        return "n/a"
    return ", ".join(f"{v}/{n} {k.replace('_', ' ')}" for k, v in c.items() if v)


def render(meta: dict[str, Any], summary: dict[str, dict[str, Any]], rates: list[int]) -> str:
    """One column per side; each cell min/median/max over repeats (one value if equal)."""
    sides = list(summary)
    rows: list[tuple[str, list[str]]] = [
        ("version", [meta.get("versions", {}).get(s, "") for s in sides]),
        ("saturation, chunks/s", [_f3(summary[s].get("sat_chunks_s"), ",.0f") for s in sides]),
        ("  vs plain", [_f3(summary[s].get("sat_vs_plain"), ".2f") for s in sides]),
        ("gateway CPU us/chunk (saturation)",
         [_f3(summary[s].get("cpu_us_chunk"), ".1f") for s in sides]),
    ]
    for rate in rates:
        rows.append((f"per-chunk p50 / p99 ms @{rate}/s",
                     [f"{_f3(summary[s].get(f'p50@{rate}'), '.2f')} / "
                      f"{_f3(summary[s].get(f'p99@{rate}'), '.2f')}" for s in sides]))
        rows.append(("  achieved chunks/s",
                     [_f3(summary[s].get(f"achieved@{rate}"), ",.0f") for s in sides]))
    rows += [
        ("time to first delta p50, ms", [_f3(summary[s].get("ttfd_p50_ms"), ".2f")
                                         for s in sides]),
        ("  added vs plain, ms", [_f3(summary[s].get("ttfd_added_ms"), "+.2f")
                                  for s in sides]),
        ("memory per open stream, KiB", [_f3(summary[s].get("kib_per_stream"), ".1f")
                                         for s in sides]),
        ("replica killed before 1st delta", [_faults(summary[s]["faults_before"])
                                             for s in sides]),
        ("replica killed after 1st delta", [_faults(summary[s]["faults_after"])
                                            for s in sides]),
        ("failed requests under load", [str(summary[s]["load_errors"]) for s in sides]),
    ]
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(s), *(len(r[1][i]) for r in rows)) for i, s in enumerate(sides)]
    lines = [f"bench-peers {meta.get('date_utc', '')}, {meta.get('nproc', '?')} CPUs, "
             f"{meta.get('cpu_model', '')}; {meta.get('note', '')}",
             "  ".join([" " * w0, *(s.ljust(w) for s, w in zip(sides, ws, strict=True))])]
    for name, cells in rows:
        padded = (c.ljust(w) for c, w in zip(cells, ws, strict=True))
        lines.append("  ".join([name.ljust(w0), *padded]))
    lines.append("cells: min/median/max over repeats (one value when they agree); gateway CPU: "
                 "plain = Envoy, ours = Envoy + processor + etcd, a peer = its process")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    ap.add_argument("--repeats", type=int, help="repeats (default 2; 1 with --quick)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated, of: {', '.join(PEERS)} (default: all)")
    ap.add_argument("--no-base", action="store_true", help="skip plain Envoy and ours")
    ap.add_argument("--streams", type=int, help="open streams for the memory figure "
                    "(default 300; 100 with --quick)")
    ap.add_argument("--per-case", type=int, help="faulted requests per case (default 6; 3 "
                    "with --quick)")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-agent", action="store_true",
                    help=f"skip {AGENT_SIDE} (ours with the replica agent; faults only)")
    ap.add_argument("--note", default="", help="a note for the table's header line")
    ap.add_argument("--out", default=str(RESULTS / "peers.json"))
    a = ap.parse_args(argv)
    peers = [x for x in a.peers.split(",") if x]
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    p = QUICK if a.quick else Params(repeats=2, budget_s=120.0)
    if a.repeats is not None:
        p = Params(**{**p.__dict__, "repeats": max(1, min(a.repeats, 10))})
    if a.quick:  # one paced rate: the 2,000 chunks/s
        p = Params(**{**p.__dict__, "lat_delays_ms": p.lat_delays_ms[:1]})
    a.streams = max(10, min(a.streams or (100 if a.quick else 300), 2000))
    a.per_case = max(1, min(a.per_case or (3 if a.quick else 6), 50))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    missing = [x for x in peers if peer_version(PEERS[x].package) == "missing"]
    if missing:
        log(f"not installed in {PEERS_VENV}: {', '.join(missing)} (make peers-install)")
        return 2
    sides = ([] if a.no_base else list(BASE_SIDES)) + peers
    if not a.no_base and not a.no_agent and not a.no_faults:
        sides.insert(2, AGENT_SIDE)
    meta = machine_info()
    meta["versions"] = {x: PEERS[x].package + " " + peer_version(PEERS[x].package)
                        for x in peers}
    meta["versions"].update({"plain": "envoy " + str(meta["envoy"]).split("/")[1]
                             if "/" in str(meta["envoy"]) else str(meta["envoy"]),
                             "ours": "this tree", AGENT_SIDE: "this tree"})
    meta["setup"] = {x: PEERS[x].how for x in peers}
    meta["note"] = a.note or "shared machine: to be re-measured on an idle one"
    work = RESULTS / "work-peers"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    DEADLINE[0] = started + p.budget_s
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    runs: list[dict[str, Any]] = []
    for rep in range(p.repeats):
        order = sides if rep % 2 == 0 else sides[::-1]
        log(f"repeat {rep + 1}/{p.repeats} ({' then '.join(order)})")
        for side in order:
            wd = work / f"rep{rep + 1}"
            r: dict[str, Any] = {"side": side, "repeat": rep + 1}
            for fig in figure_names(p) if side != AGENT_SIDE else []:
                try:
                    r[fig] = measure_figure(fig, side, p, wd, log)
                except Exception as e:  # a gateway that cannot start: say so, go on
                    log(f"  !! {side} {fig}: {type(e).__name__}: {e}")
                    r[fig] = {"error": f"{type(e).__name__}: {e}"[:300]}
            try:
                r.update(measure_extras(side, wd, a, log))
            except Exception as e:
                log(f"  !! {side} extras: {type(e).__name__}: {e}")
                r["extras_error"] = f"{type(e).__name__}: {e}"[:300]
            runs.append(r)
    rates = [measure.lat_rate(p, d) for d in p.lat_delays_ms]
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    summary = summarize(runs, sides, rates)
    table = render(meta, summary, rates)
    print(table)
    print(f"\n(total {meta['elapsed_s']} s; logs in {work}; json in {a.out})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "params": p.__dict__,
                               "options": {"streams": a.streams, "per_case": a.per_case},
                               "summary": summary, "runs": runs, "table": table},
                              indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
