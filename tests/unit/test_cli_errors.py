"""`extproc` on bad input: one `config error:` line, exit status 2, never a traceback; no
demo replicas unless asked for; `--version` and `--require-version` (decision 0038)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import extproc

ROOT = Path(__file__).resolve().parents[2]
CFG = "config/processor.yaml"
REPS = ("--replica", "127.0.0.1:8001")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, check=False)


def _one_config_error(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("config error: ") and says in r.stderr, r.stderr


@pytest.mark.parametrize("flags, says", [
    (["--replica", "foo"], "--replica: must be host:port"),
    (["--replica", "vllm:99999"], "--replica: must be host:port"),
    (["--replica", ":8000"], "--replica: must be host:port"),
    ([*REPS, "--listen", "x"], "--listen: must be host:port"),
    ([*REPS, "--listen", "0.0.0.0:port"], "--listen: must be host:port"),
    ([*REPS, "--admin", "127.0.0.1"], "--admin: must be host:port"),
    ([*REPS, "--ops", "nope"], "--ops: must be host:port"),
    ([*REPS, "--processor", "bogus"], "--processor: must be host:port"),
    ([*REPS, "--processor", "unix:"], "--processor: a Unix socket"),
    ([*REPS, "--tools", "zz", "--tool-listen", "127.0.0.1:10001"], "--tools: must be host:port"),
    ([*REPS, "--tools", "127.0.0.1:9100", "--tool-listen", "q"], "--tool-listen: must be"),
    ([*REPS, "--tools", "127.0.0.1:9100"], "need their own listener"),
    ([*REPS, "--out", "/nonexistent-dir/envoy.yaml"], "--out: cannot write"),
    ([*REPS, "--require-version", "banana"], "--require-version: expected a version"),
])
def test_render_envoy_bad_flag_is_one_config_error_line(flags: list[str], says: str) -> None:
    _one_config_error(_cli("render-envoy", "--config", CFG, *flags), says)


def test_check_config_errors_exit_2_too(tmp_path: Path) -> None:
    _one_config_error(_cli("check-config", "--config", str(tmp_path / "missing.yaml")),
                      "cannot read")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"timeouts": {"first_delta_s": 3}}))
    _one_config_error(_cli("check-config", "--config", str(bad)),
                      "timeouts.soft_first_delta_s: must be <= timeouts.first_delta_s (3.0)")


def test_no_replicas_is_refused_not_a_quiet_demo_pool(tmp_path: Path) -> None:
    _one_config_error(_cli("render-envoy", "--config", CFG), "render-envoy needs the replicas")
    _one_config_error(_cli("render-envoy", "--config", CFG, "--plain"), "needs the replicas")


def _lb_hosts(boot: dict[str, object]) -> list[tuple[str, int]]:
    (c,) = [c for c in boot["static_resources"]["clusters"]  # type: ignore[index]
            if c["name"] == "replicas"]
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]


def test_replicas_come_from_pool_replicas_or_the_registry(tmp_path: Path) -> None:
    fp = {"weights_revision": "w"}
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump({"pool": {"replicas": [
        {"address": "10.0.0.5:8000", "fingerprint": fp},
        {"address": "10.0.0.6:8000", "fingerprint": fp}]}}))
    r = _cli("render-envoy", "--config", str(static))
    assert r.returncode == 0, r.stderr
    assert _lb_hosts(yaml.safe_load(r.stdout)) == [("10.0.0.5", 8000), ("10.0.0.6", 8000)]
    live = tmp_path / "live.yaml"
    live.write_text(yaml.safe_dump({"pool": {"discovery": "registry"}}))
    r = _cli("render-envoy", "--config", str(live))
    assert r.returncode == 0, r.stderr
    (c,) = [c for c in yaml.safe_load(r.stdout)["static_resources"]["clusters"]
            if c["name"] == "replicas"]
    assert c["type"] == "EDS" and "load_assignment" not in c


def test_version_is_pyprojects() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"extproc {version}"
    assert extproc.__version__ == version


def test_require_version_refuses_an_older_extproc() -> None:
    mine = extproc.__version__
    major, minor, patch = (int(x) for x in mine.split("."))
    for ok in (mine, f"{major}.{minor}", f"v{mine}", f"{major}.{minor}.{max(patch - 1, 0)}"):
        r = _cli("render-envoy", "--config", CFG, *REPS, "--require-version", ok)
        assert r.returncode == 0, (ok, r.stderr)
    newer = f"{major}.{minor + 1}.0"
    _one_config_error(
        _cli("render-envoy", "--config", CFG, *REPS, "--require-version", newer),
        f"image llm-failover-extproc {mine} is older than the chart's appVersion {newer}; "
        "set image.processor.tag")


def test_render_mesh_config_errors_exit_2_too(tmp_path: Path) -> None:
    live = tmp_path / "live.yaml"
    live.write_text(yaml.safe_dump({"pool": {"discovery": "registry"}}))
    _one_config_error(_cli("render-mesh", "--config", str(live), "--flavor", "istio"),
                      "pool.discovery must be static for render-mesh")
