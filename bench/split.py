"""The processor's CPU at saturation split into a per-chunk and a per-request part.

    .venv/bin/python -m bench.split                       # 256 and 2048 tokens, 2 repeats
    .venv/bin/python -m bench.split --lengths 64,256,2048 --repeats 3

`make bench`'s "processor CPU per chunk" is measured at one stream length (256 tokens a
request), so it mixes what every chunk costs with what every request costs (its intake,
admission, fence and outcome, two ext_proc streams' set-up) spread over 256 chunks. This
runs the same saturation figure (`bench.measure`'s, same stack, same client) at several
lengths, floor and ours alternated on fresh stacks, and fits, per side, processor CPU per
chunk = a + b / tokens: `a` is the per-chunk cost, `b` the per-request cost. From the two
fits it says at which stream length ours comes within 1.3 times the floor (issue 28's
target), if any. Machine-wide numbers: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import RESULTS, Params, _terminate, machine_info, measure_figure

SIDES = ("floor", "ours")
TARGET = 1.3  # issue 28: ours within 1.3x of the floor's CPU per chunk


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of y = a + b / t over (t, y): (a per chunk, b per request), same unit
    as y. Needs two distinct lengths."""
    xs = [1.0 / t for t, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        raise ValueError("fit needs at least two distinct stream lengths")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def break_even(ours: tuple[float, float], floor: tuple[float, float],
               ratio: float = TARGET) -> float | None:
    """The stream length (tokens) from which ours' CPU per chunk is within `ratio` times the
    floor's, by the two fits; None if no length is (ours' per-chunk part alone is over)."""
    (ao, bo), (af, bf) = ours, floor
    room = ratio * af - ao  # what a chunk leaves for the per-request part
    if room <= 0:
        return None
    return max(1.0, (bo - ratio * bf) / room)


def at(f: tuple[float, float], tokens: float) -> float:
    return f[0] + f[1] / tokens


def render(res: dict[str, Any]) -> str:
    lines = [f"processor CPU per chunk at saturation, by stream length ({res['repeats']} "
             "repeats; median, min-max)",
             f"{'tokens':>7}  {'floor us':>18}  {'ours us':>18}  {'ours/floor':>10}"]
    for t in res["lengths"]:
        row = res["by_length"][str(t)]
        cells = []
        for side in SIDES:
            v = row[side]
            cells.append(f"{statistics.median(v):6.2f} ({min(v):.2f}-{max(v):.2f})")
        ratios = row["ratio"]
        lines.append(f"{t:>7}  {cells[0]:>18}  {cells[1]:>18}  x{statistics.median(ratios):.2f}")
    fo, ff = res["fit"]["ours"], res["fit"]["floor"]
    lines += [
        "fit: CPU per chunk = a + b / tokens",
        f"  floor: a = {ff['a_us']:.2f} us per chunk, b = {ff['b_us'] / 1000:.2f} ms per request",
        f"  ours:  a = {fo['a_us']:.2f} us per chunk (x{fo['a_us'] / ff['a_us']:.2f}), "
        f"b = {fo['b_us'] / 1000:.2f} ms per request (+{(fo['b_us'] - ff['b_us']) / 1000:.2f})",
    ]
    be = res["break_even_tokens"]
    lines.append(f"  ours within x{TARGET} of the floor from "
                 + (f"{be:.0f} tokens a request" if be is not None
                    else "no length: the per-chunk part alone is over"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.split", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,2048",
                    help="tokens per request, comma-separated (at least two)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="saturation window")
    ap.add_argument("--out", default=str(RESULTS / "split.json"))
    a = ap.parse_args(argv)
    lengths = sorted({max(8, min(int(x), 16384)) for x in a.lengths.split(",") if x.strip()})
    if len(lengths) < 2:
        ap.error("--lengths needs at least two distinct lengths")
    repeats = max(1, min(a.repeats, 10))
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = RESULTS / "work-split"
    meta = machine_info()
    t0 = time.monotonic()
    raw: list[dict[str, Any]] = []
    for rep in range(repeats):
        for t in lengths:
            sides = SIDES if rep % 2 == 0 else SIDES[::-1]
            for side in sides:
                p = Params(repeats=1, sat_tokens=t, sat_duration_s=max(1.0, min(a.seconds, 60)),
                           budget_s=60.0)
                r = measure_figure("saturation", side, p, work, log)
                us = r["cpu_us_per_chunk"].get("processor", math.nan)
                raw.append({"repeat": rep, "tokens": t, "side": side, "us_per_chunk": us,
                            "chunks_per_s": r["chunks_per_s"], "valid": r["valid"],
                            "disturbed": r["disturbed"], "failed": r["requests"] - r["ok"]})
                log(f"  repeat {rep + 1}, {t} tokens, {side}: {us:.2f} us per chunk, "
                    f"{r['chunks_per_s']:.0f} chunks/s")
    ok = [x for x in raw if x["valid"] and not math.isnan(x["us_per_chunk"])]
    by_length: dict[str, dict[str, list[float]]] = {}
    for t in lengths:
        row: dict[str, list[float]] = {s: [x["us_per_chunk"] for x in ok
                                           if x["tokens"] == t and x["side"] == s]
                                       for s in SIDES}
        row["ratio"] = [o["us_per_chunk"] / f["us_per_chunk"]
                        for o in ok if o["tokens"] == t and o["side"] == "ours"
                        for f in ok if f["tokens"] == t and f["side"] == "floor"
                        and f["repeat"] == o["repeat"]]
        by_length[str(t)] = row
    fits = {s: fit([(x["tokens"], x["us_per_chunk"]) for x in ok if x["side"] == s])
            for s in SIDES}
    res = {"meta": meta, "lengths": lengths, "repeats": repeats, "raw": raw,
           "by_length": by_length,
           "fit": {s: {"a_us": f[0], "b_us": f[1]} for s, f in fits.items()},
           "break_even_tokens": break_even(fits["ours"], fits["floor"]),
           "elapsed_s": time.monotonic() - t0}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"extproc CPU split  {meta['date_utc']}  ({meta['cpu_model']}, "
          f"{meta['nproc']} CPUs; sources {meta['code_sha256_start']})")
    print(render(res))
    print(f"(total {res['elapsed_s']:.0f} s; json in {a.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
