"""Run the fault sweep from the command line (`make sweep`, `make sweep-quick`).

  python -m devkit.sweep --full                 every kind at every index 0..N (docs/sweep.md)
  python -m devkit.sweep --quick                the deterministic subset `make test` runs
  python -m devkit.sweep --case 'kill-after-deltas@3/stream' --seed 7   one case, with trace
  python -m devkit.sweep --kinds partition,etcd-freeze --indices 0,5 --modes stream
  python -m devkit.sweep --agents --full        the same through replicas behind `extproc agent`
                                               (engine-dies in place of kill-after-deltas)
  python -m devkit.sweep --unsafe               the self-check slice on a processor started
                                               with EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE=1

Prints one line per case, then the summary table and the directory holding results.jsonl
and a trace per failing case. Exit status: 0 no violations, 1 violations, 2 time budget
exhausted before every case ran.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .harness import (
    DEFAULT_SEED,
    KINDS,
    UNSAFE_SLICE,
    Case,
    SweepEnv,
    known_issue,
    plan_cases,
    run_cases,
)
from .harness import table as summary_table

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--full", action="store_true", help="every index 0..N (default: quick)")
    g.add_argument("--quick", action="store_true", help="the fast subset (the default)")
    g.add_argument("--case", action="append", default=[],
                   help="one case KIND@INDEX/stream|unary (repeatable)")
    g.add_argument("--unsafe", action="store_true",
                   help="run the self-check slice with the fence switched off; "
                   "exits 0 only if violations were detected")
    ap.add_argument("--agents", action="store_true",
                    help="replicas behind replica agents (issue 26): the engine dies, the "
                    "agent lives; the gateway hears the agent's word")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the request's model seed")
    ap.add_argument("--kinds", help=f"comma-separated subset of: {', '.join(KINDS)}")
    ap.add_argument("--indices", help="comma-separated token indices")
    ap.add_argument("--modes", default="stream,unary", help="stream,unary")
    ap.add_argument("--out", help="results directory (default build/sweep/<timestamp>)")
    ap.add_argument("--trace-all", action="store_true",
                    help="save the trace of every case (traces/), not only failing ones")
    ap.add_argument("--budget-s", type=float, default=3000.0,
                    help="stop starting new cases after this many seconds")
    a = ap.parse_args(argv)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else ROOT / "build" / "sweep" / stamp
    out.mkdir(parents=True, exist_ok=True)
    flavour = None
    if a.case:
        cases = [Case.parse(c, a.seed, a.agents) for c in a.case]
    elif a.unsafe:
        cases = [Case(c.kind, c.index, c.stream, a.seed) for c in UNSAFE_SLICE]
        flavour = "unsafe"
    else:
        cases = plan_cases(quick=not a.full, seed=a.seed,
                           kinds=a.kinds.split(",") if a.kinds else None,
                           indices=[int(x) for x in a.indices.split(",")] if a.indices
                           else None,
                           modes=a.modes.split(","), agents=a.agents)
    print(f"# fault sweep: {len(cases)} cases, seed {a.seed}"
          + (", replicas behind agents" if a.agents else "") + f", results in {out}",
          flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="extproc-sweep-") as wd:
        env = SweepEnv(Path(wd), out, log=lambda s: print(s, flush=True),
                       trace_all=a.trace_all)
        try:
            results = list(run_cases(env, cases, a.budget_s, flavour))
        finally:
            env.close()
        skipped = list(env.skipped)
    took = time.monotonic() - t0
    failed = [r for r in results if r.violations]
    text = summary_table(results)
    reasons = sorted({why for _, why in skipped})
    if skipped:
        text += (f"\nskipped: {len(skipped)} case(s) "
                 f"({', '.join(sorted({c.kind for c, _ in skipped}))}): " + "; ".join(reasons))
    (out / "summary.txt").write_text(
        text + f"\nruntime: {took:.0f}s\n"
        + "".join(f"observation: {r.case} {r.request_id}: {o}\n"
                  for r in results for o in r.observations))
    print()
    print(text)
    print(f"runtime: {took:.0f}s ({took / 60:.1f} min) for {len(results)} cases")
    slow = [r for r in results if r.observations]
    if slow:
        print(f"observations (not violations): {len(slow)} recoveries waited for a lease "
              f"to expire although the replica's end was confirmed:")
        for r in slow:
            print(f"  {r.case} {r.request_id}: {r.observations[0]}")
    for r in failed:
        print(r.report())
    known = [r for r in failed if known_issue(r) is not None]
    if failed:
        print(f"{len(failed)} case(s) with violations: {len(known)} match a known product "
              f"issue (harness.KNOWN_ISSUES), {len(failed) - len(known)} new")
    print(f"results: {out / 'results.jsonl'}; failing traces: {out / 'failures'} "
          f"({len(failed)})")
    if a.unsafe:
        print("self-check: " + ("violations detected, as they must be" if failed
                                else "NOTHING detected: the sweep cannot fail"))
        return 0 if failed else 1
    if len(results) + len(skipped) < len(cases):
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
