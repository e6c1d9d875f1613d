"""Least privilege, exactly: the operator's rules are these and no more; the node agents have none."""

from __future__ import annotations

from tests.chart.chart_render import NAMESPACE, render

OPERATOR_RULES = [
    {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    {
        "apiGroups": ["tierckpt.io"],
        "resources": ["checkpointjobs"],
        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
    },
    {
        "apiGroups": ["tierckpt.io"],
        "resources": ["checkpointjobs/status"],
        "verbs": ["get", "update", "patch"],
    },
    {
        "apiGroups": ["tierckpt.io"],
        "resources": ["checkpointconfigurations"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {
        "apiGroups": ["tierckpt.io"],
        "resources": ["checkpointconfigurations/status"],
        "verbs": ["get", "update", "patch"],
    },
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
]

OPERATOR_SA = {"kind": "ServiceAccount", "name": "tierckpt-operator", "namespace": NAMESPACE}

LEASE_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["tierckpt-operator"],
        "verbs": ["get", "watch", "update", "patch"],
    },
]


def test_operator_cluster_role_is_exactly_least_privilege() -> None:
    r = render()
    assert [role["metadata"]["name"] for role in r.all("ClusterRole")] == ["tierckpt-operator"]
    assert r.get("ClusterRole")["rules"] == OPERATOR_RULES
    binding = r.get("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "tierckpt-operator",
    }
    assert binding["subjects"] == [OPERATOR_SA]


def test_leader_lease_rights_are_namespaced_and_named() -> None:
    r = render()
    role = r.get("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == LEASE_RULES
    binding = r.get("RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [OPERATOR_SA]
    operator = r.get("Deployment")["spec"]["template"]["spec"]["containers"][0]
    lease_env = {e["name"]: e.get("value") for e in operator["env"]}
    assert lease_env["TIERCKPT_OPERATOR_LEASE_NAME"] == "tierckpt-operator"


def test_token_reviews_and_the_ca_config_map_only_where_they_are_needed() -> None:
    legacy = render({"auth": {"mode": "token"}})
    assert legacy.get("ClusterRole")["rules"] == OPERATOR_RULES[:-1]  # no TokenReviews: no node certificates
    assert legacy.get("Role")["rules"] == LEASE_RULES
    cert_manager = render({"tls": {"mode": "certManager"}})  # the operator publishes the CA certificate
    assert cert_manager.get("Role")["rules"] == [
        *LEASE_RULES,
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["tierckpt-ca"],
            "verbs": ["get", "patch"],
        },
    ]


def test_no_wildcards_secrets_or_escalation_anywhere() -> None:
    for values in (
        {},
        {"ramdisk": {"mode": "hostPath"}},
        {"webhook": {"tls": {"mode": "certManager"}}},
        {"tls": {"mode": "certManager"}},
        {"auth": {"mode": "token"}},
    ):
        r = render(values)
        for role in r.all("ClusterRole") + r.all("Role"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
                assert "secrets" not in rule["resources"], "the token reaches pods as a mounted Secret"
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_node_agents_have_no_kubernetes_api_access() -> None:
    gsa = "ckpt-repl@my-proj.iam.gserviceaccount.com"
    r = render({"gcs": {"workloadIdentity": {"gcpServiceAccount": gsa}}})
    subjects = [s["name"] for b in r.all("ClusterRoleBinding") + r.all("RoleBinding") for s in b["subjects"]]
    assert "tierckpt-replicator" not in subjects
    sa = r.get("ServiceAccount", "tierckpt-replicator")
    assert sa["automountServiceAccountToken"] is False
    assert r.get("DaemonSet")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert sa["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": gsa}
    assert "annotations" not in render().get("ServiceAccount", "tierckpt-replicator")["metadata"]
    # the one token it gets proves its pod to the operator only: bound to the audience tierckpt
    volumes = {v["name"]: v for v in r.get("DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    (source,) = volumes["identity-token"]["projected"]["sources"]
    assert source == {
        "serviceAccountToken": {"audience": "tierckpt", "expirationSeconds": 3600, "path": "token"}
    }
