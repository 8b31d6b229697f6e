"""bench.etcd_transport: every transport carries the same transaction, with the same metadata."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from aetcd import rpc

from bench.etcd_transport import (
    METADATA,
    RUNNERS,
    TXN_PATH,
    callgrind_total,
    group_request,
    group_size,
    http_body,
    order,
    per_txn,
    runner,
    txn_request,
    value,
)
from extproc.adapters import etcd_client


def test_http_body_is_the_create_if_absent_txn() -> None:
    got = json.loads(http_body(b"bench/k/1", value(1)))
    k = base64.b64encode(b"bench/k/1").decode()
    assert got["compare"] == [{"key": k, "target": "VERSION", "result": "EQUAL",
                               "version": "0"}]
    assert got["failure"] == [{"request_range": {"key": k}}]
    put = got["success"][0]["request_put"]
    assert put["key"] == k and base64.b64decode(put["value"]) == value(1)
    assert json.loads(value(7))["n"] == 7 and len(value(7)) > 200


def test_grpc_request_is_the_same_txn_as_the_gateways() -> None:
    r = txn_request(b"bench/k/3", 3)
    # The gateway's JSON is protobuf's JSON mapping of the same message.
    assert json.loads(http_body(b"bench/k/3", value(3))) == {
        "compare": [{"key": base64.b64encode(c.key).decode(), "target": "VERSION",
                     "result": "EQUAL", "version": str(c.version)} for c in r.compare],
        "success": [{"request_put": {"key": base64.b64encode(o.request_put.key).decode(),
                                     "value": base64.b64encode(o.request_put.value).decode()}}
                    for o in r.success],
        "failure": [{"request_range": {"key": base64.b64encode(o.request_range.key).decode()}}
                    for o in r.failure]}
    assert r.compare[0].target == rpc.Compare.VERSION
    assert r.compare[0].result == rpc.Compare.EQUAL
    assert rpc.TxnRequest.FromString(r.SerializeToString()) == r


def test_grpclib_calls_the_path_and_sends_the_metadata_of_the_stub_and_etcd_client() -> None:
    paths: dict[str, Any] = {}

    class Recorder:
        def unary_unary(self, path: str, **_: Any) -> None:
            paths[path.rsplit("/", 1)[1]] = path

        unary_stream = stream_unary = stream_stream = unary_unary

    rpc.KVStub(Recorder())
    assert paths["Txn"] == TXN_PATH
    assert METADATA == etcd_client._REQUIRE_LEADER


def test_rounds_rotate_so_each_transport_goes_first_in_turn() -> None:
    names = list(RUNNERS)
    assert names == ["grpc", "grpclib", "http"]
    firsts = [order(names, r)[0] for r in range(3)]
    assert firsts == names
    assert all(sorted(order(names, r)) == sorted(names) for r in range(5))
    assert order(["grpc"], 4) == ["grpc"]


def test_callgrind_total_reads_the_summary_or_totals_line() -> None:
    assert callgrind_total("# callgrind format\nevents: Ir\nsummary: 1234567\n"
                           "fn=foo\n1 5\ntotals: 1234567\n") == 1234567
    assert callgrind_total("events: Ir\ntotals: 42\n") == 42
    with pytest.raises(ValueError):
        callgrind_total("events: Ir\nfn=foo\n1 5\n")


def test_per_txn_is_the_difference_over_the_extra_transactions() -> None:
    assert per_txn(1_600_000_000, 1_739_000_000, 200, 700) == 278_000
    with pytest.raises(ValueError):
        per_txn(1, 2, 700, 200)


def test_a_group_nests_the_same_txns_in_one_outer_txn_with_no_compare() -> None:
    items = [(i, b"bench/g/%d" % i) for i in (4, 5, 6)]
    g = group_request(items)
    assert list(g.compare) == [] and list(g.failure) == []
    assert [op.request_txn for op in g.success] == [txn_request(k, i) for i, k in items]
    assert rpc.TxnRequest.FromString(g.SerializeToString()) == g
    assert [group_size(n) for n in ("grpc", "http", "group1", "group16")] == [1, 1, 1, 16]
    assert runner("grpc") is RUNNERS["grpc"]
    for bad in ("group0", "group", "groupx", "udp"):
        with pytest.raises(ValueError):
            group_size(bad)
