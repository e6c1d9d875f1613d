"""The chart's secure defaults (issue 10): a ramdisk path that mounts no system directory, network
policies on by default with ingress AND egress, pod patching narrowed to the watched namespaces,
/metrics off the control API port, and a CheckpointConfiguration CRD that refuses what Kubernetes
would refuse in the tolerations and node selector copied into pods, and a ramdisk of no size."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.chart_render import CHART, KUBE_VERSIONS, NAMESPACE, k8s_errors, render
from tests.chart.crd_schema import validator_for
from tests.fixtures.kube_rules_cases import BAD_SELECTORS, BAD_TOLERATIONS, GOOD_SELECTORS, GOOD_TOLERATIONS
from tierckpt.protocol.contract import Labels

SYSTEM_DIRS = [
    "/",
    "/etc",
    "/usr",
    "/var",
    "/var/lib",
    "/var/lib/kubelet",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/root",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/run",
    "/home",
    "/opt",
    "/tmp",
]


@pytest.mark.parametrize(
    "path",
    [
        *SYSTEM_DIRS,
        "/ramdisk",  # one component: its parent, /, would be mounted into the DaemonSet (defect 6)
        "/var/tierckpt",  # parent /var
        "/var/lib/tierckpt",  # parent /var/lib
        "/var/lib/kubelet/pods",
        "/etc/tierckpt/ramdisk",
        "/proc/self/root",
        "/sys/fs/tierckpt",
        "/dev/shm/tierckpt",
        "/usr/local/tierckpt",
        "/var/lib/tierckpt/../../../etc",
        "/var/lib/tierckpt/./ramdisk",
        "/var/lib//tierckpt",
        "/var/lib/tierckpt/ramdisk/",
        "var/lib/tierckpt/ramdisk",
        "/var/lib/tierckpt/ram disk",
    ],
)
def test_schema_refuses_a_ramdisk_that_mounts_a_system_directory(path: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="/ramdisk/hostPath"):
        helm.Chart.load(CHART).validate_schema({"ramdisk": {"hostPath": path}})


@pytest.mark.parametrize(
    "path",
    ["/var/lib/tierckpt/ramdisk", "/mnt/ckpt/ram", "/run/tierckpt/ramdisk", "/data/tierckpt", "/opt/x/y/z"],
)
def test_schema_accepts_a_ramdisk_of_its_own(path: str) -> None:
    helm.Chart.load(CHART).validate_schema({"ramdisk": {"hostPath": path}})
    parent = path.rsplit("/", 1)[0]
    ds = render({"ramdisk": {"hostPath": path}}).get("DaemonSet")
    volume = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "ramdisk-parent")
    assert volume["hostPath"]["path"] == parent and parent.count("/") >= 1 and parent not in SYSTEM_DIRS


def _selects(peer: dict, component: str) -> bool:
    return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == component


def test_network_policies_are_on_by_default_with_ingress_and_egress() -> None:
    r = render()
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in r.all("NetworkPolicy")
    }
    assert set(policies) == {"replicator", "operator"}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert all(k8s_errors(policy, v) is None for v in KUBE_VERSIONS)

    rep = policies["replicator"]["spec"]
    peers, training = rep["ingress"]  # no metricsFrom: nobody else, not even to the probe port
    assert [c for c in ("replicator", "operator") if any(_selects(p, c) for p in peers["from"])] == [
        "replicator",
        "operator",
    ]
    assert {p["port"] for p in peers["ports"]} == {"api", "data"}
    assert training["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {Labels.MANAGED: "true"}}}
    ]
    assert [p["port"] for p in training["ports"]] == ["api"]
    egress = rep["egress"]
    to_peers = next(e for e in egress if any(_selects(p, "replicator") for p in e.get("to", [])))
    assert {p["port"] for p in to_peers["ports"]} == {8470, 8471}
    assert any(any(_selects(p, "operator") for p in e.get("to", [])) for e in egress)
    ports = {(p["port"], p["protocol"]) for e in egress if "to" not in e for p in e["ports"]}
    assert ports == {(53, "UDP"), (53, "TCP"), (443, "TCP")}  # DNS and HTTPS (GCS) to any address
    assert {e["to"][0]["ipBlock"]["cidr"] for e in egress if "ipBlock" in e.get("to", [{}])[0]} == {
        "169.254.169.254/32",
        "169.254.169.252/32",
    }

    op = policies["operator"]["spec"]
    assert [p["port"] for p in op["ingress"][0]["ports"]] == ["webhook"]
    assert _selects(op["ingress"][1]["from"][0], "replicator") and len(op["ingress"]) == 2
    api_server = op["egress"][0]
    assert "to" not in api_server and {p["port"] for p in api_server["ports"]} == {443, 6443}
    to_replicators = op["egress"][1]
    assert _selects(to_replicators["to"][0], "replicator") and [
        p["port"] for p in to_replicators["ports"]
    ] == [8470]


def test_metrics_ports_admit_only_metrics_from() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    extra = {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"port": 4443, "protocol": "TCP"}]}
    r = render({"networkPolicy": {"metricsFrom": [prometheus], "extraEgress": [extra]}})
    rep = r.get("NetworkPolicy", "tierckpt-replicator")["spec"]
    metrics = rep["ingress"][-1]
    assert metrics["from"] == [prometheus]
    assert {p["port"] for p in metrics["ports"]} == {"probes", "csi-health"}  # not the API port
    assert all("probes" not in {p["port"] for p in rule["ports"]} for rule in rep["ingress"][:-1])
    assert rep["egress"][-1] == extra
    op = r.get("NetworkPolicy", "tierckpt-operator")["spec"]
    assert op["ingress"][-1] == {"from": [prometheus], "ports": [{"port": "metrics", "protocol": "TCP"}]}
    closed = render({"networkPolicy": {"allowTrainingPods": False}}).get(
        "NetworkPolicy", "tierckpt-replicator"
    )
    assert len(closed["spec"]["ingress"]) == 1
    assert render({"networkPolicy": {"enabled": False}}).all("NetworkPolicy") == []


def test_metrics_are_scraped_from_the_probe_port_not_the_api() -> None:
    r = render({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitoring": {"enabled": True}}})
    for kind in ("ServiceMonitor", "PodMonitoring"):
        monitor = r.get(kind, "tierckpt-replicator")
        assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"probes", "csi-health"}
    service = r.get("Service", "tierckpt-replicator")
    assert {"name": "probes", "port": 8472, "targetPort": "probes", "protocol": "TCP"} in service["spec"][
        "ports"
    ]


def test_pod_patching_is_narrowed_to_the_watched_namespaces() -> None:
    cluster_wide = render()
    pods = next(rule for rule in cluster_wide.get("ClusterRole")["rules"] if rule["resources"] == ["pods"])
    assert pods["verbs"] == ["get", "list", "watch", "patch"]
    r = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    pods = next(rule for rule in r.get("ClusterRole")["rules"] if rule["resources"] == ["pods"])
    assert pods["verbs"] == ["get", "list", "watch"]  # no cluster-wide patch
    roles = {
        role["metadata"]["namespace"]: role
        for role in r.all("Role")
        if role["metadata"]["name"] == "tierckpt-operator"
    }
    assert set(roles) == {"team-a", "team-b"}
    for ns, role in roles.items():
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
        binding = next(
            b
            for b in r.all("RoleBinding")
            if b["metadata"] == {**b["metadata"], "namespace": ns, "name": "tierckpt-operator"}
        )
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "tierckpt-operator",
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "tierckpt-operator", "namespace": NAMESPACE}
        ]
        assert all(k8s_errors(doc, v) is None for doc in (role, binding) for v in KUBE_VERSIONS)


# ------------------------------------------------------------------------------------ the CRD

CONFIG_CRD = CHART / "crds" / "checkpointconfigurations.tierckpt.io.yaml"


def _config(**spec) -> dict:
    return {
        "apiVersion": "tierckpt.io/v1alpha1",
        "kind": "CheckpointConfiguration",
        "metadata": {"name": "c"},
        "spec": {"gcs": {"bucket": "ckpt-bucket"}, **spec},
    }


def test_crd_patterns_are_the_operators_rules() -> None:
    """One set of rules: the CRD's patterns are those the operator re-checks with (kube_rules)."""
    from tierckpt_operator import kube_rules

    text = CONFIG_CRD.read_text()
    for pattern in (kube_rules.QUANTITY, kube_rules.LABEL_VALUE, kube_rules.QUALIFIED_NAME.removeprefix("^")):
        assert pattern in text.replace("''", "'"), pattern


