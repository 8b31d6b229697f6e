"""What the chart's resource requests are made from (docs/helm.md, "Resources").

Runs the loopback stack (etcd, the processor, Envoy, two timestamping replicas) under two
bounded loads, and reads the processor's and Envoy's CPU and memory from /proc:

- paced: 20 streams, one chunk per stream every 10 ms (2,000 chunks/s offered), for
  --paced-s seconds;
- saturation: 32 clients as fast as the stack answers, for --sat-s seconds.

CPU is CPU-seconds per 1,000 chunks (utime + stime of each process over the window, from
/proc/<pid>/stat), not a share of the machine: the machine may be shared, and CPU per chunk
is what scales to a deployment's rate. Memory is VmHWM (the peak resident set) and VmRSS at
the end, from /proc/<pid>/status. Prints one JSON object.

    python -m bench.chart_resources [--paced-s 20] [--sat-s 15]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.measure import Params, latency, run_loop, saturation, start_stack


def _status_kib(pid: int | None, field: str) -> int:
    if pid is None:
        return 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _per_1000(cpu_s: dict[str, float], chunks: float) -> dict[str, float]:
    return {k: round(cpu_s[k] / chunks * 1000.0, 4) for k in ("processor", "envoy")
            if chunks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paced-s", type=float, default=20.0)
    ap.add_argument("--sat-s", type=float, default=15.0)
    args = ap.parse_args(argv)
    p = Params(lat_streams=20, lat_tokens=128, lat_warmup_s=2.0, lat_duration_s=args.paced_s,
               lat_max_requests=20_000, sat_clients=32, sat_tokens=256, sat_warmup_s=1.0,
               sat_duration_s=args.sat_s, sat_max_requests=50_000)
    with tempfile.TemporaryDirectory(prefix="chart-res-") as work:
        stack = start_stack("ts", "ours", Path(work))
        try:
            pids = {n: stack.procs[n].pid for n in ("processor", "envoy")}
            idle = {n: _status_kib(pid, "VmRSS") for n, pid in pids.items()}
            paced = run_loop(latency(stack, p, 10.0))
            after_paced = {n: _status_kib(pid, "VmRSS") for n, pid in pids.items()}
            sat = run_loop(saturation(stack, p))
            out: dict[str, Any] = {
                "rss_kib": {"idle": idle, "after_paced": after_paced,
                            "after_saturation": {n: _status_kib(pid, "VmRSS")
                                                 for n, pid in pids.items()},
                            "peak": {n: _status_kib(pid, "VmHWM") for n, pid in pids.items()}},
                "paced": {
                    "offered_chunks_per_s": paced["offered_chunks_per_s"],
                    "achieved_chunks_per_s": round(paced["achieved_chunks_per_s"], 1),
                    "cpu_cores": {k: round(v, 3) for k, v in paced["cpu_cores"].items()},
                    "cpu_s_per_1000_chunks": _per_1000(
                        {k: v * args.paced_s for k, v in paced["cpu_cores"].items()},
                        paced["achieved_chunks_per_s"] * args.paced_s),
                    "p99_ms": round(paced["p99_ms"], 2)},
                "saturation": {
                    "chunks_per_s": round(sat["chunks_per_s"], 1),
                    "cpu_cores": {k: round(v, 3) for k, v in sat["cpu_cores"].items()},
                    "cpu_s_per_1000_chunks": _per_1000(sat["cpu_s"], sat["counted_chunks"])},
                "envoy_concurrency": 1,
            }
        finally:
            stack.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
