"""Envoy's messages read as the events both roles see: one parse of the response headers."""

from __future__ import annotations

from extproc.adapters import envoy_codec as codec
from extproc.core import headers as H
from extproc.core.events import ResponseHeaders
from extproc.gen.envoy.config.core.v3 import base_pb2 as core
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.gen.envoy.type.v3 import http_status_pb2 as hs

SSE = "text/event-stream"


def response(h: dict[str, str], eos: bool = False) -> ep.ProcessingRequest:
    hm = core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode())
                                 for k, v in h.items()])
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm,
                                                                end_of_stream=eos))


def test_response_headers_read_once_for_both_roles() -> None:
    assert codec.response_headers(response({":status": "oops"})) == ResponseHeaders(0, "")
    assert codec.response_headers(response({})) == ResponseHeaders(0, "")
    assert codec.response_headers(response(
        {":status": "429", "content-type": SSE, "retry-after": "2", "x-model-revision": "w@2"},
        eos=True)) == ResponseHeaders(429, SSE, True, model_revision="w@2", retry_after="2")
    # What the guard reads besides: Envoy's own reply, our error, the gate's hand-off.
    assert codec.response_headers(response(
        {":status": "503", H.ENVOY_REPLY: "1", H.GATEWAY_ERROR: "x", H.HANDOFF: "{}"})
    ) == ResponseHeaders(503, "", envoy_reply=True, ours=True, handoff="{}")


def mutation(resp: ep.ProcessingResponse, which: str) -> tuple[dict[str, str], list[str]]:
    """What a headers answer sets and removes."""
    hm = getattr(resp, which).response.header_mutation
    return ({h.header.key: h.header.raw_value.decode() for h in hm.set_headers},
            list(hm.remove_headers))


def test_response_body_reads_a_chunk_with_the_lease_ports_answer() -> None:
    msg = ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: x\n\n", end_of_stream=True))
    ev = codec.response_body(msg, True)
    assert (ev.data, ev.end_of_stream, ev.lease_expired) == (b"data: x\n\n", True, True)
    assert codec.response_body(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"y")),
                               False).lease_expired is False


def test_an_attempt_goes_upstream_with_its_own_secret_and_keeps_its_offset() -> None:
    sets, removes = mutation(codec.attempt_upstream("att_1", "s3cret", None), "request_headers")
    assert sets == {H.ATTEMPT_ID: "att_1", H.ATTEMPT_SECRET: "s3cret"}
    assert removes == [H.PREADMITTED]  # the attempt offset is never removed (decision 0027)
    # No secret of its own: whatever an earlier attempt's request carried goes.
    sets, removes = mutation(codec.attempt_upstream("att_2", None, "proc-9"), "request_headers")
    assert sets == {H.ATTEMPT_ID: "att_2", H.PROCESSOR: "proc-9"}
    assert removes == [H.PREADMITTED, H.ATTEMPT_SECRET]


def test_the_gates_headers_ask_for_a_retry_only_when_told() -> None:
    assert mutation(codec.attempt_headers(True), "response_headers") == (
        {"x-gateway-retry": "1"}, [H.HANDOFF])
    assert mutation(codec.attempt_headers(False), "response_headers") == ({}, [H.HANDOFF])
    sets, _ = mutation(codec.failed_attempt("req_1", False, "upstream_unavailable"),
                       "response_headers")
    assert sets[":status"] == "503" and "x-gateway-retry" not in sets
    assert mutation(codec.released("att_1", "{}"), "response_headers") == (
        {H.ATTEMPT_ID: "att_1", H.HANDOFF: "{}"}, [])


def test_a_client_never_sees_the_hand_off_or_an_attempts_secret() -> None:
    for resp in (codec.client_response_headers("req_1", False),
                 codec.client_response_headers("req_1", True), codec.aside_response_headers()):
        _, removes = mutation(resp, "response_headers")
        assert {H.HANDOFF, H.ATTEMPT_SECRET} <= set(removes)
    sets, removes = mutation(codec.client_response_headers("req_1", True), "response_headers")
    assert sets == {H.REQUEST_ID: "req_1", "content-type": "application/json"}
    assert "content-length" in removes
    # A client's own copies of the headers we own go before anything reads them.
    sets, removes = mutation(codec.client_request_headers("req_1"), "request_headers")
    assert sets == {H.REQUEST_ID: "req_1"} and set(removes) == set(H.OWNED) - {H.REQUEST_ID}
    assert set(mutation(codec.passed_request_headers(), "request_headers")[1]) == set(H.OWNED)


def test_a_status_answer_is_compact_json() -> None:
    resp = codec.status_answer({"request_id": "req_1", "state": "done"}, "req_1")
    assert resp.immediate_response.status.code == 200
    assert resp.immediate_response.body == b'{"request_id":"req_1","state":"done"}'

