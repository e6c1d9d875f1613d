"""The chart renders, lints and validates across its value combinations."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest

from tests.chart.chart_render import CHART, KUBE_VERSIONS, k8s_errors, render
from tests.chart.crd_schema import validator_for

GSA = "tierckpt-replicator@my-project.iam.gserviceaccount.com"
TOKEN = "t" * 40

COMBOS: dict[str, dict] = {
    "defaults": {},
    "hostPath with managed tmpfs": {"ramdisk": {"mode": "hostPath"}},
    "hostPath, admin-mounted tmpfs": {"ramdisk": {"mode": "hostPath", "manageTmpfs": False}},
    "networkPolicy": {
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ],
        }
    },
    "networkPolicy, hostPath, no training pods": {
        "ramdisk": {"mode": "hostPath"},
        "networkPolicy": {"enabled": True, "allowTrainingPods": False},
    },
    "monitoring": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "podMonitoring": {"enabled": True},
        }
    },
    "legacy token mode": {"auth": {"mode": "token"}},
    "given token": {"auth": {"mode": "token", "token": TOKEN}},
    "existing token secret": {"auth": {"mode": "token", "existingSecret": "my-token"}},
    "tierckpt CA from cert-manager": {"tls": {"mode": "certManager", "certificateHours": 12}},
    "tierckpt CA under a corporate issuer": {
        "tls": {
            "mode": "certManager",
            "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "corp"}},
        }
    },
    "workload identity": {"gcs": {"bucket": "my-bucket", "workloadIdentity": {"gcpServiceAccount": GSA}}},
    "cert-manager": {"webhook": {"tls": {"mode": "certManager"}}},
    "cert-manager with issuer": {
        "webhook": {
            "tls": {
                "mode": "certManager",
                "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}},
            }
        }
    },
    "checkpoint configuration": {
        "gcs": {"bucket": "my-bucket"},
        "checkpointConfiguration": {
            "create": True,
            "spec": {"ramdisk": {"size": "48Gi"}, "backup": {"intervalMinutes": 10}},
        },
    },
    "host network, one operator": {
        "replicator": {"hostNetwork": True},
        "operator": {"replicas": 1},
        "networkPolicy": {"enabled": False},
    },
    "watched namespaces, extra egress": {
        "operator": {"watchNamespaces": ["team-a", "team-b"]},
        "networkPolicy": {
            "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}], "ports": [{"port": 4443}]}]
        },
    },
    "custom priority, no quota": {
        "replicator": {"priorityClassName": "", "criticalPodsQuota": False},
        "webhook": {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
    },
}

# Custom resources of other projects: no CRD on this machine, checked field by field in test_objects.py.
THIRD_PARTY = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.googleapis.com/v1", "PodMonitoring"),
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
}


@pytest.mark.parametrize("name", list(COMBOS))
def test_renders_and_validates(name: str) -> None:
    values = COMBOS[name]
    helm.Chart.load(CHART).validate_schema(values)
    rendered = render(values)
    ours = validator_for(CHART / "crds" / "checkpointconfigurations.tierckpt.io.yaml", True)
    errors = []
    for doc in rendered.docs:
        if (doc["apiVersion"], doc["kind"]) in THIRD_PARTY:
            continue
        if doc["kind"] == "CheckpointConfiguration":
            errors += ours.errors(doc)
            continue
        errors += [e for v in KUBE_VERSIONS if (e := k8s_errors(doc, v))]
    assert errors == []
    assert "tierckpt.io/enabled" in rendered.notes


@pytest.mark.parametrize("kube", [f"v{v}" for v in KUBE_VERSIONS])
@pytest.mark.parametrize(
    "name",
    [
        "defaults",
        "hostPath with managed tmpfs",
        "networkPolicy",
        "monitoring",
        "cert-manager",
        "checkpoint configuration",
    ],
)
def test_lints_clean(name: str, kube: str) -> None:
    report = helm.lint(CHART, COMBOS[name], strict=True, kube_version=kube)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon is recommended")
    assert (problems, report["errors"]) == ([], [])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ramdisk": {"mode": "nfs"}}, "/ramdisk/mode"),
        ({"ramdisk": {"size": "64GB"}}, "/ramdisk/size"),
        ({"auth": {"token": "too-short"}}, "/auth/token"),
        ({"auth": {"mode": "insecure"}}, "/auth/mode"),
        ({"tls": {"mode": "openssl"}}, "/tls/mode"),
        ({"tls": {"certificateHours": 0}}, "/tls/certificateHours"),
        ({"replicator": {"apiPort": 70000}}, "/replicator/apiPort"),
        ({"webhook": {"tls": {"mode": "kopf"}}}, "/webhook/tls/mode"),
        ({"replicas": 3}, "additional properties 'replicas' not allowed"),
    ],
)
def test_schema_rejects_bad_values(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=message):
        helm.Chart.load(CHART).validate_schema(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"networkPolicy": {"enabled": True}, "replicator": {"hostNetwork": True}}, "cannot protect"),
        ({"checkpointConfiguration": {"create": True}}, "needs a bucket"),
        # the shared token only when the legacy mode is chosen by name
        ({"auth": {"token": "t" * 40}}, "set auth.mode: token explicitly"),
        ({"auth": {"existingSecret": "my-token"}}, "set auth.mode: token explicitly"),
    ],
)
def test_contradictory_values_fail_with_a_reason(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_crds_are_valid_for_every_supported_version() -> None:
    from tests.chart.chart_render import crds

    docs = crds()
    assert {d["spec"]["names"]["kind"] for d in docs} >= {"CheckpointConfiguration", "CheckpointJob"}
    assert [e for d in docs for v in KUBE_VERSIONS if (e := k8s_errors(d, v))] == []


def test_every_template_is_rendered_by_some_combination() -> None:
    kinds = set().union(*(render(values).kinds() for values in COMBOS.values()))
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")}
    assert kinds >= {
        "CSIDriver",
        "DaemonSet",
        "Deployment",
        "MutatingWebhookConfiguration",
        "NetworkPolicy",
        "ServiceMonitor",
        "PodMonitoring",
        "Issuer",
        "Certificate",
        "CheckpointConfiguration",
        "ResourceQuota",
        "PodDisruptionBudget",
        "Secret",
        "ConfigMap",
        "Service",
    }
    assert Path(CHART / "templates" / "NOTES.txt").exists() and templates


def test_every_value_is_documented_in_the_chart_readme() -> None:
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text().splitlines()
    schema = helm.Chart.load(CHART).schema["properties"]

    def leaves(d: dict, prefix: str = "", props: dict | None = None):
        for key, value in d.items():
            path = f"{prefix}{key}"
            sub = (props or {}).get(key, {})
            nested = "properties" in sub and sub.get("additionalProperties") is False and key != "resources"
            if isinstance(value, dict) and value and nested:
                yield from leaves(value, path + ".", sub["properties"])
            else:
                yield path

    def documented(path: str) -> bool:
        parent, _, last = path.rpartition(".")
        return any(
            f"`{path}`" in line or (f"`{parent}." in line and f"`.{last}`" in line) or (f"`{path}` /" in line)
            for line in readme
        )

    missing = [p for p in leaves(values, props=schema) if not documented(p)]
    assert missing == []
