"""Real vLLM (CPU build) replicas behind the real gateway: Envoy + etcd + our processor.

Collected only when EXTPROC_VLLM=1 (`make test-vllm` sets it and prepares the vLLM venv and
the model first); a plain `pytest` / `make test` never collects these files.

Faults are driven from outside the engine, the way they happen in production: SIGKILL of a
replica's whole process group, SIGTERM of its API server (what a container runtime sends to
PID 1), the client closing its connection, a partition between Envoy and the replica. Each
test checks, per request: the exact text the client got (against a fault-free run; greedy
decoding is deterministic), the journal record (GET /v1/requests/{id} through Envoy), the
terminal error, and vLLM's own log.

Correlation with vLLM's log: vLLM names a request `chatcmpl-<x-request-id>` (`cmpl-...` for
/v1/completions) when the header is present. Envoy forwards the client's `x-request-id`
unchanged to every attempt, so each request here carries a fresh one and every replica's log
lines ("Received request ...", "Aborted request(s) ...") are found by it. The gateway's own
`x-gateway-request-id` is not logged by vLLM; the journal keeps Envoy's id as
`envoy_request_id`, which ties the two.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import Proc, Stack, wait_until
from extproc.core.sse import EventKind, SseDecoder

ENABLED = os.environ.get("EXTPROC_VLLM") == "1"
if not ENABLED:
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL_DIR = Path(os.environ.get("VLLM_MODEL_DIR", ROOT / "build" / "vllm" / "tiny-llama-slow"))
SHIM = ROOT / "vllm" / "vllm_serve.py"
MODEL = "tiny-llama"
MAX_MODEL_LEN = int(os.environ.get("VLLM_MAX_MODEL_LEN", "2048"))
RESULTS = Path(os.environ.get("VLLM_RESULTS", ROOT / "build" / "vllm" / "measurements.json"))

TTL = 3  # attempt lease TTL: a partitioned attempt is fenced by expiry within 2/3..1 TTL
CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": TTL, "session_ttl_s": 3},
    "timeouts": {"first_delta_s": 8.0, "soft_first_delta_s": 4.0,
                 "stall_after_first_delta_s": 5.0, "access_log_wait_s": 0.5,
                 "fence_wait_s": 3.5, "progress_interval_s": 0.2},
    # Responses and Messages deltas carry no running count: the model's own tokenizer
    # counts what was delivered (decision 0018).
    "accounting": {"tokenizers": {MODEL: str(MODEL_DIR / "tokenizer.json")}},
}

# What the tests measured, written to RESULTS and printed at the end of the run.
MEASURED: dict[str, Any] = {}


# SIGTERM behaviour differs by vLLM's --shutdown-timeout: 0 (vLLM's default) stops the engine
# at once and leaves in-flight streams hanging; > 0 drains them. r1 drains, r2 keeps the
# default, so both behaviours are tested behind the gateway (docs/real-engine.md).
SHUTDOWN_TIMEOUT = {0: 30, 1: 0}


def vllm_argv(port: int, index: int = 0) -> list[str]:
    return [
        str(VLLM_PYTHON), str(SHIM), "serve", str(MODEL_DIR),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
        "--seed", "0", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(256 << 20),
        "--enable-log-requests",
        # Each re-prefill must be a real one: with automatic prefix caching the reference run
        # would make the faulted run's prefill nearly free, and the window would vanish.
        "--no-enable-prefix-caching",
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT.get(index, 0)),
    ]


def replica_env(index: int) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),
        "PYTHONUNBUFFERED": "1",
    })
    return env


# (stack workdir, replica index) -> monotonic time of its (last) start
STARTED: dict[tuple[str, int], float] = {}


def replica_factory(index: int, port: int, workdir: Path) -> Proc:
    STARTED[(str(workdir), index)] = time.monotonic()
    return Proc(name=f"r{index + 1}", argv=vllm_argv(port, index),
                log_path=workdir / f"replica-r{index + 1}.log", env=replica_env(index))


# --- process-group facts -------------------------------------------------------------------


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after the ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def group_memory(pgid: int) -> dict[str, float]:
    rss = pss = 0
    n = 0
    for pid in group_pids(pgid):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
            n += 1
        except OSError:
            continue
    return {"processes": n, "rss_gib": round(rss / 2**20, 2), "pss_gib": round(pss / 2**20, 2)}


# Shared-memory segments (/dev/shm/psm_*, sem.mp-*) a SIGKILLed replica leaves behind: its
# resource tracker died with it, so nobody unlinks them. Removed once nothing maps them.
LEAKED_SHM: set[str] = set()


def shm_mapped(pids: list[int]) -> set[str]:
    out: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/") and not path.startswith("/dev/shm/envoy"):
                out.add(path.removesuffix(" (deleted)"))
    return out


def shm_names() -> set[str]:
    try:
        return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
                if n.startswith(("psm_", "sem.mp-"))}
    except OSError:
        return set()


# Segments that appeared while one of our replicas started (vLLM's message queues and the
# resource tracker's named semaphores): removed at the end if a replica was killed and left
# them, and nothing maps them any more.
OWNED_SHM: set[str] = set()


def reap_leaked_shm(final: bool = False) -> int:
    if final:
        LEAKED_SHM.update(p for p in OWNED_SHM if os.path.exists(p))
    if not LEAKED_SHM:
        return 0
    live = shm_mapped([int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()])
    n = 0
    for path in sorted(LEAKED_SHM - live):
        with contextlib.suppress(OSError):
            os.unlink(path)
            n += 1
        LEAKED_SHM.discard(path)
    return n


def machine_used_gib() -> float:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0])
    return round((info["MemTotal"] - info["MemAvailable"]) / 2**20, 2)


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(200 <= r.status < 300)
    except OSError:
        return False


# --- the engine side: replicas, their logs, and faults --------------------------------------


class Engines:
    """The vLLM replicas of one stack: which one has a request, faults, restarts."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    @property
    def names(self) -> list[str]:
        return [f"r{i + 1}" for i in range(self.stack.replicas)]

    def proc(self, name: str) -> Proc:
        return self.stack.procs[name]

    def port(self, name: str) -> int:
        return self.stack.replica_ports[int(name[1:]) - 1]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port(name)}"

    def log(self, name: str) -> str:
        p = self.proc(name).log_path
        return p.read_text(errors="replace") if p.exists() else ""

    def lines(self, name: str, xrid: str) -> list[str]:
        """vLLM's log lines about one request (its id embeds our x-request-id)."""
        return [ln for ln in self.log(name).splitlines() if xrid in ln]

    def received(self, name: str, xrid: str) -> bool:
        return any("Received request" in ln for ln in self.lines(name, xrid))

    def aborted(self, name: str, xrid: str) -> bool:
        return any("Aborted request" in ln for ln in self.lines(name, xrid))

    def who_received(self, xrid: str) -> list[str]:
        return [n for n in self.names if self.received(n, xrid)]

    def wait_received(self, xrid: str, timeout_s: float = 10.0) -> str:
        """The replica whose log shows the request arriving (polled every 5 ms)."""
        # Where each log ends now, taken BEFORE the full scan: a line written during the
        # scan is then found by the tail below (taken after, it would be skipped for good;
        # the longer the logs, the wider that window).
        paths = {n: self.proc(n).log_path for n in self.names}
        pos = {n: p.stat().st_size if p.exists() else 0 for n, p in paths.items()}
        got = self.who_received(xrid)
        if got:
            return got[0]
        # Then only the bytes each log gains (cheap enough to poll every 5 ms on 2 cores).
        tail = {n: "" for n in self.names}
        needle = f"Received request chatcmpl-{xrid}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n, p in paths.items():
                with contextlib.suppress(OSError), open(p, "rb") as f:
                    f.seek(pos[n])
                    data = f.read()
                    pos[n] += len(data)
                    tail[n] = (tail[n] + data.decode(errors="replace"))[-4096:]
                    if needle in tail[n]:
                        return n
            time.sleep(0.005)
        raise TimeoutError(f"no replica logged request {xrid} within {timeout_s}s")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        """SIGKILL: the whole process group (API server, EngineCore, Worker, tracker)."""
        p = self.proc(name)
        assert p.popen is not None
        shm = shm_mapped(group_pids(p.popen.pid))
        t = time.monotonic()
        os.killpg(p.popen.pid, sig)
        if sig == signal.SIGKILL:
            LEAKED_SHM.update(shm)
            MEASURED["shm_segments_left_by_kill9"] = len(shm)
        return t

    def terminate_leader(self, name: str) -> float:
        """SIGTERM to the API server only: what a container runtime sends to PID 1."""
        p = self.proc(name)
        assert p.popen is not None
        t = time.monotonic()
        os.kill(p.popen.pid, signal.SIGTERM)
        return t

    def wait_gone(self, name: str, timeout_s: float = 60.0) -> None:
        p = self.proc(name)
        assert p.popen is not None
        pg = p.popen.pid
        wait_until(lambda: p.popen is not None and p.popen.poll() is not None
                   and not group_pids(pg), timeout_s, f"{name} to exit")

    def healthy(self, name: str) -> bool:
        """The engine answers /health; with an agent in front, the agent's /healthz (which
        follows the engine's as its probes see it) says so too."""
        if not (self.proc(name).alive() and http_ok(self.url(name) + "/health")):
            return False
        if self.stack.agents:
            port = self.stack.agent_ports[int(name[1:]) - 1]
            return http_ok(f"http://127.0.0.1:{port}/healthz")
        return True

    def held(self, name: str) -> float:
        """vLLM's own count of the requests it holds: running + waiting (its /metrics)."""
        with urllib.request.urlopen(self.url(name) + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for m in re.finditer(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$",
                             text, re.M):
            total += float(m.group(1))
        return total

    def ensure_all_healthy(self, timeout_s: float = 180.0) -> None:
        """Restart any replica a previous test stopped (same port), then wait for all."""
        restarted = []
        before = shm_names()
        wd = str(self.stack.workdir)
        for name in self.names:
            p = self.proc(name)
            if not p.alive():
                p.stop()  # reaps the leader and SIGKILLs anything left in its group
                reap_leaked_shm()
                STARTED[(wd, int(name[1:]) - 1)] = time.monotonic()
                p.restarts += 1
                p.start()
                restarted.append(name)
        for name in self.names:
            wait_until(lambda name=name: self.healthy(name), timeout_s, f"{name} healthy",
                       interval_s=0.25)
            if name in restarted:
                t0 = STARTED[(wd, int(name[1:]) - 1)]
                MEASURED.setdefault("restart_to_health_s", []).append(
                    round(time.monotonic() - t0, 1))
        if restarted:
            OWNED_SHM.update(shm_names() - before)

    def memory(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in self.names:
            p = self.proc(name)
            if p.alive() and p.popen is not None:
                out[name] = group_memory(p.popen.pid)
        return out


# --- the client side -----------------------------------------------------------------------


@dataclass
class Result:
    """What one client saw."""

    status: int
    headers: dict[str, str]
    raw: bytes
    transport_error: str | None
    xrid: str
    events: list[dict[str, Any] | str] = field(default_factory=list)
    t_sent: float = 0.0
    t_first_content: float | None = None
    t_end: float = 0.0

    @property
    def request_id(self) -> str:
        return self.headers.get("x-gateway-request-id", "")

    @property
    def contents(self) -> list[str]:
        out = []
        for e in self.events:
            if isinstance(e, dict):
                for ch in e.get("choices") or []:
                    d = ch.get("delta") or {}
                    if d.get("content"):
                        out.append(d["content"])
                    elif ch.get("text"):
                        out.append(ch["text"])
                    elif (ch.get("message") or {}).get("content"):
                        out.append(ch["message"]["content"])
        return out

    @property
    def text(self) -> str:
        return "".join(self.contents)

    @property
    def error(self) -> dict[str, Any] | None:
        for e in self.events:
            if isinstance(e, dict) and "error" in e:
                err: dict[str, Any] = e["error"]
                return err
        return None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_content is None else self.t_first_content - self.t_sent

    def normalized(self) -> list[Any]:
        """The event list without what differs per request or per process by design:
        `id` (embeds the request id), `created` (a clock), `system_fingerprint` (per process)."""
        out: list[Any] = []
        for e in self.events:
            if isinstance(e, dict):
                e = {k: v for k, v in e.items()
                     if k not in ("id", "created", "system_fingerprint")}
            out.append(e)
        return out


def assert_same_stream(got: Result, want: Result) -> None:
    """Same text, same non-content events, and the same chunk list whenever both runs carried
    one token per chunk. vLLM's API server merges tokens into one chunk when it falls behind
    the engine (RequestOutputCollector), which depends on CPU load, not on the gateway."""
    assert got.text == want.text
    if got.contents == want.contents:
        assert got.normalized() == want.normalized()
    else:
        MEASURED["coalesced_chunk_runs"] = MEASURED.get("coalesced_chunk_runs", 0) + 1

        def rest(r: Result) -> list[Any]:
            return [e for e in r.normalized() if not (isinstance(e, dict) and is_content(e))]

        assert rest(got) == rest(want)


def is_content(ev: dict[str, Any]) -> bool:
    for ch in ev.get("choices") or []:
        if (ch.get("delta") or {}).get("content") or ch.get("text"):
            return True
    return False


def new_xrid() -> str:
    return "t" + uuid.uuid4().hex


OnEvent = Callable[[int, dict[str, Any] | str], str | None]


class Client:
    """Through Envoy (`gw`) or straight to one replica (`direct(name)`)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(60.0, connect=5.0))

    def close(self) -> None:
        self.http.close()

    @staticmethod
    def body(max_tokens: int = 16, prompt: str = "hello there", stream: bool = True,
             path: str = "chat", **extra: Any) -> dict[str, Any]:
        b: dict[str, Any] = {"model": MODEL, "stream": stream, "max_tokens": max_tokens,
                             "temperature": 0, "seed": 7, **extra}
        if path == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        return b

    def post(self, body: dict[str, Any], path: str = "/v1/chat/completions",
             headers: dict[str, str] | None = None, on_event: OnEvent | None = None,
             key: str | None = "auto", xrid: str | None = None) -> Result:
        """Send one request; `on_event(n_contents_so_far, event)` may act on the stream, and
        returns "close" to hang up (the client disconnects). `xrid` becomes x-request-id."""
        xrid = xrid or new_xrid()
        h = {"x-request-id": xrid, **(headers or {})}
        if key == "auto":
            h["Idempotency-Key"] = "v-" + xrid
        elif key is not None:
            h["Idempotency-Key"] = key
        raw, err, status, hdrs = b"", None, 0, {}
        dec = SseDecoder()
        events: list[dict[str, Any] | str] = []
        n = 0
        t_first: float | None = None
        t0 = time.monotonic()

        def take(evs: list[Any]) -> str | None:
            nonlocal n, t_first
            verdict = None
            for e in evs:
                if e.kind is EventKind.DONE:
                    ev: dict[str, Any] | str = "[DONE]"
                elif e.data:
                    ev = json.loads(e.data)
                else:
                    continue
                events.append(ev)
                if isinstance(ev, dict) and is_content(ev):
                    n += 1
                    if t_first is None:
                        t_first = time.monotonic()
                if on_event is not None and on_event(n, ev) == "close":
                    verdict = "close"
            return verdict

        try:
            with self.http.stream("POST", path, json=body, headers=h) as r:
                status, hdrs = r.status_code, dict(r.headers)
                sse = hdrs.get("content-type", "").startswith("text/event-stream")
                for chunk in r.iter_raw():
                    raw += chunk
                    if sse and take(dec.feed(chunk)) == "close":
                        err = "client closed"
                        break
        except httpx.HTTPError as e:
            err = f"{type(e).__name__}: {e}"
        res = Result(status=status, headers=hdrs, raw=raw, transport_error=err, xrid=xrid,
                     t_sent=t0, t_end=time.monotonic())
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            if err is None:
                take(dec.finish())
            res.events = events
            res.t_first_content = t_first
        elif raw:
            with contextlib.suppress(ValueError):
                res.events = [json.loads(raw)]
            res.t_first_content = res.t_end if res.contents else None
        return res

    def journal(self, request_id: str, settle_s: float = 5.0) -> dict[str, Any]:
        """The journal record once it has an outcome (the guard writes it at stream end)."""
        deadline = time.monotonic() + settle_s
        while True:
            r = self.http.get(f"/v1/requests/{request_id}")
            assert r.status_code == 200, r.text
            j: dict[str, Any] = r.json()
            if j.get("outcome") is not None or time.monotonic() > deadline:
                return j
            time.sleep(0.05)


def output_text(path: str, obj: dict[str, Any]) -> str:
    """A non-streaming answer's text, per API family."""
    if path == "/v1/chat/completions":
        return str(obj["choices"][0]["message"]["content"] or "")
    if path == "/v1/completions":
        return str(obj["choices"][0]["text"])
    if path == "/v1/responses":
        return "".join(c.get("text", "") for item in obj.get("output") or []
                       if item.get("type") == "message" for c in item.get("content") or [])
    return "".join(b.get("text", "") for b in obj.get("content") or [])


def engine_tokens(c: Client, body: dict[str, Any], text: str,
                  path: str = "/v1/chat/completions", lo: int = 1) -> set[int]:
    """How many tokens the engine made for `text`, asked of the engine itself: greedy
    decoding is deterministic, so the run with max_tokens=k is the first k tokens of any
    run; every k whose text is `text` (a token that decodes to nothing adds a k)."""
    field = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    found: set[int] = set()
    for k in range(max(1, lo), lo + 64):
        r = c.http.post(path, json={**body, "stream": False, field: k},
                        headers={"x-request-id": new_xrid()})
        assert r.status_code == 200, r.text
        got = output_text(path, r.json())
        if got == text:
            found.add(k)
        elif found or not text.startswith(got):
            break
    assert found, f"no max_tokens gives {text!r}"
    MEASURED.setdefault("engine_tokens_asked", 0)
    MEASURED["engine_tokens_asked"] += 1
    return found


def long_prompt(words: int = 1000) -> str:
    """A long prompt for a real prefill window (~1 token per word with this tokenizer)."""
    text = ("gateway replica stream token delta prefill decode cache request answer model "
            "server worker engine queue batch attempt lease fence journal client")
    vocab = text.split()
    return " ".join(vocab[(i * 7 + i // 13) % len(vocab)] for i in range(words))


# --- fixtures ------------------------------------------------------------------------------


def vllm_stack(wd: Path, agents: bool = False, config: dict[str, Any] | None = None) -> Stack:
    """Two vLLM replicas behind etcd + the processor + Envoy, a partition proxy in front of
    each. `agents`: an `extproc agent --engine-kind vllm` in front of each vLLM (vLLM on its
    own loopback port, the agent on the one the proxy dials: Envoy -> proxy -> agent -> vLLM),
    stopped by PID with the stack; killing `rN` kills vLLM's process group alone."""
    return Stack(workdir=wd, config=config or CONFIG, replicas=2, partition_proxies=True,
                 replica_factory=replica_factory, health_path="/health",
                 replica_start_timeout_s=120, supervise_replicas=False,
                 agents=agents, agent_engine_kind="vllm", agent_ack_timeout_s=5.0)


def start_measured(st: Stack, into: dict[str, Any]) -> None:
    """Start a stack, measuring each replica's time to /health while they start together."""
    ready: dict[str, float] = {}
    stop = threading.Event()
    wd = str(st.workdir)

    def watch() -> None:
        deadline = time.monotonic() + 180
        while not stop.is_set() and time.monotonic() < deadline and len(ready) < 2:
            for i, port in enumerate(list(st.replica_ports)):
                name = f"r{i + 1}"
                if name not in ready and (wd, i) in STARTED and http_ok(
                        f"http://127.0.0.1:{port}/health", 0.3):
                    ready[name] = round(time.monotonic() - STARTED[(wd, i)], 1)
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    used_before = machine_used_gib()
    shm_before = shm_names()
    t0 = time.monotonic()
    try:
        st.start()
    finally:
        stop.set()
        watcher.join(2)
    OWNED_SHM.update(shm_names() - shm_before)
    into["stack_start_s"] = round(time.monotonic() - t0, 1)
    into["replica_start_to_health_s"] = ready
    into["machine_used_gib_before_after_start"] = [used_before, machine_used_gib()]
    into["workdir"] = str(st.workdir)


def write_results() -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(MEASURED, indent=1, sort_keys=True) + "\n")


def check_vllm_ready() -> None:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} missing: run `make test-vllm` (it installs the vLLM venv)")
    if not (MODEL_DIR / "config.json").exists():
        pytest.fail(f"{MODEL_DIR} missing: run `make test-vllm` (it builds the model)")


@pytest.fixture(scope="session")
def vstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    check_vllm_ready()
    st = vllm_stack(tmp_path_factory.mktemp("vllm-stack"))
    start_measured(st, MEASURED)
    MEASURED["model_dir"] = str(MODEL_DIR)
    try:
        yield st
    finally:
        try:
            MEASURED["memory_at_end"] = Engines(st).memory()
        finally:
            st.stop()
            time.sleep(0.5)
            reap_leaked_shm(final=True)
            write_results()


@pytest.fixture(scope="session")
def astack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The same stack with a replica agent in front of each vLLM (tests/vllm/test_04)."""
    check_vllm_ready()
    st = vllm_stack(tmp_path_factory.mktemp("vllm-agent-stack"), agents=True)
    into: dict[str, Any] = MEASURED.setdefault("agent_stack", {})
    start_measured(st, into)
    try:
        yield st
    finally:
        try:
            into["memory_at_end"] = Engines(st).memory()
        finally:
            st.stop()
            time.sleep(0.5)
            reap_leaked_shm(final=True)
            write_results()


@pytest.fixture
def engines(vstack: Stack) -> Engines:
    e = Engines(vstack)
    e.ensure_all_healthy()
    return e


@pytest.fixture
def gw(vstack: Stack, engines: Engines) -> Iterator[Client]:
    c = Client(vstack.base_url)
    yield c
    c.close()


@pytest.fixture
def aengines(astack: Stack) -> Engines:
    e = Engines(astack)
    e.ensure_all_healthy()
    return e


@pytest.fixture
def agw(astack: Stack, aengines: Engines) -> Iterator[Client]:
    """Through Envoy to the replicas' agents."""
    c = Client(astack.base_url)
    yield c
    c.close()


@pytest.fixture
def direct(engines: Engines) -> Iterator[Callable[[str], Client]]:
    made: list[Client] = []

    def make(name: str) -> Client:
        c = Client(engines.url(name))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if ENABLED and MEASURED:
        terminalreporter.write_sep("-", "real-engine measurements")
        terminalreporter.write_line(json.dumps(MEASURED, indent=1, sort_keys=True))


# Envoy forwards the client's x-request-id; vLLM prefixes it (and adds a suffix internally).
def vllm_ids(xrid: str) -> re.Pattern[str]:
    return re.compile(rf"(?:chatcmpl|cmpl)-{re.escape(xrid)}")
