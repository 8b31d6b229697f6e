"""Engine-seconds spent on abandoned attempts per 100 faults, with and without the replica
agent (issue 26).

    .venv/bin/python -m bench.abandoned               # 50 faults per kind per side, ~1.6 min
    .venv/bin/python -m bench.abandoned --faults 10   # smoke, ~25 s

Two stacks in turn, the same config (gateway + etcd + Envoy + two demo replicas, each behind
a partition proxy and registered in the live pool): "without" has no agent (`extproc register`
beside each replica), "with" puts `extproc agent` between each proxy and its replica
(`Stack(agents=True)`, registered with `agent: {version: 1}`). The demo replicas compute one
token per TOKEN_DELAY_MS (a 64-token answer takes ~1.3 s). On each stack, N faults of each
kind, in one seeded order, CONCURRENCY at a time:

  before-first   x-partition: after-deltas:0 on attempt 1: the proxy cuts the replica off
                 just before its first content delta and propagates no close, so the replica
                 decodes on into the cut; the gateway gives the attempt up (its first-delta
                 limit, or with the agent its word + `source_grace_s`) and retries elsewhere.
  after-first    x-partition: after-deltas:1: the client has one delta, then silence; the
                 gateway ends the stream with `upstream_decode_interrupted` after
                 `stall_after_first_delta_s`.
  disconnect     the client closes after K deltas (K seeded, 2..24); the close reaches the
                 replica through Envoy (and the agent), with or without the agent.

Per abandoned attempt (the cut attempt 1; the client's own attempt for a disconnect):
  - abandoned at: the journal's `ended_at` of that attempt (when the gateway gave it up),
    or the client's close (wall clock, after the socket was closed);
  - the engine's end: the `ts` of the replica's own JSONL line for (request id, attempt),
    written when the replica stopped that request (finished or saw its peer gone);
  - engine-s after abandon: max(0, end - abandoned at) (0 when the engine had already
    finished when the gateway gave up: that is counted, in "done before");
  - engine-s wasted: (tokens_computed - tokens the client got from that attempt) x token
    delay: all the decode time of the attempt that reached no one, before or after the
    gateway gave up.
Also each client's time to the first content token and to its terminal event, and whether
every request is correct: the exact reference text (the demo's deterministic tokens) with
`[DONE]`, or an exact prefix + `upstream_decode_interrupted`, or (disconnect) the exact first
K tokens; anything else is a failure and printed.

Bounded: N per kind (at most 200), each request 30 s client timeout, the whole run
BUDGET_S; every process is stopped by PID with its stack. Writes
bench/results/abandoned.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # `python bench/abandoned.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import RESULTS, machine_info
from devkit.demo.tokens import chat_prompt, generate_tokens
from devkit.devstack import Stack
from extproc.core.sse import EventKind, SseDecoder

TOKEN_DELAY_MS = 20.0  # 64 tokens: ~1.3 s
MAX_TOKENS = 64
SEED = 26
CONCURRENCY = 4
BUDGET_S = 600.0
KINDS = ("before-first", "after-first", "disconnect")
SIDES = ("without", "with")
# Gateway limits shorter than the 1.3 s answer, as a 30 s first-delta limit is shorter than
# a long real answer: what the engine does after the gateway gave up is what is measured.
TTL = 3
CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": TTL, "session_ttl_s": 10},
    "timeouts": {"first_delta_s": 1.0, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 0.5, "access_log_wait_s": 0.5,
                 "fence_wait_s": TTL + 1.0, "source_grace_s": 0.25},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},
}
HEADERS = {
    "before-first": {"x-partition": "after-deltas:0", "x-partition-attempt": "1"},
    "after-first": {"x-partition": "after-deltas:1", "x-partition-attempt": "1"},
    "disconnect": {},
}
SETTLE_S = 15.0  # replica lines and journal outcomes awaited at most this long after a side


def _deadline_hit(signum: int, frame: Any) -> None:
    raise TimeoutError(f"signal {signum}: stopping")


def plan(n: int, seed: int) -> list[dict[str, Any]]:
    """The faults of one side, in one seeded order (the same for both sides)."""
    rng = random.Random(seed)
    out = []
    for kind in KINDS:
        for i in range(n):
            prompt = f"abandoned {kind} {i} {rng.randrange(10**6)}"
            out.append({"kind": kind, "i": i, "prompt": prompt, "seed": rng.randrange(1000),
                        "k": rng.randint(2, 24) if kind == "disconnect" else 0})
    rng.shuffle(out)
    return out


def reference(f: dict[str, Any]) -> list[str]:
    return generate_tokens(chat_prompt([{"role": "user", "content": f["prompt"]}]),
                           f["seed"], MAX_TOKENS)


def _contents(ev: dict[str, Any]) -> list[str]:
    return [str((c.get("delta") or {}).get("content")) for c in ev.get("choices") or []
            if (c.get("delta") or {}).get("content")]


def one(base: str, f: dict[str, Any]) -> dict[str, Any]:
    """One client request; what it saw, and when (monotonic from its start, wall clock)."""
    body = {"model": "demo-model", "stream": True, "max_tokens": MAX_TOKENS, "seed": f["seed"],
            "messages": [{"role": "user", "content": f["prompt"]}]}
    dec = SseDecoder()
    r: dict[str, Any] = {**f, "status": 0, "request_id": "", "contents": [], "error": None,
                         "done": False, "transport_error": None, "ttft_s": None,
                         "terminal_s": None, "closed_at": None, "client_closed": False}
    t0 = time.monotonic()
    r["started_at"] = time.time()
    try:
        with httpx.Client(base_url=base, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=body,
                         headers=HEADERS[f["kind"]]) as resp:
            r["status"], r["request_id"] = (resp.status_code,
                                            resp.headers.get("x-gateway-request-id", ""))
            for chunk in resp.iter_raw():
                for e in dec.feed(chunk):
                    if e.kind is EventKind.DONE:
                        r["done"] = True
                        r["terminal_s"] = time.monotonic() - t0
                        continue
                    if not e.data:
                        continue
                    ev = json.loads(e.data)
                    if "error" in ev:
                        r["error"] = ev["error"]
                        r["terminal_s"] = r["terminal_s"] or time.monotonic() - t0
                    got = _contents(ev)
                    if got and r["ttft_s"] is None:
                        r["ttft_s"] = time.monotonic() - t0
                    r["contents"] += got
                if f["kind"] == "disconnect" and len(r["contents"]) >= f["k"]:
                    r["client_closed"] = True
                    break
        if r["client_closed"]:
            # The with-blocks closed the response and its connection: that is the close.
            r["closed_at"] = time.time()
            r["terminal_s"] = time.monotonic() - t0
    except (httpx.HTTPError, ValueError) as e:
        r["transport_error"] = f"{type(e).__name__}: {e}"
    return r


def verdict(r: dict[str, Any]) -> str:
    """'' when the client saw a correct outcome, else what was wrong."""
    ref = reference(r)
    got = r["contents"]
    if r["transport_error"] or r["status"] != 200:
        return f"status {r['status']} {r['transport_error'] or ''}".strip()
    if r["kind"] == "disconnect":
        want = ref[:r["k"]]
        return "" if r["client_closed"] and got[:r["k"]] == want and got[:len(want)] == want \
            and ref[:len(got)] == got else f"not the exact first {r['k']} tokens: {got}"
    if r["error"] is None:
        return "" if r["done"] and got == ref else \
            f"no error, {len(got)} tokens, done={r['done']}, exact={got == ref}"
    if r["error"].get("code") != "upstream_decode_interrupted":
        return f"error {r['error']}"
    return "" if got == ref[:len(got)] and r["done"] else f"not an exact prefix: {got}"


def _journal(c: httpx.Client, rid: str, until: float) -> dict[str, Any] | None:
    while True:
        try:
            resp = c.get(f"/v1/requests/{rid}")
            if resp.status_code == 200:
                j: dict[str, Any] = resp.json()
                if j.get("outcome") is not None and all(
                        a.get("ended_at") for a in j.get("attempts") or []):
                    return j
        except httpx.HTTPError:
            pass
        if time.monotonic() > until:
            return None
        time.sleep(0.1)


def engine_rows(st: Stack) -> dict[tuple[str, int], dict[str, Any]]:
    return {(str(x["request_id"]), int(x["attempt"])): x for x in st.all_replica_logs()}


def measure_side(side: str, faults: list[dict[str, Any]], conc: int, work: Path,
                 log: Any) -> dict[str, Any]:
    st = Stack(workdir=work / side, config=CONFIG, replicas=2, partition_proxies=True,
               registry=True, agents=side == "with", token_delay_ms=TOKEN_DELAY_MS)
    started = time.monotonic()
    st.start()
    try:
        st.wait_replicas_healthy(30)
        log(f"{side}: stack up in {time.monotonic() - started:.1f} s; {len(faults)} faults, "
            f"{conc} at a time ...")
        t = time.monotonic()
        with ThreadPoolExecutor(conc) as ex:
            rows = list(ex.map(lambda f: one(st.base_url, f), faults))
        log(f"{side}: clients done in {time.monotonic() - t:.1f} s; settling ...")
        until = time.monotonic() + SETTLE_S
        d = TOKEN_DELAY_MS / 1000.0
        with httpx.Client(base_url=st.base_url, timeout=5) as c:
            for r in rows:
                r["verdict"] = verdict(r)
                rid = r["request_id"]
                r["journal"] = _journal(c, rid, until) if rid else None
        while True:
            eng = engine_rows(st)
            missing = [r for r in rows if (r["request_id"], 1) not in eng]
            if not missing or time.monotonic() > until:
                break
            time.sleep(0.2)
        for r in rows:
            abandon(r, eng.get((r["request_id"], 1)), d)
        agents = {}
        if side == "with":
            for i in range(st.replicas):
                m = st.agent_metrics(f"agent-r{i + 1}")
                agents[f"agent-r{i + 1}"] = {k: v for k, v in m.items() if k.startswith(
                    ("extproc_agent_aborts_total", "extproc_agent_acks_total",
                     "extproc_agent_no_evidence_total", "extproc_agent_fenced_refusals",
                     "extproc_agent_bytes_stopped"))}
        return {"side": side, "rows": rows, "agents": agents,
                "elapsed_s": round(time.monotonic() - started, 1)}
    finally:
        st.stop()


def abandon(r: dict[str, Any], eng: dict[str, Any] | None, d: float) -> None:
    """When attempt 1 was given up, when its engine let go, and the decode nobody got."""
    r["engine"] = eng
    r["abandoned_at"] = None
    if r["kind"] == "disconnect":
        r["abandoned_at"] = r["closed_at"]
        delivered = len(r["contents"])
    else:
        atts = (r["journal"] or {}).get("attempts") or []
        if atts:
            r["abandoned_at"] = atts[0].get("ended_at")
        # Of a cut attempt 1 the client got what crossed before the cut.
        delivered = 0 if r["kind"] == "before-first" else min(1, len(r["contents"]))
    if eng is None or r["abandoned_at"] is None:
        r["after_s"] = r["wasted_s"] = None
        return
    r["after_raw_s"] = eng["ts"] - r["abandoned_at"]
    r["after_s"] = max(0.0, r["after_raw_s"])
    r["wasted_s"] = max(0, int(eng["tokens_computed"]) - delivered) * d


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(sides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for kind in KINDS:
        for s in sides:
            rows = [r for r in s["rows"] if r["kind"] == kind]
            after = [r["after_s"] for r in rows if r.get("after_s") is not None]
            wasted = [r["wasted_s"] for r in rows if r.get("wasted_s") is not None]
            ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
            term = [r["terminal_s"] for r in rows if r["terminal_s"] is not None]
            outcomes: dict[str, int] = {}
            for r in rows:
                e = r["engine"]
                k = e["outcome"] if e else "no engine line"
                outcomes[k] = outcomes.get(k, 0) + 1
            n = len(rows)
            out.append({
                "kind": kind, "side": s["side"], "faults": n,
                "measured": len(after),
                "after_per_100": 100 * sum(after) / len(after) if after else float("nan"),
                "after_p50": pct(after, 0.5), "after_p99": pct(after, 0.99),
                "done_before": sum(1 for r in rows if (r.get("after_raw_s") or 0) < 0),
                "wasted_per_100": 100 * sum(wasted) / len(wasted) if wasted else float("nan"),
                "ttft_p50": pct(ttft, 0.5), "terminal_p50": pct(term, 0.5),
                "correct": sum(1 for r in rows if not r["verdict"]),
                "engine_outcomes": outcomes,
            })
    return out


def render(summary: list[dict[str, Any]], meta: dict[str, Any], n: int, conc: int) -> str:
    lines = [f"Abandoned attempts, {n} faults per kind per side, {conc} at a time, seed "
             f"{meta['seed']}; demo replicas at {TOKEN_DELAY_MS:g} ms/token, {MAX_TOKENS} tokens;"
             f" {meta['nproc']} CPUs; {meta['date_utc']}",
             "engine-s: engine-seconds; 'after' = from the gateway giving the attempt up to "
             "the engine's own end; 'wasted' = decode of the attempt that reached no client",
             "",
             "| kind | agent | engine-s after / 100 faults | after p50 / p99 per fault (ms) |"
             " done before | engine-s wasted / 100 faults | TTFT p50 (ms) | terminal p50 (ms)"
             " | correct |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['kind']} | {s['side']} | {s['after_per_100']:.2f} | "
            f"{1000 * s['after_p50']:.0f} / {1000 * s['after_p99']:.0f} | "
            f"{s['done_before']}/{s['measured']} | {s['wasted_per_100']:.1f} | "
            f"{1000 * s['ttft_p50']:.0f} | {1000 * s['terminal_p50']:.0f} | "
            f"{s['correct']}/{s['faults']} |")
    lines.append("")
    for s in summary:
        lines.append(f"engine's own outcome, {s['kind']} {s['side']}: {s['engine_outcomes']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.abandoned", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=50, help="faults per kind per side (50)")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", default=str(RESULTS / "abandoned.json"))
    a = ap.parse_args(args)
    n = max(1, min(a.faults, 200))
    conc = max(1, min(a.concurrency, 16))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, _deadline_hit)
    signal.alarm(int(BUDGET_S))
    meta = {**machine_info(), "seed": a.seed}
    faults = plan(n, a.seed)
    sides = []
    work = RESULTS / "abandoned-work"
    shutil.rmtree(work, ignore_errors=True)
    for side in SIDES:
        sides.append(measure_side(side, faults, conc, work, log))
    signal.alarm(0)
    summary = summarize(sides)
    table = render(summary, meta, n, conc)
    print(table)
    bad = [(s["side"], r) for s in sides for r in s["rows"] if r["verdict"]]
    for side, r in bad:
        print(f"FAILED ({side}, {r['kind']} #{r['i']}, {r['request_id']}): {r['verdict']}")
    for s in sides:
        if s["agents"]:
            print(f"agents' counters: {json.dumps(s['agents'])}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "table": table,
                               "sides": sides}, indent=1, default=str))
    print(f"(json in {out})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
