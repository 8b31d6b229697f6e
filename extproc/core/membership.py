"""Live pool membership: what a replica's registration says, and the pool it makes.

With `pool.discovery: registry` the pool is not written in the config file: each model
server has a small agent beside it (`extproc register`) that keeps a registration in etcd on
a lease while the server answers its health check. The registration names the address
Envoy will dial (an IP literal: Envoy reports `upstream.address` that way and EDS needs it),
the replica's compatibility fingerprint and the models it serves. The processor lists and
watches the registrations, builds the pool from them, and serves the same addresses to
Envoy's replicas cluster over EDS (decision 0014). Nothing here does I/O.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .pool import INT_FIELDS, Fingerprint, FingerprintError, Pool, Replica, agent_version

RECORD_FIELDS = frozenset({"address", "fingerprint", "models", "agent"})


class RegistrationError(ValueError):
    pass


def normalize_address(address: str) -> tuple[str, int, str]:
    """(host, port, canonical "host:port"), the host an IP literal ("[v6]:port" for IPv6)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistrationError(f"address {address!r}: expected IP:port")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        raise RegistrationError(
            f"address {address!r}: the host must be an IP literal (the address Envoy dials "
            "and reports as upstream.address), not a name") from None
    text = f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"
    return str(ip), int(port), text


def registration_record(address: str, fingerprint: Mapping[str, Any],
                        models: Sequence[str] = (), agent: str = "") -> dict[str, Any]:
    """The value an agent writes; validated here so a bad one never reaches etcd."""
    _, _, canonical = normalize_address(address)
    try:
        Fingerprint.from_mapping(fingerprint)
    except FingerprintError as e:
        raise RegistrationError(str(e)) from None
    if not all(isinstance(m, str) and m for m in models):
        raise RegistrationError("models: must be non-empty model names")
    return {"address": canonical, "fingerprint": dict(fingerprint), "models": list(models),
            "agent": agent}


def fingerprint_flags(items: Sequence[str]) -> dict[str, Any]:
    """`FIELD=VALUE` flags as a fingerprint mapping: integers where the field is one,
    `lora_adapters` as a comma-separated, ordered list."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RegistrationError(f"--fingerprint {item!r}: expected FIELD=VALUE")
        if key == "lora_adapters":
            out[key] = value.split(",") if value else []
        elif key in INT_FIELDS:
            if not value.isdigit():
                raise RegistrationError(f"--fingerprint {key}: must be a positive integer")
            out[key] = int(value)
        else:
            out[key] = value
    return out


def parse_registration(key_address: str, raw: bytes) -> Replica:
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RegistrationError(f"{key_address}: registration is not JSON") from None
    if not isinstance(rec, dict):
        raise RegistrationError(f"{key_address}: registration must be a JSON object")
    unknown = sorted(set(rec) - RECORD_FIELDS)
    if unknown:
        raise RegistrationError(f"{key_address}: unknown registration field {unknown[0]!r}")
    address = rec.get("address")
    if not isinstance(address, str):
        raise RegistrationError(f"{key_address}: address missing")
    _, _, canonical = normalize_address(address)
    if canonical != key_address:
        raise RegistrationError(f"{key_address}: registered under another address "
                                f"({canonical})")
    fp = rec.get("fingerprint")
    if not isinstance(fp, Mapping):
        raise RegistrationError(f"{key_address}: fingerprint missing")
    models = rec.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise RegistrationError(f"{key_address}: models must be a list of names")
    try:
        fingerprint = Fingerprint.from_mapping(fp, f"{key_address}.fingerprint")
        agent = agent_version(rec.get("agent"), key_address)
    except FingerprintError as e:
        raise RegistrationError(str(e)) from None
    return Replica(canonical, fingerprint, tuple(models), agent)


def pool_from_registrations(records: Mapping[str, bytes]) -> tuple[Pool, list[str]]:
    """The pool the registrations make (address order), and the ones refused, with why.

    A registration that does not parse is left out and reported, never guessed at: a
    replica whose fingerprint is unknown may not serve anyone's retry.
    """
    replicas: list[Replica] = []
    refused: list[str] = []
    for address in sorted(records):
        try:
            replicas.append(parse_registration(address, records[address]))
        except RegistrationError as e:
            refused.append(str(e))
    return Pool(tuple(replicas)), refused


def endpoints(pool: Pool) -> list[tuple[str, int]]:
    """(host, port) of every registered replica, in the pool's order: Envoy's EDS answer."""
    out = []
    for r in pool.replicas:
        host, port, _ = normalize_address(r.address)
        out.append((host, port))
    return out


# --- the agent beside each model server -------------------------------------------------


class AgentAction(Enum):
    REGISTER = "register"
    KEEP_ALIVE = "keep_alive"
    DEREGISTER = "deregister"


@dataclass(frozen=True)
class AgentPolicy:
    ttl_s: int
    healthy_threshold: int = 1
    unhealthy_threshold: int = 2


@dataclass
class Agent:
    """When the agent registers, keeps and withdraws its replica's registration.

    Registered only after `healthy_threshold` good probes in a row, withdrawn after
    `unhealthy_threshold` bad ones (the numbers Envoy's health checks use), kept alive
    three times per TTL. A registration etcd says it lost (expired while unreachable) is
    made again at the next good probe. The agent's own death lets the lease lapse.
    """

    policy: AgentPolicy
    registered: bool = False
    good: int = 0
    bad: int = 0
    kept_at: float = 0.0

    def probed(self, ok: bool, now: float) -> AgentAction | None:
        if ok:
            self.good, self.bad = self.good + 1, 0
            if not self.registered:
                return AgentAction.REGISTER if self.good >= self.policy.healthy_threshold \
                    else None
            if now - self.kept_at >= self.policy.ttl_s / 3:
                return AgentAction.KEEP_ALIVE
            return None
        self.good, self.bad = 0, self.bad + 1
        if self.registered and self.bad >= self.policy.unhealthy_threshold:
            return AgentAction.DEREGISTER
        if self.registered and now - self.kept_at >= self.policy.ttl_s / 3:
            # Not yet judged unhealthy: keep the registration until the threshold says so.
            return AgentAction.KEEP_ALIVE
        return None

    def done(self, action: AgentAction, ok: bool | None, now: float) -> None:
        """An action's outcome: True done, False refused (the lease is gone), None no answer.

        A keep-alive etcd did not answer changes nothing (the next probe tries again; the
        lease lapses by itself if etcd stays away); a registration it did not answer was
        not made.
        """
        if action is AgentAction.DEREGISTER:
            self.registered = False  # the lease is revoked or will lapse: never re-used
            return
        if ok is None and action is AgentAction.KEEP_ALIVE:
            return
        self.registered = bool(ok)
        if ok:
            self.kept_at = now

    def stop(self) -> AgentAction | None:
        return AgentAction.DEREGISTER if self.registered else None
