"""The fault sweep: each fault kind at each token index, checked per request_id.

A *case* is (fault kind, token index i, streaming or not, seed). It runs one request through
real Envoy + etcd + processor + demo replicas, with the fault placed at index i, and then
checks six invariants against everything that can be observed about that request: the
client's raw bytes, each replica's attempt lines, the journal record, the partition proxy's
and the tool server's logs. See docs/sweep.md for the list and how to read the result.

The harness does not trust the code under test: it parses SSE itself and derives the
reference answer from the demo replica's documented token rule (devkit.demo.tokens), and
also from a fault-free run through the same gateway.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import shlex
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devkit.demo.tokens import chat_prompt, generate_tokens
from devkit.devstack import Stack, free_ports
from extproc.core.journal import request_id_for_key

# ----- the reference answer -------------------------------------------------------------

N = 20  # faults are placed at token indices 0..N
MAX_TOKENS = N + 2  # so that a fault at index N still fires before the answer completes
PROMPT = "Prove it at every point of the token loop."
DEFAULT_SEED = 7
CALL_ID = "call_sweep"
TENANT = "default"  # the gateway's tenant when no tenancy header is configured

TTL = 3
CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": TTL, "session_ttl_s": 3},
    "timeouts": {"first_delta_s": 2.0, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 0.6, "access_log_wait_s": 0.5,
                 "fence_wait_s": 3.5, "progress_interval_s": 0.2},
    "tools": {"wait_s": 5.0},
    # The sweep runs hundreds of failovers in a row: the pool-wide retry budget is tested on
    # its own (tests/e2e/test_pool.py) and set out of the way here.
    "policy": {"retry_budget": {"min_retry_concurrency": 1000000}},
}
SOURCE_GRACE_S = 0.5  # with agents: a lost path fails this long after the agent's word
UNSAFE_ENV = {"EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE": "1"}

TOKEN_DELAY_MS = "40"  # for faults the client times itself (disconnect, etcd, processor)
ETCD_FREEZE_S = 1.5
READ_TIMEOUT_S = 25.0  # longest legitimate silence: per-try timeout + lease expiry wait


def messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": PROMPT}]


def reference_tokens(seed: int) -> list[str]:
    return generate_tokens(chat_prompt(messages()), seed, MAX_TOKENS)


# ----- cases and fault kinds ------------------------------------------------------------

ALL = tuple(range(N + 1))
QUICK = (0, 1, 2, N)
QUICK_UNARY = (0, N)  # a non-streaming body is all or nothing: the ends suffice


@dataclass(frozen=True)
class Case:
    kind: str
    index: int
    stream: bool
    seed: int = DEFAULT_SEED
    # The replicas sit behind `extproc agent` (issue 26, decisions 0033/0034): the fault
    # kills the engine, the agent lives, and the gateway hears the agent's word.
    agents: bool = False

    @property
    def mode(self) -> str:
        return "stream" if self.stream else "unary"

    @property
    def case_id(self) -> str:
        return (f"{self.kind}@{self.index}/{self.mode}/seed{self.seed}"
                + ("/agents" if self.agents else ""))

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.case_id)

    def repro(self) -> str:
        return ("python -m devkit.sweep --case "
                + shlex.quote(f"{self.kind}@{self.index}/{self.mode}") + f" --seed {self.seed}"
                + (" --agents" if self.agents else ""))

    def __str__(self) -> str:
        return f"{self.kind}@{self.index}/{self.mode}" + ("+agents" if self.agents else "")

    @staticmethod
    def parse(text: str, seed: int = DEFAULT_SEED, agents: bool = False) -> Case:
        m = re.fullmatch(r"([a-z-]+)@(\d+)/(stream|unary)", text.strip())
        if not m or m.group(1) not in KINDS:
            raise ValueError(f"expected KIND@INDEX/stream|unary with KIND one of "
                             f"{', '.join(KINDS)}; got {text!r}")
        kind = KINDS[m.group(1)]
        if kind.agents is not None and kind.agents != agents:
            raise ValueError(f"{kind.name} runs only " + ("with" if kind.agents else "without")
                             + " --agents")
        return Case(m.group(1), int(m.group(2)), m.group(3) == "stream", seed, agents)


@dataclass
class Plan:
    """What the driver does for one case: headers, and actions at moments of the stream."""

    headers: dict[str, str] = field(default_factory=dict)
    tools: bool = False
    # Called with the number of content deltas the client has read so far, every time it
    # grows; returns True to make the client close the connection (a client disconnect).
    on_delta: Callable[[int], bool] | None = None
    marks: dict[str, float] = field(default_factory=dict)  # when the driver acted
    # (seconds after sending, action): for faults placed before any delta (index 0).
    timers: list[tuple[float, Callable[[], None]]] = field(default_factory=list)
    read_timeout_s: float = READ_TIMEOUT_S
    client_gives_up: bool = False  # a read timeout is the client's own disconnect
    after: Callable[[], None] | None = None  # cleanup once the client is done (always runs)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    stack: str  # which Stack flavour runs it: main | partition
    streaming: tuple[int, ...]
    unary: tuple[int, ...]
    quick_streaming: tuple[int, ...]
    quick_unary: tuple[int, ...]
    recoverable: bool  # nothing delivered => the client must get one complete answer
    interrupted: frozenset[str]  # the journal outcome after a partial delivery
    build: Callable[[SweepEnv, Stack, Case], Plan]
    journal_settle_s: float = 6.0
    # None: in both sweeps; True: only with the replica agents; False: only without them
    # (with agents, `kill-after-deltas` is `engine-dies`: the same fault, a new expectation).
    agents: bool | None = None


def _fault(spec: Callable[[int], str]) -> Callable[[SweepEnv, Stack, Case], Plan]:
    def build(env: SweepEnv, stack: Stack, case: Case) -> Plan:
        return Plan(headers={"x-replica-fault": spec(case.index)})
    return build


def _partition(env: SweepEnv, stack: Stack, case: Case) -> Plan:
    if case.stream:
        # The proxy forwards whole SSE events until i content deltas crossed, then drops
        # every byte both ways (no FIN crosses): the replica keeps decoding into a void.
        return Plan(headers={"x-partition": f"after-deltas:{case.index}",
                             "x-partition-attempt": "1",
                             "x-replica-token-delay-ms": "30"})
    # A non-streaming body is all or nothing: the only cut is before it (after the request).
    return Plan(headers={"x-partition": "after-request", "x-partition-attempt": "1"})


def _client_disconnect(env: SweepEnv, stack: Stack, case: Case) -> Plan:
    i = case.index
    if i == 0:
        # Leave before the first delta: the replica is slow to start, the client gives up.
        return Plan(headers={"x-replica-fault": "slow-first-delta:1.5"},
                    read_timeout_s=0.4, client_gives_up=True)
    return Plan(headers={"x-replica-token-delay-ms": TOKEN_DELAY_MS},
                on_delta=lambda k: k >= i)


class _Once:
    """Run an action exactly once, from whichever thread gets there first; the time it
    ran goes into `marks[name]` (the trace's timeline)."""

    def __init__(self, fn: Callable[[], None], name: str, marks: dict[str, float]) -> None:
        self.fn, self.done, self.lock = fn, False, threading.Lock()
        self.name, self.marks = name, marks

    def __call__(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.marks[self.name] = time.time()
        self.fn()


def _etcd_freeze(env: SweepEnv, stack: Stack, case: Case) -> Plan:
    etcd = stack.procs["etcd"]
    thaw_timer: list[threading.Timer] = []

    def thaw() -> None:
        etcd.signal(signal.SIGCONT)
        marks.setdefault("etcd_continued", time.time())

    def freeze() -> None:
        etcd.signal(signal.SIGSTOP)
        t = threading.Timer(ETCD_FREEZE_S, thaw)
        t.daemon = True
        thaw_timer.append(t)
        t.start()

    marks: dict[str, float] = {}
    once = _Once(freeze, "etcd_stopped", marks)

    def after() -> None:
        for t in thaw_timer:
            t.join(ETCD_FREEZE_S + 1)
        thaw()  # whatever happened, etcd runs again

    # Index 0: admitted, waiting for the first delta (0.5 s in) when etcd stops at 0.3 s: the
    # fence transaction meets a frozen etcd and times out (etcd.timeout_s = 1 s) before etcd
    # wakes at 1.8 s.
    return _fire_at(case, once, after, marks, first_delta_after_s=0.5, fire_at_s=0.3)


def _fire_at(case: Case, once: Callable[[], None], after: Callable[[], None],
             marks: dict[str, float], first_delta_after_s: float, fire_at_s: float) -> Plan:
    """Index 0: fire while the attempt waits for a slow first delta; index i: fire once
    content delta i has reached the client."""
    if case.index == 0:
        return Plan(headers={"x-replica-fault": f"slow-first-delta:{first_delta_after_s}"},
                    timers=[(fire_at_s, once)], after=after, marks=marks)
    i = case.index

    def on_delta(k: int) -> bool:
        if k >= i:
            once()
        return False

    return Plan(headers={"x-replica-token-delay-ms": TOKEN_DELAY_MS}, on_delta=on_delta,
                after=after, marks=marks)


def _processor_kill(env: SweepEnv, stack: Stack, case: Case) -> Plan:
    proc = stack.procs["processor"]

    def kill() -> None:
        proc.signal(signal.SIGKILL)

    marks: dict[str, float] = {}
    once = _Once(kill, "processor_killed", marks)

    def after() -> None:
        once()  # never leave the case with the old processor alive by accident
        if proc.popen is not None:
            proc.popen.wait(10)
        proc.start()
        env.wait_gateway(stack, 30.0)

    return _fire_at(case, once, after, marks, first_delta_after_s=1.0, fire_at_s=0.4)


def _freeze(env: SweepEnv, stack: Stack, case: Case) -> Plan:
    # The replica SIGSTOPs itself at the exact point (devkit.demo.replica); whatever
    # happens, every replica runs again once the client is done.
    def after() -> None:
        for i in range(len(stack.replica_ports)):
            stack.thaw(f"r{i + 1}")

    return Plan(headers={"x-replica-fault": f"freeze-after-deltas:{case.index}"}, after=after)


def _tool(then: str) -> Callable[[SweepEnv, Stack, Case], Plan]:
    def build(env: SweepEnv, stack: Stack, case: Case) -> Plan:
        # The replica calls the tool after computing i tokens, then dies after i+1 tokens:
        # computed only (kill-after-compute: nothing delivered, the retry must get the
        # recorded result) or delivered (kill-after-deltas: no retry at all).
        return Plan(headers={"x-replica-tool-call": f"{CALL_ID}@{case.index}",
                             "x-replica-fault": f"{then}:{case.index + 1}"}, tools=True)
    return build


UDI = frozenset({"upstream_decode_interrupted"})

KINDS: dict[str, Kind] = {k.name: k for k in [
    Kind("kill-before-headers", "SIGKILL (FIN) before the response headers", "main",
         (0,), (0,), (0,), (0,), True, UDI, _fault(lambda i: "kill-before-headers")),
    Kind("kill-after-headers", "SIGKILL (FIN) right after the 200 headers", "main",
         (0,), (0,), (0,), (0,), True, UDI, _fault(lambda i: "kill-after-headers")),
    Kind("kill-after-compute", "SIGKILL (FIN) after computing i tokens, none written", "main",
         ALL, ALL, QUICK, QUICK_UNARY, True, UDI, _fault(lambda i: f"kill-after-compute:{i}")),
    Kind("kill-after-deltas", "SIGKILL (FIN) after writing i deltas", "main",
         ALL, ALL, QUICK, QUICK_UNARY, True, UDI, _fault(lambda i: f"kill-after-deltas:{i}"),
         agents=False),
    Kind("engine-dies", "the engine (demo replica) SIGKILLed after writing i deltas, its "
         "agent alive", "main", ALL, ALL, QUICK, QUICK_UNARY, True, UDI,
         _fault(lambda i: f"kill-after-deltas:{i}"), agents=True),
    Kind("reset-after-deltas", "RST (SO_LINGER 0) + SIGKILL after writing i deltas", "main",
         ALL, ALL, QUICK, QUICK_UNARY, True, UDI, _fault(lambda i: f"reset-after-deltas:{i}")),
    Kind("error-after-deltas", "in-band error event (500 unary) after i deltas", "main",
         ALL, ALL, QUICK, QUICK_UNARY, True, UDI, _fault(lambda i: f"error-after-deltas:{i}")),
    Kind("stall-after-deltas", "alive and silent after i deltas", "main",
         ALL, ALL, QUICK, (0,), True, UDI, _fault(lambda i: f"stall-after-deltas:{i}")),
    Kind("silent-before-headers", "reads the request, never sends a byte", "main",
         (0,), (0,), (0,), (0,), True, UDI, _fault(lambda i: "silent-before-headers")),
    Kind("replica-frozen", "the whole replica SIGSTOPped after i deltas (unary: before "
         "its headers), SIGCONT after the case", "main",
         ALL, (0,), QUICK, (0,), True, UDI, _freeze),
    Kind("partition", "gateway-replica network cut after i deltas, replica alive",
         "partition", ALL, (0,), QUICK, (), True, UDI, _partition),
    Kind("client-disconnect", "the client closes after reading i deltas", "main",
         ALL, (), QUICK, (), False, frozenset({"client_disconnected"}), _client_disconnect),
    Kind("etcd-freeze", f"etcd SIGSTOPped when the client read i deltas, "
         f"SIGCONT {ETCD_FREEZE_S:g} s later", "main",
         ALL, (), QUICK, (), False, UDI, _etcd_freeze, journal_settle_s=10.0),
    Kind("processor-kill", "processor SIGKILLed when the client read i deltas, restarted",
         "main", ALL, (), (0, 2), (), False, frozenset({"gateway_interrupted"}),
         _processor_kill, journal_settle_s=30.0),
    Kind("tool-kill-compute", "tool call after i tokens, then SIGKILL before any delta",
         "main", ALL, ALL, QUICK, QUICK_UNARY, True, UDI, _tool("kill-after-compute")),
    Kind("tool-kill-deltas", "tool call after i tokens, then SIGKILL after i+1 deltas",
         "main", ALL, (), QUICK, (), True, UDI, _tool("kill-after-deltas")),
]}

STACK_ORDER = ("main", "partition", "unsafe")


def plan_cases(quick: bool, seed: int = DEFAULT_SEED, kinds: Iterable[str] | None = None,
               indices: Iterable[int] | None = None, modes: Iterable[str] = ("stream", "unary"),
               agents: bool = False) -> list[Case]:
    """The deterministic case list, grouped by stack so each stack starts once; with
    `agents`, the kinds of the sweep behind replica agents (`engine-dies` in place of
    `kill-after-deltas`)."""
    want = set(kinds) if kinds is not None else set(KINDS)
    unknown = want - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    only = set(indices) if indices is not None else None
    out: list[Case] = []
    for stack in STACK_ORDER:
        for k in KINDS.values():
            if k.name not in want or k.stack != stack:
                continue
            if k.agents is not None and k.agents != agents:
                continue
            full = not quick or only is not None  # explicit indices pick from every index
            for stream, idx in ((True, k.streaming if full else k.quick_streaming),
                                (False, k.unary if full else k.quick_unary)):
                if ("stream" if stream else "unary") not in modes:
                    continue
                out += [Case(k.name, i, stream, seed, agents) for i in idx
                        if only is None or i in only]
    return out


# The self-check slice: run on a processor with the fence switched off, it must be caught.
# kill-after-headers: released at once, the retry is lost (I3); kill-after-deltas:2: the
# journal has no first_delta_sent though the client got deltas (I6); error-after-deltas:0:
# the replica's own error reaches the client in place of the answer (I2, I3).
UNSAFE_SLICE = [Case("kill-after-headers", 0, True), Case("kill-after-deltas", 2, True),
                Case("error-after-deltas", 0, True), Case("kill-after-headers", 0, False)]


# ----- the client -----------------------------------------------------------------------

@dataclass
class Event:
    """One SSE event as the client got it: a JSON object, [DONE], or something else."""

    data: Any  # dict for JSON, "[DONE]", or None
    raw: str

    def content(self) -> str | None:
        if not isinstance(self.data, dict):
            return None
        for ch in self.data.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            d = ch.get("delta") or {}
            if isinstance(d, dict) and d.get("content"):
                return str(d["content"])
            if ch.get("text"):
                return str(ch["text"])
        return None


def parse_sse(raw: bytes) -> tuple[list[Event], bytes]:
    """Complete events, and the bytes of an unfinished one at the end (a fragment)."""
    text = raw.replace(b"\r\n", b"\n")
    parts = text.split(b"\n\n")
    tail = parts.pop()  # after the last blank line: an event that never finished
    events: list[Event] = []
    for p in parts:
        lines = [ln for ln in p.split(b"\n") if ln and not ln.startswith(b":")]
        if not lines:
            continue
        data = b"\n".join(ln[5:].lstrip(b" ") if ln.startswith(b"data:") else ln
                          for ln in lines).decode("utf-8", "replace")
        if data == "[DONE]":
            events.append(Event("[DONE]", data))
            continue
        try:
            events.append(Event(json.loads(data), data))
        except ValueError:
            events.append(Event(None, data))
    return events, tail


class DeltaCounter:
    """Counts content deltas as bytes arrive (for actions at 'the client read i deltas')."""

    def __init__(self) -> None:
        self.buf = b""
        self.count = 0

    def feed(self, chunk: bytes) -> list[int]:
        self.buf += chunk
        grew: list[int] = []
        evs, self.buf = parse_sse(self.buf)
        for e in evs:
            if e.content() is not None:
                self.count += 1
                grew.append(self.count)
        return grew


@dataclass
class ClientView:
    """Everything the client saw, byte for byte."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""
    transport_error: str | None = None
    closed_by_client: bool = False
    t_sent: float = 0.0
    t_end: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)  # when the driver acted

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "headers": self.headers,
                "raw_text": self.raw.decode("utf-8", "replace"),
                "raw_b64": base64.b64encode(self.raw).decode(),
                "transport_error": self.transport_error,
                "closed_by_client": self.closed_by_client, "t_sent": self.t_sent,
                "t_end": self.t_end, "marks": self.marks}


def send(base_url: str, body: dict[str, Any], headers: dict[str, str], plan: Plan) -> ClientView:
    view = ClientView()
    timeout = httpx.Timeout(connect=5.0, read=plan.read_timeout_s, write=5.0, pool=5.0)
    timers: list[threading.Timer] = []
    try:
        with httpx.Client(base_url=base_url, timeout=timeout) as c:
            view.t_sent = time.time()
            for delay, fn in plan.timers:
                t = threading.Timer(delay, fn)
                t.daemon = True
                timers.append(t)
                t.start()
            try:
                with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    view.status, view.headers = r.status_code, dict(r.headers)
                    counter = DeltaCounter()
                    for chunk in r.iter_raw():
                        view.raw += chunk
                        for k in counter.feed(chunk):
                            if plan.on_delta is not None and plan.on_delta(k):
                                view.closed_by_client = True
                        if view.closed_by_client:
                            view.transport_error = "client closed"
                            plan.marks["client_closed"] = time.time()
                            break
            except httpx.HTTPError as e:
                view.transport_error = f"{type(e).__name__}: {e}"
                if plan.client_gives_up and isinstance(e, httpx.ReadTimeout):
                    view.closed_by_client = True
                    plan.marks["client_closed"] = time.time()
            view.t_end = time.time()
    finally:
        for t in timers:
            t.join(10)
        if plan.after is not None:
            plan.after()
        view.marks = plan.marks
    return view


# ----- evidence -------------------------------------------------------------------------

@dataclass
class Evidence:
    case: Case
    kind: Kind
    request_id: str
    view: ClientView
    events: list[Event]
    tail: bytes
    body: Any  # the parsed non-streaming body (or an error object), if any
    journal: dict[str, Any] | None
    journal_seen: list[dict[str, Any]]  # every distinct record observed while settling
    rows: list[dict[str, Any]]  # replica attempt lines for this request
    proxy: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    ref_events: list[Any]  # the fault-free run's normalized events (stream) or body (unary)


@dataclass
class Violation:
    invariant: str  # I1..I6
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


@dataclass
class CaseResult:
    case: Case
    request_id: str
    category: str  # complete | clean_error | violation
    violations: list[Violation]
    delivered: int
    duration_s: float
    summary: str
    trace_path: str | None = None
    observations: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{self.case.case_id} request_id={self.request_id}: {self.category} "
                 f"({self.summary})"]
        lines += [f"  {v}" for v in self.violations]
        if (known := known_issue(self)) is not None:
            lines.append(f"  known product issue: {known}")
        if self.trace_path:
            lines.append(f"  trace: {self.trace_path}")
        lines.append(f"  reproduce: {self.case.repro()}")
        return "\n".join(lines)


def _normalize(obj: Any) -> Any:
    """An event or body without its per-request `id` (it embeds the request id)."""
    if isinstance(obj, dict):
        return {k: v for k, v in obj.items() if k != "id"}
    return obj


def _split_tokens(text: str) -> list[str]:
    return re.findall(r" [^ ]*|^[^ ]+", text)


def expected_tokens(case: Case, row: dict[str, Any] | None) -> list[str]:
    """What the attempt that delivered must have produced (after its tool result, if any)."""
    toks = reference_tokens(case.seed)
    for call in (row or {}).get("tool_calls") or []:
        if call.get("status") == 200 and isinstance(call.get("result"), str):
            after = int(call["at_token"])
            prompt = chat_prompt(messages())
            toks[after:] = generate_tokens(
                prompt + "\n[tool " + str(call["call_id"]) + "]\n" + call["result"],
                case.seed, MAX_TOKENS - after)
    return toks


# ----- the invariants -------------------------------------------------------------------

def check(ev: Evidence) -> tuple[list[Violation], str, int]:
    """The six invariants for one request; returns (violations, category, delivered)."""
    out: list[Violation] = []
    case, kind, v, j = ev.case, ev.kind, ev.view, ev.journal

    def bad(inv: str, msg: str) -> None:
        out.append(Violation(inv, msg))

    atts: list[dict[str, Any]] = sorted((j or {}).get("attempts") or [],
                                        key=lambda a: int(a.get("attempt", 0)))
    aid = v.headers.get("x-gateway-attempt-id")
    delivering = next((a for a in atts if a.get("attempt_id") == aid), None) if aid else None
    n_deliv = int(delivering["attempt"]) if delivering else None
    row_deliv = next((r for r in ev.rows if r.get("attempt") == n_deliv), None)
    want = expected_tokens(case, row_deliv)

    # --- what the client got ----------------------------------------------------------
    got: list[str] = []
    complete = False
    err_event: dict[str, Any] | None = None
    if case.stream:
        evs = ev.events
        got = [c for c in (e.content() for e in evs) if c is not None]
        if v.status == 200:
            exp = [_normalize(x) for x in json.loads(json.dumps(ev.ref_events))]
            ci = 0
            for x in exp:  # the reference with the delivering attempt's tokens
                if isinstance(x, dict) and Event(x, "").content() is not None:
                    x["choices"][0]["delta"]["content"] = want[ci]
                    ci += 1
            norm = [_normalize(e.data) if e.data is not None else ("malformed", e.raw)
                    for e in evs]
            complete = (norm == exp and v.transport_error is None and not ev.tail)
            if not complete:
                k = len(got)
                head, rest = norm[:1 + k], norm[1 + k:]
                if head != exp[:len(head)]:
                    bad("I1", f"the client's events are not a prefix of one attempt's output: "
                        f"got {[e.raw for e in evs[:1 + k]]!r}")
                if rest:
                    first = rest[0]
                    if (isinstance(first, dict) and set(first) == {"error"}
                            and rest[1:] == ["[DONE]"]):
                        err_event = first["error"]
                    else:
                        bad("I1", f"unexpected events after the delivered prefix: {rest!r}")
                elif v.transport_error is None:
                    bad("I2", "the stream ended cleanly without the answer, a terminal error "
                        "event or a transport error")
            if ev.tail:
                bad("I1", f"the client got a fragment of an event: {ev.tail[:120]!r}")
    else:
        body = ev.body
        if v.status == 200:
            exp_body = _normalize(json.loads(json.dumps(ev.ref_events)))
            exp_body["choices"][0]["message"]["content"] = "".join(want)
            if isinstance(body, dict) and body.get("choices"):
                text = str(((body["choices"][0] or {}).get("message") or {})
                           .get("content") or "")
                got = _split_tokens(text)
            complete = _normalize(body) == exp_body and v.transport_error is None
            if not complete:
                bad("I1", f"a non-streaming 200 that is not exactly one complete answer: "
                    f"{v.raw[:200]!r} (transport error: {v.transport_error})")
    k = len(got)

    # I1: a prefix of exactly one attempt's output, nothing repeated, nothing mixed.
    if got != want[:k]:
        bad("I1", f"content is not a prefix of the delivering attempt's output: got "
            f"{''.join(got)!r}, expected a prefix of {''.join(want)!r}")

    if err_event is not None:
        if err_event.get("code") != "upstream_decode_interrupted":
            bad("I2", f"terminal event has code {err_event.get('code')!r}")
        if err_event.get("delivered_output_tokens") != k:
            bad("I2", f"terminal event says delivered_output_tokens="
                f"{err_event.get('delivered_output_tokens')}, the client got {k}")
        if (err_event.get("partial_output"), err_event.get("retryable")) != (k > 0, False):
            bad("I2", f"terminal event flags partial_output/retryable wrong: {err_event}")
        if err_event.get("request_id") != ev.request_id:
            bad("I2", f"terminal event names request {err_event.get('request_id')}")

    # The boundary: a 200 must not start before the first delta (the retry is lost then).
    if v.status == 200 and k == 0 and not complete and not v.closed_by_client:
        bad("I3" if kind.recoverable else "I6",
            "the response was released (HTTP 200) before any content delta, and then "
            f"ended without an answer ({v.transport_error or 'error event'})")

    # I3: nothing delivered + a recoverable fault => one complete, identical answer.
    if k == 0 and kind.recoverable and not complete:
        code = ev.body.get("error", {}).get("code") if isinstance(ev.body, dict) else None
        bad("I3", f"nothing was delivered and the fault is recoverable, but the client got "
            f"status {v.status}, error {code or err_event}, transport "
            f"{v.transport_error}, not the complete answer")
    if complete and kind.name.startswith("tool-"):
        results = {c.get("result") for r in ev.rows for c in r.get("tool_calls") or []
                   if c.get("status") == 200}
        if len(results) > 1:
            bad("I3", f"attempts saw different tool results: {sorted(map(str, results))}")

    # I2: after a delivered delta, exactly one attempt delivered and nothing followed.
    if k >= 1:
        if delivering is None:
            bad("I2", f"cannot name the delivering attempt: header x-gateway-attempt-id="
                f"{aid!r}, journal attempts {[a.get('attempt_id') for a in atts]}")
        released = [a for a in atts if a.get("released")]
        if len(released) > 1:
            bad("I2", f"{len(released)} attempts released output: "
                f"{[a.get('attempt') for a in released]}")
        if n_deliv is not None:
            later = sorted({int(a["attempt"]) for a in atts if int(a["attempt"]) > n_deliv}
                           | {int(r["attempt"]) for r in ev.rows
                              if int(r.get("attempt", 0)) > n_deliv})
            if later:
                bad("I2", f"attempt(s) {later} ran after attempt {n_deliv} had delivered")
        if not complete and not (v.transport_error or err_event or v.closed_by_client):
            bad("I2", "partial answer without a terminal error event or a transport error")

    # A client that left, or a processor that died, must not be followed by a new attempt.
    for mark in ("client_closed", "processor_killed"):
        at = v.marks.get(mark)
        if at is None:
            continue
        late = [a.get("attempt") for a in atts if float(a.get("admitted_at") or 0) > at + 0.05]
        if late:
            bad("I2", f"attempt(s) {late} admitted after the {mark.replace('_', ' ')} "
                f"({at:.3f}): a backup attempt started for a request nobody can receive")

    # I6 (and I2's journal half): the journal agrees with what the client saw.
    if j is None:
        if ev.rows or k > 0 or complete:
            bad("I6", "no journal record, yet "
                + (f"the client got {k} deltas" if k else f"{len(ev.rows)} attempt(s) ran"))
    else:
        fds = bool(j.get("first_delta_sent"))
        outcome = j.get("outcome")
        d = int(j.get("delivered_output_tokens") or 0)
        exact = j.get("delivered_output_tokens_exact", True) is not False
        for seen in ev.journal_seen:
            if k > 0 and seen.get("first_delta_sent") is False and seen.get("outcome"):
                bad("I6", "the journal said first_delta_sent=false with an outcome while the "
                    f"client had {k} deltas")
                break
        if j.get("stream") is not None and bool(j.get("stream")) != case.stream:
            bad("I6", f"journal stream={j.get('stream')} for a {case.mode} request")
        if complete:
            if (outcome, fds, d) != ("completed", True, MAX_TOKENS):
                bad("I6", f"complete answer, but journal outcome={outcome} first_delta_sent="
                    f"{fds} delivered_output_tokens={d}")
        elif k >= 1:
            if not fds:
                bad("I6", f"the client got {k} deltas but the journal says "
                    "first_delta_sent=false")
            if outcome not in kind.interrupted:
                bad("I2", f"partial delivery, journal outcome {outcome!r} (cause "
                    f"{j.get('cause')!r}); expected {sorted(kind.interrupted)}")
            if exact:
                ok = (k <= d <= MAX_TOKENS if outcome == "client_disconnected" else d == k)
                what = "at least what the client read" if outcome == "client_disconnected" \
                    else "exactly what the client got"
            elif outcome == "gateway_interrupted":
                # The last checkpoint, said to be of unknown relation to what left (what had
                # been handed to Envoy then: decisions 0025 and 0026's orphan record).
                ok = (j.get("delivered_output_tokens_bound") == "unknown"
                      and 0 <= d <= MAX_TOKENS)
                what = "the checkpoint with its bound said to be unknown"
            else:
                ok, what = d >= k, "an upper bound (cause unknown)"
            if not ok:
                bad("I2", f"journal delivered_output_tokens={d} (exact={exact}) is not {what}"
                    f"; the client got {k}")
            if err_event is not None and j.get("error") != err_event:
                bad("I6", f"journal error {j.get('error')} != the client's {err_event}")
        else:  # nothing delivered, no answer
            if fds and exact:
                bad("I6", "nothing reached the client but the journal says first_delta_sent="
                    "true (exact)")
            if outcome in ("completed", "upstream_decode_interrupted"):
                bad("I6", f"nothing reached the client but the journal outcome is {outcome}")
            if outcome is None:
                bad("I6", "the journal record never got an outcome")
            if d != 0 and exact:
                bad("I6", f"nothing reached the client but delivered_output_tokens={d}")
        if outcome is not None and kind.name != "processor-kill":
            # A processor that died never closes its attempts (the reader settles the
            # request); any other ending must leave every attempt's end in the journal.
            unclosed = [a.get("attempt") for a in atts if not a.get("ended_at")]
            if unclosed:
                bad("I6", f"outcome {outcome} recorded but attempt(s) {unclosed} never got an "
                    "end record (no ended_at/released/fence) after settling")

    # I4: never two live, publishing attempts; the expiry wait is honoured.
    if j is not None:
        admitted = {int(a["attempt"]) for a in atts}
        ran = sorted({int(r["attempt"]) for r in ev.rows} - admitted)
        if ran:
            bad("I4", f"attempt(s) {ran} ran on a replica without an admission in the journal")
        for x in range(len(atts)):
            for y in range(x + 1, len(atts)):
                a, b = atts[x], atts[y]
                a0, b0 = float(a.get("admitted_at") or 0), float(b.get("admitted_at") or 0)
                a1 = float(a["ended_at"]) if a.get("ended_at") else float("inf")
                b1 = float(b["ended_at"]) if b.get("ended_at") else float("inf")
                overlap = a0 < b1 and b0 < a1
                publishing = bool(a.get("released") or b.get("released"))
                if overlap and publishing:
                    bad("I4", f"attempts {a['attempt']} [{a0:.3f}, {a1:.3f}] and "
                        f"{b['attempt']} [{b0:.3f}, {b1:.3f}] overlap and one released")
                if a.get("fence") == "expiry" and b0 < a1 + TTL * 2 / 3 - 0.5:
                    bad("I4", f"attempt {b['attempt']} admitted {b0 - a1:.2f} s after attempt "
                        f"{a['attempt']} ended, before its lease could expire (TTL {TTL} s)")

    if case.agents:
        check_agents(ev, atts, k, complete, err_event, bad)

    # I5: every tool key executed at most once.
    keys: dict[str, int] = {}
    for t in ev.tools:
        keys[str(t.get("key"))] = keys.get(str(t.get("key")), 0) + 1
    for key, n in keys.items():
        if n > 1:
            bad("I5", f"tool key {key} executed {n} times")
    fresh = [c for r in ev.rows for c in r.get("tool_calls") or []
             if c.get("status") == 200 and not c.get("replayed")]
    if len(fresh) > 1:
        bad("I5", f"{len(fresh)} attempts got a fresh (not replayed) tool result")
    if fresh and not keys:
        bad("I5", "a tool call returned a fresh result but the tool server logged nothing")

    category = "violation" if out else ("complete" if complete else "clean_error")
    return out, category, k


# With agents: faults that kill the engine (or reset its connection) while its agent lives.
ENGINE_DEATH = frozenset({"engine-dies", "reset-after-deltas", "tool-kill-deltas"})
# With agents: faults before the first delta that the retry must recover on the other
# replica (the engine's death before content is a reset towards Envoy: decision 0033).
RERUN_BEFORE_DELTA = frozenset({"kill-before-headers", "kill-after-headers",
                                "kill-after-compute", "engine-dies", "reset-after-deltas",
                                "error-after-deltas", "tool-kill-compute", "tool-kill-deltas"})


def check_agents(ev: Evidence, atts: list[dict[str, Any]], k: int, complete: bool,
                 err_event: dict[str, Any] | None, bad: Callable[[str, str], None]) -> None:
    """What the replica agents add to the invariants (issue 26, decisions 0033/0034)."""
    case, v = ev.case, ev.view
    # The engine died after a delivered delta and the agent lives: the client gets the
    # exact prefix (I1 above) and the in-band terminal event, never a transport cut.
    if case.kind in ENGINE_DEATH and case.stream and k >= 1 and not complete:
        if v.transport_error is not None:
            bad("I2", f"the engine died after {k} delivered deltas with its agent alive, but "
                f"the client's stream was cut ({v.transport_error}), not ended in-band")
        if err_event is None:
            bad("I2", "the engine died after a delivered delta with its agent alive, but the "
                "client got no upstream_decode_interrupted event")
    # Killed before the first delta: one re-run on the other replica, 2 attempts in all.
    if case.kind in RERUN_BEFORE_DELTA and k == 0:
        runs = {int(r.get("attempt", 0)): r.get("replica") for r in ev.rows}
        if len(atts) != 2:
            bad("I3", f"a fault before the first delta behind an agent: expected exactly 2 "
                f"attempts (the re-run), the journal has {len(atts)}")
        elif runs.get(1) is not None and runs.get(1) == runs.get(2):
            bad("I3", f"the re-run ran on the same replica {runs.get(1)} as the failed attempt")
    # The agent's word about a lost path, the cancel and its acknowledgement: an uncertain
    # end of an agent-fronted attempt before release asks its agent to stop it at the engine
    # (0034). A released attempt's end deletes its `live` key with the request: the agent's
    # own watch stops it (0033), no cancel is written.
    for a in atts:
        if (a.get("failure_class") == "network_uncertain" and not a.get("released")
                and not a.get("cancel_sent")):
            bad("I4", f"attempt {a.get('attempt')} ended network_uncertain behind an agent, "
                "but the gateway sent the agent no cancel")
        if a.get("cancel_ack") is not None and a.get("fence") != "revoked":
            bad("I4", f"attempt {a.get('attempt')} has a cancel_ack but fence "
                f"{a.get('fence')!r} (an acknowledged cancel revokes the fence)")
    if case.kind == "partition" and atts:
        check_partition_agents(ev, atts, k, bad)


def check_partition_agents(ev: Evidence, atts: list[dict[str, Any]], k: int,
                           bad: Callable[[str, str], None]) -> None:
    """A partition behind an agent: the agent's `src/` word fails the attempt within
    `source_grace_s` of it (not `first_delta_s`) once the response headers came, and the
    gateway asks the agent to cancel. Time bounds only as bounds."""
    first = atts[0]
    fd = float(CONFIG["timeouts"]["first_delta_s"])
    if ev.case.stream and ev.case.index == 0:
        if not first.get("path_lost"):
            bad("I3", "partition after the role event behind an agent: attempt 1 is not "
                "recorded path_lost")
        sent = first.get("source_sent_at")
        if sent is None:
            bad("I3", "partition behind an agent: attempt 1 has no source_sent_at (the "
                "agent's word that its first content left)")
        elif len(atts) >= 2:
            ended = float(first.get("ended_at") or 0)
            if not SOURCE_GRACE_S - 0.05 <= ended - float(sent) < fd:
                bad("I3", f"attempt 1 ended {ended - float(sent):.2f} s after the agent's "
                    f"word; expected within [{SOURCE_GRACE_S}, {fd}) s (source_grace_s, not "
                    "first_delta_s)")
    if first.get("path_lost") and not first.get("cancel_sent"):
        bad("I4", "attempt 1 lost its path but the gateway sent its agent no cancel")


# Kinds whose replica is confirmed gone or answering: its attempt should be revoked, not
# left to expire (stall and partition are exactly the uncertain cases).
CONFIRMED_END = frozenset({"kill-before-headers", "kill-after-headers", "kill-after-compute",
                           "kill-after-deltas", "reset-after-deltas", "error-after-deltas",
                           "tool-kill-compute", "tool-kill-deltas"})


def observe(ev: Evidence) -> list[str]:
    """Not violations (nothing unsafe happened), but worth a look: slow recoveries."""
    out: list[str] = []
    atts = (ev.journal or {}).get("attempts") or []
    if ev.kind.name in CONFIRMED_END:
        for a, b in itertools.pairwise(atts):
            if a.get("fence") == "expiry":
                out.append(f"attempt {a.get('attempt')} ended by a {ev.kind.name} fault was "
                           f"classified {a.get('failure_class')} (envoy_cause "
                           f"{a.get('envoy_cause')}, http_status {a.get('http_status')}) and "
                           f"fenced by lease expiry: the retry waited "
                           f"{b.get('waited_for_previous_s')} s")
    return out


# Product defects the sweep found (docs/sweep.md, "What the sweep found"), by signature:
# (kind, patterns every violation of the case must match, description). A case whose
# violations all match is still a violation (the table counts it) but is labelled known, and
# the quick subset in `make test` xfails it instead of failing. Remove an entry once fixed.
# Product defects the sweep found and that are not fixed yet: (kind, message patterns, what).
# Empty: the last one (an outcome lost after an in-band error) was fixed in the guard.
# Product defects the sweep has found and that are not fixed yet, as (kind, patterns every
# violation matches, what): such a case is reported as a known issue, not a pass. Empty: the
# last one (behind agents, the previous attempt's live/ delete heard late fenced the re-run:
# 409 attempt_fenced) is fixed in the agent (decision 0033, "Only this attempt's changes").
KNOWN_ISSUES: list[tuple[str, tuple[str, ...], str]] = []


def known_issue(res: CaseResult) -> str | None:
    """The known product defect explaining every violation of this case, if any."""
    if not res.violations:
        return None
    for kind, patterns, what in KNOWN_ISSUES:
        if res.case.kind == kind and all(any(re.search(p, v.message) for p in patterns)
                                         for v in res.violations):
            return what
    return None


# ----- running cases --------------------------------------------------------------------

class Unsupported(Exception):
    """The devstack cannot build the stack this case needs (e.g. agents behind partition
    proxies before devkit.devstack supports it): the case is skipped, with this reason."""


def agents_config(partition: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The processor config and Stack arguments for a stack whose replicas sit behind
    agents: the ports Envoy dials are chosen now, so the static pool can name them with
    `agent: {version: 1}` (decision 0034: only then does the gateway send its processor id,
    hear `src/` and put cancels)."""
    n = 2
    ports = free_ports(2 * n if partition else n)
    front = ports[:n]
    extra: dict[str, Any] = ({"proxy_ports": front, "agent_ports": ports[n:]} if partition
                             else {"agent_ports": front})
    fp = {"weights_revision": "demo-1"}  # the devstack's default fingerprint
    config = {**CONFIG,
              "timeouts": {**CONFIG["timeouts"], "source_grace_s": SOURCE_GRACE_S},
              "pool": {"replicas": [{"address": f"127.0.0.1:{p}", "fingerprint": fp,
                                     "agent": {"version": 1}} for p in front]}}
    return config, extra


class SweepEnv:
    """Owns at most one Stack at a time (main, partition, unsafe) and runs cases on it."""

    def __init__(self, workdir: Path, out_dir: Path, log: Callable[[str], None] = print,
                 trace_all: bool = False) -> None:
        self.trace_all = trace_all
        self.workdir = workdir
        self.out_dir = out_dir
        self.log = log
        self.stack: Stack | None = None
        self.flavour: str | None = None
        self.refs: dict[tuple[str, bool, int], Any] = {}
        self.unsupported: dict[str, str] = {}  # stack key -> why it cannot be built
        self.skipped: list[tuple[Case, str]] = []
        self.results: list[CaseResult] = []
        (out_dir / "failures").mkdir(parents=True, exist_ok=True)
        self.results_path = out_dir / "results.jsonl"

    # --- stacks -----------------------------------------------------------------------

    def get(self, flavour: str, agents: bool = False) -> Stack:
        """The stack of this flavour (`main`, `partition`, `unsafe`), with a replica agent
        in front of every demo replica when `agents`; raises Unsupported when the devstack
        cannot build that combination."""
        key = flavour + ("+agents" if agents else "")
        if self.flavour == key and self.stack is not None:
            return self.stack
        if key in self.unsupported:
            raise Unsupported(self.unsupported[key])
        self.close()
        wd = self.workdir / f"stack-{flavour}-{uuid.uuid4().hex[:6]}"
        t0 = time.monotonic()
        config, extra = CONFIG, dict[str, Any]()
        if agents:
            config, extra = agents_config(partition=flavour == "partition")
        st = Stack(workdir=wd, config=config, replicas=2,
                   tool_server=flavour == "main",
                   partition_proxies=flavour == "partition",
                   processor_env=UNSAFE_ENV if flavour == "unsafe" else None,
                   agents=agents, **extra)
        try:
            st.start()
        except ValueError as e:  # the devstack says it cannot combine these (yet)
            self.unsupported[key] = f"Stack({flavour}, agents=True): {e}"
            raise Unsupported(self.unsupported[key]) from e
        self.stack, self.flavour = st, key
        self.wait_gateway(st, 20.0)
        self.log(f"# stack {flavour} up in {time.monotonic() - t0:.1f}s (logs: {wd})")
        return st

    def close(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        self.stack, self.flavour = None, None

    def wait_gateway(self, stack: Stack, timeout_s: float) -> None:
        """Until Envoy and the processor serve (a status lookup goes through the guard)."""
        deadline = time.monotonic() + timeout_s
        probe = "/v1/requests/req_" + "0" * 26
        while True:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(stack.base_url + probe, timeout=2.0)
                if r.status_code == 404:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not come back")
            time.sleep(0.1)

    def reference(self, stack: Stack, stream: bool, seed: int) -> Any:
        """The fault-free run through this gateway, checked against the token rule."""
        key = (self.flavour or "", stream, seed)
        if key not in self.refs:
            body = self.body(stream, seed, tools=False)
            view = send(stack.base_url, body, {"Idempotency-Key": "ref-" + uuid.uuid4().hex},
                        Plan(read_timeout_s=10.0))
            want = "".join(reference_tokens(seed))
            if v_err := view.transport_error:
                raise RuntimeError(f"fault-free reference run failed: {v_err}")
            if stream:
                evs, _tail = parse_sse(view.raw)
                got = "".join(c for c in (e.content() for e in evs) if c is not None)
                ref: Any = [_normalize(e.data) for e in evs]
            else:
                ref = _normalize(json.loads(view.raw))
                got = ref["choices"][0]["message"]["content"]
            if view.status != 200 or got != want:
                raise RuntimeError(f"fault-free reference run differs from the token rule: "
                                   f"{view.status} {got!r} != {want!r}")
            self.refs[key] = ref
        return self.refs[key]

    @staticmethod
    def body(stream: bool, seed: int, tools: bool) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "demo-model", "stream": stream, "max_tokens": MAX_TOKENS,
                             "seed": seed, "messages": messages()}
        if tools:
            b["tools"] = [{"type": "function", "function": {
                "name": "demo_tool", "parameters": {"type": "object"}}}]
        return b

    # --- one case ---------------------------------------------------------------------

    def run(self, case: Case, flavour: str | None = None) -> CaseResult:
        kind = KINDS[case.kind]
        stack = self.get(flavour or kind.stack, case.agents)
        t0 = time.monotonic()
        stack.wait_replicas_healthy(20.0)
        ref = self.reference(stack, case.stream, case.seed)
        plan = kind.build(self, stack, case)
        key = f"sweep-{case.slug}-{uuid.uuid4().hex[:10]}"
        headers = {"Idempotency-Key": key, **plan.headers}
        body = self.body(case.stream, case.seed, plan.tools)
        view = send(stack.base_url, body, headers, plan)
        rid = request_id_for_key(TENANT, key)
        notes = list(plan.notes)
        if view.headers.get("x-gateway-request-id") not in (None, rid):
            notes.append(f"x-gateway-request-id {view.headers.get('x-gateway-request-id')} "
                         f"!= the id derived from the key {rid}")
        t_client = time.monotonic()
        ev = self.collect(stack, case, kind, rid, view, ref)
        violations, category, k = check(ev)
        notes.append(f"timing: client {view.t_end - view.t_sent:.2f}s, evidence "
                     f"{time.monotonic() - t_client:.2f}s")
        res = CaseResult(case, rid, category, violations, k, time.monotonic() - t0,
                         self.summarize(ev, k, category), observations=observe(ev))
        if violations or self.trace_all:
            res.trace_path = str(self.save_trace(ev, res, headers, body, notes))
        self.results.append(res)
        with open(self.results_path, "a") as f:
            f.write(json.dumps({"case": case.case_id, "request_id": rid,
                                "category": category, "delivered": k,
                                "duration_s": round(res.duration_s, 3),
                                "summary": res.summary, "notes": notes,
                                "client_s": round(view.t_end - view.t_sent, 3),
                                "attempts": [
                                    {x: a.get(x) for x in ("attempt", "failure_class", "fence",
                                                           "envoy_cause", "released",
                                                           "waited_for_previous_s",
                                                           "path_lost", "cancel_sent",
                                                           "cancel_ack", "engine_ack",
                                                           "source_sent_at")
                                     if x in a}
                                    for a in (ev.journal or {}).get("attempts") or []],
                                "violations": [str(x) for x in violations],
                                "observations": res.observations,
                                "trace": res.trace_path}) + "\n")
        return res

    def collect(self, stack: Stack, case: Case, kind: Kind, rid: str, view: ClientView,
                ref: Any) -> Evidence:
        events, tail = parse_sse(view.raw) if case.stream and view.status == 200 else ([], b"")
        body: Any = None
        if not (case.stream and view.status == 200) and view.raw:
            try:
                body = json.loads(view.raw)
            except ValueError:
                body = None
        k = sum(1 for e in events if e.content() is not None)
        if not case.stream and isinstance(body, dict) and body.get("choices"):
            k = 1
        # With the fence off (the self-check) attempts never end: do not wait for that.
        settle_s = 2.0 if self.flavour == "unsafe" else kind.journal_settle_s
        journal, seen = self.settle_journal(stack, rid, kind, k > 0, settle_s)
        n_attempts = len((journal or {}).get("attempts") or [])
        rows = self.settle_rows(stack, rid, n_attempts,
                                4.0 if kind.stack == "partition" else 2.0)
        proxy = [p for p in stack.proxy_log() if p.get("request_id") == rid]
        tools = [t for t in stack.tool_log() if str(t.get("key", "")).startswith(rid + ":")]
        return Evidence(case, kind, rid, view, events, tail, body, journal, seen, rows, proxy,
                        tools, ref)

    def settle_journal(self, stack: Stack, rid: str, kind: Kind, delivered: bool,
                       settle_s: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Poll the status endpoint until the record is final: an outcome, every attempt
        ended, unchanged for 0.2 s; bounded by `settle_s`."""
        deadline = time.monotonic() + settle_s
        seen: list[dict[str, Any]] = []
        last: dict[str, Any] | None = None
        stable_since = time.monotonic()
        missing_since: float | None = None
        with httpx.Client(base_url=stack.base_url, timeout=3.0) as c:
            while True:
                j: dict[str, Any] | None = None
                status = 0
                with contextlib.suppress(httpx.HTTPError):
                    r = c.get(f"/v1/requests/{rid}")
                    status = r.status_code
                    if status == 200:
                        j = r.json()
                now = time.monotonic()
                if status == 404:
                    missing_since = missing_since or now
                    # No record: the request never got one (e.g. etcd was frozen at intake).
                    if now - missing_since > 1.5:
                        return None, seen
                if j is not None:
                    if not seen or seen[-1] != j:
                        seen.append(j)
                    if j != last:
                        last, stable_since = j, now
                    settled = (j.get("outcome") is not None
                               and all(a.get("ended_at") for a in j.get("attempts") or []))
                    if kind.name == "processor-kill":  # its attempts never record an end
                        settled = j.get("outcome") is not None
                    if kind.name == "etcd-freeze":
                        # A fence that timed out in a frozen etcd may apply when it wakes;
                        # the gate takes it back asynchronously: wait for that, bounded.
                        settled = settled and bool(j.get("first_delta_sent")) == delivered
                    if settled and now - stable_since >= 0.2:
                        return j, seen
                if now > deadline:
                    return last, seen
                time.sleep(0.1)

    @staticmethod
    def settle_rows(stack: Stack, rid: str, want: int, max_s: float) -> list[dict[str, Any]]:
        """Replica lines are written when an attempt ends: wait until the set is stable."""
        deadline = time.monotonic() + max_s
        rows: list[dict[str, Any]] = []
        stable_since = time.monotonic()
        while time.monotonic() < deadline:
            new = sorted((r for r in stack.all_replica_logs() if r.get("request_id") == rid),
                         key=lambda r: (r.get("attempt", 0), r.get("ts", 0)))
            now = time.monotonic()
            if new != rows:
                rows, stable_since = new, now
            elif len(rows) >= want and now - stable_since >= 0.2:
                break
            time.sleep(0.05)
        return rows

    @staticmethod
    def summarize(ev: Evidence, k: int, category: str) -> str:
        j = ev.journal or {}
        err = None
        for e in ev.events:
            if isinstance(e.data, dict) and "error" in e.data:
                err = e.data["error"].get("code")
        if isinstance(ev.body, dict) and "error" in ev.body:
            err = ev.body["error"].get("code")
        return (f"http {ev.view.status}, {k} delta(s)"
                + (f", error {err}" if err else "")
                + (f", transport: {ev.view.transport_error}" if ev.view.transport_error else "")
                + f"; journal {j.get('outcome')} fds={j.get('first_delta_sent')} "
                f"d={j.get('delivered_output_tokens')} attempts={len(j.get('attempts') or [])}"
                f"; replica attempts {[(r.get('attempt'), r.get('outcome')) for r in ev.rows]}")

    def save_trace(self, ev: Evidence, res: CaseResult, headers: dict[str, str],
                   body: dict[str, Any], notes: list[str]) -> Path:
        assert self.stack is not None
        wd = self.stack.workdir
        time.sleep(1.1)  # Envoy flushes its file access log once a second

        def lines_with(path: Path, needle: str) -> list[str]:
            if not path.exists():
                return []
            with open(path, errors="replace") as f:
                return [ln.rstrip("\n") for ln in f if needle in ln]

        trace = {
            "case": {"kind": ev.case.kind, "index": ev.case.index, "stream": ev.case.stream,
                     "seed": ev.case.seed, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                     "fault": ev.kind.doc, "reproduce": ev.case.repro()},
            "request_id": ev.request_id,
            "violations": [str(v) for v in res.violations],
            "summary": res.summary,
            "request": {"headers": headers, "body": body},
            "client": ev.view.to_json(),
            "expected_tokens": reference_tokens(ev.case.seed),
            "journal": ev.journal,
            "journal_observed": ev.journal_seen,
            "replica_attempts": ev.rows,
            "proxy_log": ev.proxy,
            "tool_log": ev.tools,
            "processor_log": lines_with(wd / "processor.log", ev.request_id),
            "envoy_access_log": lines_with(wd / "envoy-access.jsonl", ev.request_id),
            "stack_workdir": str(wd),
            "config": CONFIG,
            "notes": notes,
        }
        sub = "failures" if res.violations else "traces"
        (self.out_dir / sub).mkdir(parents=True, exist_ok=True)
        path = self.out_dir / sub / f"{ev.case.slug}.json"
        path.write_text(json.dumps(trace, indent=2, default=str))
        return path


# ----- the summary table ----------------------------------------------------------------

BUCKETS: list[tuple[str, Callable[[int], bool]]] = [
    ("0", lambda i: i == 0), ("1", lambda i: i == 1), ("2-5", lambda i: 2 <= i <= 5),
    ("6-10", lambda i: 6 <= i <= 10), (f"11-{N}", lambda i: 11 <= i <= N)]


def table(results: list[CaseResult]) -> str:
    """Rows: fault kind x mode; cells per index bucket: complete/clean-error/violations."""
    rows: dict[tuple[str, str], dict[str, list[int]]] = {}
    order = list(KINDS)
    for r in results:
        cell = rows.setdefault((r.case.kind, r.case.mode), {})
        for name, pred in BUCKETS:
            if pred(r.case.index):
                c = cell.setdefault(name, [0, 0, 0])
                c[["complete", "clean_error", "violation"].index(r.category)] += 1
    head = f"{'fault kind':<20} {'mode':<6} " + " ".join(f"{b:>9}" for b, _ in BUCKETS) \
        + f" {'runs':>5} {'viol':>5}"
    lines = ["cells: complete/clean-error/violations per token-index bucket", head,
             "-" * len(head)]
    tot = [0, 0, 0]
    for kname, mode in sorted(rows, key=lambda km: (order.index(km[0]), km[1] != "stream")):
        cell = rows[(kname, mode)]
        cells = []
        runs = viol = 0
        for b, _ in BUCKETS:
            got = cell.get(b)
            cells.append(f"{'/'.join(map(str, got)) if got else '-':>9}")
            if got:
                runs += sum(got)
                viol += got[2]
                for n in range(3):
                    tot[n] += got[n]
        lines.append(f"{kname:<20} {mode:<6} " + " ".join(cells) + f" {runs:>5} {viol:>5}")
    lines.append("-" * len(head))
    lines.append(f"total: {sum(tot)} runs, {tot[0]} complete answers, {tot[1]} clean errors, "
                 f"{tot[2]} with violations")
    return "\n".join(lines)


def run_cases(env: SweepEnv, cases: list[Case], budget_s: float | None = None,
              flavour: str | None = None) -> Iterator[CaseResult]:
    t0 = time.monotonic()
    for n, case in enumerate(cases, 1):
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            env.log(f"# time budget of {budget_s:.0f}s used up: {len(cases) - n + 1} cases "
                    "not run")
            return
        try:
            res = env.run(case, flavour)
        except Unsupported as e:
            env.skipped.append((case, str(e)))
            env.log(f"[{n:>3}/{len(cases)}] {case!s:<32} skipped: {e}")
            continue
        env.log(f"[{n:>3}/{len(cases)}] {case!s:<32} {res.category:<11} "
                f"{res.duration_s:5.1f}s  {res.summary}")
        for v in res.violations:
            env.log(f"      {v}")
        yield res
