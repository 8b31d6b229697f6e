"""Exec probe: grpc.health.v1 Check on the processor's Unix socket.

The kubelet's own `grpc:` probe dials the pod IP, and the processor listens only on a Unix
socket in a shared emptyDir (so nothing but this pod's Envoy can reach ext_proc); this script
runs inside the processor container instead. Exit 0 iff the status is SERVING.

usage: health_probe.py TARGET [SERVICE] [TIMEOUT_S]    e.g. unix:/var/run/extproc/extproc.sock
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    target = argv[1]
    service = argv[2] if len(argv) > 2 else ""
    timeout = float(argv[3]) if len(argv) > 3 else 3.0
    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        print(f"health check of {target!r} failed: {e.code().name}: {e.details()}",
              file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{target!r} service {service!r}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
