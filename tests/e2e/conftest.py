"""Real Envoy + real etcd + our processor + demo replicas, as subprocesses on loopback."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import Stack
from extproc.core.sse import EventKind, SseDecoder

E2E_CONFIG: dict[str, Any] = {
    "timeouts": {
        "first_delta_s": 5.0,
        "stall_after_first_delta_s": 1.0,
        "access_log_wait_s": 0.5,
        "fence_wait_s": 12.0,
    },
    "limits": {"max_request_body_bytes": 65536},
    # These tests exercise failover itself, many retries in a short time: the pool-wide
    # retry budget is tested on its own (test_pool.py) and set out of the way here.
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},
}


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    wd: Path = tmp_path_factory.mktemp("stack")
    st = Stack(workdir=wd, config=E2E_CONFIG, replicas=2).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="session")
def stack_grpclib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The same stack with the processor on grpclib (server.transport, decision 0020)."""
    wd: Path = tmp_path_factory.mktemp("stack-grpclib")
    cfg = {**E2E_CONFIG, "server": {"transport": "grpclib"}}
    st = Stack(workdir=wd, config=cfg, replicas=2).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def gw(stack: Stack) -> Iterator[Gateway]:
    stack.wait_replicas_healthy()
    g = Gateway(stack)
    yield g
    g.client.close()


@dataclass
class Result:
    """What one client saw, per request."""

    status: int
    headers: dict[str, str]
    raw: bytes
    transport_error: str | None
    events: list[dict[str, Any] | str] = field(default_factory=list)

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
        return out

    @property
    def error(self) -> dict[str, Any] | None:
        for e in self.events:
            if isinstance(e, dict) and "error" in e:
                err: dict[str, Any] = e["error"]
                return err
        return None

    def normalized(self) -> list[Any]:
        """The exact event list with the per-request `id` removed (it embeds request_id)."""
        out: list[Any] = []
        for e in self.events:
            if isinstance(e, dict):
                e = {k: v for k, v in e.items() if k != "id"}
            out.append(e)
        return out


def parse_events(raw: bytes) -> list[dict[str, Any] | str]:
    dec = SseDecoder()
    evs = dec.feed(raw) + dec.finish()
    out: list[dict[str, Any] | str] = []
    for e in evs:
        if e.kind is EventKind.DONE:
            out.append("[DONE]")
        elif e.data:
            out.append(json.loads(e.data))
    return out


def word_tokenizer(path: Path) -> Path:
    """A real Hugging Face tokenizer.json: one token per whitespace-separated word (the demo
    replica's tokens are " word" each)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


class Gateway:
    def __init__(self, stack: Stack, headers: dict[str, str] | None = None,
                 keyed: bool = True) -> None:
        self.stack = stack
        # Room for every thread a test starts: httpcore's sync pool can close an idle
        # connection it has just handed to a queued request (encode/httpcore#1110), which a
        # test sees as `ReadError: Bad file descriptor`; with no queue and no surplus idle
        # connection to close, that path is never taken.
        self.client = httpx.Client(
            base_url=stack.base_url, timeout=30, headers=headers,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
        # Whether `post` sends a fresh Idempotency-Key unless told a key (or None).
        self.keyed = keyed

    def body(self, stream: bool = True, max_tokens: int = 8, prompt: str = "hello",
             path: str = "chat", **extra: Any) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "demo-model", "stream": stream, "max_tokens": max_tokens,
                             "seed": 7, **extra}
        if path == "chat":
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        return b

    def post(self, body: dict[str, Any], headers: dict[str, str] | None = None,
             path: str = "/v1/chat/completions", key: str | None = "auto",
             stop_after_contents: int | None = None) -> Result:
        h = dict(headers or {})
        if key == "auto" and self.keyed:
            h["Idempotency-Key"] = "t-" + uuid.uuid4().hex
        elif key not in (None, "auto"):
            h["Idempotency-Key"] = key
        raw = b""
        err: str | None = None
        status, hdrs = 0, {}
        try:
            with self.client.stream("POST", path, json=body, headers=h) as r:
                status, hdrs = r.status_code, dict(r.headers)
                for chunk in r.iter_raw():
                    raw += chunk
                    if stop_after_contents is not None:
                        got = sum(1 for e in parse_events(raw) if isinstance(e, dict)
                                  and any((c.get("delta") or {}).get("content")
                                          for c in e.get("choices") or []))
                        if got >= stop_after_contents:
                            err = "client closed"
                            break
        except httpx.HTTPError as e:
            err = f"{type(e).__name__}: {e}"
        res = Result(status=status, headers=hdrs, raw=raw, transport_error=err)
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            res.events = parse_events(raw)
        elif raw:
            try:
                res.events = [json.loads(raw)]
            except ValueError:
                res.events = []
        return res

    def status(self, request_id: str) -> httpx.Response:
        return self.client.get(f"/v1/requests/{request_id}")

    def journal(self, request_id: str, settle_s: float = 3.0) -> dict[str, Any]:
        """The journal record once it has an outcome (the guard writes it at stream end)."""
        deadline = time.monotonic() + settle_s
        while True:
            r = self.status(request_id)
            assert r.status_code == 200, r.text
            j: dict[str, Any] = r.json()
            if j["outcome"] is not None or time.monotonic() > deadline:
                return j
            time.sleep(0.05)

    def attempts_logged(self, request_id: str, settle_s: float = 2.0) -> list[dict[str, Any]]:
        """Every attempt any replica logged for this request, in time order.

        Lines are written when an attempt ends; wait until the set is stable for 300 ms.
        """
        deadline = time.monotonic() + settle_s
        rows: list[dict[str, Any]] = []
        stable_since = time.monotonic()
        while time.monotonic() < deadline:
            new = sorted((r for r in self.stack.all_replica_logs()
                          if r.get("request_id") == request_id), key=lambda r: r["ts"])
            now = time.monotonic()
            if new != rows:
                rows, stable_since = new, now
            elif rows and now - stable_since >= 0.3:
                break
            time.sleep(0.05)
        return rows
