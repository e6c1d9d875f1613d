"""Render the tierckpt chart with helm-python-sdk (bundled Helm) and look at the objects it makes."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

from tests.fixtures.shared_data import JOBSET_CRD

__all__ = ["CHART", "JOBSET_CRD", "NAMESPACE", "RELEASE", "REPO", "Rendered", "k8s_errors", "render"]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tierckpt"
NAMESPACE = "tierckpt-system"
RELEASE = "tierckpt"
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
"""The oldest Kubernetes we support and the newest kubernetes-validate bundles."""


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@dataclasses.dataclass
class Rendered:
    docs: list[dict[str, Any]]
    notes: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        names = [d["metadata"]["name"] for d in found]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {names}"
        return found[0]

    def kinds(self) -> set[str]:
        return {d["kind"] for d in self.docs}


def render(values: dict[str, Any] | None = None, *, config: helm.Config | None = None) -> Rendered:
    """Render like ``helm install tierckpt charts/tierckpt -n tierckpt-system`` (CRDs excluded)."""
    values = values or {}
    if config is None:
        out = chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    else:
        out = config.render(chart(), values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = [
        d
        for path, text in sorted(out.items())
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]
    notes = next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")
    return Rendered(docs, notes)


def crds() -> list[dict[str, Any]]:
    return [yaml.safe_load(c["data"]) for c in sorted(chart().crds, key=lambda c: c["filename"])]


def k8s_errors(doc: dict[str, Any], version: str) -> str | None:
    """kubernetes-validate --strict on one object: None if valid, else the error ("no schema" included)."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}"
    return None