def test_a_streamed_body_answer_is_the_whole_nested_message_empty_data_too() -> None:
    # Built in place (decision 0041): every enclosing message must still be present, also
    # for an empty, not-final chunk, where no field holds a non-default value.
    for data in (b"", b"data: x\n\n"):
        for eos in (False, True):
            r = codec.streamed_response_body(data, eos)
            assert r.WhichOneof("response") == "response_body"
            mut = r.response_body.response.body_mutation
            assert mut.WhichOneof("mutation") == "streamed_response"
            assert (mut.streamed_response.body, mut.streamed_response.end_of_stream) == \
                (data, eos)
            assert r.SerializeToString() == ep.ProcessingResponse(
                response_body=ep.BodyResponse(response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                        body=data, end_of_stream=eos))))).SerializeToString()


def test_header_mutations_built_in_place_are_the_nested_messages() -> None:
    # Each set header is added in place (decision 0041): key, raw value, overwrite, in order,
    # an empty value included.
    sets, remove = {"x-a": "1", "x-b": "", "x-c": "caf\u00e9"}, ["x-d", "x-e"]
    got = codec.continue_request_headers(sets, remove).request_headers.response.header_mutation
    want = ep.HeaderMutation(remove_headers=remove, set_headers=[
        core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode("latin-1")),
                               append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in sets.items()])
    assert got.SerializeToString() == want.SerializeToString()
    assert [(h.header.key, h.header.raw_value) for h in got.set_headers] == [
        ("x-a", b"1"), ("x-b", b""), ("x-c", b"caf\xe9")]


def test_answers_built_in_place_are_what_nested_constructors_build() -> None:
    # Built from the outermost message in (decision 0044): every level present as before,
    # an empty header mutation and an empty common response included.
    C, HR, BR = ep.CommonResponse, ep.HeadersResponse, ep.BodyResponse
    opt = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

    def hm(sets: dict[str, str], remove: tuple[str, ...] = ()) -> ep.HeaderMutation:
        return ep.HeaderMutation(remove_headers=list(remove), set_headers=[
            core.HeaderValueOption(header=core.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=opt) for k, v in sets.items()])

    lb = {"envoy.lb": {"x-gateway-hosts": ["127.0.0.1:8001", "127.0.0.1:8002"]}}
    meta = ep.ProcessingResponse().dynamic_metadata
    meta.update(lb)
    pairs = [
        (codec.continue_request_headers(),
         ep.ProcessingResponse(request_headers=HR(response=C(header_mutation=hm({}))))),
        (codec.continue_response_headers({"a": "1"}, ("b",)),
         ep.ProcessingResponse(response_headers=HR(response=C(
             header_mutation=hm({"a": "1"}, ("b",)))))),
        (codec.continue_request_body(), ep.ProcessingResponse(request_body=BR(response=C()))),
        (codec.continue_response_body(), ep.ProcessingResponse(response_body=BR(response=C()))),
        (codec.trailers_response(),
         ep.ProcessingResponse(response_trailers=ep.TrailersResponse())),
        (codec.request_trailers_response(),
         ep.ProcessingResponse(request_trailers=ep.TrailersResponse())),
        (codec.continue_request_body_with({"h": "v"}, lb, b"body"),
         ep.ProcessingResponse(request_body=BR(response=C(
             header_mutation=hm({"h": "v"}), body_mutation=ep.BodyMutation(body=b"body"))),
             dynamic_metadata=meta)),
        (codec.immediate_json(503, b"{}", {"x": "y"}),
         ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
             status=hs.HttpStatus(code=503),  # type: ignore[arg-type]
             headers=hm({"content-type": "application/json", "x": "y"}), body=b"{}",
             details="extproc"))),
        (codec.immediate_raw(429, b"", {}),
         ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
             status=hs.HttpStatus(code=429),  # type: ignore[arg-type]
             headers=hm({}), details="replayed"))),
    ]
    for got, want in pairs:
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(
            deterministic=True), (got, want)


def test_a_gate_passes_what_it_does_not_read_and_reads_its_attempts_replica() -> None:
    assert mutation(codec.passed_by_gate("response_headers"), "response_headers") == (
        {}, [H.HANDOFF])  # only a gate may say which attempt the guard owns
    for which in ("request_body", "response_body", "request_trailers", "response_trailers"):
        assert codec.passed_by_gate(which).WhichOneof("response") == which
    msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=core.HeaderMap(
        headers=[core.HeaderValue(key=H.REQUEST_ID, raw_value=b"req_1")])))
    assert codec.attempt_request(msg) == ({H.REQUEST_ID: "req_1"}, None)
    msg.attributes["envoy.filters.http.ext_proc"].update({"upstream.address": "10.0.0.1:80"})
    assert codec.attempt_request(msg) == ({H.REQUEST_ID: "req_1"}, "10.0.0.1:80")
