"""The API families the guard applies the contract to, as data (decision 0017).

One SSE decoder (core.sse) and one state table (core.machine) serve every family; a family
only says, for its own wire format:

- which paths it owns;
- how one event is classified (CONTENT / NON_CONTENT / ERROR / DONE / MALFORMED) and how
  many content units it carries: the first CONTENT event is the delivery boundary;
- how the gateway's terminal event is written in the family's own shape, carrying our
  fields (`code`, `request_id`, `partial_output`, `delivered_output_tokens`, `retryable`);
- whether the family has a `[DONE]` sentinel (only the OpenAI chunk APIs do);
- how a non-streaming body is checked (an error in a 200) and its output tokens counted.

The OpenAI chunk families (chat, completions) keep `sse.classify` and its fast path; the
others parse each event's JSON (their events are typed, there is no common token shape).
Over-counting content only moves the boundary earlier (safe: nothing is re-run after it);
so an event type a family does not know counts as content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import GatewayError
from .sse import Classifier, EventKind, SseDecoder, carries, parse_event_json

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "FAMILIES",
    "MESSAGES",
    "RESPONSES",
    "Family",
    "family_for_path",
    "family_named",
]

_CONTENT1 = (EventKind.CONTENT, 1)
_NON = (EventKind.NON_CONTENT, 0)
_ERROR = (EventKind.ERROR, 0)
_DONE = (EventKind.DONE, 0)
_MALFORMED = (EventKind.MALFORMED, 0)


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    paths: frozenset[str]
    operation: str  # gen_ai.operation.name of the request span
    # None: OpenAI chunks, `sse.classify` with its fast path (runs of token events merged).
    classify: Classifier | None
    has_done: bool  # a `data: [DONE]` sentinel ends the stream (OpenAI chunk APIs only)
    # The terminal event: (error, data of the stream's first event, data of the last event
    # forwarded) -> the bytes that end the stream for the client.
    terminal: Callable[[GatewayError, bytes, bytes], bytes]
    error_json: Callable[[GatewayError], bytes]  # a whole-body error in the family's shape
    body_ok: Callable[[object], bool]  # a non-streaming 200 body that is an answer
    # A non-streaming body's output tokens, from its usage (None: it reports none).
    output_tokens: Callable[[object], int | None]
    # The text of one content event (the data's JSON): what a tokenizer re-encodes when
    # the engine gave no count (decision 0018).
    event_text: Callable[[dict[str, Any]], str]
    # The terminal event needs the first and last forwarded events' data (Responses: the
    # response object and the sequence number); families that do not are spared the copy.
    wants_context: bool = False
    # Chunks may carry the engine's running usage (stream_options.continuous_usage_stats):
    # the OpenAI chunk APIs, as vLLM and SGLang serve them.
    running_usage: bool = False
    # The engine's whole output count in a non-content event that ends a complete answer
    # (Responses' `response.completed`, Messages' `message_delta`); None if it is not one.
    final_count: Callable[[bytes], int | None] | None = None

    def decoder(self) -> SseDecoder:
        """The decoder the machines use: counting, runs merged where the family allows."""
        return SseDecoder(merge_content=True, classify=self.classify)

    def text_of(self, raws: list[bytes]) -> str:
        """The output text of forwarded content events (their bytes as sent upstream)."""
        dec = SseDecoder(classify=self.classify)
        out: list[str] = []
        for raw in raws:
            for e in dec.feed(raw):
                obj = parse_event_json(e.data) if e.data else None
                if obj is not None:
                    out.append(self.event_text(obj))
        return "".join(out)


# --- OpenAI chat / completions chunks -----------------------------------------------------


def _openai_terminal(err: GatewayError, first: bytes, last: bytes) -> bytes:
    return err.sse_bytes()


def _openai_error_json(err: GatewayError) -> bytes:
    return err.json_bytes()


def _openai_body_ok(obj: object) -> bool:
    return isinstance(obj, dict) and obj.get("error") is None


def _usage_int(obj: object, field: str) -> int | None:
    if isinstance(obj, dict):
        usage = obj.get("usage")
        if isinstance(usage, dict):
            v = usage.get(field)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                return v
    return None


def _openai_tokens(obj: object) -> int | None:
    return _usage_int(obj, "completion_tokens")


def _strings(value: object, keys: tuple[str, ...]) -> list[str]:
    """The string values under `keys` in a nest of dicts and lists, in order."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k in keys and isinstance(v, str):
                out.append(v)
            elif isinstance(v, dict | list):
                out += _strings(v, keys)
    elif isinstance(value, list):
        for v in value:
            out += _strings(v, keys)
    return out


# Output text in a chunk's choices: content, reasoning, a tool call's name and arguments.
_CHUNK_TEXT = ("content", "text", "reasoning_content", "reasoning", "refusal", "name",
               "arguments")


