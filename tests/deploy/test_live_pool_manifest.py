"""The live-pool example manifest runs the agent as `extproc register` accepts it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.membership import registration_record

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy/live-pool/vllm-with-register.yaml"


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _register_parser() -> argparse.ArgumentParser:
    """The `register` subcommand exactly as the CLI declares it (its own parser)."""
    import extproc.cli as cli
    captured: dict[str, argparse.ArgumentParser] = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self: argparse.ArgumentParser, args: Any = None, ns: Any = None) -> Any:
        sub = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        captured["register"] = sub.choices["register"]
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            cli.main(["register"])
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return captured["register"]


def test_the_agent_sidecar_is_a_valid_register_command() -> None:
    docs = _docs()
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "register")
    cmd = agent["command"]
    assert cmd[:2] == ["extproc", "register"]
    args = _register_parser().parse_args(cmd[2:])
    # The downward API gives the pod IP; the registration must then be valid as written.
    assert args.address == "$(POD_IP):8000"
    assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]
            if e["name"] == "POD_IP"] == ["status.podIP"]
    fp = yaml.safe_load(cm["data"]["fingerprint.yaml"])
    rec = registration_record(args.address.replace("$(POD_IP)", "10.1.2.3"), fp, args.model)
    assert rec["fingerprint"]["weights_revision"].startswith("meta-llama/")
    # The files the command names are mounted where it looks for them.
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert str(Path(args.config).parent) in mounts
    assert str(Path(args.fingerprint_file).parent) in mounts
    # It probes the model server it sits beside, on the port the model server serves.
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert args.probe == "127.0.0.1:8000"
    assert vllm["ports"][0]["containerPort"] == 8000
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True

