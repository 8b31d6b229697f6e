"""The journal-ceiling benchmark's pure parts: arrivals, percentiles, the ceiling's rule, the
fleet arithmetic, the file-system check and etcdctl's figure (bench/journal_ceiling.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from bench.journal_ceiling import (
    Step,
    arrivals,
    bucket_quantile,
    ceiling,
    counter,
    etcd_side,
    fleet_need,
    fs_type,
    histogram,
    parse_check_perf,
    passes,
    percentile,
    shards_needed,
    txns_per_request,
)


def test_arrivals_are_open_loop_and_interleave() -> None:
    a = arrivals(100, 1.0)
    assert len(a) == 100 and a[0] == 0.0 and a[1] == pytest.approx(0.01)
    b = arrivals(100, 1.0, phase=0.5)
    assert b[0] == pytest.approx(0.005) and all(x < 1.0 for x in b)
    # Two generators at half the rate each, phases 0 and 1/2, offer the whole rate evenly.
    both = sorted(arrivals(50, 1.0, 0.0) + arrivals(50, 1.0, 0.5))
    assert len(both) == 100
    assert max(y - x for x, y in itertools.pairwise(both)) == pytest.approx(0.01)
    assert arrivals(0, 1.0) == [] and arrivals(10, 0) == []


def test_percentile_nearest_rank() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0
    assert percentile(xs, 100) == 100.0 and percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def _summary(offered: float, achieved: float, p99: float | None, errors: int = 0,
             shed: int = 0, unfinished: int = 0) -> dict[str, Any]:
    return {"offered_rps": offered, "achieved_rps": achieved, "txn_p99_ms": p99,
            "errors": errors, "shed": shed, "unfinished": unfinished}


def test_a_rate_fails_on_each_rule() -> None:
    assert passes(_summary(100, 100, 10), 50) == (True, "")
    assert not passes(_summary(100, 100, 51), 50)[0]
    assert not passes(_summary(100, 94, 10), 50)[0]  # achieved < 95 % of offered
    assert passes(_summary(100, 95, 10), 50)[0]
    assert "errors" in passes(_summary(100, 100, 10, errors=1), 50)[1]
    assert "unfinished 1" in passes(_summary(100, 100, 10, unfinished=1), 50)[1]
    assert not passes(_summary(100, 100, 10, shed=3), 50)[0]
    assert not passes(_summary(100, 0, None), 50)[0]


def test_the_ceiling_is_the_last_rate_before_the_first_failure() -> None:
    steps = [_summary(400, 400, 20), _summary(100, 100, 5), _summary(800, 700, 90),
             _summary(1600, 1600, 10)]  # a pass above a failure does not count
    c = ceiling(steps, 50)
    assert c["ceiling_rps"] == 400 and c["first_failing_rps"] == 800
    assert "p99" in c["why"] and "achieved" in c["why"]
    assert ceiling([_summary(100, 100, 5)], 50)["first_failing_rps"] is None
    assert ceiling([_summary(100, 100, 500)], 50)["ceiling_rps"] is None


def test_step_sums_its_generators() -> None:
    s = Step(offered=200, step_s=2.0)
    part = {"launched": 200, "completed": 199, "completed_in_window": 199,
            "errors": {"fence: deadline": 1}, "shed": 0, "unfinished": 0,
            "txn_ms": {"intake": [1.0, 3.0], "fence": [2.0], "progress": [], "finish": [4.0]},
            "request_ms": [7.0], "lateness_ms": [0.1], "cpu_s": 0.5,
            "warnings": {"attempt lease keep-alive failed": 1}}
    s.add(part)
    s.add(part)
    s.etcd_cpu_s = 0.398
    out = s.summary()
    assert out["achieved_rps"] == 199.0 and out["launched"] == 400
    assert out["errors"] == 2 and out["error_kinds"] == {"fence: deadline": 2}
    assert out["txn_per_s"] == 4.0 and out["txn_p99_ms"] == 4.0
    assert out["generator_cores"] == 0.5 and out["etcd_cores"] == 0.2
    assert out["etcd_cpu_us_per_request"] == 1000.0
    assert out["store_warnings"] == {"attempt lease keep-alive failed": 2}


def test_fleet_arithmetic() -> None:
    f = fleet_need(1000, (1.0, 5.0), 3)
    assert (f["rps_low"], f["rps_high"], f["txn_high"]) == (1000, 5000, 15000)
    assert shards_needed(5000, 1000, headroom=0.5) == 10
    assert shards_needed(100, 1000) == 1
    with pytest.raises(ValueError):
        shards_needed(100, 0)


def test_fs_type_takes_the_longest_mount_point() -> None:
    mounts = ("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
              "tmpfs /tmpx tmpfs rw 0 0\n")
    assert fs_type(Path("/dev/shm/etcd"), mounts) == "tmpfs"
    assert fs_type(Path("/tmpxy/etcd"), mounts) == "ext4"  # a prefix of a name is not a dir
    assert fs_type(Path("/tmpx"), mounts) == "tmpfs"


def test_parse_check_perf() -> None:
    assert parse_check_perf("60 / 60 ...\nPASS: Throughput is 150 writes/s\nPASS") == 150.0
    assert parse_check_perf("FAIL: Throughput too low: 4211 writes/s\n") == 4211.0
    assert parse_check_perf("nothing") is None


def _metrics(txn: tuple[int, int, int], rng: int, fsync: tuple[int, int]) -> str:
    """A /metrics text as etcd --metrics extensive writes it (Txn and Range buckets)."""
    lab = 'grpc_service="etcdserverpb.KV",grpc_type="unary"'
    h = "grpc_server_handling_seconds_bucket"
    rows = ["# HELP grpc_server_handling_seconds x"]
    rows += [f'{h}{{grpc_method="Txn",{lab},le="{le}"}} {n}'
             for le, n in zip(("0.005", "0.01", "+Inf"), txn, strict=True)]
    rows += [f'{h}{{grpc_method="Range",{lab},le="{le}"}} {rng}' for le in ("0.005", "+Inf")]
    f = "etcd_disk_wal_fsync_duration_seconds_bucket"
    rows += [f'{f}{{le="0.001"}} {fsync[0]}', f'{f}{{le="+Inf"}} {fsync[1]}']
    return "\n".join(rows) + "\n"


METRICS_BEFORE = _metrics((90, 100, 100), 7, (10, 10))
METRICS_AFTER = _metrics((180, 199, 200), 9, (30, 50))


def test_etcd_histograms_between_two_scrapes() -> None:
    b = histogram(METRICS_BEFORE, "grpc_server_handling_seconds", grpc_method="Txn")
    a = histogram(METRICS_AFTER, "grpc_server_handling_seconds", grpc_method="Txn")
    assert b == {0.005: 90, 0.01: 100, float("inf"): 100}
    # 100 txns between: 90 within 5 ms, 9 more within 10 ms, 1 above.
    assert bucket_quantile(b, a, 90) == 0.005
    assert bucket_quantile(b, a, 99) == 0.01
    assert bucket_quantile(b, a, 100) == float("inf")
    assert bucket_quantile(a, a, 99) is None
    assert counter(METRICS_AFTER, "etcd_disk_wal_fsync_duration_seconds_bucket") == 80
    side = etcd_side([METRICS_BEFORE], [METRICS_AFTER], wall_s=2.0)
    assert side == {"etcd_txn_p99_ms_le": 10.0, "wal_fsync_p99_ms_le": float("inf"),
                    "fsyncs_per_s_per_member": 20.0}


def test_txns_per_request_counts_the_progress_checkpoints() -> None:
    assert txns_per_request(10.0, 2.0) == 8  # intake, fence, finish + 5 checkpoints
    assert txns_per_request(1.9, 2.0) == 3
    assert txns_per_request(10.0, 0.0) == 3  # checkpoints off
