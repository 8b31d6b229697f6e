"""bench.etcd_transport: the gateway's JSON carries the same transaction as the gRPC one."""

from __future__ import annotations

import base64
import json

from bench.etcd_transport import http_body, value


def test_http_body_is_the_create_if_absent_txn() -> None:
    got = json.loads(http_body(b"bench/k/1", value(1)))
    k = base64.b64encode(b"bench/k/1").decode()
    assert got["compare"] == [{"key": k, "target": "VERSION", "result": "EQUAL",
                               "version": "0"}]
    assert got["failure"] == [{"request_range": {"key": k}}]
    put = got["success"][0]["request_put"]
    assert put["key"] == k and base64.b64decode(put["value"]) == value(1)
    assert json.loads(value(7))["n"] == 7 and len(value(7)) > 200