@pytest.mark.parametrize("toleration", GOOD_TOLERATIONS)
def test_crd_accepts_valid_tolerations(toleration: dict) -> None:
    assert validator_for(CONFIG_CRD, True).errors(_config(tolerations=[toleration])) == []


@pytest.mark.parametrize("toleration", BAD_TOLERATIONS)
def test_crd_refuses_what_kubernetes_refuses_in_tolerations(toleration: dict) -> None:
    errors = validator_for(CONFIG_CRD, True).errors(_config(tolerations=[toleration]))
    assert errors and all(e.startswith("spec.tolerations.0") for e in errors), errors


@pytest.mark.parametrize("selector", GOOD_SELECTORS)
def test_crd_accepts_valid_node_selectors(selector: dict) -> None:
    assert validator_for(CONFIG_CRD, True).errors(_config(nodeSelector=selector)) == []


@pytest.mark.parametrize("selector", BAD_SELECTORS)
def test_crd_refuses_bad_node_selector_keys_and_values(selector: dict) -> None:
    errors = validator_for(CONFIG_CRD, True).errors(_config(nodeSelector=selector))
    assert errors and all(e.startswith("spec.nodeSelector") for e in errors), errors


@pytest.mark.parametrize("size", ["0", "0Gi", "00", "0.0", "0.000Mi", "-1Gi", "-64Gi", "1e3", "", "Gi"])
def test_crd_refuses_a_ramdisk_of_no_size(size: str) -> None:
    errors = validator_for(CONFIG_CRD, True).errors(_config(ramdisk={"size": size}))
    assert errors and all(e.startswith("spec.ramdisk.size") for e in errors), errors


@pytest.mark.parametrize("size", ["1", "64Gi", "0.5Gi", "10.25M", "1500Mi"])
def test_crd_accepts_a_ramdisk_size(size: str) -> None:
    assert validator_for(CONFIG_CRD, True).errors(_config(ramdisk={"size": size})) == []
