"""The chaos loop's rule of concurrent faults (chaos/faults.py): at most one per etcd
cluster, so a fault on another journal shard's cluster may overlap one on shard 0's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chaos.faults import FAULT_KINDS, SHARD_FAULT_KINDS, ChaosLoop, Fault
from devkit.devstack import Stack


def _loop(tmp_path: Path, active: tuple[str, ...]) -> ChaosLoop:
    stack = Stack(workdir=tmp_path, replicas=3, etcd_shards=2)  # never started
    stack.replica_ports = [1, 2, 3]
    loop = ChaosLoop(stack, random.Random(1), kinds=FAULT_KINDS + SHARD_FAULT_KINDS,
                     max_concurrent=3)
    for k in active:
        loop._active.append((Fault(k, "x", 0.0, 1.0), lambda: None, 0.0))
    return loop


@pytest.mark.parametrize(("active", "kind", "allowed"), [
    ((), "etcd_shard_kill", True),
    (("etcd_leader_kill",), "etcd_shard_freeze", True),   # two clusters, one fault each
    (("etcd_quorum_loss",), "etcd_shard_kill", True),
    (("etcd_shard_freeze",), "etcd_member_freeze", True),
    (("etcd_shard_freeze",), "etcd_shard_kill", False),   # the same (single-member) cluster
    (("etcd_leader_kill",), "etcd_member_freeze", False),  # shard 0's cluster twice
    (("etcd_shard_kill", "etcd_leader_kill"), "etcd_quorum_loss", False),
    (("etcd_shard_kill", "etcd_leader_kill"), "processor_kill", True),
    (("etcd_shard_kill", "etcd_leader_kill", "replica_kill"), "replica_freeze", False),  # 3 max
])
def test_at_most_one_fault_per_etcd_cluster(tmp_path: Path, active: tuple[str, ...],
                                            kind: str, allowed: bool) -> None:
    assert _loop(tmp_path, active)._allowed(kind) is allowed


def test_a_quorum_fault_covers_the_requests_of_the_cluster_it_hit() -> None:
    """`Transcript.journal_down`'s matching (chaos.runner): shard 0's quorum loss names
    shard 0's members, a shard fault its member `etcd-shard<k>`; a request's cluster is
    its id's shard."""
    from chaos.runner import _cluster_of, _journal_cluster
    from extproc.adapters.shards import shard_of

    rids = [f"req_{i:026d}" for i in range(40)]
    on1 = next(r for r in rids if shard_of(r, 2) == 1)
    on0 = next(r for r in rids if shard_of(r, 2) == 0)
    assert _journal_cluster(on1, 2) == _cluster_of("etcd-shard1") == "etcd-shard1"
    assert _journal_cluster(on0, 2) == _cluster_of("etcd,etcd-2") == ""
    assert _journal_cluster(on1, 1) == _journal_cluster("", 2) == ""  # one cluster; no id
