"""The processor on each gRPC stack (`server.transport`, decision 0020), against plain Envoy.

    .venv/bin/python -m bench.transports              # 3 repeats, ~10 min
    .venv/bin/python -m bench.transports --quick      # 1 repeat, short windows, ~2 min

Per repeat, three sides in turn (the order reverses between repeats): plain Envoy, ours on
grpc.aio, ours on grpclib; each side measures bench/measure.py's saturation, per-chunk latency at
5,000 chunks/s offered and time-to-first-delta figures, with measure.py's own code (fresh stack
per figure, idle wait, per-process CPU from /proc, crash re-measurement). The transport is
chosen with the EXTPROC_SERVER__TRANSPORT override the processor inherits. Then, with
`--streams N`, the processor's memory per open ext_proc stream on each stack
(bench/streams.py: N guard streams held open, driven directly). Prints min / median / max per
side and the ratios to plain measured in the same repeat; writes bench/results/transports.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import streams
from bench.measure import QUICK, RESULTS, Params, lat_rate, machine_info, measure_figure
from bench.report import fmt3, mmm

SIDES = ("plain", "grpcio", "grpclib")
ENV = "EXTPROC_SERVER__TRANSPORT"


@contextlib.contextmanager
def transport(name: str) -> Iterator[None]:
    before = os.environ.get(ENV)
    if name != "plain":
        os.environ[ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def figures(p: Params) -> list[str]:
    return ["saturation", f"latency@{lat_rate(p, min(p.lat_delays_ms))}", "ttfd"]


def measure(side: str, p: Params, work: Path, log: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with transport(side):
        for fig in figures(p):
            out[fig] = measure_figure(fig, "plain" if side == "plain" else "ours", p,
                                          work / side, log)
    return out


def _get(r: dict[str, Any], fig: str, key: str) -> float | None:
    v = r.get(fig, {}).get(key)
    return float(v) if isinstance(v, int | float) else None


def summarize(runs: list[dict[str, Any]], p: Params) -> dict[str, Any]:
    lat = figures(p)[1]
    rows = [("chunks/s at saturation", "saturation", "chunks_per_s", "ratio"),
            (f"per-chunk p50 ms {lat}", lat, "p50_ms", "delta"),
            (f"per-chunk p99 ms {lat}", lat, "p99_ms", "delta"),
            ("TTFD p50 ms", "ttfd", "p50_ms", "delta"),
            ("TTFD p99 ms", "ttfd", "p99_ms", "delta")]
    out: dict[str, Any] = {}
    for label, fig, key, how in rows:
        row: dict[str, Any] = {}
        for side in SIDES:
            xs = [v for r in runs if (v := _get(r[side], fig, key)) is not None]
            row[side] = mmm(xs)
            if side != "plain":
                rel = []
                for r in runs:
                    a, b = _get(r[side], fig, key), _get(r["plain"], fig, key)
                    if a is not None and b:
                        rel.append(a / b if how == "ratio" else a - b)
                row[f"{side}_vs_plain"] = mmm(rel)
        out[label] = {"how": how, **row}
    cpu = {}
    for side in SIDES[1:]:
        xs = [r[side]["saturation"].get("cpu_us_per_chunk", {}).get("processor") for r in runs]
        cpu[side] = mmm([float(x) for x in xs if x is not None])
    out["processor CPU us/chunk (saturation)"] = {"how": "value", **cpu}
    return out


def render(s: dict[str, Any], mem: dict[str, Any]) -> str:
    lines = ["| figure | plain | ours, grpc.aio | ours, grpclib | grpc.aio vs plain | "
             "grpclib vs plain |", "|---|---|---|---|---|---|"]
    for label, row in s.items():
        def f(v: list[float] | None, spec: str = ".3f", signed: bool = False) -> str:
            return fmt3(v, spec, signed)
        spec = ".0f" if row["how"] == "ratio" else ".3f" if row["how"] == "delta" else ".1f"
        rel = ".3f"
        cells = [f(row.get(side), spec) if side in row else "-" for side in SIDES]
        rels = [("x " + f(row.get(f"{side}_vs_plain"), rel)) if row["how"] == "ratio" else
                f(row.get(f"{side}_vs_plain"), rel, True) if row["how"] == "delta" else ""
                for side in SIDES[1:]]
        lines.append(f"| {label} | " + " | ".join(cells + rels) + " |")
    if mem:
        lines.append("")
        lines.append("| open-stream memory | grpc.aio | grpclib |")
        lines.append("|---|---|---|")
        for label, key in (("KiB per stream at N", "at_n"), ("KiB per stream, N/2 to N slope",
                                                            "slope")):
            lines.append(f"| {label} | " + " | ".join(
                f"{mem[side][key]:.1f}" if side in mem else "n/a" for side in SIDES[1:]) + " |")
    return "\n".join(lines)


def memory(side: str, n: int, work: Path, log: Any) -> dict[str, Any]:
    with transport(side):
        r = streams.measure(n, work / f"streams-{side}", log)
    pts = r["points"]
    last = pts[-1]
    half = next((x for x in pts if x["streams"] == max(1, n // 2)), pts[0])
    slope = ((last["rss_kib"] - half["rss_kib"]) / max(1, last["open_ok"] - half["open_ok"]))
    return {"at_n": last["kib_per_stream"], "slope": slope, "open_ok": last["open_ok"],
            "alive": r["processor_alive"], "raw": r}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.transports", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    ap.add_argument("--repeats", type=int, help="default 3 (1 with --quick)")
    ap.add_argument("--streams", type=int, default=0,
                    help="also the memory per open stream with N streams (<= 10000)")
    ap.add_argument("--out", default=str(RESULTS / "transports.json"))
    a = ap.parse_args(argv)
    p = QUICK if a.quick else Params()
    p = dataclasses.replace(p, repeats=max(1, min(a.repeats or p.repeats, 10)))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = RESULTS / "work-transports"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    meta = machine_info()
    runs: list[dict[str, Any]] = []
    for rep in range(p.repeats):
        order = SIDES if rep % 2 == 0 else SIDES[::-1]
        log(f"repeat {rep + 1}/{p.repeats} ({' then '.join(order)})")
        runs.append({side: measure(side, p, work / f"rep{rep + 1}", log) for side in order})
    mem: dict[str, Any] = {}
    if a.streams:
        for side in SIDES[1:]:
            log(f"open streams ({side}) ...")
            mem[side] = memory(side, max(10, min(a.streams, 10_000)), work, log)
    s = summarize(runs, p)
    table = render(s, mem)
    print(f"extproc transports  {meta['date_utc']}  sources {meta['code_sha256_start']}  "
          f"repeats={p.repeats}")
    print(table)
    Path(a.out).write_text(json.dumps({"meta": meta, "params": dataclasses.asdict(p),
                                       "summary": s, "memory": mem, "runs": runs}, indent=1,
                                      default=str) + "\n")
    errors = sum(int(f.get(k, 0)) for r in runs for side in r.values() for f in side.values()
                 for k in ("non_200", "transport_errors", "error_events", "incomplete"))
    print(f"\nerrors (non-200, transport, error events, incomplete; every side): {errors}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
