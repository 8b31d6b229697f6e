"""Where the processor's time goes: py-spy samples of the processor under benchmark load.

    .venv/bin/python -m bench.profile                 # paced (16 streams @ 4 ms) + saturation
    .venv/bin/python -m bench.profile --load paced --seconds 8
    .venv/bin/python -m bench.profile --load ttfd      # sequential requests: per-request work

Starts the same stack as `bench.run` ("ours"), drives one load, records the processor with
`py-spy record --format raw` (collapsed stacks, native frames off, GIL-holding samples only)
and prints the top frames by self time and by inclusive time, grouped into buckets (gRPC
read/write, protobuf, SSE parsing, state machine, etcd, logging, event loop). The raw
collapsed stacks are kept in bench/results/profile-<load>.txt (for flamegraph tools).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import RESULTS, Params, latency, run_loop, saturation, start_stack, ttfd

BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Self time in these frames is grpc.aio's Cython (no Python frames below them).
    ("grpc.aio write (awaited send)", ("Session.write",)),
    ("grpc.aio read", ("Session.run",)),
    ("etcd (aetcd stubs, our store)", ("etcd_store.py", "journal_store.py", "kv_etcd.py",
                                       "aetcd")),
    ("logging / telemetry", ("logging/", "logs.py", "telemetry.py", "opentelemetry")),
    ("SSE parsing", ("core/sse.py",)),
    ("state machine", ("core/machine.py", "core/gate.py", "core/guard.py")),
    ("protobuf build/parse", ("envoy_codec.py", "google/protobuf", "_pb2")),
    ("grpc.aio read/write", ("grpc/aio", "grpc/_cython", "_server.py", "_call.py")),
    ("our session code", ("adapters/session.py", "adapters/guard.py", "adapters/gate.py",
                          "adapters/processor.py", "adapters/released.py",
                          "adapters/attempt_record.py", "adapters/request_record.py",
                          "adapters/server.py")),
    ("asyncio / uvloop", ("asyncio/", "uvloop")),
)


def bucket(stack: list[str]) -> str:
    """The innermost frame decides the bucket; frames are 'func (file:line)'."""
    for frame in reversed(stack):
        for name, needles in BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "other"


def summarize(raw: Path, top: int) -> str:
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    buckets: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack_s, _, n_s = line.rpartition(" ")
        if not stack_s:
            continue
        n = int(n_s)
        frames = stack_s.split(";")
        total += n
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
        buckets[bucket(frames)] += n
    out = [f"samples: {total}", "", "by bucket (innermost matching frame):"]
    for name, n in buckets.most_common():
        out.append(f"  {100 * n / total:5.1f}%  {name}")
    out += ["", f"top {top} by self time:"]
    for f, n in self_t.most_common(top):
        out.append(f"  {100 * n / total:5.1f}%  {f}")
    out += ["", f"top {top} by inclusive time:"]
    for f, n in incl.most_common(top):
        out.append(f"  {100 * n / total:5.1f}%  {f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", choices=("paced", "saturation", "ttfd", "both"),
                    default="both")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    loads = ("paced", "saturation") if a.load == "both" else (a.load,)
    secs = max(2.0, min(a.seconds, 60.0))
    for load in loads:
        p = Params(repeats=1, sat_warmup_s=1.0, sat_duration_s=secs, lat_warmup_s=1.0,
                   lat_duration_s=secs, ttfd_requests=100_000, ttfd_max_s=secs)
        work = RESULTS / f"profile-{load}"
        shutil.rmtree(work, ignore_errors=True)
        stack = start_stack("ts" if load == "paced" else "demo", "ours", work)
        raw = RESULTS / f"profile-{load}.txt"
        try:
            pid = stack.procs["processor"].pid
            assert pid is not None
            rec = subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(secs)), "--rate", "500",
                 "--format", "raw", "--output", str(raw), "--gil", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if load == "paced":
                r = run_loop(latency(stack, p, 4.0))
                figure = (f"achieved {r['achieved_chunks_per_s']:.0f} chunks/s, "
                          f"p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms")
            elif load == "ttfd":
                r = run_loop(ttfd(stack, p))
                figure = (f"{r['samples']} sequential requests, TTFD p50 {r['p50_ms']:.3f} ms "
                          f"p99 {r['p99_ms']:.3f} ms")
            else:
                r = run_loop(saturation(stack, p))
                figure = f"{r['chunks_per_s']:.0f} chunks/s"
            rec.wait(timeout=secs + 30)
        finally:
            stack.stop()
        print(f"== {load}: {figure}")
        print(summarize(raw, a.top) if raw.exists() else "(py-spy wrote nothing)")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
