"""Command line: serve the processor, check a config, render Envoy's config, run the demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from . import __version__
from .core.config import Config, ConfigError, apply_env_overrides, load_config

# A bad config or flag: one `config error: ...` line on stderr, exit status 2, no traceback
# (argparse's own usage errors exit 2 too).
CONFIG_ERROR_EXIT = 2


class ConfigExit(SystemExit):
    """A config or flag error; its text is the whole `config error: ...` line. `main` prints
    it and exits 2; raised past `main` it still ends the program with the line (status 1)."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"config error: {problem}")


def config_error(problem: str) -> ConfigExit:
    return ConfigExit(problem)


def read_config(path: str | None, env: dict[str, str] | None = None) -> Config:
    """Load the one config file plus EXTPROC_SECTION__FIELD overrides; exit 2 naming the field."""
    raw: Any = {}
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise config_error(f"cannot read {path}: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise config_error(f"{path} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise config_error(f"{path} must hold a mapping at the top level")
    try:
        raw = apply_env_overrides(raw, dict(os.environ if env is None else env))
        return load_config(raw)
    except ConfigError as e:
        raise config_error(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    """The `extproc` command; a config error is one line on stderr and exit status 2."""
    try:
        return _main(argv)
    except SystemExit as e:
        # ConfigExit, or a handler's own SystemExit("config error: ...").
        if isinstance(e.code, str) and e.code.startswith("config error: "):
            print(e.code, file=sys.stderr)
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        raise


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="extproc", description=__doc__)
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
                   help="replica host:port (repeat); default: pool.replicas' addresses; "
                        "none with pool.discovery: registry")
    r.add_argument("--plain", action="store_true", help="no ext_proc: the benchmark baseline")
    r.add_argument("--ops", default=None, metavar="HOST:PORT",
                   help="a listener serving only GET /ready and /stats/prometheus (routed to "
                        "the admin, which should then be on loopback)")
    r.add_argument("--tools", action="append", default=[], metavar="HOST:PORT[,HOST:PORT]",
                   help="the tool servers behind the tool route (repeat or comma-separate); "
                        "needs --tool-listen")
    r.add_argument("--tool-listen", default=None, metavar="HOST:PORT",
                   help="the workers' listener serving the tool route (and nothing else); "
                        "the client listener answers the tool prefix with 404")
    r.add_argument("--out", default=None, metavar="FILE",
                   help="write the bootstrap to FILE (atomically) instead of stdout")
    r.add_argument("--require-version", default=None, metavar="X.Y.Z",
                   help="refuse (config error) when this extproc is older than X.Y.Z: the "
                        "chart passes its appVersion, so an older cached image fails here, "
                        "in the init container, with a line saying so (decision 0038)")
    m = sub.add_parser("render-mesh", help="print the Istio or Envoy Gateway objects that "
                       "give a mesh's Envoy what render-envoy gives ours")
    m.add_argument("--config", required=True)
    m.add_argument("--flavor", required=True, choices=["istio", "envoy-gateway"])
    m.add_argument("--out-dir", default=None, metavar="DIR",
                   help="write one file per object group into DIR (as deploy/mesh/<flavor>/ "
                        "holds them) instead of printing one stream")
    _mesh_name_flags(m)
    g = sub.add_parser("register", help="keep one model server registered in the live pool "
                       "while it passes its health check (pool.discovery: registry)")
    g.add_argument("--config")
    g.add_argument("--address", required=True, metavar="IP:PORT",
                   help="the address Envoy dials for this replica (a pod IP, not a name)")
    g.add_argument("--probe", default=None, metavar="HOST:PORT",
                   help="where to probe its health (default: --address)")
    g.add_argument("--fingerprint-file", default=None,
                   help="YAML mapping of the compatibility fingerprint (docs/configuration.md)")
    g.add_argument("--fingerprint", action="append", default=[], metavar="FIELD=VALUE",
                   help="one fingerprint field (repeat; lora_adapters as a,b,c)")
    g.add_argument("--model", action="append", default=[], help="a model it serves (repeat)")
    a = sub.add_parser("agent", help="`register`'s job plus a streaming proxy in front of the "
                       "model server that fences, aborts and acknowledges attempts at the "
                       "source (docs/replica-agent.md)")
    a.add_argument("--config")
    a.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="what Envoy and the pool dial (the agent's proxy)")
    a.add_argument("--address", default=None, metavar="IP:PORT",
                   help="the address registered in the pool (default: --listen)")
    a.add_argument("--engine", required=True, metavar="HOST:PORT",
                   help="the model server, on loopback behind the agent")
    a.add_argument("--engine-kind", default="openai",
                   choices=["openai", "vllm", "sglang", "demo"],
                   help="how an abort is confirmed (docs/replica-agent.md)")
    a.add_argument("--engine-metrics", default=None, metavar="NAME[,NAME]",
                   help="the engine metrics whose sum is what it still holds "
                        "(default: the kind's)")
    a.add_argument("--ops", default=None, metavar="HOST:PORT",
                   help="a listener serving /metrics and /healthz")
    a.add_argument("--ack-timeout-s", type=float, default=5.0,
                   help="how long to wait for the engine's evidence before giving up the ack")
    a.add_argument("--fingerprint-file", default=None)
    a.add_argument("--fingerprint", action="append", default=[], metavar="FIELD=VALUE")
    a.add_argument("--model", action="append", default=[])
    i = sub.add_parser("inspect", help="show a request's journal record and event traces")
    i.add_argument("request_id")
    i.add_argument("--config")
    i.add_argument("--events", action="store_true", help="print every traced event")
    rp = sub.add_parser("replay", help="re-feed a request's recorded events into the core "
                        "and check it reaches the same decisions")
    rp.add_argument("request_id")
    rp.add_argument("--config")
    rp.add_argument("--trace-file", help="replay a trace JSON file instead of etcd's")
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["run"]:
        # The quickstart is development tooling (devkit/, not in the package): the old
        # command says where it went instead of argparse's "invalid choice".
        raise SystemExit("extproc run: the quickstart moved out of the package; from a clone of "
                         "the repository: `make run`, or `python -m devkit run` with the same "
                         "options")
    args = ap.parse_args(argv)

    if args.cmd == "serve":
        cfg = read_config(args.config)
        from .adapters.logs import setup
        from .adapters.server import serve
        setup(cfg.server.log_level)
        if cfg.tenancy.header is None and cfg.tenancy.api_key_header is None:
            # Decision 0030: off stays the processor's default; said once, at start-up.
            logging.getLogger("extproc").warning(
                "tenancy is off: every client shares one namespace of request ids and may "
                "read any record by its id; set tenancy.api_key_header or tenancy.header",
                extra={"request_id": None, "attempt_id": None})
        _fast_loop()
        try:
            asyncio.run(serve(cfg))
        except ConfigError as e:  # an etcd.tls / etcd.auth file unreadable at start-up
            raise config_error(str(e)) from e
        return 0
    if args.cmd == "check-config":
        cfg = read_config(args.config)
        import dataclasses
        print(yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False), end="")
        return 0
    if args.cmd == "render-envoy":
        return _render_envoy(args)
    if args.cmd == "render-mesh":
        from .mesh_config import render_files
        cfg = read_config(args.config, env={})
        try:
            files = render_files(cfg, args.flavor, _mesh_names(args), source=args.config)
        except ValueError as e:
            raise config_error(str(e)) from e
        if args.out_dir:
            try:
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                for name, text in files.items():
                    (Path(args.out_dir) / name).write_text(text)
            except OSError as e:
                raise config_error(f"--out-dir: cannot write {args.out_dir}: "
                                   f"{e.strerror}") from e
        else:
            sys.stdout.write("---\n".join(files.values()))
        return 0
    if args.cmd in ("register", "agent"):
        return _register(args)
    if args.cmd in ("inspect", "replay"):
        file_trace = (json.loads(Path(args.trace_file).read_text())
                      if getattr(args, "trace_file", None) else None)
        return asyncio.run(_inspect_or_replay(args, file_trace))
    return 2


