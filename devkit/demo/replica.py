"""Demo OpenAI-compatible streaming model replica with per-request fault hooks.

It serves `/v1/chat/completions`, `/v1/completions`, the Responses API (`/v1/responses`)
and the Anthropic Messages API (`/v1/messages`), streaming and not, each in vLLM's shapes
and with the same fault hooks at the same points (the events before the first content
event stand where chat's role event does).

It exists so that failover behaviour can be reproduced with nothing but curl: the
output is deterministic (see ``devkit.demo.tokens``), the wire format mirrors
vLLM's, and each request can ask the replica to die, stall or fail at an exact
point of the stream via ``x-replica-fault`` headers. Every attempt leaves one JSON
line in ``--log-file`` so tests can check what the replica actually saw and sent.

Run: ``python -m devkit.demo.replica --host 127.0.0.1 --port PORT --name r1
--log-file PATH [--token-delay-ms 0] [--model demo-model]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import re
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn

import aiohttp
from aiohttp import web

from devkit.demo.serving import until_signalled
from devkit.demo.tokens import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    MAX_TOKENS_CAP,
    chat_prompt,
    count_prompt_tokens,
    generate_tokens,
)
from extproc.core.pool import Fingerprint

FAULT_HEADER: Final = "x-replica-fault"
FAULT_ATTEMPT_HEADER: Final = "x-replica-fault-attempt"
ATTEMPT_HEADER: Final = "x-envoy-attempt-count"
GATEWAY_ID_HEADER: Final = "x-gateway-request-id"
# Per-request override of --token-delay-ms, so one long stream needs no special replica.
TOKEN_DELAY_HEADER: Final = "x-replica-token-delay-ms"
# Tokens merged into one streamed event (default 1), as an engine under load does: what
# makes a count of events differ from a count of tokens (decision 0018).
TOKENS_PER_EVENT_HEADER: Final = "x-replica-tokens-per-event"
# Agent mode: "<call_id>[@<after_tokens>][+<delay_s>]": call a tool through the gateway's
# tool route after computing that many tokens (optionally after a pause), then generate
# the rest of the answer from the tool's result.
TOOL_CALL_HEADER: Final = "x-replica-tool-call"
# Apply the tool call's pause only on this Envoy attempt (e.g. a partitioned attempt 1).
TOOL_DELAY_ATTEMPT_HEADER: Final = "x-replica-tool-delay-attempt"
ATTEMPT_ID_HEADER: Final = "x-gateway-attempt-id"
# The attempt's credential the gateway sends upstream with it (decision 0028): forwarded
# on this attempt's tool calls, never logged. extproc.core.headers.ATTEMPT_SECRET.
ATTEMPT_SECRET_HEADER: Final = "x-gateway-attempt-secret"
# How many attempts' secrets the test hook remembers (oldest forgotten first).
KEPT_CREDENTIALS: Final = 4096
REQUEST_ID_HEADER: Final = "x-request-id"

STALL_LIMIT_S: Final = 600.0
PEER_POLL_S: Final = 0.02
# Time for the last written bytes to leave the socket before the process is killed.
PRE_KILL_SETTLE_S: Final = 0.02

FAULT_MESSAGE: Final = "demo replica fault"

# chat and completion: OpenAI chunks; responses: the OpenAI Responses API's typed events;
# messages: the Anthropic Messages API's events. Shapes follow what vLLM emits for each.
Kind = Literal["chat", "completion", "responses", "messages"]
Outcome = Literal[
    "completed",
    "killed",
    "stalled_peer_closed",
    "stalled_timeout",
    "error_injected",
    "peer_closed",
    "bad_request",
    "overloaded",
    "frozen",
]

# silent-before-headers reads the whole request, then sends nothing at all (no status line)
# until the peer gives up: a replica stuck before its first byte.
NO_ARG_FAULTS: Final = frozenset({"kill-before-headers", "kill-after-headers",
                                  "silent-before-headers"})
# reset-after-deltas:N dies like kill-after-deltas:N, but closes the connection with an RST
# (SO_LINGER {1, 0}) instead of the FIN a plain SIGKILL leaves.
# reset-now-after-deltas:N is reset-after-deltas:N without the settle time: the RST follows
# the Nth delta's bytes at once, so Envoy may read the reset before the gateway let that
# delta go to the client (the race of issue 24, finding 2, made the common case).
# freeze-after-deltas:N SIGSTOPs the whole replica process after writing N deltas (unary:
# after computing N tokens, before the headers): the kernel still accepts connections, and
# nothing answers, health checks included, until someone sends SIGCONT.
COUNT_FAULTS: Final = frozenset(
    {"kill-after-compute", "kill-after-deltas", "stall-after-deltas", "error-after-deltas",
     "reset-after-deltas", "reset-now-after-deltas", "freeze-after-deltas"}
)
SECONDS_FAULTS: Final = frozenset({"slow-first-delta"})
# overloaded:STATUS[:RETRY_AFTER_SECONDS] answers at once with 429 or 503 (alive, busy).
OVERLOAD_FAULTS: Final = frozenset({"overloaded"})


class BadRequest(Exception):
    """A client mistake answered with 400; carries the OpenAI-style message."""


@dataclass(frozen=True)
class Fault:
    """A parsed ``x-replica-fault`` value that applies to the current attempt."""

    kind: str
    count: int = 0
    seconds: float = 0.0
    spec: str = ""


@dataclass
class Attempt:
    """What one attempt did; becomes the single log line written when it ends."""

    request_id: str | None
    attempt: int
    path: str
    stream: bool = False
    fault: str | None = None
    tokens_computed: int = 0
    tokens_written: int = 0
    peer_closed: bool = False
    outcome: Outcome = "completed"
    tool_calls: list[Any] = field(default_factory=list)
    token_delay_s: float = 0.0
    tool_plan: ToolPlan | None = None
    tokens_ref: list[str] | None = None  # the answer's tokens, rewritten after a tool call
    prompt: str = ""
    seed: int = 0
    attempt_id: str | None = None
    secret: str | None = field(default=None, repr=False)  # forwarded, never logged


@dataclass
class ToolPlan:
    call_id: str
    after: int
    delay_s: float
    tool: str = "demo_tool"
    done: bool = False


def parse_tool_plan(value: str) -> ToolPlan:
    m = re.fullmatch(r"([A-Za-z0-9_.:-]{1,128})(?:@(\d+))?(?:\+(\d+(?:\.\d+)?))?", value.strip())
    if not m:
        raise BadRequest(f"{TOOL_CALL_HEADER}: expected '<call_id>[@<after_tokens>]"
                         f"[+<delay_s>]', got {value!r}")
    return ToolPlan(call_id=m.group(1), after=int(m.group(2) or 0),
                    delay_s=float(m.group(3) or 0.0))


@dataclass(frozen=True)
class GenRequest:
    """The validated generation parameters the replica honours."""

    kind: Kind
    prompt: str
    seed: int
    max_tokens: int
    stream: bool
    include_usage: bool
    # stream_options.continuous_usage_stats (with include_usage): every chunk carries the
    # running usage, as vLLM does.
    continuous_usage: bool = False


def parse_fault(value: str) -> Fault:
    """Parse ``kind`` or ``kind:ARG``; reject anything unknown so typos are loud."""
    kind, sep, arg = value.strip().partition(":")
    kind = kind.strip().lower()
    arg = arg.strip()
    if kind in NO_ARG_FAULTS:
        if sep:
            raise BadRequest(f"{FAULT_HEADER}: fault {kind!r} takes no argument, got {value!r}")
        return Fault(kind=kind, spec=kind)
    if kind in COUNT_FAULTS:
        try:
            count = int(arg)
        except ValueError:
            count = -1
        if count < 0:
            raise BadRequest(
                f"{FAULT_HEADER}: fault {kind!r} needs a non-negative integer, "
                f"as in '{kind}:3', got {value!r}"
            )
        return Fault(kind=kind, count=count, spec=f"{kind}:{count}")
    if kind in SECONDS_FAULTS:
        try:
            seconds = float(arg)
        except ValueError:
            seconds = -1.0
        if not math.isfinite(seconds) or seconds < 0 or seconds > STALL_LIMIT_S:
            raise BadRequest(
                f"{FAULT_HEADER}: fault {kind!r} needs seconds between 0 and "
                f"{STALL_LIMIT_S:g}, as in '{kind}:1.5', got {value!r}"
            )
        return Fault(kind=kind, seconds=seconds, spec=f"{kind}:{arg}")
    if kind in OVERLOAD_FAULTS:
        status_s, _, after = arg.partition(":")
        if status_s not in ("429", "503") or (after and not after.isdigit()):
            raise BadRequest(f"{FAULT_HEADER}: fault 'overloaded' needs 429 or 503 and an "
                             f"optional Retry-After in seconds, as in 'overloaded:429:1', "
                             f"got {value!r}")
        return Fault(kind=kind, count=int(status_s), seconds=float(after or -1),
                     spec=f"{kind}:{arg}")
    known = sorted(NO_ARG_FAULTS | COUNT_FAULTS | SECONDS_FAULTS | OVERLOAD_FAULTS)
    raise BadRequest(f"{FAULT_HEADER}: unknown fault {value!r}; known kinds: {', '.join(known)}")


def _delay_header(headers: Mapping[str, str], default_s: float) -> float:
    raw = headers.get(TOKEN_DELAY_HEADER)
    if raw is None:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not math.isfinite(ms) or not 0 <= ms <= 10_000:
        raise BadRequest(f"{TOKEN_DELAY_HEADER}: expected milliseconds 0-10000, got {raw!r}")
    return ms / 1000.0


def _positive_int_header(headers: Mapping[str, str], name: str) -> int:
    """Parse an attempt-number header; missing means 1, garbage is the client's error."""
    raw = headers.get(name)
    if raw is None or raw.strip() == "":
        return 1
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise BadRequest(f"{name}: expected a positive integer, got {raw!r}")
    return value


