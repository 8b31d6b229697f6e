"""The demo replica, run as a real process: output shape, determinism and every fault hook.

Faults must be observable from outside (a killed process, a half-written stream, a log
line), so these tests drive a subprocess over loopback instead of an in-process app.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.demo.tokens import (
    MAX_TOKENS_CAP,
    WORDS,
    chat_prompt,
    generate_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


# ----- pure token generation -------------------------------------------------------------


def test_generate_tokens_is_deterministic_and_well_formed() -> None:
    a = generate_tokens("hello", 0, 32)
    assert a == generate_tokens("hello", 0, 32)
    assert len(a) == 32
    assert all(t.startswith(" ") and t[1:] in WORDS for t in a)
    assert generate_tokens("hello", 1, 32) != a
    assert generate_tokens("hellp", 0, 32) != a
    # A shorter request yields a prefix of a longer one: re-runs stay comparable.
    assert generate_tokens("hello", 0, 5) == a[:5]
    assert generate_tokens("hello", 0, 0) == []


def test_generate_tokens_caps_max_tokens() -> None:
    assert len(generate_tokens("x", 0, MAX_TOKENS_CAP)) == MAX_TOKENS_CAP
    with pytest.raises(ValueError):
        generate_tokens("x", 0, MAX_TOKENS_CAP + 1)


def test_chat_prompt_rule() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    assert chat_prompt(messages) == "system\ns\nuser\nab\nassistant\n\n"


# ----- subprocess harness ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_lines(self) -> list[dict[str, Any]]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.strip()]

    async def log_for(self, request_id: str, within: float = 2.0) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            found = [x for x in self.log_lines() if x["request_id"] == request_id]
            if found:
                assert len(found) == 1, found
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line for {request_id}: {self.log_lines()}")
            await asyncio.sleep(0.01)

    async def wait_exit(self, within: float = 5.0) -> int:
        return await asyncio.to_thread(self.proc.wait, within)


Spawn = Callable[..., Awaitable[Replica]]


async def _start(tmp: Path, name: str, *extra: str) -> Replica:
    port = _free_port()
    log_path = tmp / f"{name}-{port}.jsonl"
    stderr = (tmp / f"{name}-{port}.stderr").open("wb")
    cmd = [sys.executable, "-m", "devkit.demo.replica", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--name", name, "--log-file", str(log_path), *extra]
    proc = await asyncio.to_thread(
        subprocess.Popen, cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=stderr
    )
    stderr.close()
    replica = Replica(proc, port, log_path)
    deadline = time.monotonic() + 10
    async with httpx.AsyncClient() as client:
        while True:
            if proc.poll() is not None:
                raise AssertionError((tmp / f"{name}-{port}.stderr").read_text())
            try:
                r = await client.get(replica.url + "/health", timeout=0.5)
                if r.status_code == 200:
                    assert r.json() == {"status": "ok", "name": name}
                    return replica
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("replica did not become healthy")
            await asyncio.sleep(0.03)


def _stop(replica: Replica) -> None:
    if replica.proc.poll() is None:
        replica.proc.kill()
    replica.proc.wait(timeout=5)


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    started: list[Replica] = []

    async def _spawn(name: str = "r1", *extra: str) -> Replica:
        replica = await _start(tmp_path, name, *extra)
        started.append(replica)
        return replica

    yield _spawn
    for replica in started:
        _stop(replica)


@pytest.fixture(scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Replica]:
    replica = await _start(tmp_path_factory.mktemp("shared"), "shared")
    yield replica
    _stop(replica)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


def _rid() -> str:
    return uuid.uuid4().hex


def _chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": MESSAGES, "stream": True, "max_tokens": 5, **kw}


def _events(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("\n\n"), raw[-40:]
    parts = raw[:-2].split("\n\n")
    assert all(p.startswith("data: ") for p in parts), parts
    return [p[len("data: ") :] for p in parts]


async def _read_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int | None, list[str], BaseException | None]:
    """Collect data payloads until the stream ends or breaks; report how it ended."""
    status: int | None = None
    payloads: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            status = resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    payloads.append(line[len("data: ") :])
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return status, payloads, exc
    return status, payloads, None


# ----- output shape and determinism ------------------------------------------------------


async def test_chat_stream_shape(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    body = _chat_body(stream_options={"include_usage": True})
    r = await client.post(shared.url + CHAT, json=body, headers={"x-request-id": rid})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = _events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 1 + 5 + 1 + 1
    for c in chunks:
        assert c["id"] == f"chatcmpl-{rid}"
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == "demo-model"
        assert c["created"] == 0
    role, *deltas, final, usage = chunks
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    expected = generate_tokens(chat_prompt(MESSAGES), 0, 5)
    assert [d["choices"][0]["delta"] for d in deltas] == [{"content": t} for t in expected]
    assert all(d["choices"][0]["finish_reason"] is None for d in deltas)
    assert final["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    # Compact JSON, byte for byte.
    assert payloads[1] == json.dumps(deltas[0], separators=(",", ":"))
    line = await shared.log_for(rid)
    assert line["outcome"] == "completed"
    assert line["stream"] is True
    assert (line["tokens_computed"], line["tokens_written"]) == (5, 5)
    assert line["peer_closed"] is False
    assert line["fault"] is None
    assert line["tool_calls"] == []
    assert line["replica"] == "shared"
    assert line["port"] == shared.port
    assert line["attempt"] == 1
    assert line["path"] == CHAT


async def test_completions_stream_shape(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    body = {"prompt": "once upon", "stream": True, "max_tokens": 3, "seed": 7}
    r = await client.post(shared.url + COMPL, json=body, headers={"x-gateway-request-id": rid})
    payloads = _events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 3 + 1  # no role event, no usage event
    assert all(c["object"] == "text_completion" and c["id"] == f"cmpl-{rid}" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert texts == generate_tokens("once upon", 7, 3)
    assert chunks[-1]["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    ]


async def test_non_streaming_bodies(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    body = _chat_body(stream=False, max_tokens=4)
    r = await client.post(shared.url + CHAT, json=body, headers={"x-request-id": rid})
    assert r.status_code == 200
    data = r.json()
    assert data["id"] == f"chatcmpl-{rid}"
    assert data["object"] == "chat.completion"
    text = "".join(generate_tokens(chat_prompt(MESSAGES), 0, 4))
    assert data["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert data["usage"]["completion_tokens"] == 4
    line = await shared.log_for(rid)
    assert (line["stream"], line["outcome"], line["tokens_written"]) == (False, "completed", 4)

    r = await client.post(shared.url + COMPL, json={"prompt": "p"})
    data = r.json()
    assert data["object"] == "text_completion"
    assert data["id"].startswith("cmpl-")
    assert data["choices"][0]["text"] == "".join(generate_tokens("p", 0, 16))


async def test_identical_across_calls_and_processes(
    shared: Replica, spawn: Spawn, client: httpx.AsyncClient
) -> None:
    other = await spawn("r2")
    headers = {"x-gateway-request-id": "same-id"}
    body = _chat_body(max_tokens=12, seed=3, stream_options={"include_usage": True})
    bodies = [
        (await client.post(url + CHAT, json=body, headers=headers)).content
        for url in (shared.url, shared.url, other.url)
    ]
    assert bodies[0] == bodies[1] == bodies[2]
    line = await other.log_for("same-id")
    assert line["replica"] == "r2"


async def test_models_endpoint(shared: Replica, client: httpx.AsyncClient) -> None:
    r = await client.get(shared.url + "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["demo-model"]


async def test_openai_sdk_reads_the_stream(shared: Replica) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.AsyncOpenAI(base_url=shared.url + "/v1", api_key="unused")
    stream = await sdk.chat.completions.create(
        model="demo-model", messages=MESSAGES, max_tokens=6, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "".join(generate_tokens(chat_prompt(MESSAGES), 0, 6))
    await sdk.close()


# ----- bad requests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "content", "needle"),
    [
        ({"x-replica-fault": "explode"}, None, "x-replica-fault"),
        ({"x-replica-fault": "kill-after-deltas:x"}, None, "x-replica-fault"),
        ({"x-replica-fault": "kill-before-headers:1"}, None, "x-replica-fault"),
        ({"x-replica-fault": "slow-first-delta:nan"}, None, "x-replica-fault"),
        ({"x-replica-fault-attempt": "zero"}, None, "x-replica-fault-attempt"),
        ({}, b"{not json", "not valid JSON"),
        ({}, json.dumps(_chat_body(max_tokens=MAX_TOKENS_CAP + 1)).encode(), "max_tokens"),
        ({}, json.dumps({"messages": []}).encode(), "messages"),
    ],
)
async def test_bad_requests(
    shared: Replica,
    client: httpx.AsyncClient,
    headers: dict[str, str],
    content: bytes | None,
    needle: str,
) -> None:
    rid = _rid()
    payload = content if content is not None else json.dumps(_chat_body()).encode()
    r = await client.post(
        shared.url + CHAT,
        content=payload,
        headers={**headers, "x-request-id": rid, "content-type": "application/json"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["code"] == 400
    assert (await shared.log_for(rid))["outcome"] == "bad_request"


# ----- faults that keep the process alive ------------------------------------------------


async def test_error_after_deltas_stream(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    headers = {"x-request-id": rid, "x-replica-fault": "error-after-deltas:2"}
    r = await client.post(shared.url + CHAT, json=_chat_body(), headers=headers)
    assert r.status_code == 200
    payloads = _events(r.text)
    assert len(payloads) == 1 + 2 + 2
    assert json.loads(payloads[3]) == {
        "error": {"message": "demo replica fault", "type": "InternalServerError", "code": 500}
    }
    assert payloads[4] == "[DONE]"
    line = await shared.log_for(rid)
    assert line["outcome"] == "error_injected"
    assert line["fault"] == "error-after-deltas:2"
    assert (line["tokens_computed"], line["tokens_written"]) == (2, 2)


async def test_error_after_deltas_non_streaming(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    headers = {"x-request-id": rid, "x-replica-fault": "error-after-deltas:3"}
    r = await client.post(shared.url + CHAT, json=_chat_body(stream=False), headers=headers)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    line = await shared.log_for(rid)
    assert (line["outcome"], line["tokens_computed"], line["tokens_written"]) == (
        "error_injected",
        3,
        0,
    )


async def test_fault_attempt_gating(shared: Replica, client: httpx.AsyncClient) -> None:
    fault = {"x-replica-fault": "error-after-deltas:1"}
    # Default gate is attempt 1; attempt 2 runs clean.
    rid = _rid()
    headers = {**fault, "x-request-id": rid, "x-envoy-attempt-count": "2"}
    r = await client.post(shared.url + CHAT, json=_chat_body(), headers=headers)
    assert _events(r.text)[-1] == "[DONE]" and "error" not in r.text
    line = await shared.log_for(rid)
    assert (line["attempt"], line["fault"], line["outcome"]) == (2, None, "completed")
    # Gated to attempt 2: attempt 1 (header missing) is clean, attempt 2 gets the fault.
    rid1, rid2 = _rid(), _rid()
    gated = {**fault, "x-replica-fault-attempt": "2"}
    r = await client.post(
        shared.url + CHAT, json=_chat_body(), headers={**gated, "x-request-id": rid1}
    )
    assert "error" not in r.text
    headers = {**gated, "x-request-id": rid2, "x-envoy-attempt-count": "2"}
    r = await client.post(shared.url + CHAT, json=_chat_body(), headers=headers)
    assert "demo replica fault" in r.text
    assert (await shared.log_for(rid1))["outcome"] == "completed"
    assert (await shared.log_for(rid2))["outcome"] == "error_injected"


async def test_slow_first_delta(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    headers = {"x-request-id": rid, "x-replica-fault": "slow-first-delta:0.4"}
    stamps: list[float] = []
    t0 = time.monotonic()
    async with client.stream("POST", shared.url + CHAT, json=_chat_body(), headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                stamps.append(time.monotonic() - t0)
    assert len(stamps) == 1 + 5 + 1 + 1
    assert stamps[0] < 0.3  # headers and role event at once
    assert stamps[1] >= 0.4  # first content delta after the pause
    assert (await shared.log_for(rid))["outcome"] == "completed"


async def test_stall_detects_peer_close(shared: Replica, client: httpx.AsyncClient) -> None:
    rid = _rid()
    headers = {"x-request-id": rid, "x-replica-fault": "stall-after-deltas:2"}
    seen: list[str] = []
    async with client.stream("POST", shared.url + CHAT, json=_chat_body(), headers=headers) as r:
        async for text in r.aiter_lines():
            if text.startswith("data: "):
                seen.append(text)
            if len(seen) == 3:  # role + 2 deltas, then silence
                break
        await asyncio.sleep(0.2)  # really silent: nothing more arrives meanwhile
    closed_at = time.time()
    line = await shared.log_for(rid, within=2.0)
    assert line["outcome"] == "stalled_peer_closed"
    assert line["peer_closed"] is True
    assert (line["tokens_computed"], line["tokens_written"]) == (2, 2)
    assert line["ts"] - closed_at < 1.0


async def test_stall_non_streaming(shared: Replica) -> None:
    rid = _rid()
    headers = {"x-request-id": rid, "x-replica-fault": "stall-after-deltas:3"}
    async with httpx.AsyncClient(timeout=0.3) as short:
        with pytest.raises(httpx.ReadTimeout):
            await short.post(shared.url + CHAT, json=_chat_body(stream=False), headers=headers)
    closed_at = time.time()
    line = await shared.log_for(rid)
    assert (line["outcome"], line["peer_closed"]) == ("stalled_peer_closed", True)
    assert (line["tokens_computed"], line["tokens_written"]) == (3, 0)
    assert line["ts"] - closed_at < 1.0


async def test_peer_close_mid_stream_is_logged(spawn: Spawn, client: httpx.AsyncClient) -> None:
    replica = await spawn("slow", "--token-delay-ms", "50")
    rid = _rid()
    body = _chat_body(max_tokens=100)
    async with client.stream(
        "POST", replica.url + CHAT, json=body, headers={"x-request-id": rid}
    ) as r:
        n = 0
        async for text in r.aiter_lines():
            n += text.startswith("data: ")
            if n == 4:
                break
    closed_at = time.time()
    line = await replica.log_for(rid)
    assert line["outcome"] == "peer_closed" and line["peer_closed"] is True
    assert 3 <= line["tokens_written"] < 100
    assert line["ts"] - closed_at < 1.0


# ----- faults that kill the process ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "stream", "fault", "status", "n_events", "computed", "written"),
    [
        (CHAT, True, "kill-before-headers", None, 0, 0, 0),
        (CHAT, True, "kill-after-headers", 200, 0, 0, 0),
        (CHAT, True, "kill-after-compute:3", None, 0, 3, 0),
        (CHAT, True, "kill-after-deltas:0", 200, 1, 0, 0),
        (CHAT, True, "kill-after-deltas:2", 200, 3, 2, 2),
        (COMPL, True, "kill-after-deltas:2", 200, 2, 2, 2),
        (CHAT, False, "kill-after-deltas:2", None, 0, 2, 0),
        (CHAT, True, "reset-after-deltas:0", 200, 1, 0, 0),
        (CHAT, True, "reset-after-deltas:2", 200, 3, 2, 2),
        (COMPL, True, "reset-after-deltas:2", 200, 2, 2, 2),
        (CHAT, False, "reset-after-deltas:2", None, 0, 2, 0),
    ],
)
async def test_kill_faults(
    spawn: Spawn,
    client: httpx.AsyncClient,
    path: str,
    stream: bool,
    fault: str,
    status: int | None,
    n_events: int,
    computed: int,
    written: int,
) -> None:
    replica = await spawn("victim")
    rid = _rid()
    body = _chat_body(stream=stream) if path == CHAT else {"prompt": "x", "stream": stream}
    headers = {"x-request-id": rid, "x-replica-fault": fault}
    got_status, payloads, exc = await _read_stream(client, replica.url + path, body, headers)
    assert exc is not None, "the stream must break, not end cleanly"
    assert got_status == status
    assert len(payloads) == n_events
    assert "[DONE]" not in payloads
    if path == CHAT and n_events:
        assert json.loads(payloads[0])["choices"][0]["delta"]["role"] == "assistant"
    assert await replica.wait_exit() == -signal.SIGKILL
    line = await replica.log_for(rid, within=0)
    assert line["outcome"] == "killed"
    assert line["fault"] == fault
    assert (line["tokens_computed"], line["tokens_written"]) == (computed, written)
    assert line["stream"] is stream


async def _raw_close_kind(replica: Replica, fault: str, stream: bool) -> tuple[str, bytes]:
    """Send one request on a bare socket; report how the connection ended: FIN or RST."""
    body = json.dumps(_chat_body(stream=stream)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nx-replica-fault: " + fault.encode()
                 + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    got = b""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(65536), 5)
            if not data:
                return "FIN", got
            got += data
    except ConnectionResetError:
        return "RST", got
    finally:
        writer.close()


@pytest.mark.parametrize(("fault", "stream", "kind", "deltas"), [
    ("reset-after-deltas:2", True, "RST", 2),
    ("reset-after-deltas:0", True, "RST", 0),
    ("reset-after-deltas:3", False, "RST", 0),
    ("kill-after-deltas:2", True, "FIN", 2),
])
async def test_reset_fault_closes_with_rst_kill_with_fin(
        spawn: Spawn, fault: str, stream: bool, kind: str, deltas: int) -> None:
    replica = await spawn("rst")
    how, got = await _raw_close_kind(replica, fault, stream)
    assert how == kind, got
    # The deltas written before the close arrived in full; nothing after them.
    assert got.count(b'"delta":{"content":"') == deltas
    assert b"[DONE]" not in got
    assert await replica.wait_exit() == -signal.SIGKILL
    (line,) = replica.log_lines()
    assert (line["outcome"], line["fault"], line["tokens_written"]) == ("killed", fault,
                                                                         deltas)


# ----- the attempt credential (decision 0028) ----------------------------------------------


async def test_the_attempt_secret_goes_to_its_own_tool_calls_and_the_test_hook_only(
        spawn: Spawn, client: httpx.AsyncClient) -> None:
    from aiohttp import web

    seen: list[dict[str, str]] = []

    async def tool(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/tools/{name}", tool)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        replica = await spawn("creds", "--tool-gateway", f"http://127.0.0.1:{port}")
        calls = {}
        for n, secret in ((1, "secret_of_attempt_one_".ljust(43, "z")), (2, None)):
            rid, aid = _rid(), "att_" + str(n) * 26
            headers = {"x-gateway-request-id": rid, "x-gateway-attempt-id": aid,
                       "x-replica-tool-call": f"call_{n}@2"}
            if secret is not None:
                headers["x-gateway-attempt-secret"] = secret
            status, _, exc = await _read_stream(client, replica.url + CHAT, _chat_body(),
                                                headers)
            assert status == 200 and exc is None
            line = await replica.log_for(rid)
            assert line["tool_calls"][0]["status"] == 200
            calls[n] = (aid, secret, line)
        first, second = seen
        # Forwarded as received, on that attempt's own call; none when none came.
        assert first["x-gateway-attempt-secret"] == calls[1][1]
        assert first["x-gateway-attempt-id"] == calls[1][0]
        assert "x-gateway-attempt-secret" not in second
        # The demo's test hook: the secret of an attempt it has seen, else 404.
        r = await client.get(f"{replica.url}/debug/attempts/{calls[1][0]}/credential")
        assert r.status_code == 200 and r.json() == {"secret": calls[1][1]}
        for unknown in (calls[2][0], "att_never_seen"):
            r = await client.get(f"{replica.url}/debug/attempts/{unknown}/credential")
            assert r.status_code == 404
        # Never in its attempt log.
        assert str(calls[1][1]) not in replica.log_path.read_text()
    finally:
        await runner.cleanup()
