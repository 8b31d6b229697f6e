"""The store over TLS, client certificates and password auth, against a real etcd cluster.

Three etcd members on loopback serve TLS only and demand a client certificate
(`--client-cert-auth`); auth is on, with a user whose role grants readwrite on one prefix
only, and `simple` tokens that lapse after 2 s idle (`--auth-token-ttl 2`). The certificates
are made here: one CA, a server certificate per member with the names it is dialed by
(member 3's names neither its IP nor localhost, only a made-up host name), a client one.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aetcd import rpc

from devkit.devstack import Proc, Stack, _bin, _http_ok, free_port, wait_until
from devkit.etcd_tls import Pki, enable_auth, tls_flags, write_secret
from extproc.adapters.etcd_store import EtcdStore
from extproc.adapters.leases import StoreUnavailable
from extproc.core.config import ConfigError, EtcdConfig, load_config

pytestmark = pytest.mark.e2e

PREFIX = "/tls-test"  # the user's role grants readwrite on this prefix only
USER, PASSWORD = "gw", "gw-secret"
TOKEN_TTL_S = 2
TIMEOUT_S = 1.5  # etcd.timeout_s of every store here
OTHER_NAME = "etcd-3.test.internal"  # member 3's only name


@dataclass
class Cluster:
    pki: Pki
    ports: list[int]  # client port of member 1, 2, 3
    procs: list[Proc]
    metrics_ports: list[int]  # plain HTTP /health and /metrics
    workdir: Path

    def ep(self, i: int, host: str = "127.0.0.1") -> str:
        return f"{host}:{self.ports[i]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    wd = tmp_path_factory.mktemp("etcd-tls")
    pki = Pki(wd / "pki")
    names = [("127.0.0.1", "localhost", "::1"), ("127.0.0.1", "localhost"), (OTHER_NAME,)]
    cports = [free_port() for _ in range(3)]
    pports = [free_port() for _ in range(3)]
    mports = [free_port() for _ in range(3)]
    initial = ",".join(f"m{i + 1}=http://127.0.0.1:{pports[i]}" for i in range(3))
    procs: list[Proc] = []
    try:
        for i in range(3):
            cert, key = pki.issue(f"m{i + 1}", *names[i])
            urls = f"https://127.0.0.1:{cports[i]}" + (f",https://[::1]:{cports[i]}"
                                                       if i == 0 else "")
            p = Proc(f"etcd-m{i + 1}", [
                _bin("etcd"), "--name", f"m{i + 1}", "--data-dir", str(wd / f"data-{i + 1}"),
                "--listen-client-urls", urls,
                "--advertise-client-urls", f"https://127.0.0.1:{cports[i]}",
                "--listen-metrics-urls", f"http://127.0.0.1:{mports[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{pports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{pports[i]}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                *tls_flags(pki, cert, key, token_ttl_s=TOKEN_TTL_S),
                "--log-level", "warn", "--unsafe-no-fsync"], wd / f"etcd-m{i + 1}.log")
            p.start()
            procs.append(p)
        for i, p in enumerate(procs):
            def up(p: Proc = p, i: int = i) -> bool:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited; see {p.log_path}")
                return _http_ok(f"http://127.0.0.1:{mports[i]}/health")
            wait_until(up, 40, f"etcd member {i + 1} healthy")
        enable_auth(_bin("etcdctl"), f"127.0.0.1:{cports[0]}", pki, USER, PASSWORD, PREFIX,
                    "root-secret")
        yield Cluster(pki, cports, procs, mports, wd)
    finally:
        for p in procs:
            p.stop()


def _raw(c: Cluster, endpoints: list[str], tls: dict[str, Any] | None = None,
         auth: dict[str, Any] | None = None) -> dict[str, Any]:
    sec = c.workdir / "secrets"
    sec.mkdir(exist_ok=True)
    return {"etcd": {
        "endpoints": endpoints, "timeout_s": TIMEOUT_S, "attempt_lease_ttl_s": 2,
        "prefix": f"{PREFIX}/{uuid.uuid4().hex}",
        "tls": {"enabled": True, "ca_file": str(c.pki.ca_file),
                "cert_file": str(c.pki.client_cert), "key_file": str(c.pki.client_key)}
        if tls is None else tls,
        "auth": {"username_file": str(write_secret(sec / "username", USER)),
                 "password_file": str(write_secret(sec / "password", PASSWORD))}
        if auth is None else auth}}


def _cfg(c: Cluster, endpoints: list[str], **kw: Any) -> EtcdConfig:
    return load_config(_raw(c, endpoints, **kw)).etcd


async def _store(cfg: EtcdConfig, background: bool = False) -> EtcdStore:
    s = EtcdStore(cfg, owner="tls-test")
    await s.connect()
    if background:
        s.start_background()
    return s


async def _until(pred: Any, what: str, s: float = 5.0) -> None:
    deadline = time.monotonic() + s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _one_request(s: EtcdStore, rid: str) -> None:
    """Open with attempt 1, fence its first delta, end it, finish; then read it back."""
    assert await s.open_request(rid, {"request_id": rid},
                                ("att_1", {"attempt": 1, "attempt_id": "att_1"})) is None
    assert await s.fence_first_delta(rid, "att_1", {"at": 1.0, "attempt_id": "att_1"})
    await s.end_attempt(rid, 1, "att_1", {"attempt": 1, "attempt_id": "att_1",
                                          "released": True}, expire=False)
    assert await s.finish(rid, {"status": "completed"})
    view = await s.get(rid)
    assert view is not None and view.outcome == {"status": "completed"}
    assert view.delivery == {"at": 1.0, "attempt_id": "att_1"} and view.live_attempt_id is None


# --- the contract over TLS + client certificate + password -------------------------------


async def test_the_store_contract_over_tls_client_certificate_and_password(
        cluster: Cluster) -> None:
    s = await _store(_cfg(cluster, [cluster.ep(0)]), background=True)
    try:
        await asyncio.wait_for(s.watch_connected.wait(), 10)
        rid = "req_tls_1"
        assert await s.open_request(rid, {"request_id": rid},
                                    ("att_1", {"attempt": 1, "attempt_id": "att_1"})) is None
        seen: list[str | None] = []
        off = s.on_live_change(rid, seen.append)
        # attempt 2 waits for attempt 1's revocation, learnt through the watch
        task = asyncio.create_task(s.admit_attempt(rid, 2, "att_2", {"attempt": 2,
                                                                    "attempt_id": "att_2"}, 5.0))
        await asyncio.sleep(0.3)
        assert not task.done()
        await s.end_attempt(rid, 1, "att_1", {"attempt": 1, "attempt_id": "att_1",
                                              "released": False}, expire=False)
        res = await asyncio.wait_for(task, 5)
        assert res.admitted and res.reason == "admitted"
        await _until(lambda: None in seen, "the revocation event over the TLS watch")
        off()
        assert not await s.fence_first_delta(rid, "att_1", {"at": 2.0})  # fenced
        assert await s.fence_first_delta(rid, "att_2", {"at": 2.0, "attempt_id": "att_2"})
        await s.progress(rid, {"delivered": 3})
        assert await s.finish(rid, {"status": "completed"},
                              (2, {"attempt": 2, "attempt_id": "att_2", "released": True}))
        view = await s.get(rid)
        assert view is not None and view.outcome == {"status": "completed"}
        assert [a["attempt_id"] for a in view.attempts] == ["att_1", "att_2"]
        assert view.progress == {"delivered": 3} and view.live_attempt_id is None
        assert s._channel is not None and s._channel.authentications >= 1
    finally:
        await s.close()
    # Another client (etcdctl, as the user) sees the same record: it is in etcd, not in us.
    out = await asyncio.to_thread(
        subprocess.run,
        [_bin("etcdctl"), f"--endpoints=https://{cluster.ep(1)}",
         f"--cacert={cluster.pki.ca_file}", f"--cert={cluster.pki.client_cert}",
         f"--key={cluster.pki.client_key}", f"--user={USER}:{PASSWORD}", "get",
         f"{s.cfg.prefix}/req/{rid}/outcome", "--print-value-only"],
        capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == {"status": "completed"}


# --- failures are named, and bounded by etcd.timeout_s ------------------------------------


def _failure_cases(c: Cluster) -> dict[str, tuple[dict[str, Any], str]]:
    other = Pki(c.workdir / "other-pki")  # a CA etcd does not trust, and one we do not
    ok_tls = {"enabled": True, "ca_file": str(c.pki.ca_file),
              "cert_file": str(c.pki.client_cert), "key_file": str(c.pki.client_key)}
    sec = c.workdir / "secrets"
    sec.mkdir(exist_ok=True)
    return {
        "wrong CA": (_raw(c, [c.ep(0)], tls={**ok_tls, "ca_file": str(other.ca_file)}),
                     f"is not signed by a CA in etcd.tls.ca_file ({other.ca_file})"),
        "no client certificate": (
            _raw(c, [c.ep(0)], tls={"enabled": True, "ca_file": str(c.pki.ca_file)}),
            "requires a client certificate (etcd.tls.cert_file and etcd.tls.key_file"),
        "client certificate of another CA": (
            _raw(c, [c.ep(0)], tls={**ok_tls, "cert_file": str(other.client_cert),
                                    "key_file": str(other.client_key)}),
            f"refused our client certificate etcd.tls.cert_file ({other.client_cert})"),
        "wrong password": (
            _raw(c, [c.ep(0)], auth={
                "username_file": str(write_secret(sec / "u2", USER)),
                "password_file": str(write_secret(sec / "p2", "not-the-password"))}),
            "refused the user or its password (etcd.auth.username_file"),
        "no auth": (_raw(c, [c.ep(0)], auth={}),
                    "denied access (has etcd auth enabled? set etcd.auth.username_file"),
        "plaintext to a TLS etcd": (_raw(c, [c.ep(0)], tls={}),
                                    "(if it serves TLS, set etcd.tls.enabled: true)"),
        "a name not in the certificate": (
            _raw(c, [c.ep(2)]), "is not valid for the name '127.0.0.1' "
                                "(etcd.tls.server_name overrides"),
    }


@pytest.mark.parametrize("case", ["wrong CA", "no client certificate",
                                  "client certificate of another CA", "wrong password",
                                  "no auth", "plaintext to a TLS etcd",
                                  "a name not in the certificate"])
async def test_a_bad_credential_fails_the_first_call_naming_the_cause(
        cluster: Cluster, case: str) -> None:
    raw, expected = _failure_cases(cluster)[case]
    s = await _store(load_config(raw).etcd)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            await s.get("req_x")
        took = time.monotonic() - started
    finally:
        await s.close()
    assert expected in str(err.value)
    assert took < TIMEOUT_S + 0.5  # no hang: at most the call's deadline


def _authentications_seen_by_etcd(c: Cluster, member: int) -> int:
    """etcd's own count of finished Auth.Authenticate calls on one member."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_ports[member]}/metrics",
                                timeout=5) as r:
        text = r.read().decode()
    return sum(int(float(line.rpartition(" ")[2])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{")
               and 'grpc_method="Authenticate"' in line)


async def test_a_wrong_password_is_not_tried_once_per_call(cluster: Cluster) -> None:
    """20 concurrent calls with a wrong password: each fails naming the cause, and etcd
    (where each try is a bcrypt) sees one authentication, then one more after the hold-off."""
    raw, expected = _failure_cases(cluster)["wrong password"]
    s = await _store(load_config(raw).etcd)
    try:
        before = await asyncio.to_thread(_authentications_seen_by_etcd, cluster, 0)
        results = await asyncio.gather(*(s.get(f"req_{i}") for i in range(20)),
                                       return_exceptions=True)
        assert all(isinstance(r, StoreUnavailable) and expected in str(r) for r in results)
        assert await asyncio.to_thread(_authentications_seen_by_etcd, cluster, 0) == before + 1
        await asyncio.sleep(1.1)  # AUTH_HOLD_OFF_S
        with pytest.raises(StoreUnavailable, match="refused the user or its password"):
            await s.get("req_again")
        assert await asyncio.to_thread(_authentications_seen_by_etcd, cluster, 0) == before + 2
    finally:
        await s.close()


async def test_a_refused_watch_is_not_taken_for_a_connected_one(cluster: Cluster) -> None:
    """Without credentials etcd does not fail the watch stream: it answers "created" and
    "canceled" at once. The store must not count that as a watch (no revocation would
    ever reach it)."""
    s = await _store(_cfg(cluster, [cluster.ep(0)], auth={}), background=True)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.watch_connected.wait(), 2.0)
    finally:
        await s.close()


async def test_server_name_overrides_the_name_checked(cluster: Cluster) -> None:
    raw = _raw(cluster, [cluster.ep(2)])
    raw["etcd"]["tls"]["server_name"] = OTHER_NAME
    s = await _store(load_config(raw).etcd)
    try:
        await _one_request(s, "req_sn")
    finally:
        await s.close()


async def test_an_unreadable_file_stops_the_start_naming_field_and_path(
        cluster: Cluster) -> None:
    missing = cluster.workdir / "nope" / "tls.key"
    raw = _raw(cluster, [cluster.ep(0)])
    raw["etcd"]["tls"]["key_file"] = str(missing)
    with pytest.raises(ConfigError) as err:
        await EtcdStore(load_config(raw).etcd).connect()
    assert str(err.value) == f"etcd.tls.key_file: cannot read {missing}: No such file or directory"
    empty = write_secret(cluster.workdir / "empty-password", "")
    raw = _raw(cluster, [cluster.ep(0)])
    raw["etcd"]["auth"]["password_file"] = str(empty)
    with pytest.raises(ConfigError) as err:
        await EtcdStore(load_config(raw).etcd).connect()
    assert str(err.value) == f"etcd.auth.password_file: {empty} is empty"


def test_the_processor_does_not_start_on_an_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "etcd-tls" / "ca.crt"
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(json.dumps({"etcd": {"tls": {"enabled": True, "ca_file": str(missing)}}}))
    out = subprocess.run([sys.executable, "-m", "extproc", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    assert (f"config error: etcd.tls.ca_file: cannot read {missing}: No such file or directory"
            in out.stderr)


# --- the token ------------------------------------------------------------------------------


async def test_a_token_that_expired_is_replaced_without_failing_a_call(
        cluster: Cluster) -> None:
    s = await _store(_cfg(cluster, [cluster.ep(0)]))
    try:
        await _one_request(s, "req_tok_1")
        assert s._channel is not None and s._channel.authentications == 1
        old = s._channel._token
        assert old
        await asyncio.sleep(TOKEN_TTL_S + 1.5)  # idle longer than --auth-token-ttl
        # etcd has dropped it: a call sent with it is refused ...
        ch = grpc.aio.secure_channel(cluster.ep(0), grpc.ssl_channel_credentials(
            cluster.pki.ca_file.read_bytes(), cluster.pki.client_key.read_bytes(),
            cluster.pki.client_cert.read_bytes()))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc.KVStub(ch).Range(rpc.RangeRequest(key=s.prefix + b"/x"),
                                           metadata=(("token", old),), timeout=2)
        finally:
            await ch.close()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # ... while ours succeed: the client authenticated again and retried.
        await _one_request(s, "req_tok_2")
        assert s._channel.authentications == 2 and s._channel._token != old

        # A watch created with a lapsed token: etcd answers "canceled, permission denied";
        # the client authenticates again and the watch is created.
        await asyncio.sleep(TOKEN_TTL_S + 1.5)
        call = s._watch.Watch(iter([rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=s.live_prefix, range_end=s.live_prefix[:-1] + b"0"))]))
        try:
            async for resp in call:
                assert resp.created and not resp.canceled, resp.cancel_reason
                break
        finally:
            call.cancel()
        assert s._channel.authentications == 3
    finally:
        await s.close()


async def test_a_token_lapsing_under_load_fails_no_call(cluster: Cluster) -> None:
    """Bursts of concurrent calls with idle gaps longer than the token's TTL between them:
    every call of every burst succeeds, and each lapse costs one authentication, not one
    per call."""
    s = await _store(_cfg(cluster, [cluster.ep(0), cluster.ep(1, "localhost")]))
    try:
        for burst in range(3):
            rids = [f"req_load_{burst}_{i}" for i in range(10)]
            await asyncio.wait_for(asyncio.gather(*(_one_request(s, r) for r in rids)), 20)
            assert s._channel is not None and s._channel.authentications == burst + 1
            if burst < 2:
                await asyncio.sleep(TOKEN_TTL_S + 1.5)
    finally:
        await s.close()


# --- endpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", [
    [(0, "localhost"), (1, "localhost")],  # by host name
    [(0, "127.0.0.1"), (1, "127.0.0.1")],  # by IPv4
    [(0, "[::1]")],  # by IPv6
    [(0, "[::1]"), (1, "localhost"), (1, "127.0.0.1")],  # any mix
    # Member 3's certificate names neither: that endpoint fails its check (per endpoint),
    # and the next one serves.
    [(2, "127.0.0.1"), (0, "localhost")],
], ids=["hostname", "ipv4", "ipv6", "mixed", "bad-name-first"])
async def test_endpoints_by_hostname_ipv4_ipv6_or_mixed(
        cluster: Cluster, hosts: list[tuple[int, str]]) -> None:
    s = await _store(_cfg(cluster, [cluster.ep(i, h) for i, h in hosts]))
    try:
        await _one_request(s, "req_ep_0")  # the first call of all: nothing else connected
        s.start_background()
        await asyncio.wait_for(s.watch_connected.wait(), 10)
        for n in range(1, 3):
            await _one_request(s, f"req_ep_{n}")
    finally:
        await s.close()


