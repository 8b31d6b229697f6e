"""`python -m devkit run`: the quickstart (`make run`) on loopback, by PID, until Ctrl-C.

etcd, the processor, Envoy and demo replicas (optionally a live pool, cells, an etcd
cluster), as `devkit.devstack` starts them for the tests. Development tooling only: it is
not part of the shipped package (the image and the wheel carry `extproc` alone).
"""

from __future__ import annotations

import argparse

from extproc.cli import read_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("run", help="quickstart: etcd + processor + Envoy + 2 demo replicas")
    q.add_argument("--config")
    q.add_argument("--workdir")
    q.add_argument("--replicas", type=int, default=2)
    q.add_argument("--port", type=int, default=10000)
    q.add_argument("--live-pool", action="store_true",
                   help="pool.discovery: registry, an `extproc register` agent per replica")
    q.add_argument("--cells", type=int, default=1,
                   help="N cells (an Envoy and a processor each) on one port: one core each "
                        "(docs/decisions/0019-cells-for-more-cores.md)")
    q.add_argument("--etcd-members", type=int, default=1,
                   help="N etcd members on loopback (a cluster when N > 1), the processor "
                        "given every member's endpoint (docs/chaos.md)")
    args = ap.parse_args(argv)
    from devkit.devstack import run_forever
    if args.config:
        read_config(args.config)  # fail fast, naming the field
    if not 1 <= args.cells <= 64:
        raise SystemExit("run: --cells must be between 1 and 64")
    if not 1 <= args.etcd_members <= 9:
        raise SystemExit("run: --etcd-members must be between 1 and 9")
    return run_forever(args.config, args.workdir, args.replicas, args.port,
                       live_pool=args.live_pool, cells=args.cells,
                       etcd_members=args.etcd_members)


if __name__ == "__main__":
    raise SystemExit(main())
