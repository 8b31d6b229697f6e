"""Pool availability: healthy traffic while one replica of three is dead or frozen.

    .venv/bin/python -m bench.pool             # both sides, both faults, ~1 min
    .venv/bin/python -m bench.pool --requests 120 --concurrency 8

Two sides measured back to back in the same run, on the same Envoy config: plain (Envoy
alone, with the same health checks, outlier detection and retry policy) and ours (Envoy +
processor + etcd). Three demo replicas; `timeouts.first_delta_s` is shortened to FIRST so
the bounds are seconds (everything else is the default policy: retry budget, pool health,
first-delta budget). For each fault, on a fresh stack: N healthy requests (no fault
header), C at a time, while replica r2 is SIGKILLed and kept down ("dead") or SIGSTOPped
("frozen": the kernel still accepts its connections), or both at once ("two-down": r2 dead
and r3 frozen, one healthy replica left; decision 0024). `--panic P` renders
pool.healthy_panic_threshold P on both sides (the comparison in decision 0024). A request
counts as complete only with HTTP 200, every expected content event, `[DONE]` and no error
event; anything else is counted by what the client saw. Prints, per side and fault: the
share of complete requests, the worst and median wait, and ours / plain. Bounded: N
requests per scenario, each with a 30 s client timeout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # `python bench/pool.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.devstack import Stack

FIRST = 3.0
MAX_TOKENS = 16
CONFIG: dict[str, Any] = {"timeouts": {"first_delta_s": FIRST, "soft_first_delta_s": 1.0,
                                       "stall_after_first_delta_s": 2.0}}
FAULTS = ("dead", "frozen", "two-down")
SIDES = ("plain", "ours")


def _one(base: str) -> dict[str, Any]:
    body = {"model": "demo-model", "stream": True, "max_tokens": MAX_TOKENS, "seed": 7,
            "messages": [{"role": "user", "content": "pool availability"}]}
    t = time.monotonic()
    status, raw, err = 0, b"", None
    try:
        with httpx.Client(base_url=base, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            status = r.status_code
            for chunk in r.iter_raw():
                raw += chunk
    except httpx.HTTPError as e:
        err = type(e).__name__
    took = time.monotonic() - t
    contents = raw.count(b'"delta":{"content":"')
    complete = (status == 200 and err is None and contents == MAX_TOKENS
                and b"data: [DONE]" in raw and b'data: {"error"' not in raw)
    code = None
    if not complete:
        try:
            code = json.loads(raw).get("error", {}).get("code") if status != 200 else None
        except ValueError:
            code = None
        if code is None and b'data: {"error"' in raw:
            code = "in-band error"
    return {"complete": complete, "took_s": took, "status": status, "error": err,
            "code": code}


def scenario(side: str, fault: str, n: int, conc: int, work: Path,
             pool: dict[str, Any] | None = None) -> dict[str, Any]:
    config = {**CONFIG, "pool": pool} if pool else CONFIG
    st = Stack(workdir=work / f"{side}-{fault}", config=config, replicas=3,
               plain=side == "plain").start()
    try:
        st.wait_replicas_healthy()
        time.sleep(2.5)  # Envoy's health checks have seen every replica healthy
        if fault in ("dead", "two-down"):
            st.hold_down("r2")
        if fault == "frozen":
            st.freeze("r2")
        if fault == "two-down":
            st.freeze("r3")
        lock = threading.Lock()
        rows: list[dict[str, Any]] = []

        def run(_: int) -> None:
            r = _one(st.base_url)
            with lock:
                rows.append(r)

        t0 = time.monotonic()
        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(run, range(n)))
        wall = time.monotonic() - t0
    finally:
        if fault == "frozen":
            st.thaw("r2")
        if fault == "two-down":
            st.thaw("r3")
        st.release("r2")
        st.stop()
    took = sorted(r["took_s"] for r in rows)
    failures: dict[str, int] = {}
    for r in rows:
        if not r["complete"]:
            k = r["code"] or r["error"] or f"http {r['status']}"
            failures[k] = failures.get(k, 0) + 1
    return {"side": side, "fault": fault, "requests": n, "concurrency": conc,
            "complete": sum(1 for r in rows if r["complete"]),
            "share": sum(1 for r in rows if r["complete"]) / max(1, n),
            "worst_s": took[-1], "p50_s": statistics.median(took),
            "p99_s": took[min(len(took) - 1, int(0.99 * len(took)))],
            "wall_s": wall, "failures": failures}


def measure(n: int = 60, conc: int = 4, log: Any = None,
            faults: tuple[str, ...] = FAULTS, pool: dict[str, Any] | None = None
            ) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as d:
        for fault in faults:
            for side in SIDES:
                if log:
                    log(f"pool availability: {side}, {fault} ...")
                out.append(scenario(side, fault, n, conc, Path(d), pool))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["side"], r["fault"]): r for r in rows}
    n, c = rows[0]["requests"], rows[0]["concurrency"]
    lines = [f"pool availability: 3 demo replicas, {n} healthy requests, {c} at a time, "
             f"first_delta_s {FIRST:g} (bound: 2 x first_delta_s + margin)",
             f"{'fault':<8} {'side':<6} {'complete':>10} {'share':>7} {'p50 s':>7} "
             f"{'p99 s':>7} {'worst s':>8}  failures",
             "-" * 78]
    for fault in dict.fromkeys(r["fault"] for r in rows):
        for side in SIDES:
            r = by[(side, fault)]
            lines.append(f"{fault:<8} {side:<6} {r['complete']:>5}/{r['requests']:<4} "
                         f"{r['share']:>7.1%} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f} "
                         f"{r['worst_s']:>8.2f}  {r['failures'] or '-'}")
        o, p = by[("ours", fault)], by[("plain", fault)]
        lines.append(f"{'':<8} ours / plain: complete x{o['share'] / max(p['share'], 1e-9):.2f}, "
                     f"worst wait x{o['worst_s'] / max(p['worst_s'], 1e-9):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--panic", type=float, default=None,
                    help="pool.healthy_panic_threshold for both sides (default: the config's)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f in FAULTS) or FAULTS
    pool = None if a.panic is None else {"healthy_panic_threshold": max(0.0, min(a.panic, 100.0))}
    rows = measure(max(4, min(a.requests, 2000)), max(1, min(a.concurrency, 64)),
                   lambda m: print(m, file=sys.stderr, flush=True), faults, pool)
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
