"""Request intake: the headers classified, the body parsed, the request's digest."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.adapters.ports import RandomIds
from extproc.core.config import Config, load_config
from extproc.core.errors import ErrorCode, GatewayError, bad_request, tool_route_not_here
from extproc.core.intake import (
    Generation,
    Misrouted,
    PassThrough,
    Rejected,
    RequestMeta,
    StatusLookup,
    ToolCall,
    classify_request,
    parse_body,
    request_id_of,
)
from extproc.core.journal import REQUEST_ID_RE, request_id_for_key

CFG = Config()
REQUIRED = load_config({"idempotency": {"required": True}})
TENANTED = load_config({"tenancy": {"header": "X-Tenant"}})
RID = request_id_for_key("default", "k-1")


def post(path: str = "/v1/chat/completions", **headers: str) -> dict[str, str]:
    return {":method": "POST", ":path": path, **headers}


def get(path: str, **headers: str) -> dict[str, str]:
    return {":method": "GET", ":path": path, **headers}


def rejected(res: Any, code: ErrorCode, status: int) -> GatewayError:
    assert isinstance(res, Rejected), res
    assert res.error.code is code
    assert res.error.http_status == status
    assert res.error.retryable is False
    return res.error


# --- classify_request -----------------------------------------------------------------------


def test_status_lookup() -> None:
    res = classify_request(get(f"/v1/requests/{RID}"), CFG)
    assert res == StatusLookup(request_id=RID, tenant="default")
    res = classify_request(get(f"/v1/requests/{RID}?verbose=1"), CFG)
    assert res == StatusLookup(request_id=RID, tenant="default")


@pytest.mark.parametrize("rid", ["", "req_", "req_short", RID.upper(), RID + "0", RID[:-1],
                                 RID + "/x", "xyz_" + RID[4:], "../../etc/passwd"])
def test_status_lookup_with_an_invalid_id(rid: str) -> None:
    rejected(classify_request(get(f"/v1/requests/{rid}"), CFG), ErrorCode.INVALID_REQUEST_ID,
             400)


@pytest.mark.parametrize("method", ["POST", "DELETE", "PUT", ""])
def test_status_lookup_only_accepts_get(method: str) -> None:
    res = classify_request({":method": method, ":path": f"/v1/requests/{RID}"}, CFG)
    rejected(res, ErrorCode.INVALID_HEADER, 405)


@pytest.mark.parametrize("headers", [
    get("/v1/models"), post("/v1/embeddings"), get("/healthz"), post("/v1/chat/completions/x"),
    post("/v1/chat"), {":method": "GET"},
])
def test_passthrough_paths(headers: dict[str, str]) -> None:
    assert classify_request(headers, CFG) == PassThrough()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_paths_only_accept_post(path: str) -> None:
    rejected(classify_request(get(path), CFG), ErrorCode.INVALID_HEADER, 405)
    assert isinstance(classify_request(post(path), CFG, RandomIds().request_id), Generation)


def test_missing_key_when_not_required_gets_a_fresh_id() -> None:
    # The id comes from the Ids port (the core mints nothing).
    a = classify_request(post(), CFG, RandomIds().request_id)
    b = classify_request(post("/v1/chat/completions?x=1"), CFG, RandomIds().request_id)
    assert isinstance(a, Generation) and isinstance(b, Generation)
    assert a.idempotency_key is None and a.tenant == "default"
    assert a.path == "/v1/chat/completions" and b.path == "/v1/chat/completions"
    assert REQUEST_ID_RE.match(a.request_id) and REQUEST_ID_RE.match(b.request_id)
    assert a.request_id != b.request_id


def test_missing_key_when_required() -> None:
    rejected(classify_request(post(), REQUIRED), ErrorCode.MISSING_IDEMPOTENCY_KEY, 400)
    res = classify_request(post(**{"idempotency-key": "abc"}), REQUIRED)
    assert isinstance(res, Generation) and res.idempotency_key == "abc"


@pytest.mark.parametrize("key", ["", "x" * 129, "has space", "tab\there", "ключ", "caf\u00e9",
                                 "nul\x00", "bell\x07", "del\x7f", "line\nbreak"],
                         ids=["empty", "too-long", "space", "tab", "cyrillic", "latin1", "nul",
                              "bell", "del", "newline"])
def test_invalid_keys(key: str) -> None:
    rejected(classify_request(post(**{"idempotency-key": key}), CFG),
             ErrorCode.INVALID_IDEMPOTENCY_KEY, 400)


def test_key_length_limit_is_inclusive_and_configurable() -> None:
    assert isinstance(classify_request(post(**{"idempotency-key": "x" * 128}), CFG), Generation)
    short = load_config({"limits": {"max_idempotency_key_length": 8}})
    assert isinstance(classify_request(post(**{"idempotency-key": "x" * 8}), short), Generation)
    rejected(classify_request(post(**{"idempotency-key": "x" * 9}), short),
             ErrorCode.INVALID_IDEMPOTENCY_KEY, 400)


def test_same_key_same_tenant_same_request() -> None:
    h = {"idempotency-key": "order-42", "x-tenant": "acme"}
    a = classify_request(post(**h), TENANTED)
    b = classify_request(post("/v1/completions", **h), TENANTED)
    assert isinstance(a, Generation) and isinstance(b, Generation)
    assert a.request_id == b.request_id == request_id_for_key("acme", "order-42")
    assert a.tenant == "acme"
    c = classify_request(post(**{**h, "x-tenant": "globex"}), TENANTED)
    assert isinstance(c, Generation) and c.request_id != a.request_id
    d = classify_request(post(**{**h, "idempotency-key": "order-43"}), TENANTED)
    assert isinstance(d, Generation) and d.request_id != a.request_id


@pytest.mark.parametrize("tenant", [None, "", "a b", "x" * 257])
def test_missing_or_invalid_tenant_is_401(tenant: str | None) -> None:
    h = {} if tenant is None else {"x-tenant": tenant}
    for req in (post(**h), get(f"/v1/requests/{RID}", **h), get("/v1/models", **h)):
        rejected(classify_request(req, TENANTED), ErrorCode.INVALID_HEADER, 401)


def test_status_lookup_carries_the_tenant() -> None:
    res = classify_request(get(f"/v1/requests/{RID}", **{"x-tenant": "acme"}), TENANTED)
    assert res == StatusLookup(request_id=RID, tenant="acme")


# --- parse_body -------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "needle"), [
    (b"{", "not valid JSON"), (b"", "not valid JSON"), (b"\xff\xfe\x00", "not valid JSON"),
    (b"[1, 2]", "JSON object"), (b'"text"', "JSON object"), (b"null", "JSON object"),
    (b'{"stream": "yes"}', "'stream'"), (b'{"stream": 1}', "'stream'"),
    (b'{"model": 3}', "'model'"),
    (b'{"seed": 1.5}', "'seed'"), (b'{"seed": true}', "'seed'"), (b'{"seed": "7"}', "'seed'"),
    (b'{"max_tokens": "10"}', "'max_tokens'"), (b'{"max_tokens": false}', "'max_tokens'"),
    (b'{"max_completion_tokens": 1.0}', "'max_tokens'"),
])
def test_parse_body_rejections(body: bytes, needle: str) -> None:
    err = parse_body(body, CFG, RID)
    assert isinstance(err, GatewayError)
    assert err.code is ErrorCode.INVALID_REQUEST_BODY
    assert err.http_status == 400 and err.request_id == RID
    assert needle in err.message


def test_parse_body_too_large() -> None:
    cfg = load_config({"limits": {"max_request_body_bytes": 1024}})
    body = json.dumps({"model": "m", "messages": [{"content": "x" * 1024}]}).encode()
    err = parse_body(body, cfg, RID)
    assert isinstance(err, GatewayError)
    assert err.code is ErrorCode.REQUEST_BODY_TOO_LARGE and err.http_status == 413
    assert isinstance(parse_body(b" " * 1020 + b"{}", cfg, RID), RequestMeta)


def test_parse_body_deeply_nested() -> None:
    err = parse_body(b"[" * 100_000 + b"]" * 100_000, CFG, RID)
    assert isinstance(err, GatewayError) and err.code is ErrorCode.INVALID_REQUEST_BODY


def test_parse_body_valid_meta() -> None:
    body = json.dumps({"model": "m-1", "stream": True, "seed": 42, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    meta = parse_body(body, CFG, RID)
    assert isinstance(meta, RequestMeta)
    assert (meta.model, meta.stream, meta.seed, meta.max_tokens) == ("m-1", True, 42, 64)
    assert meta.body_bytes == len(body)
    assert meta.input_digest.startswith("sha256:") and len(meta.input_digest) == 7 + 64
    d = meta.to_dict()
    assert set(d) == {"model", "stream", "seed", "max_tokens", "input_digest", "body_bytes",
                      "estimated_prompt_tokens", "request_digest"}
    assert "hi" not in json.dumps(d)  # never the prompt itself
    other = parse_body(body.replace(b"hi", b"ho"), CFG, RID)
    assert isinstance(other, RequestMeta) and other.input_digest != meta.input_digest
    again = parse_body(body, CFG, RID)
    assert isinstance(again, RequestMeta) and again.input_digest == meta.input_digest


def test_parse_body_defaults() -> None:
    meta = parse_body(b'{"max_completion_tokens": 9}', CFG, RID)
    assert isinstance(meta, RequestMeta)
    assert (meta.model, meta.stream, meta.seed, meta.max_tokens) == (None, False, None, 9)


# --- a key names one request (its canonical digest) -------------------------------------------

_BODY = {"model": "m-1", "stream": True, "max_tokens": 8, "temperature": 0.5,
         "messages": [{"role": "user", "content": "hi"}]}


def _digest(obj: dict[str, Any] | bytes, path: str = "/v1/chat/completions") -> str:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    meta = parse_body(raw, CFG, RID, path)
    assert isinstance(meta, RequestMeta)
    return meta.request_digest


def test_the_digest_ignores_spelling_and_sees_every_value() -> None:
    d = _digest(_BODY)
    assert d.startswith("sha256:") and len(d) == 7 + 64
    # Key order and whitespace are spelling, not the request.
    respelled = json.dumps(dict(reversed(list(_BODY.items()))), indent=2).encode()
    assert _digest(respelled) == d
    assert "hi" not in d  # a digest, never the prompt
    for change in ({"model": "m-2"}, {"temperature": 0.7}, {"max_tokens": 9},
                   {"messages": [{"role": "user", "content": "ho"}]}, {"seed": 1},
                   {"stream": False}):
        assert _digest({**_BODY, **change}) != d, change
    assert _digest(_BODY, "/v1/completions") != d  # another endpoint, another request


def test_the_request_id_a_verdict_runs_under() -> None:
    rid = "req_0123456789abcdefghjkmnpqrs"
    assert request_id_of(Generation(rid, "t", None, "/v1/chat/completions")) == rid
    assert request_id_of(StatusLookup(rid, "t")) == rid
    assert request_id_of(Rejected(bad_request(ErrorCode.INVALID_HEADER, "x", rid))) == rid
    assert request_id_of(Rejected(bad_request(ErrorCode.INVALID_HEADER, "x"))) == ""
    assert request_id_of(Misrouted(tool_route_not_here("/tools/x", False), "/tools/x")) == ""
    assert request_id_of(PassThrough()) == "" and request_id_of(ToolCall({})) == ""


def test_an_answered_meta_lets_go_of_the_body_sent_upstream_and_keeps_the_rest() -> None:
    """RequestMeta.answered (decision 0055): the rewritten body is dropped, nothing else."""
    body = json.dumps({"model": "m-1", "stream": True, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    meta = parse_body(body, CFG, RID, "/v1/chat/completions")
    assert isinstance(meta, RequestMeta) and meta.upstream_body is not None
    before = (meta.to_dict(), meta.usage_mode)
    meta.answered()
    assert meta.upstream_body is None
    assert (meta.to_dict(), meta.usage_mode) == before
