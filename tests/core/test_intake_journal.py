"""Request intake (headers, body) and the journal record as operators and clients see it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.ports import RandomIds
from extproc.core.config import Config, load_config
from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.intake import (
    Generation,
    PassThrough,
    Rejected,
    RequestMeta,
    StatusLookup,
    classify_request,
    parse_body,
)
from extproc.core.journal import (
    REQUEST_ID_RE,
    JournalView,
    Outcome,
    Phase,
    new_request_id,
    repeat_answer,
    request_id_for_key,
    validate_request_id,
)

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


# --- journal view -----------------------------------------------------------------------------

META = {"model": "m-1", "stream": True, "max_attempts": 2, "created_at": "t0"}


def attempt(n: int, rev: str | None = "model-x@sha256:aa") -> dict[str, Any]:
    return {"attempt": n, "attempt_id": f"{RID}:a{n}", "replica": "r", "model_revision": rev}


def view(**kw: Any) -> JournalView:
    return JournalView(request_id=RID, meta=META, **kw)


def test_phase_derivation() -> None:
    assert view().phase is Phase.PREFILL
    assert view(attempts=(attempt(1),)).phase is Phase.PREFILL
    assert view(delivery={"at": "t1"}).phase is Phase.DECODE
    assert view(delivery={"at": "t1"}, outcome={"outcome": "completed"}).phase is Phase.DONE
    assert view(outcome={"outcome": "upstream_failed"}).phase is Phase.DONE
    assert not view().first_delta_sent and view(delivery={}).first_delta_sent


def test_to_dict_in_prefill() -> None:
    d = view(attempts=(attempt(1),)).to_dict()
    assert d["request_id"] == RID
    assert d["phase"] == "prefill" and d["attempt"] == 1
    assert d["attempt_id"] == f"{RID}:a1"
    assert d["first_delta_sent"] is False
    assert d["delivered_output_tokens"] == 0
    assert d["model_revision"] == "model-x@sha256:aa"
    assert d["retry_budget"] == 1
    assert d["outcome"] is None and d["finished_at"] is None and d["first_delta_at"] is None
    assert d["created_at"] == "t0"
    assert "error" not in d
    json.dumps(d)  # the status endpoint serializes it


def test_to_dict_without_attempts() -> None:
    d = view().to_dict()
    assert d["attempt"] == 0 and d["attempt_id"] is None and d["model_revision"] is None
    assert d["retry_budget"] == 2


def test_to_dict_retry_budget_never_negative() -> None:
    d = view(attempts=(attempt(1), attempt(2), attempt(3))).to_dict()
    assert d["retry_budget"] == 0 and d["attempt"] == 3


def test_to_dict_interrupted() -> None:
    v = view(attempts=(attempt(1, None), attempt(2, "rev-2")),
             delivery={"at": "t1", "model_revision": "rev-delivered"},
             outcome={"outcome": "upstream_decode_interrupted",
                      "delivered_output_tokens": 37, "cause": "upstream",
                      "finished_at": "t2"})
    d = v.to_dict()
    assert d["phase"] == "done" and d["first_delta_sent"] is True
    assert d["attempt"] == 2 and d["attempt_id"] == f"{RID}:a2"
    assert d["delivered_output_tokens"] == 37
    assert d["model_revision"] == "rev-delivered"
    assert d["outcome"] == "upstream_decode_interrupted" and d["cause"] == "upstream"
    assert d["first_delta_at"] == "t1" and d["finished_at"] == "t2"
    err = d["error"]
    assert err["code"] == "upstream_decode_interrupted"
    assert err["partial_output"] is True and err["retryable"] is False
    assert err["delivered_output_tokens"] == 37 and err["request_id"] == RID
    ce = v.client_error()
    assert ce is not None and ce.code is ErrorCode.UPSTREAM_DECODE_INTERRUPTED


INTERRUPTED = (Outcome.UPSTREAM_DECODE_INTERRUPTED, Outcome.GATEWAY_INTERRUPTED)


@pytest.mark.parametrize("oc", [o for o in Outcome if o not in INTERRUPTED])
def test_client_error_only_for_interrupted(oc: Outcome) -> None:
    v = view(delivery={"at": "t"}, outcome={"outcome": str(oc), "delivered_output_tokens": 3})
    assert v.client_error() is None
    assert "error" not in v.to_dict()
    assert view().client_error() is None


# --- repeat answers ---------------------------------------------------------------------------


def test_repeat_while_in_progress() -> None:
    for v, phase in [(view(), "prefill"), (view(delivery={"at": "t"}), "decode")]:
        err = repeat_answer(v)
        assert err.code is ErrorCode.REQUEST_IN_PROGRESS
        assert err.http_status == 409 and err.retryable is True
        assert err.body()["error"]["phase"] == phase
        assert err.request_id == RID


def test_repeat_after_interruption() -> None:
    err = repeat_answer(view(delivery={"at": "t"}, outcome={
        "outcome": "upstream_decode_interrupted", "delivered_output_tokens": 5}))
    assert err.code is ErrorCode.UPSTREAM_DECODE_INTERRUPTED
    assert err.http_status == 409 and err.retryable is False and err.partial_output is True
    assert err.delivered_output_tokens == 5
    body = err.body()["error"]
    assert body["delivered_output_tokens"] == 5 and body["request_id"] == RID


def test_repeat_after_completion() -> None:
    err = repeat_answer(view(delivery={"at": "t"}, outcome={
        "outcome": "completed", "delivered_output_tokens": 9}))
    assert err.code is ErrorCode.REQUEST_ALREADY_COMPLETED
    assert err.http_status == 409 and err.retryable is False
    body = err.body()["error"]
    assert body["outcome"] == "completed" and body["delivered_output_tokens"] == 9


@pytest.mark.parametrize(("oc", "delivered"), [
    (Outcome.CLIENT_DISCONNECTED, 4), (Outcome.CLIENT_DISCONNECTED, 0),
    (Outcome.UPSTREAM_FAILED, 0), (Outcome.REFUSED, 0),
])
def test_repeat_after_another_end(oc: Outcome, delivered: int) -> None:
    err = repeat_answer(view(outcome={"outcome": str(oc), "delivered_output_tokens": delivered}))
    assert err.code is ErrorCode.REQUEST_ALREADY_FINISHED
    assert err.http_status == 409 and err.retryable is False
    assert err.partial_output is (delivered > 0)
    body = err.body()["error"]
    assert body["outcome"] == str(oc) and body["delivered_output_tokens"] == delivered


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


def _with_digest(digest: str | None, **kw: Any) -> JournalView:
    meta = {**META, **({"request_digest": digest} if digest is not None else {})}
    return JournalView(request_id=RID, meta=meta, **kw)


@pytest.mark.parametrize("recorded", [
    {},  # in progress
    {"delivery": {"at": "t"}, "outcome": {"outcome": "completed",
                                          "delivered_output_tokens": 9}},
    {"delivery": {"at": "t"}, "outcome": {"outcome": "upstream_decode_interrupted",
                                          "delivered_output_tokens": 5}},
])
def test_a_different_request_under_a_used_key_is_refused(recorded: dict[str, Any]) -> None:
    d = _digest(_BODY)
    other = _digest({**_BODY, "model": "m-2"})
    err = repeat_answer(_with_digest(d, **recorded), other, "key-1")
    assert err.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    assert err.http_status == 422 and err.retryable is False and not err.partial_output
    body = err.body()["error"]
    assert "'key-1'" in body["message"] and body["param"] == "Idempotency-Key"
    assert body["request_id"] == RID
    # Nothing of the first request is told to the second.
    assert "delivered_output_tokens" not in body and "outcome" not in body
    # The same request under the key: today's answers, unchanged.
    same = repeat_answer(_with_digest(d, **recorded), d, "key-1")
    assert same.code is not ErrorCode.IDEMPOTENCY_KEY_REUSED and same.http_status == 409


def test_a_record_from_before_digests_is_answered_as_a_repeat() -> None:
    err = repeat_answer(_with_digest(None, delivery={"at": "t"}, outcome={
        "outcome": "completed", "delivered_output_tokens": 9}), _digest(_BODY), "key-1")
    assert err.code is ErrorCode.REQUEST_ALREADY_COMPLETED


# --- request ids ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(tenant=st.text(min_size=1, max_size=40), key=st.text(min_size=1, max_size=80))
def test_request_id_for_key_is_deterministic(tenant: str, key: str) -> None:
    rid = request_id_for_key(tenant, key)
    assert REQUEST_ID_RE.match(rid)
    assert validate_request_id(rid) is None
    assert rid == request_id_for_key(tenant, key)
    assert rid != request_id_for_key(tenant + "x", key)
    assert rid != request_id_for_key(tenant, key + "x")


def test_tenant_and_key_do_not_run_together() -> None:
    assert request_id_for_key("ab", "c") != request_id_for_key("a", "bc")


@settings(max_examples=200, deadline=None)
@given(t1=st.integers(0, 2**48 - 2), dt=st.integers(1, 10**9),
       r1=st.binary(min_size=10, max_size=10), r2=st.binary(min_size=10, max_size=10))
def test_new_request_id_is_time_ordered(t1: int, dt: int, r1: bytes, r2: bytes) -> None:
    t2 = min(t1 + dt, 2**48 - 1)
    a, b = new_request_id(t1, r1), new_request_id(t2, r2)
    assert REQUEST_ID_RE.match(a) and REQUEST_ID_RE.match(b)
    assert a < b


def test_new_request_id_uses_the_randomness() -> None:
    ids = {RandomIds().request_id() for _ in range(50)}
    assert len(ids) == 50
    assert new_request_id(5, b"\x01" * 10) != new_request_id(5, b"\x02" * 10)
    assert all(REQUEST_ID_RE.match(i) for i in ids)
    with pytest.raises(RuntimeError, match="new_id"):  # no id without the port
        classify_request(post(), CFG)


def test_new_request_id_keeps_every_random_bit() -> None:
    assert new_request_id(5, b"\x00" * 9 + b"\x07") != new_request_id(5, b"\x00" * 10)


def test_gateway_interrupted_says_its_count_is_unknown() -> None:
    from extproc.core.journal import orphan_outcome
    v = view(delivery={"at": "t"}, progress={"delivered_output_tokens": 5})
    assert v.orphaned
    oc = orphan_outcome(v, 1.0)
    assert oc["outcome"] == "gateway_interrupted" and oc["delivered_output_tokens"] == 5
    assert oc["delivered_output_tokens_exact"] is False
    # The checkpoint is what had been handed to Envoy then: it may not all have left
    # (decision 0025) and the stream may have gone on; neither bound holds.
    assert oc["delivered_output_tokens_bound"] == "unknown"
    # Fenced, no checkpoint yet: 0, not a made-up 1 (the released delta may never have left).
    no_checkpoint = orphan_outcome(view(delivery={"at": "t"}), 1.0)
    assert no_checkpoint["delivered_output_tokens"] == 0
    assert no_checkpoint["delivered_output_tokens_bound"] == "unknown"
    settled = view(delivery={"at": "t"}, outcome=oc)
    err = settled.client_error()
    assert err is not None and err.code is ErrorCode.GATEWAY_INTERRUPTED
    assert err.partial_output is True and err.retryable is False
    body = err.body()["error"]
    assert body["delivered_output_tokens"] == 5 and body["delivered_output_tokens_exact"] is False
    # Before the fence nothing was released: 0 is exact and the client may retry.
    none_sent = orphan_outcome(view(), 1.0)
    assert none_sent["delivered_output_tokens"] == 0
    assert none_sent["delivered_output_tokens_exact"] is True
    err0 = view(outcome=none_sent).client_error()
    assert err0 is not None and err0.retryable is True and err0.partial_output is False
    # A request with a live processor or attempt is not orphaned.
    assert not view(delivery={"at": "t"}, guard="gw-1/1").orphaned
