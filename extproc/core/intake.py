"""What the guard decides about an incoming request before anything runs.

Pure functions over headers and body bytes, so every bad-input rule is testable without
Envoy: a malformed body, an oversized one, a bad Idempotency-Key, a bad request id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import headers as H
from . import records
from .budget import estimate_prompt_tokens
from .config import Config
from .errors import (
    ErrorCode,
    GatewayError,
    bad_request,
    no_compatible_replica,
    tool_route_not_here,
)
from .families import GENERATION_PATHS as FAMILY_PATHS
from .families import family_for_path
from .journal import Rerun, request_id_for_key, validate_request_id
from .pool import Pool
from .usage import UsageMode, ask_for_usage

# Every API family the contract covers (core.families): chat, completions, Responses and
# Anthropic Messages.
GENERATION_PATHS = FAMILY_PATHS
STATUS_PREFIX = "/v1/requests/"
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class StatusLookup:
    request_id: str
    tenant: str


@dataclass(frozen=True, slots=True)
class Generation:
    request_id: str
    tenant: str
    idempotency_key: str | None
    path: str


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Not ours to journal (e.g. GET /v1/models): forwarded untouched."""


@dataclass(frozen=True, slots=True)
class Rejected:
    error: GatewayError


Intake = StatusLookup | Generation | PassThrough | Rejected


@dataclass(frozen=True, slots=True)
class Misrouted:
    """A tool call on the client listener, or anything else on the tool listener: refused
    before anything is read (no ledger, no journal; decision 0028)."""

    error: GatewayError
    path: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """The tool route on the tool listener: its own machine (core.tool_route) serves it."""

    headers: Mapping[str, str]


Verdict = Intake | Misrouted | ToolCall


def read_headers(headers: Mapping[str, str], cfg: Config, tools_listener: bool,
                 new_id: Callable[[], str]) -> Verdict:
    """The request's headers, as the guard of the listener `tools_listener` reads them."""
    path = headers.get(":path", "")
    is_tool = path.startswith(cfg.tools.path_prefix)
    if is_tool != tools_listener:
        bare = path.split("?", 1)[0]
        return Misrouted(tool_route_not_here(bare, tools_listener), bare)
    if is_tool:
        return ToolCall(headers)
    return classify_request(headers, cfg, new_id)


def kind_of(v: Verdict) -> tuple[str, str, GatewayError | None]:
    """What the guard's machine is told of a verdict: (kind, family, error)."""
    if isinstance(v, Generation):
        return "generation", family_for_path(v.path).name, None
    if isinstance(v, Misrouted | Rejected):
        return ("misrouted" if isinstance(v, Misrouted) else "rejected"), "chat", v.error
    return {StatusLookup: "status", PassThrough: "passthrough",
            ToolCall: "tool"}[type(v)], "chat", None


def request_id_of(v: Verdict) -> str:
    """The request id a verdict's machine runs under: a generation's or a status lookup's,
    a refusal's own, else none ("")."""
    if isinstance(v, Generation | StatusLookup):
        return v.request_id
    return (v.error.request_id if isinstance(v, Misrouted | Rejected) else None) or ""


def _valid_key(key: str, max_len: int) -> bool:
    return 0 < len(key) <= max_len and all(0x21 <= ord(c) <= 0x7E for c in key)


def _no_ids() -> str:
    raise RuntimeError("a key-less request needs a new id: pass new_id (the Ids port)")


