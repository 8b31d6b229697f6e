"""python -m chaos --duration S --seed N [--etcd-members 3] [--out DIR]

Exit status: 0 with no break, 1 with at least one break, 2 when the harness itself failed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import yaml

from .faults import FAULT_KINDS, SHARD_FAULT_KINDS
from .runner import CHAOS_CONFIG, Options, render_evidence, render_summary, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds of traffic and faults (the settle phase and checks follow)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--etcd-members", type=int, default=3)
    ap.add_argument("--shards", type=int, default=1,
                    help="the journal sharded over this many etcd clusters (decision 0042); "
                         f"with 2 or more, the faults include {','.join(SHARD_FAULT_KINDS)}")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--workers", type=int, default=6, help="concurrent client workers")
    ap.add_argument("--max-requests", type=int, default=20000)
    ap.add_argument("--fault-share", type=float, default=0.3,
                    help="share of requests carrying an x-replica-fault header")
    ap.add_argument("--keyed-share", type=float, default=0.5,
                    help="share of requests carrying an Idempotency-Key")
    ap.add_argument("--faults", default=None,
                    help=f"fault kinds of the chaos loop, comma-separated (default all: "
                         f"{','.join(FAULT_KINDS)}, and the shard faults with --shards 2 "
                         f"or more; '' for none)")
    ap.add_argument("--max-concurrent-faults", type=int, default=2)
    ap.add_argument("--config", default=None,
                    help="a processor config YAML merged over the chaos defaults")
    ap.add_argument("--out", default=None, help="report directory (default chaos-out/...)")
    args = ap.parse_args(argv)

    known = FAULT_KINDS + SHARD_FAULT_KINDS
    if args.faults is None:
        kinds = FAULT_KINDS + (SHARD_FAULT_KINDS if args.shards > 1 else ())
    else:
        kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = [k for k in kinds if k not in known]
    if unknown:
        ap.error(f"unknown fault kinds {unknown}; known: {', '.join(known)}")
    if not 1 <= args.shards <= 8:
        ap.error("--shards must be between 1 and 8")
    if args.shards == 1 and any(k in SHARD_FAULT_KINDS for k in kinds):
        ap.error(f"{', '.join(SHARD_FAULT_KINDS)} need --shards 2 or more")
    if not 1 <= args.etcd_members <= 9:
        ap.error("--etcd-members must be between 1 and 9")
    if args.duration <= 0 or args.workers < 1 or args.max_requests < 1:
        ap.error("--duration, --workers and --max-requests must be positive")
    config = json.loads(json.dumps(CHAOS_CONFIG))
    if args.config:
        extra = yaml.safe_load(Path(args.config).read_text()) or {}
        for section, values in extra.items():
            if isinstance(values, dict):
                config[section] = {**(config.get(section) or {}), **values}
            else:
                config[section] = values
    out = Path(args.out) if args.out else None
    opts = Options(duration_s=args.duration, seed=args.seed, etcd_members=args.etcd_members,
                   shards=args.shards,
                   replicas=args.replicas, workers=args.workers,
                   max_requests=args.max_requests, fault_share=args.fault_share,
                   keyed_share=args.keyed_share, kinds=kinds,
                   max_concurrent_faults=args.max_concurrent_faults, out=out, config=config,
                   log=lambda s: print(s, flush=True))
    def _stop(signum: int, frame: object) -> None:
        # SIGTERM unwinds like Ctrl-C, so the run's `finally` stops every process it started.
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    try:
        report = run(opts)
    except KeyboardInterrupt:
        print("chaos: interrupted; every process it started is stopped", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"chaos: the harness failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(render_summary(report, opts.out or report.workdir.parent), flush=True)
    if report.breaks:
        print("\nthe first break of each kind, with its evidence:\n"
              + render_evidence(report), flush=True)
    if report.harness_errors:
        return 2 if not report.breaks else 1
    return 1 if report.breaks else 0


if __name__ == "__main__":
    sys.exit(main())