def _mesh_name_flags(m: argparse.ArgumentParser) -> None:
    """render-mesh: every name of the user's cluster the objects refer to (docs/mesh.md)."""
    from .mesh_config import MeshNames
    d = MeshNames()
    m.add_argument("--namespace", default=d.namespace, help="where the objects go")
    m.add_argument("--name", default=d.name, help="the EnvoyFilter, DestinationRule, "
                   "EnvoyPatchPolicy and BackendTrafficPolicy")
    m.add_argument("--gateway", default=d.gateway, help="Istio: the gateway pods' label "
                   "istio=<this>; Envoy Gateway: the Gateway")
    m.add_argument("--route", default=d.route, help="Istio: the VirtualService http route "
                   "of the replicas; Envoy Gateway: the HTTPRoute")
    m.add_argument("--replicas", default=f"{d.replicas[0]}:{d.replicas[1]}", metavar="HOST:PORT",
                   help="Istio: the replicas' Service (its FQDN) and port")
    m.add_argument("--listener-port", type=int, default=d.listener_port,
                   help="Istio: the gateway pod's container port")
    m.add_argument("--gateway-port", type=int, default=d.gateway_port,
                   help="the Gateway server's (Istio) or listener's (Envoy Gateway) port")
    m.add_argument("--listener", default=d.listener,
                   help="Envoy Gateway: the Gateway listener's name")
    m.add_argument("--rule", type=int, default=d.rule,
                   help="Envoy Gateway: the HTTPRoute rule (0-based) of the replicas")
    m.add_argument("--guard-policy", default=d.guard_policy,
                   help="Envoy Gateway: the guard's EnvoyExtensionPolicy")
    m.add_argument("--backend", default=d.backend,
                   help="Envoy Gateway: the Backend of the processor's Unix socket")
    m.add_argument("--istio-version", default="{}.{}".format(*d.istio_version),
                   help="the Istio the gateway runs (before 1.27 the retry budget is "
                        "patched, not typed: decision 0035)")
    m.add_argument("--xds-name-scheme", default=d.xds_name_scheme, choices=["legacy", "v2"],
                   help="Envoy Gateway: v2 if its XDSNameSchemeV2 runtime flag is on")