def classify_request(headers: Mapping[str, str], cfg: Config,
                     new_id: Callable[[], str] = _no_ids) -> Intake:
    """Decide from the request headers alone (lower-case names). `new_id` mints the id of
    a request without an Idempotency-Key (the adapters' Ids port: the core mints nothing)."""
    method = headers.get(":method", "")
    path = headers.get(":path", "").split("?", 1)[0]
    tenant = DEFAULT_TENANT
    if cfg.tenancy.header is not None:
        t = headers.get(cfg.tenancy.header)
        if t is None or not _valid_key(t, 256):
            return Rejected(bad_request(ErrorCode.INVALID_HEADER,
                                        f"header {cfg.tenancy.header} is missing or invalid",
                                        status=401))
        tenant = t
    elif cfg.tenancy.api_key_header is not None:
        k = headers.get(cfg.tenancy.api_key_header, "")
        if not k or len(k) > 4096:
            return Rejected(bad_request(ErrorCode.INVALID_HEADER,
                                        f"header {cfg.tenancy.api_key_header} is missing",
                                        status=401))
        # Only a digest of the key is ever kept; the same key is the same tenant.
        tenant = "key:" + hashlib.sha256(k.encode("utf-8", "replace")).hexdigest()
    if path.startswith(STATUS_PREFIX):
        if method != "GET":
            return Rejected(bad_request(ErrorCode.INVALID_HEADER,
                                        "the request status endpoint only accepts GET",
                                        status=405))
        rid = path[len(STATUS_PREFIX):]
        err = validate_request_id(rid)
        if err is not None:
            return Rejected(err)
        return StatusLookup(request_id=rid, tenant=tenant)
    if path not in GENERATION_PATHS:
        return PassThrough()
    if method != "POST":
        return Rejected(bad_request(ErrorCode.INVALID_HEADER,
                                    f"{path} only accepts POST", status=405))
    key = headers.get("idempotency-key")
    if key is None:
        if cfg.idempotency.required:
            return Rejected(bad_request(ErrorCode.MISSING_IDEMPOTENCY_KEY,
                                        "this gateway requires an Idempotency-Key header"))
        return Generation(request_id=new_id(), tenant=tenant,
                          idempotency_key=None, path=path)
    if not _valid_key(key, cfg.limits.max_idempotency_key_length):
        return Rejected(bad_request(
            ErrorCode.INVALID_IDEMPOTENCY_KEY,
            f"Idempotency-Key must be 1-{cfg.limits.max_idempotency_key_length} visible "
            "ASCII characters"))
    return Generation(request_id=request_id_for_key(tenant, key), tenant=tenant,
                      idempotency_key=key, path=path)


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What the journal keeps about the input: enough to replay, never the prompt itself."""

    model: str | None
    stream: bool
    seed: int | None
    max_tokens: int | None
    input_digest: str
    body_bytes: int
    estimated_prompt_tokens: int = 0
    # The canonical request (endpoint + body as sorted, compact JSON): what an
    # Idempotency-Key names. A repeat whose digest differs is refused (decision 0005).
    request_digest: str = ""
    # The body sent upstream when the gateway asked the engine for its running usage
    # (core.usage; None: the client's own bytes), and what the guard strips.
    upstream_body: bytes | None = None
    usage_mode: UsageMode = UsageMode.OFF

    def answered(self) -> None:
        """Let go of `upstream_body` once the body's answer carried it: nothing reads it
        after, and an open stream would hold the prompt's size to its end (decision 0055).
        The one field changed after construction, in place: a copy without it costs ~21k
        instructions a request (a frozen dataclass's __init__), this ~100."""
        object.__setattr__(self, "upstream_body", None)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "stream": self.stream, "seed": self.seed,
                "max_tokens": self.max_tokens, "input_digest": self.input_digest,
                "body_bytes": self.body_bytes,
                "estimated_prompt_tokens": self.estimated_prompt_tokens,
                "request_digest": self.request_digest}


# json.dumps with options builds its encoder on every call; this one is built once (and
# its C encoder too: records.one_shot).
_CANONICAL = records.one_shot(json.JSONEncoder(sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=False))


def request_digest(path: str, obj: Mapping[str, Any]) -> str:
    """The same request however it is spelled: key order and whitespace do not count,
    every value does (model, messages, every parameter), and so does the endpoint."""
    canonical = _CANONICAL(obj)
    return "sha256:" + hashlib.sha256(
        path.encode() + b"\0" + canonical.encode("utf-8", "surrogatepass")).hexdigest()


def parse_body(body: bytes, cfg: Config, request_id: str,
               path: str = "/v1/chat/completions") -> RequestMeta | GatewayError:
    if len(body) > cfg.limits.max_request_body_bytes:
        return bad_request(ErrorCode.REQUEST_BODY_TOO_LARGE,
                           f"request body is {len(body)} bytes; the limit is "
                           f"{cfg.limits.max_request_body_bytes}", request_id, status=413)
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return bad_request(ErrorCode.INVALID_REQUEST_BODY,
                           f"request body is not valid JSON: {e}", request_id)
    except RecursionError:
        return bad_request(ErrorCode.INVALID_REQUEST_BODY,
                           "request body is not valid JSON: nested too deeply", request_id)
    if not isinstance(obj, dict):
        return bad_request(ErrorCode.INVALID_REQUEST_BODY,
                           "request body must be a JSON object", request_id)
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        return bad_request(ErrorCode.INVALID_REQUEST_BODY, "'stream' must be a boolean",
                           request_id)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        return bad_request(ErrorCode.INVALID_REQUEST_BODY, "'model' must be a string",
                           request_id)
    seed = obj.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return bad_request(ErrorCode.INVALID_REQUEST_BODY, "'seed' must be an integer",
                           request_id)
    # Responses calls it max_output_tokens; chat, completions and Anthropic max_tokens.
    max_tokens = obj.get("max_tokens", obj.get("max_completion_tokens",
                                               obj.get("max_output_tokens")))
    if max_tokens is not None and (isinstance(max_tokens, bool)
                                   or not isinstance(max_tokens, int)):
        return bad_request(ErrorCode.INVALID_REQUEST_BODY, "'max_tokens' must be an integer",
                           request_id)
    upstream: bytes | None = None
    mode = UsageMode.OFF
    # One choice only: with n > 1 each chunk's running usage is its own choice's count.
    if (stream and cfg.accounting.engine_usage and family_for_path(path).running_usage
            and obj.get("n", 1) in (1, None)):
        upstream, mode = ask_for_usage(body, obj)
        if upstream == body:
            upstream = None
    return RequestMeta(model=model, stream=stream, seed=seed, max_tokens=max_tokens,
                       upstream_body=upstream, usage_mode=mode,
                       input_digest="sha256:" + hashlib.sha256(body).hexdigest(),
                       body_bytes=len(body),
                       request_digest=request_digest(path, obj),
                       estimated_prompt_tokens=estimate_prompt_tokens(
                           obj, cfg.policy.retry_cost.chars_per_token))