def _chunk_text(obj: dict[str, Any]) -> str:
    return "".join(_strings(obj.get("choices"), _CHUNK_TEXT))


CHAT = Family(
    name="chat", paths=frozenset({"/v1/chat/completions"}), operation="chat",
    classify=None, has_done=True, terminal=_openai_terminal, error_json=_openai_error_json,
    body_ok=_openai_body_ok, output_tokens=_openai_tokens, event_text=_chunk_text,
    running_usage=True)
COMPLETIONS = Family(
    name="completions", paths=frozenset({"/v1/completions"}), operation="text_completion",
    classify=None, has_done=True, terminal=_openai_terminal, error_json=_openai_error_json,
    body_ok=_openai_body_ok, output_tokens=_openai_tokens, event_text=_chunk_text,
    running_usage=True)


# --- OpenAI Responses API -------------------------------------------------------------------

# Lifecycle events: no model output in them.
_RESPONSES_LIFECYCLE = frozenset({
    "response.created", "response.in_progress", "response.queued",
})
# Item types whose `output_item.added` announces a container, not output: a message or
# reasoning item starts empty and its text comes in deltas. Any other item (a function
# call, a custom tool call, an MCP or built-in tool call) names a tool: that is output.
_RESPONSES_CONTAINERS = frozenset({"message", "reasoning"})
# The response ended but not as an answer: vLLM ends an aborted generation this way.
_RESPONSES_CUT_SHORT = frozenset({"failed", "cancelled"})


def _responses_item_has_output(item: dict[str, Any]) -> bool:
    if item.get("type") not in _RESPONSES_CONTAINERS:
        return True
    return carries(item.get("content")) or carries(item.get("summary"))


def _typed(data: bytes, event: str | None) -> tuple[dict[str, Any] | None, str]:
    """A typed event's JSON and its type: the JSON `type`, else the SSE event name."""
    obj = parse_event_json(data)
    if obj is None:
        return None, ""
    t = obj.get("type")
    return obj, t if isinstance(t, str) else (event or "")


def classify_responses(data: bytes, event: str | None) -> tuple[EventKind, int]:
    """One Responses API streaming event (`type` in the JSON; the SSE name if it has none)."""
    obj, t = _typed(data, event)
    if obj is None:
        return _DONE if data.strip() == b"[DONE]" else _MALFORMED
    if t == "error" or t == "response.failed" or obj.get("error") is not None:
        return _ERROR
    if t == "response.completed" or t == "response.incomplete":
        resp = obj.get("response")
        if isinstance(resp, dict) and resp.get("status") in _RESPONSES_CUT_SHORT:
            return _ERROR
        return _DONE  # `incomplete` (max_output_tokens) is an answer that ends, like length
    if t.endswith(".delta"):
        return _CONTENT1 if carries(obj.get("delta")) else _NON
    if t == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict) and not _responses_item_has_output(item):
            return _NON
        return _CONTENT1
    if t == "response.content_part.added":
        part = obj.get("part")
        if isinstance(part, dict) and not any(carries(part.get(k))
                                              for k in ("text", "refusal", "transcript")):
            return _NON
        return _CONTENT1
    if t in _RESPONSES_LIFECYCLE or t.endswith(".done"):
        # `.done` events repeat what their deltas carried; a server that sends no deltas
        # ends with response.completed, which the gate takes as a complete answer.
        return _NON
    return _CONTENT1  # unknown: counted as output (moves the boundary earlier: safe)