def _mesh_names(args: argparse.Namespace) -> Any:
    from .mesh_config import MeshNames, parse_istio_version, parse_replicas
    try:
        return MeshNames(
            namespace=args.namespace, name=args.name, gateway=args.gateway, route=args.route,
            replicas=parse_replicas(args.replicas), listener_port=args.listener_port,
            gateway_port=args.gateway_port, listener=args.listener, rule=args.rule,
            guard_policy=args.guard_policy, backend=args.backend,
            istio_version=parse_istio_version(args.istio_version),
            xds_name_scheme=args.xds_name_scheme)
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from e


def version_tuple(text: str) -> tuple[int, int, int]:
    """X.Y.Z (a leading v and a -pre or +build suffix ignored) as numbers; ValueError else."""
    core = text.strip().removeprefix("v").split("+")[0].split("-")[0]
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"expected a version X.Y.Z, got {text!r}")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def require_version(required: str) -> None:
    """Refuse to run as an extproc older than `required` (the chart's appVersion)."""
    try:
        need = version_tuple(required)
    except ValueError as e:
        raise config_error(f"--require-version: {e}") from e
    if version_tuple(__version__) < need:
        raise config_error(f"image llm-failover-extproc {__version__} is older than the "
                           f"chart's appVersion {required}; set image.processor.tag to an "
                           f"image of {required} or newer")


def _flag(name: str, value: str) -> tuple[str, int]:
    from .envoy_config import parse_hostport
    host, sep, _ = value.rpartition(":")
    try:
        parsed = parse_hostport(value)
    except ValueError:
        parsed = None
    if (parsed is None or not sep or not host.strip("[]") or not 1 <= parsed[1] <= 65535
            or any(c.isspace() for c in value)):
        raise config_error(f"{name}: must be host:port (port 1-65535, [IPv6] in brackets), "
                           f"got {value!r}")
    return parsed


