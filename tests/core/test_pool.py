"""Compatibility fingerprints and host lists."""

from __future__ import annotations

import pytest

from extproc.core.pool import Fingerprint, FingerprintError, Pool, Replica, pool_from_config

BASE = {"weights_revision": "model-x@sha256:aa", "quantization": "fp8",
        "tokenizer_hash": "t1", "chat_template_hash": "c1", "attention": "gqa",
        "kv_cache_dtype": "fp16", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
        "kv_block_size": 16, "lora_adapters": ["sql", "legal"]}


def fp(**kw: object) -> Fingerprint:
    return Fingerprint.from_mapping({**BASE, **kw})


@pytest.mark.parametrize("change", [
    {"lora_adapters": ["legal", "sql"]},  # same set, other order
    {"kv_cache_dtype": "fp8"},
    {"chat_template_hash": "c2"},
    {"weights_revision": "model-x@sha256:bb"},
    {"quantization": "int4"},
    {"tokenizer_hash": "t2"},
    {"attention": "mla"},
    {"tensor_parallel_size": 4},
    {"pipeline_parallel_size": 2},
    {"kv_block_size": 32},
    {"lora_adapters": ["sql"]},
])
def test_one_differing_field_is_incompatible(change: dict[str, object]) -> None:
    assert fp().digest != fp(**change).digest


def test_canonical_hash_is_stable_and_order_insensitive_for_keys() -> None:
    a = Fingerprint.from_mapping(dict(reversed(list(BASE.items()))))
    assert a.digest == fp().digest and a.digest.startswith("fp-")


@pytest.mark.parametrize(("raw", "field"), [
    ({}, "weights_revision"), ({**BASE, "bogus": 1}, "bogus"),
    ({**BASE, "tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({**BASE, "lora_adapters": "sql"}, "lora_adapters"),
])
def test_bad_fingerprints_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(FingerprintError, match=field):
        Fingerprint.from_mapping(raw)


def test_host_list_never_mixes_fingerprints() -> None:
    a, b = fp(), fp(kv_cache_dtype="fp8")
    pool = Pool((Replica("h1:1", a), Replica("h2:1", a), Replica("h3:1", b),
                 Replica("h4:1", b), Replica("h5:1", b, ("other-model",))))
    for i in range(50):
        got = pool.choose("m", f"req_{i}")
        assert got is not None
        digest, hosts = got
        assert {pool.fingerprint_of(h) for h in hosts} == {digest}
        assert len(hosts) == 2 and len(set(hosts)) == 2
    assert pool.choose("m", "r", exclude=["h1:1", "h2:1", "h3:1", "h4:1"]) is None
    # Replicas that declare no models serve any; h5 serves only other-model.
    other = pool.choose("other-model", "r")
    assert other is not None and sorted(other[1]) == ["h3:1", "h4:1", "h5:1"]
    assert all("h5:1" not in (pool.choose("m", f"q{i}") or ("", []))[1] for i in range(20))


def test_pool_config_errors() -> None:
    with pytest.raises(FingerprintError, match=r"pool\.replicas\[1\]\.address"):
        pool_from_config([{"address": "h:1", "fingerprint": BASE},
                          {"address": "h:1", "fingerprint": BASE}])