def _seq(data: bytes) -> int | None:
    obj = parse_event_json(data) if data else None
    if obj is not None:
        n = obj.get("sequence_number")
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def _responses_terminal(err: GatewayError, first: bytes, last: bytes) -> bytes:
    """`response.failed`: the response object of the stream's `response.created` (same id),
    status failed, and our error object in its `error`. No `[DONE]`: the family has none."""
    created = parse_event_json(first) if first else None
    resp: dict[str, Any] = {}
    if created is not None and isinstance(created.get("response"), dict):
        resp = dict(created["response"])
    resp.setdefault("id", f"resp_{err.request_id}")
    resp.setdefault("object", "response")
    resp.setdefault("output", [])
    resp["status"] = "failed"
    resp["error"] = err.body()["error"]
    resp["incomplete_details"] = None
    ev: dict[str, Any] = {"type": "response.failed"}
    n = _seq(last)
    if n is not None:
        ev["sequence_number"] = n + 1
    ev["response"] = resp
    return (b"event: response.failed\ndata: "
            + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")


def _responses_final_count(data: bytes) -> int | None:
    obj = parse_event_json(data)
    if obj is None or obj.get("type") not in ("response.completed", "response.incomplete"):
        return None
    return _usage_int(obj.get("response"), "output_tokens")


def _messages_final_count(data: bytes) -> int | None:
    obj = parse_event_json(data)
    if obj is None or obj.get("type") != "message_delta":
        return None
    return _usage_int(obj, "output_tokens")


def _responses_body_ok(obj: object) -> bool:
    return (isinstance(obj, dict) and obj.get("error") is None
            and obj.get("status") not in _RESPONSES_CUT_SHORT)


def _output_tokens(obj: object) -> int | None:
    return _usage_int(obj, "output_tokens")


def _responses_text(obj: dict[str, Any]) -> str:
    """A delta's text, or a tool call's name and arguments as an added item names them."""
    d = obj.get("delta")
    if isinstance(d, str):
        return d
    return "".join(_strings(obj.get("item"), ("name", "arguments", "text")))


def _messages_text(obj: dict[str, Any]) -> str:
    return "".join(_strings(obj.get("delta"), ("text", "thinking", "partial_json"))
                   + _strings(obj.get("content_block"), ("text", "thinking", "name")))


RESPONSES = Family(
    name="responses", paths=frozenset({"/v1/responses"}), operation="chat",
    classify=classify_responses, has_done=False, terminal=_responses_terminal,
    error_json=_openai_error_json, body_ok=_responses_body_ok, output_tokens=_output_tokens,
    event_text=_responses_text, wants_context=True, final_count=_responses_final_count)


# --- Anthropic Messages API -----------------------------------------------------------------

_MESSAGES_NON_CONTENT = frozenset({"message_start", "content_block_stop", "ping"})
# Blocks that start empty and fill by deltas; any other block (tool_use, server_tool_use,
# and whatever comes next) names a tool or is output in itself.
_MESSAGES_TEXT_BLOCKS = {"text": "text", "thinking": "thinking"}


def classify_messages(data: bytes, event: str | None) -> tuple[EventKind, int]:
    """One Anthropic Messages streaming event (`type` in the JSON; else the SSE name)."""
    obj, t = _typed(data, event)
    if obj is None:
        return _DONE if data.strip() == b"[DONE]" else _MALFORMED
    if t == "error" or obj.get("error") is not None:
        return _ERROR
    if t == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and any(carries(v) for k, v in delta.items()
                                           if k not in ("type", "index")):
            return _CONTENT1
        return _NON
    if t == "message_stop":
        return _DONE
    if t == "message_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and "stop_reason" in delta and delta["stop_reason"] is None:
            # vLLM reports an aborted (or failed) generation as a message with no stop
            # reason: cut short, not an answer.
            return _ERROR
        return _NON
    if t == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict):
            text_field = _MESSAGES_TEXT_BLOCKS.get(str(block.get("type")))
            if text_field is not None and not carries(block.get(text_field)):
                return _NON
        return _CONTENT1
    if t in _MESSAGES_NON_CONTENT:
        if t == "message_start":
            msg = obj.get("message")
            if isinstance(msg, dict) and carries(msg.get("content")):
                return _CONTENT1
        return _NON
    return _CONTENT1  # unknown: counted as output (moves the boundary earlier: safe)


def _anthropic_error(err: GatewayError) -> dict[str, Any]:
    body = err.body()["error"]
    body["type"] = "api_error" if err.http_status >= 500 else "invalid_request_error"
    return {"type": "error", "error": body}


def _messages_terminal(err: GatewayError, first: bytes, last: bytes) -> bytes:
    """`event: error`, as Anthropic ends a failed stream; no `message_stop` (the message did
    not end), no `[DONE]` (the family has none)."""
    return (b"event: error\ndata: "
            + json.dumps(_anthropic_error(err), separators=(",", ":")).encode() + b"\n\n")


def _messages_error_json(err: GatewayError) -> bytes:
    return json.dumps(_anthropic_error(err), separators=(",", ":")).encode()


def _messages_body_ok(obj: object) -> bool:
    return (isinstance(obj, dict) and obj.get("type") != "error"
            and obj.get("error") is None)


MESSAGES = Family(
    name="messages", paths=frozenset({"/v1/messages"}), operation="chat",
    classify=classify_messages, has_done=False, terminal=_messages_terminal,
    error_json=_messages_error_json, body_ok=_messages_body_ok, output_tokens=_output_tokens,
    event_text=_messages_text, final_count=_messages_final_count)


FAMILIES: tuple[Family, ...] = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
_BY_PATH = {p: f for f in FAMILIES for p in f.paths}
_BY_NAME = {f.name: f for f in FAMILIES}
GENERATION_PATHS = frozenset(_BY_PATH)


def family_for_path(path: str) -> Family:
    """The family serving a path (query string ignored); chat for anything unknown."""
    return _BY_PATH.get(path.split("?", 1)[0], CHAT)


def family_named(name: str) -> Family:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown API family {name!r}") from None

