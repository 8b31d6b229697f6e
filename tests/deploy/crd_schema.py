"""Strict validation of custom resources against the upstream CRDs vendored in crds/.

The API server prunes or (kubectl's default `--validate=strict`) rejects a field its
structural schema does not list. jsonschema would accept it: every object schema that lists
`properties` and says nothing of extra ones gets `additionalProperties: false` here, unless
it carries `x-kubernetes-preserve-unknown-fields: true` (there Kubernetes keeps anything).
The CRDs' CEL rules (`x-kubernetes-validations`) are not evaluated: no CEL runs here.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"


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
def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every served version."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRDS.rglob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served"):
                    key = (f"{group}/{v['name']}", kind)
                    assert key not in out, f"{key} vendored twice"
                    schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
                    # Every object has these, whether or not its CRD lists them (Istio's
                    # do not); metadata is ObjectMeta, checked by the API server itself.
                    schema["properties"].setdefault("apiVersion", {"type": "string"})
                    schema["properties"].setdefault("kind", {"type": "string"})
                    schema["properties"].setdefault("metadata", {"type": "object"})
                    out[key] = schema
    return out


def has_crd(doc: dict[str, Any]) -> bool:
    return (doc["apiVersion"], doc["kind"]) in _schemas()


def validate(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError where the API server would refuse `doc`."""
    schema = _schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft4Validator(schema).validate(doc)


def errors(doc: dict[str, Any]) -> list[str]:
    schema = _schemas()[(doc["apiVersion"], doc["kind"])]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft4Validator(schema).iter_errors(doc)]
