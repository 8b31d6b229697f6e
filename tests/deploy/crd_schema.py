"""Strict validation of custom resources against the upstream CRDs vendored in crds/.

The API server prunes or (kubectl's default `--validate=strict`) rejects a field its
structural schema does not list. jsonschema would accept it: every object schema that lists
`properties` and says nothing of extra ones gets `additionalProperties: false` here, unless
it carries `x-kubernetes-preserve-unknown-fields: true` (there Kubernetes keeps anything).
The CRDs' CEL rules (`x-kubernetes-validations`) are not evaluated: no CEL runs here.

crds/<project>-<version>/ holds one release's CRDs. By default an object is checked against
the newest release vendored for its kind (CURRENT); `release=` picks an older one.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"
# The release each kind is checked against unless a test names another.
CURRENT = ("istio-1.30.3", "envoy-gateway-v1.9.0", "gateway-api-v1.6.1")


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@cache
def _schemas(release: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every served version."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((CRDS / release).glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served"):
                    key = (f"{group}/{v['name']}", kind)
                    assert key not in out, f"{key} vendored twice in {release}"
                    schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
                    # Every object has these, whether or not its CRD lists them (Istio's
                    # do not); metadata is ObjectMeta, checked by the API server itself.
                    schema["properties"].setdefault("apiVersion", {"type": "string"})
                    schema["properties"].setdefault("kind", {"type": "string"})
                    schema["properties"].setdefault("metadata", {"type": "object"})
                    out[key] = schema
    return out


def _schema(doc: dict[str, Any], release: str | None) -> dict[str, Any] | None:
    key = (doc["apiVersion"], doc["kind"])
    for r in [release] if release else CURRENT:
        if key in _schemas(r):
            return _schemas(r)[key]
    return None


def has_crd(doc: dict[str, Any], release: str | None = None) -> bool:
    return _schema(doc, release) is not None


def errors(doc: dict[str, Any], release: str | None = None) -> list[str]:
    """Where the API server would refuse `doc`, one line each (empty: accepted)."""
    schema = _schema(doc, release)
    assert schema is not None, f"no vendored CRD for {doc['apiVersion']} {doc['kind']}"
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft4Validator(schema).iter_errors(doc)]