def _render_envoy(args: argparse.Namespace) -> int:
    from .envoy_config import Topology, render
    if args.require_version is not None:
        require_version(args.require_version)
    cfg = read_config(args.config)
    listen, admin = _flag("--listen", args.listen), _flag("--admin", args.admin)
    ops = _flag("--ops", args.ops) if args.ops is not None else None
    processor = args.processor or cfg.server.listen
    if processor.startswith("unix:"):
        if not processor[len("unix:"):].strip():
            raise config_error(f"--processor: a Unix socket must be unix:/path, got "
                               f"{processor!r}")
    else:
        _flag("--processor" if args.processor else "server.listen", processor)
    tools = tuple(_flag("--tools", t.strip()) for arg in args.tools for t in arg.split(",")
                  if t.strip())
    tool_listen = (_flag("--tool-listen", args.tool_listen)
                   if args.tool_listen is not None else None)
    replicas = tuple(_flag("--replica", x) for x in args.replica)
    if not replicas:
        # pool.replicas name the replicas by the address Envoy reports: they are the pool.
        replicas = tuple(_flag("pool.replicas[].address", str(r["address"]))
                         for r in cfg.pool.replicas)
    if not replicas and (args.plain or cfg.pool.discovery != "registry"):
        # No quiet demo default: a gateway pointed at 127.0.0.1:8001 serves nothing.
        raise config_error("render-envoy needs the replicas: --replica host:port (repeat), or "
                           "pool.replicas in the config, or pool.discovery: registry")
    try:
        topo = Topology(listen=listen, admin=admin, processor=processor, replicas=replicas,
                        ops=ops, tools=tools, tool_listen=tool_listen)
        boot = render(cfg, topo, plain=args.plain)
    except ValueError as e:
        raise config_error(f"render-envoy: {e}") from e
    text = yaml.safe_dump(boot, sort_keys=False)
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        try:
            tmp.write_text(text)
            tmp.replace(out)
        except OSError as e:
            raise config_error(f"--out: cannot write {out}: {e.strerror}") from e
    else:
        sys.stdout.write(text)
    return 0


def _register(args: argparse.Namespace) -> int:
    from .core.membership import RegistrationError, fingerprint_flags, registration_record
    cfg = read_config(args.config)
    fp: dict[str, Any] = {}
    if args.fingerprint_file:
        try:
            loaded = yaml.safe_load(Path(args.fingerprint_file).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"register: cannot read --fingerprint-file: {e}") from e
        if not isinstance(loaded, dict):
            raise SystemExit("register: --fingerprint-file must hold a mapping")
        fp.update(loaded)
    proxy = args.cmd == "agent"
    try:
        fp.update(fingerprint_flags(args.fingerprint))
        record = registration_record(args.address or args.listen if proxy else args.address,
                                     fp, args.model,
                                     agent=f"{os.uname().nodename}/{os.getpid()}")
    except RegistrationError as e:
        raise SystemExit(f"{args.cmd}: {e}") from e
    from .adapters.logs import setup
    from .adapters.register import run_agent
    setup(cfg.server.log_level)
    try:
        if proxy:
            try:
                from .adapters.agent import EngineSpec, run
            except ImportError as e:
                raise SystemExit("agent: needs the `agent` extra (pip install "
                                 f"'llm-failover-extproc[agent]'): {e}") from e
            try:
                engine = EngineSpec.make(args.engine, args.engine_kind, args.engine_metrics,
                                         cfg.pool.health_check.path)
            except ValueError as e:
                raise SystemExit(f"agent: {e}") from e
            # The gateway learns from the record that an agent fronts this replica.
            record["agent"] = {"version": 1, "id": record["agent"]}
            _fast_loop()  # every chunk crosses it, as it crosses the processor
            return asyncio.run(run(cfg, record, args.listen, engine, args.ops,
                                   args.ack_timeout_s))
        return asyncio.run(run_agent(cfg, record, args.probe or record["address"]))
    except ConfigError as e:  # an etcd.tls / etcd.auth file unreadable at start-up
        raise config_error(str(e)) from e


async def _inspect_or_replay(args: argparse.Namespace, file_trace: Any) -> int:
    from .adapters.etcd_store import EtcdStore
    from .adapters.leases import StoreUnavailable
    from .adapters.shards import shard_of
    from .core.replay import replay

    traces: dict[str, Any]
    view = None
    if file_trace is not None:
        traces = {"file": file_trace}
    else:
        cfg = read_config(args.config)
        clusters = cfg.etcd.clusters()  # the request's journal shard (decision 0042)
        store = EtcdStore(clusters[shard_of(args.request_id, len(clusters))])
        try:
            await store.connect()  # reads etcd.tls / etcd.auth files
        except ConfigError as e:
            raise config_error(str(e)) from e
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


def _fast_loop() -> None:
    """uvloop where it is installed (a dependency off Windows), else asyncio's own loop."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
