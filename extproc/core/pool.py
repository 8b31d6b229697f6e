"""Which replicas are interchangeable: compatibility fingerprints and host lists.

Two replicas may serve a retry of each other's request only if everything that decides the
tokens matches: weights revision, quantization, tokenizer, chat template, attention
architecture, KV-cache dtype, tensor/pipeline parallel sizes, KV block layout, and the LoRA
adapter set *in order*. The fingerprint is a hash of all of it in one canonical form; one
differing field gives a different hash, and a different hash is never a retry target.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FINGERPRINT_FIELDS: tuple[str, ...] = (
    "weights_revision", "quantization", "tokenizer_hash", "chat_template_hash",
    "attention", "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size",
    "kv_block_size", "lora_adapters",
)
INT_FIELDS = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "kv_block_size"})


class FingerprintError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Fingerprint:
    weights_revision: str
    quantization: str = "none"
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    attention: str = ""
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_block_size: int = 16
    lora_adapters: tuple[str, ...] = ()  # order matters: adapters apply in sequence

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], where: str = "fingerprint") -> Fingerprint:
        unknown = sorted(set(raw) - set(FINGERPRINT_FIELDS))
        if unknown:
            raise FingerprintError(f"{where}.{unknown[0]}: unknown fingerprint field")
        if not isinstance(raw.get("weights_revision"), str) or not raw["weights_revision"]:
            raise FingerprintError(f"{where}.weights_revision: required, a non-empty string")
        kw: dict[str, Any] = {}
        for k, v in raw.items():
            if k == "lora_adapters":
                if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
                    raise FingerprintError(f"{where}.lora_adapters: must be a list of names")
                kw[k] = tuple(v)
            elif k in INT_FIELDS:
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise FingerprintError(f"{where}.{k}: must be a positive integer")
                kw[k] = v
            else:
                if not isinstance(v, str):
                    raise FingerprintError(f"{where}.{k}: must be a string")
                kw[k] = v
        return cls(**kw)

    def canonical(self) -> bytes:
        d = {f: getattr(self, f) for f in FINGERPRINT_FIELDS}
        d["lora_adapters"] = list(self.lora_adapters)
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return "fp-" + hashlib.sha256(self.canonical()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Replica:
    address: str  # host:port as Envoy reports it (upstream.address)
    fingerprint: Fingerprint
    models: tuple[str, ...] = ()
    # The version of the agent in front of its engine (0: none; decision 0034).
    agent: int = 0

    def serves(self, model: str | None) -> bool:
        return not self.models or model is None or model in self.models


@dataclass(frozen=True)
class Pool:
    replicas: tuple[Replica, ...] = ()
    _by_addr: dict[str, Replica] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._by_addr.update({r.address: r for r in self.replicas})

    @property
    def enabled(self) -> bool:
        return bool(self.replicas)

    def fingerprint_of(self, address: str) -> str | None:
        r = self._by_addr.get(address)
        return r.fingerprint.digest if r else None

    def agent_of(self, address: str) -> int:
        """The version of the agent that fronts the replica at `address` (0: none)."""
        r = self._by_addr.get(address)
        return r.agent if r else 0

    def groups(self, model: str | None, exclude: Iterable[str] = ()) -> dict[str, list[str]]:
        """Compatible groups serving `model`: fingerprint -> addresses (declared order)."""
        skip = set(exclude)
        out: dict[str, list[str]] = {}
        for r in self.replicas:
            if r.serves(model) and r.address not in skip:
                out.setdefault(r.fingerprint.digest, []).append(r.address)
        return out

    def choose(self, model: str | None, request_id: str,
               exclude: Iterable[str] = ()) -> tuple[str, list[str]] | None:
        """One compatible group and its host order for this request (attempt n -> host n).

        The largest group wins (more hosts to fail over to); ties and the rotation inside
        the group follow a hash of the request id, spreading load deterministically.
        """
        groups = self.groups(model, exclude)
        if not groups:
            return None
        h = int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16)
        best = max(len(v) for v in groups.values())
        tied = sorted(k for k, v in groups.items() if len(v) == best)
        fp = tied[h % len(tied)]
        hosts = groups[fp]
        k = h % len(hosts)
        return fp, hosts[k:] + hosts[:k]


def agent_version(raw: Any, where: str = "agent") -> int:
    """`agent: {version: N}` says an agent fronts the replica (decision 0034). Absent, or
    the name string `extproc register` wrote before agents proxied: none (0)."""
    if raw is None or isinstance(raw, str):
        return 0
    v = raw.get("version") if isinstance(raw, Mapping) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise FingerprintError(f"{where}.agent: must be {{version: N}} with N >= 1")
    return v


def pool_from_config(items: Sequence[Mapping[str, Any]]) -> Pool:
    reps = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        where = f"pool.replicas[{i}]"
        addr = item.get("address")
        if not isinstance(addr, str) or ":" not in addr:
            raise FingerprintError(f"{where}.address: must be host:port")
        if addr in seen:
            raise FingerprintError(f"{where}.address: {addr} is listed twice")
        seen.add(addr)
        models = item.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise FingerprintError(f"{where}.models: must be a list of model names")
        fp_raw = item.get("fingerprint")
        if not isinstance(fp_raw, Mapping):
            raise FingerprintError(f"{where}.fingerprint: required mapping")
        unknown = sorted(set(item) - {"address", "models", "fingerprint", "agent"})
        if unknown:
            raise FingerprintError(f"{where}.{unknown[0]}: unknown field")
        reps.append(Replica(addr, Fingerprint.from_mapping(fp_raw, f"{where}.fingerprint"),
                            tuple(models), agent_version(item.get("agent"), where)))
    return Pool(tuple(reps))
