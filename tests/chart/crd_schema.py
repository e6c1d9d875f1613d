"""Validate custom resources against the openAPIV3Schema of their CustomResourceDefinition.

kubernetes-validate knows only built-in kinds; for a custom resource it says "Couldn't find schema". So
custom resources are checked here, against the CRD itself: the JobSet CRD from ../shared/k8s (read at test
time, never copied) and our own CRDs from charts/tierckpt/crds. ``strict`` also rejects unknown fields,
as the API server prunes (drops) them silently: a typo'd field would otherwise be lost without a word.
The schemas' ``x-kubernetes-validations`` (CEL) rules are evaluated too, with cel-python (whose
``matches`` is RE2, as in Kubernetes).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

__all__ = ["CrdValidator", "load_crd"]


def load_crd(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` in which every object with declared properties allows no others (the
    junctors' sub-schemas only add checks on fields declared outside them: left as they are)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _JUNCTORS else _strict(v) for k, v in schema.items()}
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
        self._schemas: dict[str, dict[str, Any]] = {}
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
            self._schemas[f"{self.group}/{version['name']}"] = schema

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
        ] + _cel_errors(self._schemas[obj["apiVersion"]], obj, "")


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """Every ``x-kubernetes-validations`` rule of ``schema`` and its sub-schemas that ``value`` breaks
    (on creation: transition rules, which compare with ``oldSelf``, apply only to updates)."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        if not _cel(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)}):
            out.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in value.items():
            child = schema.get("properties", {}).get(key) or schema.get("additionalProperties")
            if isinstance(child, dict):
                out += _cel_errors(child, sub, f"{path}.{key}".lstrip("."))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _cel_errors(schema["items"], item, f"{path}.{i}")
    return out


@functools.lru_cache(maxsize=64)
def _cel(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


@functools.lru_cache(maxsize=8)
def validator_for(path: Path, strict: bool) -> CrdValidator:
    return CrdValidator(load_crd(path), strict=strict)
