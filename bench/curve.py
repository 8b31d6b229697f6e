"""The scaling curve: paced streams vs delivered chunk rate vs per-chunk latency, plain and ours.

For each point (N concurrent streams, one token every 4 ms each, so N x 250 chunks/s offered)
the timestamping upstream runs behind plain Envoy and behind Envoy + processor, each on a fresh
stack; the table gives achieved chunks/s and p50/p99 delivery latency, and `plot` draws it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.measure import Params, latency, run_loop, start_stack

DELAY_MS = 4.0
POINTS = (5, 10, 20, 40, 80)  # streams: 1250 .. 20000 chunks/s offered


def measure(work: Path, log: Any, points: tuple[int, ...] = POINTS,
            window_s: float = 3.0) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in points:
        p = Params(lat_streams=n, lat_warmup_s=0.5, lat_duration_s=window_s,
                   lat_tokens=128)
        row: dict[str, Any] = {"streams": n, "offered": n * 1000.0 / DELAY_MS}
        for side in ("plain", "ours"):
            stack = start_stack("ts", side, work / f"curve-{n}-{side}")
            try:
                r = run_loop(latency(stack, p, DELAY_MS))
            finally:
                stack.stop()
            row[side] = {k: r[k] for k in ("achieved_chunks_per_s", "p50_ms", "p99_ms",
                                           "transport_errors", "incomplete")}
            row[side]["processor_cores"] = r["cpu_cores"].get("processor", 0.0)
            log(f"  curve {n} streams {side}: {r['achieved_chunks_per_s']:.0f} chunks/s, "
                f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms")
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["scaling curve (paced, 4 ms/token): streams, offered chunks/s, then per side "
           "achieved chunks/s, p50 ms, p99 ms",
           f"{'streams':>7} {'offered':>8} | {'plain':>8} {'p50':>7} {'p99':>7} | "
           f"{'ours':>8} {'p50':>7} {'p99':>7} {'proc':>5}"]
    for r in rows:
        a, b = r["plain"], r["ours"]
        out.append(f"{r['streams']:>7} {r['offered']:>8.0f} | {a['achieved_chunks_per_s']:>8.0f} "
                   f"{a['p50_ms']:>7.3f} {a['p99_ms']:>7.3f} | {b['achieved_chunks_per_s']:>8.0f} "
                   f"{b['p50_ms']:>7.3f} {b['p99_ms']:>7.3f} {b['processor_cores']:>5.2f}")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["offered"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, style in (("plain", "o-"), ("ours", "s-")):
        ax1.plot(x, [r[side]["achieved_chunks_per_s"] for r in rows], style, label=side)
        ax2.plot(x, [r[side]["p50_ms"] for r in rows], style, label=f"{side} p50")
        ax2.plot(x, [r[side]["p99_ms"] for r in rows], style.replace("-", "--"),
                 label=f"{side} p99")
    ax1.plot(x, x, ":", color="grey", label="offered")
    ax1.set_xlabel("offered chunks/s (streams x 250/s)")
    ax1.set_ylabel("delivered chunks/s")
    ax1.legend()
    ax2.set_xlabel("offered chunks/s")
    ax2.set_ylabel("per-chunk delivery latency (ms)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