def _int_field(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer")
    return value


def parse_gen_request(kind: Kind, body: Any) -> GenRequest:
    """Validate the request body; only the fields that shape the output matter."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if kind in ("chat", "messages"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("every entry of 'messages' must be an object")
        if kind == "messages":
            system = body.get("system")
            if system is not None:
                if not isinstance(system, str | list):
                    raise BadRequest("'system' must be a string or a list of blocks")
                messages = [{"role": "system", "content": system}, *messages]
            if body.get("max_tokens") is None:
                raise BadRequest("'max_tokens' is required")
        try:
            prompt = chat_prompt(messages)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        token_field = (
            "max_completion_tokens"
            if body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
    elif kind == "responses":
        raw_input = body.get("input")
        items: list[Any]
        if isinstance(raw_input, str):
            items = [{"role": "user", "content": raw_input}]
        elif isinstance(raw_input, list) and raw_input and all(
                isinstance(m, dict) for m in raw_input):
            items = list(raw_input)
        else:
            raise BadRequest("'input' must be a string or a non-empty list of items")
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            items = [{"role": "system", "content": instructions}, *items]
        try:
            prompt = chat_prompt(items)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        token_field = "max_output_tokens"
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list) and len(raw_prompt) == 1:
            raw_prompt = raw_prompt[0]
        if not isinstance(raw_prompt, str):
            raise BadRequest("'prompt' must be a string (or a list holding one string)")
        prompt = raw_prompt
        token_field = "max_tokens"
    max_tokens = _int_field(body, token_field, DEFAULT_MAX_TOKENS)
    if not 1 <= max_tokens <= MAX_TOKENS_CAP:
        raise BadRequest(
            f"'{token_field}' must be between 1 and {MAX_TOKENS_CAP}, got {max_tokens}"
        )
    seed = _int_field(body, "seed", DEFAULT_SEED)
    if _int_field(body, "n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        include_usage = options.get("include_usage") is True
        continuous = include_usage and options.get("continuous_usage_stats") is True
    return GenRequest(kind, prompt, seed, max_tokens, stream, include_usage, continuous)


_compact_dumps = functools.partial(json.dumps, separators=(",", ":"))


def _json(payload: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.json_response(payload, status=status, dumps=_compact_dumps)


def _error_body(message: str, err_type: str, code: int,
                kind: Kind = "chat") -> dict[str, Any]:
    if kind == "messages":  # Anthropic's error shape
        a_type = {400: "invalid_request_error", 429: "rate_limit_error",
                  503: "overloaded_error"}.get(code, "api_error")
        return {"type": "error", "error": {"type": a_type, "message": message}}
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def _named_sse(payload: Mapping[str, Any]) -> bytes:
    """A typed event (Responses, Anthropic): `event:` repeats the JSON's `type`."""
    return (f"event: {payload['type']}\ndata: "
            f"{json.dumps(payload, separators=(',', ':'))}\n\n").encode()


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _peer_gone(request: web.BaseRequest) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _sleep_watching(request: web.BaseRequest, seconds: float) -> bool:
    """Sleep, but notice a closed peer within ``PEER_POLL_S``; True if the peer left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        if _peer_gone(request):
            return True
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(PEER_POLL_S, remaining))


class Replica:
    """Request handlers plus the attempt log of one replica process."""

    def __init__(self, name: str, model: str, log_file: str, token_delay_s: float,
                 tool_gateway: str | None = None) -> None:
        self.tool_gateway = tool_gateway.rstrip("/") if tool_gateway else None
        self.fingerprint: dict[str, Any] | None = None
        self.name = name
        self.model = model
        self.log_file = log_file
        self.token_delay_s = token_delay_s
        self.port = 0
        # attempt id -> the secret it came with, for the test hook below (bounded).
        self.credentials: dict[str, str] = {}
        self.running = 0  # generation requests in progress (GET /metrics)

    # ----- logging -------------------------------------------------------------------

    def log_attempt(self, att: Attempt, *, fsync: bool = False) -> None:
        """Append one JSON line with a single write so concurrent writers never interleave."""
        record = {
            "ts": time.time(),
            "replica": self.name,
            "port": self.port,
            "request_id": att.request_id,
            "attempt": att.attempt,
            "path": att.path,
            "stream": att.stream,
            "fault": att.fault,
            "tokens_computed": att.tokens_computed,
            "tokens_written": att.tokens_written,
            "peer_closed": att.peer_closed,
            "outcome": att.outcome,
            "tool_calls": att.tool_calls,
        }
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    async def die(self, att: Attempt, *, wrote: bool) -> NoReturn:
        """Really die (SIGKILL), after the log line is durable and written bytes left."""
        if wrote:
            await asyncio.sleep(PRE_KILL_SETTLE_S)
        att.outcome = "killed"
        self.log_attempt(att, fsync=True)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL did not stop the process")

    async def freeze(self, request: web.BaseRequest, att: Attempt,
                     *, wrote: bool) -> web.Response:
        """SIGSTOP this whole process (its log line written first); once continued, drop
        the connection: whatever it would still send belongs to a fenced attempt."""
        if wrote:
            await asyncio.sleep(PRE_KILL_SETTLE_S)
        att.outcome = "frozen"
        self.log_attempt(att, fsync=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        transport = request.transport
        if transport is not None:
            transport.close()
        return web.Response(status=499)

    async def reset(self, request: web.BaseRequest, att: Attempt, *, wrote: bool) -> NoReturn:
        """Die like `die`, but the connection ends with an RST, not a FIN.

        SO_LINGER {on, 0} makes the close abortive: the kernel sends a RST (and drops any
        unsent bytes, hence the settle time for the bytes already written first).
        """
        if wrote:
            await asyncio.sleep(PRE_KILL_SETTLE_S)
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        att.outcome = "killed"
        self.log_attempt(att, fsync=True)
        if transport is not None:
            transport.abort()  # the socket is closed (RST) in the loop's next callbacks
            for _ in range(3):
                await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL did not stop the process")

    def finish(self, att: Attempt, outcome: Outcome) -> None:
        att.outcome = outcome
        if outcome in ("peer_closed", "stalled_peer_closed"):
            att.peer_closed = True
        self.log_attempt(att)

    # ----- small endpoints -----------------------------------------------------------

    def remember_credential(self, attempt_id: str, secret: str) -> None:
        self.credentials[attempt_id] = secret
        while len(self.credentials) > KEPT_CREDENTIALS:
            del self.credentials[next(iter(self.credentials))]

    async def credential(self, request: web.Request) -> web.Response:
        """`GET /debug/attempts/<attempt_id>/credential`: a TEST HOOK of the loopback demo.

        The secret the gateway sent with that attempt, so a test can act as that attempt's
        worker (or as one that stole it). A real model server never hands its credential
        out; this one answers only a loopback peer, and only for attempts it has seen.
        """
        secret = self.credentials.get(request.match_info["attempt_id"])
        if secret is None or request.remote not in ("127.0.0.1", "::1"):
            return _json({"error": "unknown attempt"}, status=404)
        return _json({"secret": secret})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "name": self.name})

    async def fingerprint_view(self, request: web.Request) -> web.Response:
        return _json(self.fingerprint or {})

    @web.middleware
    async def revision_header(self, request: web.Request, handler: Any) -> Any:
        resp = await handler(request)
        if self.fingerprint is not None and not resp.prepared:
            resp.headers["x-model-revision"] = self.fingerprint["digest"]
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return _json(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "demo"}],
            }
        )

    # ----- generation ----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "responses")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "messages")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        # The running-requests gauge a replica agent confirms an abort with (as it reads
        # vLLM's num_requests_running): up while the handler runs, down when it returns.
        self.running += 1
        try:
            return await self._generate_counted(request, kind)
        finally:
            self.running -= 1

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: the generation requests this replica is running now."""
        return web.Response(text="# TYPE demo_requests_running gauge\n"
                            f"demo_requests_running {self.running}\n",
                            content_type="text/plain")

    async def _generate_counted(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        headers = request.headers
        request_id = headers.get(GATEWAY_ID_HEADER) or headers.get(REQUEST_ID_HEADER) or None
        att = Attempt(request_id=request_id, attempt=1, path=request.path)
        try:
            att.attempt = _positive_int_header(headers, ATTEMPT_HEADER)
            fault_value = headers.get(FAULT_HEADER)
            fault = parse_fault(fault_value) if fault_value else None
            every_attempt = headers.get(FAULT_ATTEMPT_HEADER, "").strip().lower() == "all"
            fault_attempt = (0 if every_attempt
                             else _positive_int_header(headers, FAULT_ATTEMPT_HEADER))
            att.token_delay_s = _delay_header(headers, self.token_delay_s)
            per_event = (_positive_int_header(headers, TOKENS_PER_EVENT_HEADER)
                         if TOKENS_PER_EVENT_HEADER in headers else 1)
            plan_value = headers.get(TOOL_CALL_HEADER)
            att.tool_plan = parse_tool_plan(plan_value) if plan_value else None
            delay_attempt = headers.get(TOOL_DELAY_ATTEMPT_HEADER)
            if (att.tool_plan is not None and delay_attempt is not None
                    and delay_attempt.strip() != str(att.attempt)):
                att.tool_plan.delay_s = 0.0
            att.attempt_id = headers.get(ATTEMPT_ID_HEADER)
            att.secret = headers.get(ATTEMPT_SECRET_HEADER)
            if att.attempt_id and att.secret:
                self.remember_credential(att.attempt_id, att.secret)
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadRequest(f"request body is not valid JSON: {exc}") from exc
            gen = parse_gen_request(kind, body)
        except BadRequest as exc:
            self.finish(att, "bad_request")
            return _json(_error_body(str(exc), "BadRequestError", 400, kind), status=400)

        att.stream = gen.stream
        if fault is not None and fault_attempt not in (0, att.attempt):
            fault = None  # gated to another attempt: this one runs clean
        att.fault = fault.spec if fault else None

        prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_",
                  "messages": "msg_"}[kind]
        response_id = prefix + (request_id or uuid.uuid4().hex)
        tokens = generate_tokens(gen.prompt, gen.seed, gen.max_tokens)
        att.tokens_ref, att.prompt, att.seed = tokens, gen.prompt, gen.seed
        if att.tool_plan is not None:
            tools = body.get("tools") if isinstance(body, dict) else None
            if isinstance(tools, list) and tools and isinstance(tools[0], dict):
                fn = tools[0].get("function")
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    att.tool_plan.tool = fn["name"]

        if fault is not None and fault.kind == "overloaded":
            self.finish(att, "overloaded")
            hdrs = {"Retry-After": str(int(fault.seconds))} if fault.seconds >= 0 else {}
            resp = _json(_error_body("replica overloaded", "ServiceUnavailableError"
                                     if fault.count == 503 else "RateLimitError", fault.count,
                                     kind),
                         status=fault.count)
            resp.headers.update(hdrs)
            return resp
        if fault is not None and fault.kind == "kill-before-headers":
            await self.die(att, wrote=False)
        if fault is not None and fault.kind == "silent-before-headers":
            return await self._stall(request, att)
        if fault is not None and fault.kind == "kill-after-compute":
            if await self._compute(request, att, min(fault.count, len(tokens))):
                self.finish(att, "peer_closed")
                return web.Response(status=499)
            await self.die(att, wrote=False)
        if gen.stream:
            return await self._stream(request, att, gen, fault, response_id, tokens,
                                      per_event)
        return await self._unary(request, att, gen, fault, response_id, tokens)

    async def _compute(self, request: web.BaseRequest, att: Attempt, upto: int) -> bool:
        """Advance ``tokens_computed`` to ``upto`` with the configured per-token delay.

        Returns True when the peer went away meanwhile.
        """
        while att.tokens_computed < upto:
            plan = att.tool_plan
            if plan is not None and not plan.done and att.tokens_computed == plan.after:
                await self._call_tool(att, plan)
            if (
                att.tokens_computed > 0
                and att.token_delay_s > 0
                and await _sleep_watching(request, att.token_delay_s)
            ):
                return True
            att.tokens_computed += 1
        return False

    async def _call_tool(self, att: Attempt, plan: ToolPlan) -> None:
        """Call a server-side tool through the gateway, then answer from its result.

        The rest of the answer is generated from the result, so two attempts agree only if
        they saw the same result: exactly what the gateway's ledger guarantees.
        """
        plan.done = True
        if plan.delay_s:
            await asyncio.sleep(plan.delay_s)
        record: dict[str, Any] = {"call_id": plan.call_id, "tool": plan.tool,
                                  "at_token": plan.after, "status": None,
                                  "replayed": False, "result": None}
        att.tool_calls.append(record)
        if not self.tool_gateway:
            record["status"] = "no --tool-gateway configured"
            return
        headers = {GATEWAY_ID_HEADER: att.request_id or "", ATTEMPT_ID_HEADER:
                   att.attempt_id or "", "x-tool-call-id": plan.call_id}
        if att.secret:
            # The worker proves it is this attempt's: the gateway's tool route needs it.
            headers[ATTEMPT_SECRET_HEADER] = att.secret
        body = {"call_id": plan.call_id, "arguments": {"query": att.prompt[:64]}}
        try:
            async with aiohttp.ClientSession() as session, session.post(
                    f"{self.tool_gateway}/tools/{plan.tool}", json=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=30)) as resp:
                text = await resp.text()
                record["status"] = resp.status
                record["replayed"] = resp.headers.get("x-tool-replayed") == "true"
                record["result"] = text[:200]
        except (aiohttp.ClientError, TimeoutError) as exc:
            record["status"] = f"error: {exc!r}"
            return
        if att.tokens_ref is not None and record["status"] == 200:
            rest = len(att.tokens_ref) - plan.after
            att.tokens_ref[plan.after:] = generate_tokens(
                att.prompt + "\n[tool " + plan.call_id + "]\n" + text, att.seed, rest)

    def _usage(self, gen: GenRequest) -> dict[str, int]:
        prompt_tokens = count_prompt_tokens(gen.prompt)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": gen.max_tokens,
            "total_tokens": prompt_tokens + gen.max_tokens,
        }

    async def _unary(
        self,
        request: web.Request,
        att: Attempt,
        gen: GenRequest,
        fault: Fault | None,
        response_id: str,
        tokens: list[str],
    ) -> web.StreamResponse:
        """Non-streaming: count-based faults fire after computing N tokens, body unwritten."""
        if fault is not None and fault.kind == "kill-after-headers":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await self.die(att, wrote=True)
        if (
            fault is not None
            and fault.kind == "slow-first-delta"
            and await _sleep_watching(request, fault.seconds)
        ):
            self.finish(att, "peer_closed")
            return web.Response(status=499)
        upto = len(tokens)
        if fault is not None and fault.kind in COUNT_FAULTS:
            upto = min(fault.count, len(tokens))
        if await self._compute(request, att, upto):
            self.finish(att, "peer_closed")
            return web.Response(status=499)
        if fault is not None and fault.kind == "kill-after-deltas":
            await self.die(att, wrote=False)
        if fault is not None and fault.kind in ("reset-after-deltas", "reset-now-after-deltas"):
            await self.reset(request, att, wrote=False)
        if fault is not None and fault.kind == "stall-after-deltas":
            return await self._stall(request, att)
        if fault is not None and fault.kind == "freeze-after-deltas":
            return await self.freeze(request, att, wrote=False)
        if fault is not None and fault.kind == "error-after-deltas":
            self.finish(att, "error_injected")
            return _json(_error_body(FAULT_MESSAGE, "InternalServerError", 500, gen.kind),
                         status=500)
        text = "".join(tokens)
        choice: dict[str, Any]
        if gen.kind == "responses":
            payload: dict[str, Any] = self._response_object(gen, response_id, "incomplete",
                                                            text)
        elif gen.kind == "messages":
            payload = self._message_object(gen, response_id, text, "max_tokens")
        elif gen.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        if gen.kind in ("chat", "completion"):
            payload = {
                "id": response_id,
                "object": "chat.completion" if gen.kind == "chat" else "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(gen),
            }
        resp = _json(payload)
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionError:
            self.finish(att, "peer_closed")
            return resp
        att.tokens_written = len(tokens)
        self.finish(att, "peer_closed" if _peer_gone(request) else "completed")
        return resp

    async def _stall(self, request: web.BaseRequest, att: Attempt) -> web.StreamResponse:
        """Hold the connection silently until the peer gives up (or the stall limit)."""
        if await _sleep_watching(request, STALL_LIMIT_S):
            self.finish(att, "stalled_peer_closed")
        else:
            self.finish(att, "stalled_timeout")
            transport = request.transport
            if transport is not None:
                transport.close()
        return web.Response(status=499)

    def _response_object(self, gen: GenRequest, response_id: str, status: str,
                         text: str | None) -> dict[str, Any]:
        """A Responses API `response` object (vLLM's fields that matter to clients)."""
        output: list[Any] = []
        if text is not None:
            output = [{"type": "message", "id": "msg_" + response_id[5:], "status": status,
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": [],
                                    "logprobs": []}]}]
        prompt_tokens = count_prompt_tokens(gen.prompt)
        obj: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": 0, "model": self.model,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if status == "incomplete" else None),
            "instructions": None, "max_output_tokens": gen.max_tokens, "output": output,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": 1.0, "top_p": 1.0, "usage": None,
        }
        if text is not None:
            obj["usage"] = {"input_tokens": prompt_tokens, "output_tokens": gen.max_tokens,
                            "total_tokens": prompt_tokens + gen.max_tokens,
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}
        return obj

    def _message_object(self, gen: GenRequest, message_id: str, text: str | None,
                        stop_reason: str | None) -> dict[str, Any]:
        """An Anthropic `message` object."""
        return {
            "id": message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": stop_reason, "stop_sequence": None,
            "usage": {"input_tokens": count_prompt_tokens(gen.prompt),
                      "output_tokens": 0 if text is None else gen.max_tokens},
        }

    async def _stream(
        self,
        request: web.Request,
        att: Attempt,
        gen: GenRequest,
        fault: Fault | None,
        response_id: str,
        tokens: list[str],
        per_event: int = 1,
    ) -> web.StreamResponse:
        """Server-sent events shaped like vLLM's, with the fault fired at its exact point.
        Count faults count events; each event carries `per_event` tokens."""
        shape = _StreamShape(self, gen, response_id)
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if self.fingerprint is not None:
            headers["x-model-revision"] = self.fingerprint["digest"]
        resp = web.StreamResponse(status=200, headers=headers)

        async def send(data: bytes) -> bool:
            """Write one event; False when the peer is gone."""
            try:
                await resp.write(data)
            except ConnectionError:
                return False
            return True

        try:
            await resp.prepare(request)  # aiohttp sends a StreamResponse's headers right away
        except ConnectionError:
            self.finish(att, "peer_closed")
            return resp
        if fault is not None and fault.kind == "kill-after-headers":
            await self.die(att, wrote=True)

        # What comes before the first content: chat's role event, the Responses lifecycle
        # and empty item/part, Anthropic's message_start and empty text block.
        for event in shape.head():
            if not await send(event):
                self.finish(att, "peer_closed")
                return resp

        if (
            fault is not None
            and fault.kind == "slow-first-delta"
            and await _sleep_watching(request, fault.seconds)
        ):
            self.finish(att, "peer_closed")
            return resp

        events = -(-len(tokens) // per_event)
        if fault is not None and fault.kind in COUNT_FAULTS:
            events = min(fault.count, events)
        limit = 0  # tokens sent
        for _ in range(events):
            end = min(limit + per_event, len(tokens))
            if await self._compute(request, att, end):
                self.finish(att, "peer_closed")
                return resp
            # Read after computing: a tool call on the way rewrites the tokens after it.
            group = tokens[limit:end]
            if not await send(shape.delta("".join(group), len(group))):
                self.finish(att, "peer_closed")
                return resp
            limit = end
            att.tokens_written += len(group)

        if fault is not None:
            if fault.kind == "kill-after-deltas":
                await self.die(att, wrote=True)
            if fault.kind == "reset-after-deltas":
                await self.reset(request, att, wrote=True)
            if fault.kind == "reset-now-after-deltas":
                await self.reset(request, att, wrote=False)
            if fault.kind == "stall-after-deltas":
                return await self._stall(request, att)
            if fault.kind == "freeze-after-deltas":
                await self.freeze(request, att, wrote=True)
                return resp
            if fault.kind == "error-after-deltas":
                ok = True
                for event in shape.error():
                    ok = ok and await send(event)
                if ok:
                    with contextlib.suppress(ConnectionError):
                        await resp.write_eof()
                self.finish(att, "error_injected" if ok else "peer_closed")
                return resp

        for event in shape.tail("".join(tokens[:limit])):
            if not await send(event):
                self.finish(att, "peer_closed")
                return resp
        try:
            await resp.write_eof()
        except ConnectionError:
            self.finish(att, "peer_closed")
            return resp
        self.finish(att, "completed")
        return resp


class _StreamShape:
    """One stream's events in its API family's wire format (as vLLM 0.32 emits them)."""

    def __init__(self, replica: Replica, gen: GenRequest, response_id: str) -> None:
        self.r = replica
        self.gen = gen
        self.id = response_id
        self.seq = 0  # Responses: every event's sequence_number
        self.done = 0  # tokens sent so far: the running usage

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.gen.kind == "chat" else "text_completion"
        chunk: dict[str, Any] = {"id": self.id, "object": obj, "created": 0,
                                 "model": self.r.model, "choices": [choice]}
        if self.gen.continuous_usage:
            p = count_prompt_tokens(self.gen.prompt)
            # vLLM 0.32's field order and its explicit null.
            chunk["usage"] = {"prompt_tokens": p, "total_tokens": p + self.done,
                              "completion_tokens": self.done,
                              "completion_tokens_details": None}
        return _sse(chunk)

    def _typed(self, payload: dict[str, Any]) -> bytes:
        if self.gen.kind == "responses":
            payload = {"type": payload["type"], "sequence_number": self.seq,
                       **{k: v for k, v in payload.items() if k != "type"}}
            self.seq += 1
        return _named_sse(payload)

    @property
    def _item(self) -> str:
        return "msg_" + self.id[5:]

    def head(self) -> list[bytes]:
        kind = self.gen.kind
        if kind == "chat":
            return [self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})]
        if kind == "responses":
            created = self.r._response_object(self.gen, self.id, "in_progress", None)
            return [
                self._typed({"type": "response.created", "response": created}),
                self._typed({"type": "response.in_progress", "response": created}),
                self._typed({"type": "response.output_item.added", "output_index": 0,
                             "item": {"type": "message", "id": self._item,
                                      "status": "in_progress", "role": "assistant",
                                      "content": []}}),
                self._typed({"type": "response.content_part.added", "item_id": self._item,
                             "output_index": 0, "content_index": 0,
                             "part": {"type": "output_text", "text": "", "annotations": []}}),
            ]
        if kind == "messages":
            return [
                self._typed({"type": "message_start",
                             "message": self.r._message_object(self.gen, self.id, None, None)}),
                self._typed({"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
            ]
        return []

    def delta(self, token: str, n: int = 1) -> bytes:
        """One content event carrying `n` tokens (their text concatenated)."""
        self.done += n
        kind = self.gen.kind
        if kind == "chat":
            return self._chunk({"index": 0, "delta": {"content": token}, "logprobs": None,
                                "finish_reason": None})
        if kind == "responses":
            return self._typed({"type": "response.output_text.delta", "item_id": self._item,
                                "output_index": 0, "content_index": 0, "delta": token,
                                "logprobs": []})
        if kind == "messages":
            return self._typed({"type": "content_block_delta", "index": 0,
                                "delta": {"type": "text_delta", "text": token}})
        return self._chunk({"index": 0, "text": token, "logprobs": None,
                            "finish_reason": None})

    def error(self) -> list[bytes]:
        """The engine's in-band error: chat's error chunk and [DONE]; Responses' `error`
        event; Anthropic's `event: error`."""
        kind = self.gen.kind
        if kind == "responses":
            return [self._typed({"type": "error", "code": "server_error",
                                 "message": FAULT_MESSAGE, "param": None})]
        if kind == "messages":
            return [self._typed({"type": "error", "error": {"type": "api_error",
                                                            "message": FAULT_MESSAGE}})]
        return [_sse({"error": {"message": FAULT_MESSAGE, "type": "InternalServerError",
                                "code": 500}}), _sse("[DONE]")]

    def tail(self, text: str) -> list[bytes]:
        kind, gen = self.gen.kind, self.gen
        if kind == "responses":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            final = self.r._response_object(gen, self.id, "incomplete", text)
            return [
                self._typed({"type": "response.output_text.done", "item_id": self._item,
                             "output_index": 0, "content_index": 0, "text": text,
                             "logprobs": []}),
                self._typed({"type": "response.content_part.done", "item_id": self._item,
                             "output_index": 0, "content_index": 0, "part": part}),
                self._typed({"type": "response.output_item.done", "output_index": 0,
                             "item": final["output"][0]}),
                self._typed({"type": "response.completed", "response": final}),
            ]
        if kind == "messages":
            return [
                self._typed({"type": "content_block_stop", "index": 0}),
                self._typed({"type": "message_delta",
                             "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                             "usage": {"output_tokens": gen.max_tokens}}),
                self._typed({"type": "message_stop"}),
            ]
        if kind == "chat":
            final = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        else:
            final = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
        events = [self._chunk(final)]
        if gen.include_usage:
            events.append(_sse({"id": self.id, "object": "chat.completion.chunk"
                                if kind == "chat" else "text_completion", "created": 0,
                                "model": self.r.model, "choices": [],
                                "usage": self.r._usage(gen)}))
        events.append(_sse("[DONE]"))
        return events


def build_app(replica: Replica) -> web.Application:
    """Wire the routes; kept separate so an in-process server can reuse it."""
    app = web.Application(middlewares=[replica.revision_header])
    app.router.add_get("/health", replica.health)
    app.router.add_get("/fingerprint", replica.fingerprint_view)
    app.router.add_get("/v1/models", replica.models)
    app.router.add_get("/metrics", replica.metrics)
    app.router.add_get("/debug/attempts/{attempt_id}/credential", replica.credential)
    app.router.add_post("/v1/chat/completions", replica.chat)
    app.router.add_post("/v1/completions", replica.completions)
    app.router.add_post("/v1/responses", replica.responses)
    app.router.add_post("/v1/messages", replica.messages)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.demo.replica",
        description="Deterministic OpenAI-compatible demo replica with fault hooks.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--name", required=True, help="replica name, echoed in logs")
    parser.add_argument("--log-file", required=True, help="JSON-lines attempt log (appended)")
    parser.add_argument("--token-delay-ms", type=float, default=0.0)
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--fingerprint", default=None,
                        help="JSON object of compatibility fields (extproc.core.pool): "
                        "weights_revision, quantization, tokenizer_hash, chat_template_hash, "
                        "attention, kv_cache_dtype, tensor_parallel_size, "
                        "pipeline_parallel_size, kv_block_size, lora_adapters (ordered)")
    parser.add_argument("--tool-gateway", default=None,
                        help="base URL of the gateway whose tool route agent mode calls")
    args = parser.parse_args(argv)
    if args.token_delay_ms < 0 or not math.isfinite(args.token_delay_ms):
        parser.error("--token-delay-ms must be a non-negative number")
    return args


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT; a stalled request must not hold shutdown for long."""
    replica = Replica(args.name, args.model, args.log_file, args.token_delay_ms / 1000.0,
                      args.tool_gateway)
    if args.fingerprint:
        fp = Fingerprint.from_mapping(json.loads(args.fingerprint))
        replica.fingerprint = {**json.loads(fp.canonical()), "digest": fp.digest}
    runner = web.AppRunner(
        build_app(replica), access_log=None, handler_cancellation=False, shutdown_timeout=1.0
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else args.port
    replica.port = port
    print(
        f"demo replica {args.name} serving model {args.model} on http://{args.host}:{port} "
        f"(log: {args.log_file}, token delay {args.token_delay_ms:g} ms)",
        file=sys.stderr,
        flush=True,
    )
    await until_signalled(runner)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
