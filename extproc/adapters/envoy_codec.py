"""Translation between Envoy's ext_proc messages and plain Python values.

Only this module builds the generated protobuf messages; the sessions read incoming ones
(their `WhichOneof` and fields) and write what this module returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration

from ..core import headers as H
from ..core.admission import RETRY_HEADER
from ..core.errors import GatewayError
from ..core.events import ResponseBody, ResponseHeaders
from ..gen.envoy.config.core.v3 import base_pb2 as core
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

ProcessingRequest = ep.ProcessingRequest
ProcessingResponse = ep.ProcessingResponse

_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_dict(hm: core.HeaderMap) -> dict[str, str]:
    """Envoy sends values in raw_value (bytes); older versions in value."""
    out: dict[str, str] = {}
    for h in hm.headers:  # each field read copies it out of the message: once
        out[h.key] = rv.decode("latin-1") if (rv := h.raw_value) else h.value
    return out


def _int(v: str | None) -> int:
    try:
        return int(v or 0)
    except ValueError:
        return 0


def response_headers(msg: ep.ProcessingRequest) -> ResponseHeaders:
    """Envoy's response headers as the event both roles read (`:status` parsed here only;
    0 when absent or unreadable)."""
    rh = msg.response_headers
    hd = headers_dict(rh.headers)
    return ResponseHeaders(_int(hd.get(":status")), hd.get("content-type", ""),
                           rh.end_of_stream, envoy_reply=H.ENVOY_REPLY in hd,
                           ours=H.GATEWAY_ERROR in hd, handoff=hd.get(H.HANDOFF),
                           model_revision=hd.get("x-model-revision"),
                           retry_after=hd.get("retry-after"))


def attributes(req: ep.ProcessingRequest) -> dict[str, Any]:
    """The request_attributes Envoy attached, flattened (e.g. 'upstream.address')."""
    out: dict[str, Any] = {}
    for _, st in req.attributes.items():
        for k, v in st.fields.items():
            kind = v.WhichOneof("kind")
            out[k] = getattr(v, kind) if kind else None
    return out


def _fill(hm: ep.HeaderMutation, set_headers: Mapping[str, str] | None,
          remove: Iterable[str] = ()) -> None:
    """`hm` made present and filled in place: each header built in the list (`add`), not
    built and then copied in."""
    hm.SetInParent()
    if remove:
        hm.remove_headers.extend(remove)
    if set_headers:
        add = hm.set_headers.add
        for k, v in set_headers.items():
            hv = add(append_action=_OVERWRITE).header  # each read of a field is a lookup
            hv.key = k
            hv.raw_value = v.encode("latin-1")


# The answers are built in place, from the outermost message in: nested keyword
# constructors copy each level into the next (decision 0041), which cost a request start
# about a tenth of its instructions (decision 0044).


def continue_request_headers(set_headers: Mapping[str, str] | None = None,
                             remove: Iterable[str] = ()) -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    _fill(r.request_headers.response.header_mutation, set_headers, remove)
    return r


def continue_response_headers(set_headers: Mapping[str, str] | None = None,
                              remove: Iterable[str] = ()) -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    _fill(r.response_headers.response.header_mutation, set_headers, remove)
    return r


def continue_request_body() -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    r.request_body.response.SetInParent()
    return r


def continue_request_body_with(set_headers: Mapping[str, str],
                                dynamic_metadata: Mapping[str, Any] | None = None,
                                body: bytes | None = None) -> ep.ProcessingResponse:
    """Body response that also mutates request headers and sets dynamic metadata.

    With a buffered request body Envoy has not picked an upstream host yet, so metadata
    set here (e.g. envoy.lb's host list for override_host) steers the first attempt.
    `body`: the buffered body replaced (every attempt sends it); Envoy sets its length.
    """
    resp = ep.ProcessingResponse()
    common = resp.request_body.response
    _fill(common.header_mutation, set_headers)
    if body is not None:
        common.body_mutation.body = body
    if dynamic_metadata:
        resp.dynamic_metadata.update(dict(dynamic_metadata))
    return resp


def continue_response_body() -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    r.response_body.response.SetInParent()
    return r


def replace_response_body(data: bytes) -> ep.ProcessingResponse:
    """STREAMED mode: this chunk's bytes become `data` (empty clears it)."""
    mut = ep.BodyMutation(body=data) if data else ep.BodyMutation(clear_body=True)
    return ep.ProcessingResponse(response_body=ep.BodyResponse(
        response=ep.CommonResponse(body_mutation=mut)))


def streamed_response_body(data: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED mode: the processor owns the body and sends what it wants.

    Once per chunk, so built in place: nested keyword constructors copy each level into
    the next (about 33k instructions under callgrind against 11k; decision 0041)."""
    r = ep.ProcessingResponse()
    sr = r.response_body.response.body_mutation.streamed_response
    sr.body = data  # setting a field marks every enclosing message present, empty data too
    sr.end_of_stream = end_of_stream
    return r


def trailers_response() -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    r.response_trailers.SetInParent()
    return r


def request_trailers_response() -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    r.request_trailers.SetInParent()
    return r


def fail_attempt_headers(request_id: str, retry: dict[str, str] | None = None,
                         code: str = "upstream_unavailable") -> ep.ProcessingResponse:
    """Answer held response headers as a 503 so the router retries on another host
    (`retry`: the header that asks it to, unless this was the last attempt)."""
    return continue_response_headers(
        {":status": "503", "content-type": "application/json",
         "x-gateway-request-id": request_id, H.GATEWAY_ERROR: code, **(retry or {})},
        remove=("content-length",))


def immediate(err: GatewayError, extra_headers: Mapping[str, str] | None = None
              ) -> ep.ProcessingResponse:
    return immediate_json(err.http_status, err.json_bytes(),
                          {H.GATEWAY_ERROR: str(err.code), **(extra_headers or {})},
                          str(err.code))


def immediate_json(status: int, body: bytes, extra_headers: Mapping[str, str] | None = None,
                   details: str = "extproc") -> ep.ProcessingResponse:
    hdrs = {"content-type": "application/json"}
    hdrs.update(extra_headers or {})
    return _immediate(status, body, hdrs, details)


def immediate_raw(status: int, body: bytes, headers: Mapping[str, str]) -> ep.ProcessingResponse:
    """A recorded answer replayed as it was (status, kept headers, body)."""
    return _immediate(status, body, headers, "replayed")


def _immediate(status: int, body: bytes, headers: Mapping[str, str],
               details: str) -> ep.ProcessingResponse:
    r = ep.ProcessingResponse()
    im = r.immediate_response
    im.status.code = status  # type: ignore[assignment]
    _fill(im.headers, headers)
    im.body, im.details = body, details
    return r


def message_timeout(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def struct(d: Mapping[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(dict(d))
    return s


# --- the sessions' messages: what an event reads, what an action writes ----------------

# Response headers that never reach a client: the gate's hand-off, and an attempt's secret
# (a replica could echo it back; decision 0028).
NEVER_TO_CLIENT = (H.HANDOFF, H.ATTEMPT_SECRET)


def response_body(msg: ep.ProcessingRequest, expired: bool) -> ResponseBody:
    """A response chunk as the event both roles read, with the lease port's answer then
    (its deadline moves with keep-alives)."""
    body = msg.response_body
    return ResponseBody(body.body, body.end_of_stream, expired)


def attempt_request(msg: ep.ProcessingRequest) -> tuple[dict[str, str], str | None]:
    """An attempt's request headers at its gate, and the replica Envoy picked for it (the
    `upstream.address` attribute; None if Envoy sent none)."""
    replica = str(attributes(msg).get("upstream.address") or "") or None
    return headers_dict(msg.request_headers.headers), replica


def passed_by_gate(which: str) -> ep.ProcessingResponse:
    """A message a gate does not read (not gated, or not one of its events) passed on: a
    response's headers still lose the hand-off, which only a gate may set."""
    return _PASSED[which]()


def attempt_upstream(attempt_id: str, secret: str | None,
                     processor: str | None) -> ep.ProcessingResponse:
    """An admitted attempt's request headers as they go upstream: its id, its own secret
    (replacing whatever an earlier attempt's request carried) and, for a replica's agent,
    the processor its word goes to (decision 0034). The attempt offset stays: a removal
    here holds for Envoy's later attempts of the request too, whose gates need it
    (decision 0027)."""
    via = {H.PROCESSOR: processor} if processor else {}
    if secret:
        return continue_request_headers({H.ATTEMPT_ID: attempt_id, H.ATTEMPT_SECRET: secret,
                                         **via}, remove=(H.PREADMITTED,))
    return continue_request_headers({H.ATTEMPT_ID: attempt_id, **via},
                                    remove=(H.PREADMITTED, H.ATTEMPT_SECRET))


def attempt_headers(retry: bool) -> ep.ProcessingResponse:
    """A gated attempt's response headers passed on (asking the router to retry, if
    `retry`); only the gate may say which attempt the guard owns, never the replica."""
    return continue_response_headers({RETRY_HEADER: "1"} if retry else {}, remove=(H.HANDOFF,))


def failed_attempt(request_id: str, retry: bool, code: str) -> ep.ProcessingResponse:
    """A failed attempt's held headers answered as a 503 (`fail_attempt_headers`)."""
    return fail_attempt_headers(request_id, {RETRY_HEADER: "1"} if retry else {}, code)


def released(attempt_id: str, handoff: str) -> ep.ProcessingResponse:
    """A released attempt's headers, carrying the hand-off record to the guard."""
    return continue_response_headers({H.ATTEMPT_ID: attempt_id, H.HANDOFF: handoff})


_OWNED_BUT_THE_ID = tuple(h for h in H.OWNED if h != H.REQUEST_ID)


def client_request_headers(request_id: str) -> ep.ProcessingResponse:
    """A journaled request's headers: its id set, every other header we own removed."""
    return continue_request_headers({H.REQUEST_ID: request_id}, remove=_OWNED_BUT_THE_ID)


def passed_request_headers() -> ep.ProcessingResponse:
    """A request we do not journal: every header we own removed."""
    return continue_request_headers(remove=H.OWNED)


def client_response_headers(request_id: str, as_json: bool) -> ep.ProcessingResponse:
    """The response headers a client sees (our error's shape, as JSON, if `as_json`)."""
    if as_json:
        return continue_response_headers(
            {H.REQUEST_ID: request_id, "content-type": "application/json"},
            remove=("content-length", *NEVER_TO_CLIENT))
    return continue_response_headers({H.REQUEST_ID: request_id}, remove=NEVER_TO_CLIENT)


def aside_response_headers() -> ep.ProcessingResponse:
    """Response headers passed on untouched but for what never reaches a client."""
    return continue_response_headers(remove=NEVER_TO_CLIENT)


def status_answer(view: Mapping[str, Any], request_id: str) -> ep.ProcessingResponse:
    """A status lookup's answer: the record's view as compact JSON."""
    return immediate_json(200, json.dumps(view, separators=(",", ":")).encode(),
                          {H.REQUEST_ID: request_id})


_PASSED: dict[str, Callable[[], ep.ProcessingResponse]] = {
    "request_body": continue_request_body,
    "response_headers": lambda: attempt_headers(False),
    "response_body": continue_response_body,
    "response_trailers": trailers_response,
    "request_trailers": request_trailers_response,
}
