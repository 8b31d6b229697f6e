"""The replica agent's own cost per chunk: through `extproc agent` vs straight to the replica.

    python -m bench.agent_cost [--streams 8] [--delay-ms 10] [--tokens 100]
        [--sat-streams 8] [--sat-tokens 200] [--round-s 4] [--rounds 3] [--uvloop]
        [--out FILE.json]

One etcd, one timestamping replica (bench.tsupstream: the demo replica's wire shape, each
content event stamped as it is written) and one `extproc agent --engine-kind openai` in
front of it, on loopback; no Envoy, no processor: the only difference between the two sides
is the agent's hop. Each request is a tracked attempt as the gate would send it: the bench
writes `live/<rid>` naming the attempt (on a lease) before sending
`x-gateway-request-id` / `-attempt-id` / `-processor`, so the agent does its whole job
(admission read, the lease's deadline per chunk, the SSE scan, the first-content notice).
The direct side writes the same keys and sends the same headers, so the client's own work is
equal. The sides alternate in rounds (direct, agent, agent, direct, ...: ABBA, so a drift of
the machine's load hits both alike), for two loads:

- paced: `--streams` streams of `--tokens` tokens, one every `--delay-ms`: per-chunk latency
  (client receive minus the replica's stamp; the first content event excluded, as in
  bench.run) p50 / p99 per side, and the added p50 / p99;
- saturation: `--sat-streams` streams, no token delay: chunks/s per side.

The agent's CPU per chunk is its process's CPU over its rounds, less its rate while it
carries nothing (measured over the direct rounds: its ticker, its probes, and its watch of
`live/`, which hears every attempt's live key, this replica's or not), over the chunks it
carried; that second rate is reported per live-key write. Bounded:
each round is `--round-s` plus the requests in flight at its end (each capped at 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.client import Conn, Tally
from bench.measure import machine_info, pct, proc_cpu_s
from devkit.devstack import Proc, Stack, free_ports, wait_until
from extproc.core import headers as H
from extproc.core.config import load_config

HOST = "127.0.0.1"
LEASE_TTL_S = 30  # attempt_lease_ttl_s: a fresh lease per round outlives it
PREFIX = "/llmgw/v1"


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def request_bytes(port: int, tokens: int, delay_ms: float, rid: str, aid: str) -> bytes:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "benchmark prompt"}]},
                      separators=(",", ":")).encode()
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {HOST}:{port}",
            "Content-Type: application/json", "Accept: text/event-stream",
            f"Content-Length: {len(body)}", f"x-replica-token-delay-ms: {delay_ms:g}",
            f"{H.REQUEST_ID}: {rid}", f"{H.ATTEMPT_ID}: {aid}", f"{H.PROCESSOR}: bench"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Bench:
    def __init__(self, work: Path, uvloop: bool = False) -> None:
        self.work = work
        self.uvloop = uvloop
        cfg = {"etcd": {"prefix": PREFIX, "attempt_lease_ttl_s": LEASE_TTL_S},
               "pool": {"discovery": "registry", "health_check": {"path": "/health"}},
               "timeouts": {"fence_wait_s": LEASE_TTL_S},  # the config's own rule
               "server": {"log_level": "WARNING"}}
        self.stack = Stack(workdir=work, config=cfg)
        self.n = 0

    def start(self) -> None:
        st = self.stack
        st._start_etcd()
        raw = {**st.config, "etcd": {**st.config["etcd"], "endpoints": [st.etcd_endpoint]}}
        (self.work / "extproc.yaml").write_text(yaml.safe_dump(raw))
        self.cfg = load_config(raw)
        self.up, self.agent, ops = free_ports(3)
        r = Proc("r1", [sys.executable, "-m", "bench.tsupstream", "--port", str(self.up)],
                 self.work / "replica.log")
        r.start()
        st.procs["r1"] = r
        wait_until(lambda: _ok(f"http://{HOST}:{self.up}/health"), 20, "replica")
        (self.work / "fp.yaml").write_text("weights_revision: bench@1\n")
        # --uvloop: the agent on uvloop (the processor's loop; `extproc agent` runs on
        # asyncio's own), to see what the loop alone costs per chunk.
        entry = (["-c", "import sys, uvloop; uvloop.install(); from extproc.cli import main; "
                  "sys.exit(main(sys.argv[1:]))"] if self.uvloop else ["-m", "extproc"])
        a = Proc("agent-r1", [
            sys.executable, *entry, "agent", "--config", str(self.work / "extproc.yaml"),
            "--listen", f"{HOST}:{self.agent}", "--engine", f"{HOST}:{self.up}",
            "--engine-kind", "openai", "--ops", f"{HOST}:{ops}",
            "--fingerprint-file", str(self.work / "fp.yaml"), "--model", "demo-model"],
            self.work / "agent.log")
        a.start()
        st.procs["agent-r1"] = a
        wait_until(lambda: _ok(f"http://{HOST}:{self.agent}/healthz"), 30, "agent")

    def stop(self) -> None:
        self.stack.stop()

    async def round(self, kv: Any, side: str, streams: int, tokens: int, delay_ms: float,
                    round_s: float) -> dict[str, Any]:
        from extproc.adapters.kv import Put, Txn
        port = self.agent if side == "agent" else self.up
        lease = (await kv.grant(LEASE_TTL_S)).id
        tally, lats = Tally(), []
        t0 = time.time_ns()
        w0, w1 = t0 + int(0.5e9), t0 + int((0.5 + round_s) * 1e9)
        cpu: dict[str, float] = {}

        async def sample() -> None:
            await asyncio.sleep(max(0.0, (w0 - time.time_ns()) / 1e9))
            cpu["a"] = proc_cpu_s(self.stack.procs["agent-r1"].pid)
            cpu["ra"] = proc_cpu_s(self.stack.procs["r1"].pid)
            await asyncio.sleep(max(0.0, (w1 - time.time_ns()) / 1e9))
            cpu["b"] = proc_cpu_s(self.stack.procs["agent-r1"].pid)
            cpu["rb"] = proc_cpu_s(self.stack.procs["r1"].pid)

        async def client(i: int) -> None:
            await asyncio.sleep(i * max(delay_ms, 1.0) / 1000.0 / streams)
            conn = Conn(HOST, port)
            try:
                while time.time_ns() < w1:
                    self.n += 1
                    rid, aid = f"req_bench{self.n}", f"att_bench{self.n}"
                    await kv.txn(Txn(success=[Put(f"{PREFIX}/live/{rid}".encode(),
                                                  aid.encode(), lease)]))
                    o = await conn.request(request_bytes(port, tokens, delay_ms, rid, aid),
                                           window=(w0, w1), want_ts=True, timeout_s=30.0)
                    tally.add(o, tokens)
                    lats.extend(o.latencies_ns)
            finally:
                await conn.close()

        await asyncio.gather(sample(), *(client(i) for i in range(streams)))
        dur = (w1 - w0) / 1e9
        return {"side": side, "chunks_per_s": tally.counted_chunks / dur,
                "chunks": tally.counted_chunks, "lat_ms": [x / 1e6 for x in lats],
                "agent_cpu_s": cpu["b"] - cpu["a"], "replica_cpu_s": cpu["rb"] - cpu["ra"],
                "duration_s": dur, "errors": tally.errors(), "requests": tally.requests,
                "tally": tally.as_dict()}


def summarize(rounds: list[dict[str, Any]], paced: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("direct", "agent"):
        rs = [r for r in rounds if r["side"] == side]
        lat = [x for r in rs for x in r["lat_ms"]]
        out[side] = {"chunks_per_s": sum(r["chunks"] for r in rs) / sum(r["duration_s"]
                                                                      for r in rs),
                     "chunks_per_s_by_round": [round(r["chunks_per_s"]) for r in rs],
                     "requests": sum(r["requests"] for r in rs),
                     "errors": sum(r["errors"] for r in rs),
                     "replica_cpu_us_per_chunk": 1e6 * sum(r["replica_cpu_s"] for r in rs)
                     / max(1, sum(r["chunks"] for r in rs))}
        if paced:
            out[side].update(samples=len(lat), p50_ms=pct(lat, 50), p99_ms=pct(lat, 99))
    d = [r for r in rounds if r["side"] == "direct"]
    a = [r for r in rounds if r["side"] == "agent"]
    idle = sum(r["agent_cpu_s"] for r in d) / sum(r["duration_s"] for r in d)
    busy = sum(r["agent_cpu_s"] for r in a) - idle * sum(r["duration_s"] for r in a)
    # Not idle: its watch of `live/` hears every attempt's live key (the bench writes one
    # per request on both sides, as a gateway writes one per attempt for the whole pool).
    out["agent_idle_cpu_cores"] = idle
    writes = sum(r["requests"] for r in d) / sum(r["duration_s"] for r in d)
    out["live_writes_per_s_while_idle"] = writes
    out["agent_idle_cpu_us_per_live_write"] = 1e6 * idle / writes if writes else 0.0
    out["agent_cpu_us_per_chunk"] = 1e6 * busy / max(1, sum(r["chunks"] for r in a))
    out["agent_cpu_cores_while_carrying"] = (sum(r["agent_cpu_s"] for r in a)
                                             / sum(r["duration_s"] for r in a))
    out["throughput_ratio"] = out["agent"]["chunks_per_s"] / out["direct"]["chunks_per_s"]
    if paced:
        out["added_p50_ms"] = out["agent"]["p50_ms"] - out["direct"]["p50_ms"]
        out["added_p99_ms"] = out["agent"]["p99_ms"] - out["direct"]["p99_ms"]
    return out


async def measure(b: Bench, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from extproc.adapters.kv_etcd import EtcdKV
    kv = EtcdKV(b.cfg.etcd)
    kv.open()
    res: dict[str, Any] = {}
    try:
        order = ["direct", "agent", "agent", "direct"]
        for name, streams, tokens, delay in (
                ("paced", args.streams, args.tokens, args.delay_ms),
                ("saturation", args.sat_streams, args.sat_tokens, 0.0)):
            await b.round(kv, "agent", streams, tokens, delay, 1.0)  # warm both paths
            await b.round(kv, "direct", streams, tokens, delay, 1.0)
            rounds = []
            for i in range(args.rounds * 2):
                side = order[i % 4]
                r = await b.round(kv, side, streams, tokens, delay, args.round_s)
                log(f"  {name} {side:6} {r['chunks_per_s']:8.0f} chunks/s"
                    + (f"  p50 {pct(r['lat_ms'], 50):.3f} ms  p99 {pct(r['lat_ms'], 99):.3f}"
                       f" ms" if delay else "")
                    + f"  agent cpu {r['agent_cpu_s'] / r['duration_s']:.2f} cores"
                    + (f"  ERRORS {r['errors']}" if r["errors"] else ""))
                rounds.append(r)
            res[name] = summarize(rounds, paced=bool(delay))
            res[name]["load"] = {"streams": streams, "tokens": tokens, "delay_ms": delay,
                                 "rounds_per_side": args.rounds, "round_s": args.round_s}
    finally:
        await kv.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_cost")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--sat-streams", type=int, default=8)
    ap.add_argument("--sat-tokens", type=int, default=200)
    ap.add_argument("--round-s", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side and load")
    ap.add_argument("--uvloop", action="store_true", help="run the agent on uvloop")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, flush=True)

    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="agent-cost-"))
    b = Bench(work, args.uvloop)
    try:
        b.start()
        res = asyncio.run(measure(b, args, log))
    finally:
        b.stop()
    info["loadavg_at_end"] = os.getloadavg()
    out = {"machine": info, **res, "workdir": str(work)}
    p, s = res["paced"], res["saturation"]
    log("\nthe agent's own cost (same run, alternated rounds; docs/benchmarks.md)")
    log(f"  paced {p['load']['streams']} x 1 chunk/{p['load']['delay_ms']:g} ms: per-chunk "
        f"latency p50 {p['direct']['p50_ms']:.3f} -> {p['agent']['p50_ms']:.3f} ms "
        f"(+{p['added_p50_ms']:.3f}), p99 {p['direct']['p99_ms']:.3f} -> "
        f"{p['agent']['p99_ms']:.3f} ms (+{p['added_p99_ms']:.3f}); agent CPU "
        f"{p['agent_cpu_us_per_chunk']:.1f} us/chunk")
    log(f"  saturation {s['load']['streams']} streams: {s['direct']['chunks_per_s']:.0f} -> "
        f"{s['agent']['chunks_per_s']:.0f} chunks/s (x{s['throughput_ratio']:.2f}); agent "
        f"CPU {s['agent_cpu_us_per_chunk']:.1f} us/chunk, "
        f"{s['agent_cpu_cores_while_carrying']:.2f} cores")
    log(f"  carrying nothing: {s['agent_idle_cpu_cores']:.3f} cores while "
        f"{s['live_writes_per_s_while_idle']:.0f} live/ keys/s were written "
        f"({s['agent_idle_cpu_us_per_live_write']:.0f} us each)")
    log(f"  errors: paced {p['direct']['errors']}/{p['agent']['errors']}, saturation "
        f"{s['direct']['errors']}/{s['agent']['errors']} (direct/agent); load average "
        f"{info['loadavg_at_start'][0]:.2f} -> {info['loadavg_at_end'][0]:.2f}")
    for k in ("paced", "saturation"):
        for side in ("direct", "agent"):
            out[k][side].pop("lat_ms", None)
    text = json.dumps(out, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    errors = sum(res[k][side]["errors"] for k in res for side in ("direct", "agent"))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
