"""Command line: serve the processor, check a config, render Envoy's config, run the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from .core.config import Config, ConfigError, apply_env_overrides, load_config


def read_config(path: str | None, env: dict[str, str] | None = None) -> Config:
    """Load the one config file plus EXTPROC_SECTION__FIELD overrides; exit 2 naming the field."""
    raw: Any = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise SystemExit(f"config error: cannot read {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise SystemExit(f"config error: {path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise SystemExit(f"config error: {path} must hold a mapping at the top level")
    try:
        raw = apply_env_overrides(raw, dict(os.environ if env is None else env))
        return load_config(raw)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from e


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the ext_proc gRPC server")
    s.add_argument("--config", help="YAML config file (see docs/configuration.md)")
    c = sub.add_parser("check-config", help="validate a config file and print it resolved")
    c.add_argument("--config", required=True)
    r = sub.add_parser("render-envoy", help="print the Envoy bootstrap matching a config")
    r.add_argument("--config")
    r.add_argument("--listen", default="127.0.0.1:10000")
    r.add_argument("--admin", default="127.0.0.1:9901")
    r.add_argument("--processor", default=None,
                   help="processor address (default: server.listen from the config)")
    r.add_argument("--replica", action="append", default=[],
                   help="replica host:port (repeat); default 127.0.0.1:8001 and :8002")
    r.add_argument("--plain", action="store_true", help="no ext_proc: the benchmark baseline")
    i = sub.add_parser("inspect", help="show a request's journal record and event traces")
    i.add_argument("request_id")
    i.add_argument("--config")
    i.add_argument("--events", action="store_true", help="print every traced event")
    rp = sub.add_parser("replay", help="re-feed a request's recorded events into the core "
                        "and check it reaches the same decisions")
    rp.add_argument("request_id")
    rp.add_argument("--config")
    rp.add_argument("--trace-file", help="replay a trace JSON file instead of etcd's")
    q = sub.add_parser("run", help="quickstart: etcd + processor + Envoy + 2 demo replicas")
    q.add_argument("--config")
    q.add_argument("--workdir")
    q.add_argument("--replicas", type=int, default=2)
    q.add_argument("--port", type=int, default=10000)
    args = ap.parse_args(argv)

    if args.cmd == "serve":
        cfg = read_config(args.config)
        from .adapters.logs import setup
        from .adapters.server import serve
        setup(cfg.server.log_level)
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        asyncio.run(serve(cfg))
        return 0
    if args.cmd == "check-config":
        cfg = read_config(args.config)
        import dataclasses
        print(yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False), end="")
        return 0
    if args.cmd == "render-envoy":
        from .envoy_config import Topology, parse_hostport, render, replicas_from
        cfg = read_config(args.config)
        topo = Topology(listen=parse_hostport(args.listen), admin=parse_hostport(args.admin),
                        processor=args.processor or cfg.server.listen,
                        replicas=replicas_from(args.replica or ["127.0.0.1:8001",
                                                                "127.0.0.1:8002"]))
        sys.stdout.write(yaml.safe_dump(render(cfg, topo, plain=args.plain), sort_keys=False))
        return 0
    if args.cmd in ("inspect", "replay"):
        file_trace = (json.loads(Path(args.trace_file).read_text())
                      if getattr(args, "trace_file", None) else None)
        return asyncio.run(_inspect_or_replay(args, file_trace))
    if args.cmd == "run":
        from .devstack import run_forever
        if args.config:
            read_config(args.config)  # fail fast, naming the field
        return run_forever(args.config, args.workdir, args.replicas, args.port)
    return 2


async def _inspect_or_replay(args: argparse.Namespace, file_trace: Any) -> int:
    from .adapters.etcd_store import EtcdStore
    from .adapters.leases import StoreUnavailable
    from .core.replay import replay

    traces: dict[str, Any]
    view = None
    if file_trace is not None:
        traces = {"file": file_trace}
    else:
        cfg = read_config(args.config)
        store = EtcdStore(cfg.etcd)
        await store.connect()
        try:
            view = await store.get(args.request_id)
            traces = await store.get_traces(args.request_id)
        except StoreUnavailable as e:
            print(f"etcd unavailable: {e}", file=sys.stderr)
            return 2
        finally:
            await store.close()
        if view is None and not traces:
            print(f"no request {args.request_id} in the journal", file=sys.stderr)
            return 1
    if args.cmd == "inspect":
        out: dict[str, Any] = {"journal": view.to_dict() if view else None, "traces": {}}
        for name, t in sorted(traces.items()):
            out["traces"][name] = {
                "role": t.get("role"), "meta": t.get("meta"), "events": len(t.get("events", [])),
                "truncated": t.get("truncated"), "decisions": t.get("decisions"),
                "summary": t.get("summary")}
            if args.events:
                out["traces"][name]["event_list"] = t.get("events")
        print(json.dumps(out, indent=2))
        return 0
    if not traces:
        print(f"no event traces kept for {args.request_id} (telemetry.record_traces)",
              file=sys.stderr)
        return 1
    failed = 0
    for name, t in sorted(traces.items()):
        r = replay(t)
        status = "same decisions" if r.ok else f"DIVERGES: {r.divergence}"
        print(f"{name}: {r.steps} events replayed: {status}"
              + (" (trace truncated: prefix only)" if t.get("truncated") else ""))
        failed += 0 if r.ok else 1
    return 1 if failed else 0


def _plain(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _plain(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_plain(v) for v in o]
    return o


if __name__ == "__main__":
    sys.exit(main())
