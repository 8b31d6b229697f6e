"""adapters/etcd_client: how the processor dials etcd. The TLS and auth files are read at
start-up (a missing, empty or non-text file names its field and path); a call that reached
no member is tried on the next endpoint within the same deadline, and the endpoint that
failed is passed over for a while; with none reachable a call fails within its deadline.
TLS and password auth against a real etcd: tests/e2e/test_etcd_tls_auth.py."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from devkit.devstack import free_port
from extproc.adapters.etcd_client import EtcdClient, read_credentials
from extproc.core.config import ConfigError, EtcdConfig, load_config

from .test_journal_store import etcd_endpoint

__all__ = ["etcd_endpoint"]  # this module's etcd (a fixture of its own)


def _cfg(etcd: dict[str, object]) -> EtcdConfig:
    return load_config({"etcd": etcd}).etcd


def test_plaintext_without_auth_reads_nothing() -> None:
    c = read_credentials(_cfg({}))
    assert (c.root_certificates, c.username, c.password) == (None, None, None)


def test_files_are_read_at_start_and_a_secret_loses_its_trailing_newline(
        tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "user").write_text("llmgw\n")
    (tmp_path / "pass").write_text("s3cret \r\n")
    c = read_credentials(_cfg({
        "tls": {"enabled": True, "ca_file": str(tmp_path / "ca.pem")},
        "auth": {"username_file": str(tmp_path / "user"),
                 "password_file": str(tmp_path / "pass")}}))
    assert c.root_certificates == b"-----BEGIN CERTIFICATE-----\n"
    assert (c.username, c.password) == ("llmgw", "s3cret ")  # only the line's end goes


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read"), (b"\n", "is empty"), (b"\xff\xfe\xfa", "is not UTF-8 text")])
def test_an_unusable_file_stops_the_start_naming_field_and_path(
        tmp_path: Path, content: bytes | None, says: str) -> None:
    user, pw = tmp_path / "user", tmp_path / "pass"
    user.write_text("u")
    if content is not None:
        pw.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        EtcdClient(_cfg({"auth": {"username_file": str(user), "password_file": str(pw)}}))
    assert "etcd.auth.password_file" in str(e.value) and str(pw) in str(e.value)
    assert says in str(e.value)


async def test_a_call_that_reached_no_member_goes_to_the_next_one(etcd_endpoint: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    c = EtcdClient(_cfg({"endpoints": [dead, etcd_endpoint], "timeout_s": 3.0,
                         "prefix": f"/client/{uuid.uuid4().hex}"}))
    c.open()
    try:
        assert c.endpoint_count == 2
        resp = await c.kv.Range(rpc.RangeRequest(key=b"/nothing"), timeout=3.0)
        assert resp.header.revision > 0  # answered, though the first endpoint is down
        assert c.pick().address == etcd_endpoint  # and the next call starts there
        live = c.pick()
        c.move_on(live)  # a call on it failed in a way that may be its own
        assert live.suspect_until > asyncio.get_running_loop().time()  # passed over a while
    finally:
        await c.close()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await c.kv.Range(rpc.RangeRequest(key=b"/x"), timeout=1.0)
    assert e.value.code() == grpc.StatusCode.CANCELLED  # closed: no call goes anywhere


async def test_no_member_reachable_fails_within_the_deadline_naming_it() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    c = EtcdClient(_cfg({"endpoints": dead, "timeout_s": 0.5}))
    c.open()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.kv.Range(rpc.RangeRequest(key=b"/x"), timeout=0.5)
        assert loop.time() - t0 < 2.0
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED)
        assert any(d in (e.value.details() or "") for d in dead)
    finally:
        await c.close()


def test_a_unary_call_s_metadata_is_hasleader_then_the_token_built_once_per_token() -> None:
    c = EtcdClient(_cfg({}))
    leader = (("hasleader", "true"),)
    none = c.unary_metadata(None)
    assert tuple(none) == leader and c.unary_metadata(None) is none
    t1 = c.unary_metadata("t1")
    assert tuple(t1) == (*leader, ("token", "t1")) and c.unary_metadata("t1") is t1
    t2 = c.unary_metadata("t2")  # a new token: new metadata, never the old token's
    assert tuple(t2) == (*leader, ("token", "t2"))
    assert tuple(c.unary_metadata(None)) == leader
    # The caller's own metadata goes first, as it always did.
    assert tuple(c.unary_metadata("t2", [("x", "y")])) == (("x", "y"), *leader, ("token", "t2"))
    assert c.unary_metadata(None, ()) is c.unary_metadata(None)
