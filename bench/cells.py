"""Cells (decision 0019): saturation throughput with 1 and 2 cells, ours and plain Envoy.

    .venv/bin/python -m bench.cells            # 3 repeats, ~5 min
    .venv/bin/python -m bench.cells --quick    # 1 repeat, short windows, ~1.5 min

A cell is one Envoy (`--concurrency 1`) and, on our side, one processor; N cells share the
listener port (SO_REUSEPORT), etcd and the 2 demo replicas. Per repeat, four stacks in turn
(fresh each; the order reverses between repeats): plain x1, plain x2, ours x1, ours x2 (plain
x2 is two Envoys on the port, the same shape without processors). Each runs bench/measure.py's
saturation figure (32 looping streams of 256 chunks, CPU accounted per process from /proc).
Prints delivered chunks/s (min/median/max), ours/plain for the same number of cells, the
scaling from 1 to 2 cells, and the cores each part used, per cell; writes
bench/results/cells.json. On this 2-core machine the load generator and the replicas share
the cores with the cells: the scaling shown is what 2 cores allow, not 2 free cores per cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import QUICK, RESULTS, Params, machine_info, run_loop, saturation, wait_idle
from devkit.devstack import Stack

CONFIGS = (("plain", 1), ("plain", 2), ("ours", 1), ("ours", 2))


def measure(side: str, cells: int, p: Params, work: Path, log: Any) -> dict[str, Any]:
    wd = work / f"{side}-x{cells}-{time.time_ns()}"
    idle = wait_idle(p, log)
    st = Stack(workdir=wd, config={}, replicas=2, plain=side == "plain", cells=cells).start()
    try:
        time.sleep(0.3)
        log(f"  {side} x{cells}: saturation ...")
        r = run_loop(saturation(st, p))
        r["died"] = sorted(set(r["died"]) | {k for k, pr in st.procs.items() if not pr.alive()})
    finally:
        st.stop()
    r["idle_check"] = idle
    r["workdir"] = str(wd)
    return r


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, cells in CONFIGS:
        key = f"{side}x{cells}"
        rs = [r[key] for r in runs if key in r and not r[key]["died"]]
        cps = [r["chunks_per_s"] for r in rs]
        cores = {part: med([r["cpu_cores"][part] for r in rs])
                 for part in ("processor", "envoy", "replicas", "etcd", "client")}
        out[key] = {"chunks_per_s": [min(cps), med(cps), max(cps)] if cps else None,
                    "cores": cores, "machine_busy": med([r["cpu_cores"]["machine_busy_frac"]
                                                         for r in rs]),
                    "errors": sum(int(r["non_200"]) + int(r["transport_errors"])
                                  + int(r["error_events"]) for r in rs)}
    for cells in (1, 2):
        o, pl = out[f"oursx{cells}"]["chunks_per_s"], out[f"plainx{cells}"]["chunks_per_s"]
        out[f"ratio_x{cells}"] = o[1] / pl[1] if o and pl else None
    for side in ("plain", "ours"):
        one, two = out[f"{side}x1"]["chunks_per_s"], out[f"{side}x2"]["chunks_per_s"]
        out[f"scaling_{side}"] = two[1] / one[1] if one and two else None
    return out


def render(s: dict[str, Any]) -> str:
    lines = ["| stack | chunks/s (min / median / max) | vs plain, same cells | "
             "cores: processors / Envoys / replicas / etcd / client | machine busy | errors |",
             "|---|---|---|---|---|---|"]
    for side, cells in CONFIGS:
        r = s[f"{side}x{cells}"]
        c = r["chunks_per_s"]
        cps = " / ".join(f"{x:,.0f}" for x in c) if c else "n/a"
        ratio = f"x{s[f'ratio_x{cells}']:.2f}" if side == "ours" and s[
            f"ratio_x{cells}"] else ""
        k = r["cores"]
        lines.append(f"| {side} x{cells} | {cps} | {ratio} | {k['processor']:.2f} / "
                     f"{k['envoy']:.2f} / {k['replicas']:.2f} / {k['etcd']:.2f} / "
                     f"{k['client']:.2f} | {r['machine_busy']:.0%} | {r['errors']} |")
    lines.append("")
    lines.append(f"2 cells / 1 cell: plain x{s['scaling_plain']:.2f}, "
                 f"ours x{s['scaling_ours']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cells", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    ap.add_argument("--repeats", type=int, help="default 3 (1 with --quick)")
    ap.add_argument("--out", default=str(RESULTS / "cells.json"))
    a = ap.parse_args(argv)
    p = QUICK if a.quick else Params()
    p = dataclasses.replace(p, repeats=max(1, min(a.repeats or p.repeats, 10)))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = RESULTS / "work-cells"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    meta = machine_info()
    runs: list[dict[str, Any]] = []
    for rep in range(p.repeats):
        log(f"repeat {rep + 1}/{p.repeats}")
        order = CONFIGS if rep % 2 == 0 else CONFIGS[::-1]
        runs.append({f"{side}x{cells}": measure(side, cells, p, work, log)
                     for side, cells in order})
    s = summarize(runs)
    table = render(s)
    print(table)
    Path(a.out).write_text(json.dumps({"meta": meta, "params": dataclasses.asdict(p),
                                       "summary": s, "runs": runs}, indent=1, default=str)
                           + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