async def test_one_endpoint_down_of_two_keeps_the_store_working(cluster: Cluster) -> None:
    """Member 2 (the endpoint in use) is killed; its peers keep quorum. Every call after
    the kill succeeds on the other endpoint, and the revocation watch comes back there."""
    s = await _store(_cfg(cluster, [cluster.ep(1), cluster.ep(0, "localhost")]),
                     background=True)
    try:
        await asyncio.wait_for(s.watch_connected.wait(), 10)
        await _one_request(s, "req_down_0")
        assert s._channel is not None and s._channel.pick().address == cluster.ep(1)
        victim = cluster.procs[1]
        victim.signal(signal.SIGKILL)
        assert victim.popen is not None
        victim.popen.wait(5)
        # If it was the leader, the others elect a new one first (etcd's election timeout):
        # no etcd answers a write meanwhile, whichever endpoint is dialed.
        await asyncio.to_thread(wait_until, lambda: _http_ok(
            f"http://127.0.0.1:{cluster.metrics_ports[0]}/health"), 15, "a leader again")
        for n in range(1, 11):
            await _one_request(s, f"req_down_{n}")
        assert s._channel.pick().address == cluster.ep(0, "localhost")
        await asyncio.wait_for(s.watch_connected.wait(), 10)
        seen: list[str | None] = []
        rid = "req_down_watch"
        await s.open_request(rid, {"request_id": rid}, ("att_1", {"attempt": 1}))
        off = s.on_live_change(rid, seen.append)
        await s.end_attempt(rid, 1, "att_1", {"attempt": 1}, expire=False)
        await _until(lambda: None in seen, "the revocation through the other endpoint")
        off()
    finally:
        await s.close()


