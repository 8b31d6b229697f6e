"""Envoy's messages read as the events both roles see: one parse of the response headers."""

from __future__ import annotations

from extproc.adapters import envoy_codec as codec
from extproc.core import headers as H
from extproc.core.events import ResponseHeaders
from extproc.gen.envoy.config.core.v3 import base_pb2 as core
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

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
