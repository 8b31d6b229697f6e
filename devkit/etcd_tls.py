"""An etcd with TLS, client certificates and password auth, for the tests and the dev stack.

Certificates are made on the spot (the `trustme` package, a dev dependency): one CA, a
server certificate per etcd member with the names it is dialed by, a client certificate.
Auth is switched on with etcdctl the way an operator does it: a root user, then a role
granting readwrite on one key prefix, a user holding it, `auth enable`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Pki:
    """A CA and the files issued by it under `root`."""

    root: Path
    ca_file: Path = field(init=False)
    client_cert: Path = field(init=False)
    client_key: Path = field(init=False)
    _ca: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import trustme  # dev dependency: only the tests and the TLS dev stack make certs

        self.root.mkdir(parents=True, exist_ok=True)
        self._ca = trustme.CA(organization_name="extproc test CA")
        self.ca_file = self.root / "ca.crt"
        self._ca.cert_pem.write_to_path(str(self.ca_file))
        self.client_cert, self.client_key = self.issue("client", "extproc-client")

    def issue(self, name: str, *identities: str) -> tuple[Path, Path]:
        """A leaf certificate for `identities` (IP literals and DNS names): (cert, key)."""
        leaf = self._ca.issue_cert(*identities, common_name=identities[0])
        cert, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        key.chmod(0o600)
        return cert, key


def tls_flags(pki: Pki, cert: Path, key: Path, token_ttl_s: int = 300) -> list[str]:
    """etcd's flags for TLS on client URLs with client-certificate auth, and simple tokens."""
    return ["--cert-file", str(cert), "--key-file", str(key),
            "--trusted-ca-file", str(pki.ca_file), "--client-cert-auth",
            "--auth-token", "simple", "--auth-token-ttl", str(token_ttl_s)]


def etcdctl(binary: str, endpoint: str, pki: Pki, *args: str) -> str:
    argv = [binary, f"--endpoints=https://{endpoint}", f"--cacert={pki.ca_file}",
            f"--cert={pki.client_cert}", f"--key={pki.client_key}", "--dial-timeout=5s",
            "--command-timeout=10s", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"etcdctl {' '.join(args[:2])} failed: {r.stderr.strip()}")
    return r.stdout


def enable_auth(binary: str, endpoint: str, pki: Pki, user: str, password: str,
                prefix: str, root_password: str) -> None:
    """A root user, a user with readwrite on `prefix` (and everything under it), auth on."""
    for args in (["user", "add", "root", f"--new-user-password={root_password}",
                  "--interactive=false"],
                 ["role", "add", "root"], ["user", "grant-role", "root", "root"],
                 ["role", "add", user],
                 ["role", "grant-permission", user, "--prefix=true", "readwrite", prefix],
                 ["user", "add", user, f"--new-user-password={password}",
                  "--interactive=false"],
                 ["user", "grant-role", user, user], ["auth", "enable"]):
        etcdctl(binary, endpoint, pki, *args)


def write_secret(path: Path, value: str) -> Path:
    """A file as a Kubernetes Secret key is mounted (here with the trailing newline an
    `echo` leaves, which the reader drops)."""
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path