# --- pool registrations: only a client with the credentials can write one ----------------


async def test_a_registration_without_credentials_is_refused_and_the_pool_unchanged(
        cluster: Cluster) -> None:
    """Anyone who reaches etcd could put themselves in the pool (EDS serves whatever is
    registered, decision 0014), so etcd's auth is what guards it. The agent's own write
    (`EtcdPoolRegistry.register`, what `extproc register` runs) with a client certificate
    but no user, or with a wrong password, is refused by etcd; the processor's listing,
    the source of every EDS answer, still holds exactly the registration made with them."""
    from extproc.adapters.etcd_pool import EtcdPoolRegistry
    from extproc.core.membership import registration_record
    fp = {"weights_revision": "demo@sha256:reg", "kv_cache_dtype": "fp16"}
    good = _raw(cluster, [cluster.ep(0)])
    prefix = good["etcd"]["prefix"]
    sec = cluster.workdir / "secrets"
    no_user = {**good["etcd"], "auth": {}}
    wrong_pw = {**good["etcd"], "auth": {
        "username_file": str(write_secret(sec / "reg-u", USER)),
        "password_file": str(write_secret(sec / "reg-p", "guessed"))}}
    ok = await _store(load_config(good).etcd)
    try:
        legit = EtcdPoolRegistry(ok)
        await legit.register("127.0.0.1:18001", registration_record("127.0.0.1:18001", fp),
                             30)
        _, before = await legit.snapshot()
        assert set(before) == {"127.0.0.1:18001"}
        for raw, expected in ((no_user, "denied access (has etcd auth enabled?"),
                              (wrong_pw, "refused the user or its password")):
            bad = await _store(load_config({"etcd": raw}).etcd)
            try:
                with pytest.raises(StoreUnavailable) as err:
                    await EtcdPoolRegistry(bad).register(
                        "127.0.0.1:18666", registration_record("127.0.0.1:18666", fp), 30)
                assert expected in str(err.value)
            finally:
                await bad.close()
        # The same write with etcdctl, the client certificate and no user: refused too.
        put = await asyncio.to_thread(
            subprocess.run,
            [_bin("etcdctl"), f"--endpoints=https://{cluster.ep(0)}",
             f"--cacert={cluster.pki.ca_file}", f"--cert={cluster.pki.client_cert}",
             f"--key={cluster.pki.client_key}", "put", f"{prefix}/pool/127.0.0.1:18667",
             json.dumps(registration_record("127.0.0.1:18667", fp))],
            capture_output=True, text=True, timeout=30, check=False)
        assert put.returncode != 0 and "permission denied" in put.stderr, put
        _, after = await legit.snapshot()
        assert after == before  # nothing of the refused writes reached the pool
    finally:
        await ok.close()