def own_intake(attempts: tuple[Mapping[str, Any], ...], live: str | None,
               first_attempt_id: str) -> bool:
    """A record found where our intake meant to create one is our own earlier try's.

    An intake whose answer was lost (a deadline, a member that went away) may have applied;
    sent again, it finds the record. It is ours, and the intake a success, when attempt 1 is
    the very attempt id minted for this try (ids are random: no other request has it) and
    nothing else was admitted since; anything else is a repeat by someone else.
    """
    return (len(attempts) == 1 and attempts[0].get("attempt_id") == first_attempt_id
            and live in (None, first_attempt_id))



@dataclass(frozen=True, slots=True)
class Prepared:
    """A generation's body, ready for its intake: the parsed body, the hosts in order, the
    record and attempt 1 (admitted in the same transaction as the record)."""

    meta: RequestMeta
    route: tuple[str, list[str]] | None
    record: dict[str, Any]
    first: dict[str, Any]


def prepare_intake(body: bytes, cfg: Config, gen: Generation, *, pool: Pool,
                   order_hosts: Callable[[list[str]], list[str]],
                   new_attempt_id: Callable[[], str], wall: float,
                   envoy_request_id: str | None) -> Prepared | GatewayError:
    """Parse the body, route it, and write down its record and attempt 1 (ids and times
    come in: the core mints nothing); else the error the client gets."""
    rid = gen.request_id
    meta = parse_body(body, cfg, rid, gen.path)
    if isinstance(meta, GatewayError):
        return meta
    route: tuple[str, list[str]] | None = None
    if pool.enabled:
        route = pool.choose(meta.model, rid)
        if route is None:
            return no_compatible_replica(rid, f"no replica declared for model {meta.model!r}")
        # Hosts known to be down go last: attempt 1 should not be spent on them.
        route = (route[0], order_hosts(route[1]))
    gw = cfg.server.gateway_id
    record = records.request_meta(
        request_id=rid, tenant=gen.tenant, idempotency_key=gen.idempotency_key,
        endpoint=gen.path, max_attempts=cfg.policy.max_attempts, gateway_id=gw,
        envoy_request_id=envoy_request_id, created_at=wall, body_meta=meta.to_dict(),
        route=route)
    return Prepared(meta, route, record, records.first_attempt(new_attempt_id(), gw, wall))


def body_headers(p: Prepared, *, secret: str | None, traceparent: str | None,
                 rerun: Rerun | None) -> tuple[dict[str, str], dict[str, Any] | None]:
    """What the body's answer sets for attempt 1's gate (headers, and Envoy's dynamic
    metadata with the hosts in order)."""
    meta, route = p.meta, p.route
    set_headers = {H.PROMPT_TOKENS: str(meta.estimated_prompt_tokens),
                   H.PREADMITTED: str(p.first["attempt_id"]),
                   H.ACCEPTED_AT: f"{p.record['created_at']:.6f}"}
    if secret is not None:
        # For the gate of attempt 1, which keeps it; a later attempt's gate replaces it with
        # its own.
        set_headers[H.ATTEMPT_SECRET] = secret
    if traceparent:
        set_headers[H.TRACEPARENT] = traceparent
    if rerun is not None:
        # The gates name their attempts after the runs before (decision 0027).
        set_headers[H.ATTEMPT_OFFSET] = str(rerun.attempt_offset)
    lb: dict[str, Any] | None = None
    if route is not None:
        # Attempt n goes to hosts[n-1]: every host listed shares one fingerprint, so no
        # retry can land on an incompatible replica.
        set_headers[H.FINGERPRINT] = route[0]
        lb = {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(route[1])}}
    if meta.upstream_body is not None:
        # Envoy rejects a buffered body mutation whose content-length does not match.
        set_headers["content-length"] = str(len(meta.upstream_body))
    return set_headers, lb
