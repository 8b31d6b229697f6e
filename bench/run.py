"""One-command benchmark: plain Envoy vs Envoy + our processor vs the floor, on this machine.

    .venv/bin/python -m bench.run            # full: 3 repeats + extras, ~10 min
    .venv/bin/python -m bench.run --quick    # smoke: 1 repeat, ~6 min (--no-extras: ~1.5)

Three sides, measured per repeat in turn (the order reverses between repeats), each figure on
a fresh stack started just before and stopped just after, so no two sides share the cores:
plain (Envoy alone), ours (Envoy + our processor + etcd) and floor (the same Envoy config and
ext_proc messages answered by bench/nullproc.py: no logic, no etcd). Figures:
  - added time-to-first-delta: sequential requests (demo replicas);
  - delivered chunks/s at saturation: C concurrent looping streams (demo replicas), with
    per-process CPU accounting from /proc;
  - per-chunk delivery latency at fixed rates: bench/tsupstream.py (timestamps every event)
    replaces the demo replicas behind the identical Envoy config (same Stack code path);
  - failover before the first delta and etcd round trips (ours only).
A figure whose stack loses a process (Envoy has segfaulted under load) is re-measured on a
fresh stack, up to 3 attempts; every attempt's errors and crashes are counted and printed.
Prints a table (min/median/max over repeats) and writes bench/results/latest.json.
See docs/benchmarks.md for what each figure means and its error sources.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import curve, grpc_floor, pool, streams
from bench.measure import (
    DEADLINE,
    QUICK,
    RESULTS,
    SIDES,
    Params,
    _terminate,
    code_digest,
    machine_info,
    measure_side,
)
from bench.report import render_extras, render_table, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    ap.add_argument("--repeats", type=int, help="repeats (default 3; 1 with --quick)")
    ap.add_argument("--clients", type=int, help="saturation concurrency (default 32)")
    ap.add_argument("--duration", type=float, help="saturation window seconds (default 8)")
    ap.add_argument("--out", default=str(RESULTS / "latest.json"))
    ap.add_argument("--streams", type=int, help="open streams for the memory figure "
                    "(default 10000; 1000 with --quick)")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip pool availability, the scaling curve, the open-streams figure "
                    "and the grpc floor")
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
    DEADLINE[0] = started + p.budget_s
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    runs: list[dict[str, Any]] = []
    for rep in range(p.repeats):
        order = SIDES if rep % 2 == 0 else SIDES[::-1]
        log(f"repeat {rep + 1}/{p.repeats} ({' then '.join(order)})")
        for side in order:
            r = measure_side(side, p, work / f"rep{rep + 1}", log)
            r["repeat"] = rep + 1
            runs.append(r)
    extras: dict[str, Any] = {}
    if not a.no_extras:
        extras["pool"] = pool.measure(60, 4, log)

        log("scaling curve ...")
        rows = curve.measure(work, log, curve.POINTS[:3] if a.quick else curve.POINTS,
                             2.0 if a.quick else 3.0)
        png = RESULTS / "curve.png"
        curve.plot(rows, png, f"plain Envoy vs Envoy + processor, {meta['date_utc']}, "
                   f"{meta['nproc']} CPUs, paced 4 ms/token")
        extras["curve"] = {"rows": rows, "png": str(png)}
        n = a.streams or (1000 if a.quick else 10_000)
        log(f"open streams ({n}) ...")
        extras["streams"] = streams.measure(max(10, min(n, 10_000)), work / "streams", log)
        log("grpc.aio floor ...")
        extras["floor"] = grpc_floor.measure(max(10, min(n, 10_000)))
    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["code_sha256_end"] = code_digest()
    summary = summarize(runs, p)
    table = render_table(meta, p, summary, runs)
    if extras:
        table += "\n\n" + render_extras(extras)
    print(table)
    print(f"\n(total {meta['elapsed_s']} s; logs in {work}; json in {a.out})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "params": p.__dict__, "summary": summary,
                               "runs": runs, "extras": extras, "table": table}, indent=2,
                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