# --- one request through Envoy and the processor, etcd over TLS + auth -------------------


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("tls-stack"), replicas=2, etcd_tls_auth=True,
               config={"policy": {"retry_budget": {"min_retry_concurrency": 100000}}}).start()
    try:
        yield st
    finally:
        st.stop()


def test_a_request_through_envoy_with_etcd_over_tls_and_auth(tls_stack: Stack) -> None:
    st = tls_stack
    st.wait_replicas_healthy()
    cfg = st.cfg
    assert cfg is not None and cfg.etcd.tls.enabled and cfg.etcd.auth.enabled
    body = {"model": "demo-model", "stream": True, "max_tokens": 6, "seed": 7,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=st.base_url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json=body,
                        headers={"Idempotency-Key": "tls-" + uuid.uuid4().hex})
        assert r.status_code == 200, r.text
        assert "data: [DONE]" in r.text
        rid = r.headers["x-gateway-request-id"]
        deadline = time.monotonic() + 5
        while True:
            j = client.get(f"/v1/requests/{rid}").json()
            if j.get("outcome") is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert j["outcome"] is not None and j["first_delta_sent"] is True, j
    # `extproc inspect` reads the same record over TLS + auth with the processor's config.
    out = subprocess.run([sys.executable, "-m", "extproc", "inspect", rid, "--config",
                          str(st.workdir / "extproc.yaml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["journal"]["request_id"] == rid
    # etcd really demands the credentials: without them the same read is refused.
    raw = json.loads(json.dumps({"etcd": {"endpoints": [st.etcd_endpoint],
                                          "tls": {"enabled": True,
                                                  "ca_file": cfg.etcd.tls.ca_file}}}))
    (st.workdir / "no-creds.yaml").write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "extproc", "inspect", rid, "--config",
                          str(st.workdir / "no-creds.yaml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "requires a client certificate" in out.stderr
