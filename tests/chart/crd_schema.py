"""Validate custom resources against the openAPIV3Schema of their CustomResourceDefinition.

kubernetes-validate knows only built-in kinds; for a custom resource it says "Couldn't find schema". So
custom resources are checked here, against the CRD itself: the JobSet CRD from ../shared/k8s (read at test
time, never copied) and our own CRDs from charts/tierckpt/crds. ``strict`` also rejects unknown fields,
as the API server prunes (drops) them silently: a typo'd field would otherwise be lost without a word.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

__all__ = ["CrdValidator", "load_crd"]


def load_crd(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` in which every object with declared properties allows no others."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


class CrdValidator:
    """Validates objects of one CRD's kind, per served version."""

    def __init__(self, crd: dict[str, Any], *, strict: bool = False) -> None:
        spec = crd["spec"]
        self.group, self.kind = spec["group"], spec["names"]["kind"]
        self._validators = {}
        for version in spec["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            props = schema.setdefault("properties", {})
            # metadata is validated by the API server's ObjectMeta, not the CRD schema.
            props["metadata"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
            props.setdefault("apiVersion", {"type": "string"})
            props.setdefault("kind", {"type": "string"})
            if strict:
                schema = _strict(schema)
            self._validators[f"{self.group}/{version['name']}"] = jsonschema.Draft7Validator(schema)

    def errors(self, obj: dict[str, Any]) -> list[str]:
        """Every schema violation in ``obj``, as "path: message" lines (empty when valid)."""
        if obj.get("kind") != self.kind:
            return [f"kind {obj.get('kind')!r} is not {self.kind!r}"]
        validator = self._validators.get(obj.get("apiVersion", ""))
        if validator is None:
            return [f"apiVersion {obj.get('apiVersion')!r} is not served (have {sorted(self._validators)})"]
        return [
            f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        ]


@functools.lru_cache(maxsize=8)
def validator_for(path: Path, strict: bool) -> CrdValidator:
    return CrdValidator(load_crd(path), strict=strict)
