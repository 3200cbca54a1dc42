"""Offline checks of MilesJob objects against k8s/crd.yaml, the way the API server checks them.

- `json_schema(crd)`: the CRD's structural openAPIV3Schema as a JSON Schema (draft 7): int-or-string becomes
  anyOf[integer, string], `nullable` adds null, and objects with `properties` reject unknown fields unless
  marked x-kubernetes-preserve-unknown-fields (the server would prune those fields silently).
- `apply_defaults(schema, obj)`: the server's defaulting (`default:` values, applied top-down).
- `validation_errors(crd, obj)`: every schema violation, as "path: message" lines.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_DROP = ("default", "description", "nullable", "example", "externalDocs")


def load_crd(path: str | Path) -> dict[str, Any]:
    """Read a CRD YAML file (one document)."""
    with open(path, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    if not isinstance(crd, dict) or crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path}: not a CustomResourceDefinition (kind={crd.get('kind') if crd else None!r})")
    return crd


def openapi_schema(crd: Mapping[str, Any], version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of `version` (default: the storage version)."""
    versions = crd["spec"]["versions"]
    chosen = next((v for v in versions if (v["name"] == version if version else v.get("storage"))), None)
    if chosen is None:
        raise KeyError(f"CRD {crd['metadata']['name']} has no version {version!r}")
    return chosen["schema"]["openAPIV3Schema"]


def json_schema(node: Mapping[str, Any]) -> dict[str, Any]:
    """Convert one structural-schema node (recursively) to JSON Schema."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = json_schema(value)
        elif key == "additionalProperties":
            out[key] = json_schema(value) if isinstance(value, Mapping) else value
        elif key in _DROP or key.startswith("x-kubernetes-"):
            continue
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: Mapping[str, Any], obj: Any) -> Any:
    """A copy of `obj` with the structural schema's `default:` values filled in, as the API server does."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(sub, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            known = set(schema.get("properties") or {})
            for name in [n for n in obj if n not in known]:
                obj[name] = apply_defaults(extra, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def validation_errors(crd: Mapping[str, Any], obj: Mapping[str, Any]) -> list[str]:
    """Every violation of the CRD schema by `obj`, sorted, as "spec.trainer.replicas: 0 is less than ..." lines."""
    validator = jsonschema.Draft7Validator(json_schema(openapi_schema(crd)))
    lines = []
    for err in validator.iter_errors(dict(obj)):
        path = ".".join(str(p) for p in err.absolute_path) or "<root>"
        lines.append(f"{path}: {err.message}")
    return sorted(lines)
