"""The DaemonSet and the operator Deployment: privileges, mounts, probes, selectors, contract values."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.chart_render import render
from tierckpt.protocol.contract import Csi


def _containers(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every long-running container: the regular ones and native sidecars (restartPolicy Always)."""
    pod = doc["spec"]["template"]["spec"]
    assert all(c.get("restartPolicy") == "Always" for c in pod.get("initContainers", [])), "only sidecars"
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _assert_probes_name_declared_ports(container: dict[str, Any]) -> None:
    ports = {p["name"] for p in container.get("ports", [])}
    probes = [container[k] for k in ("livenessProbe", "readinessProbe") if k in container]
    assert probes, f"{container['name']} has no probe"
    for probe in probes:
        check = probe.get("httpGet") or probe["tcpSocket"]
        assert check["port"] in ports, (container["name"], probe)


def _assert_selector_matches(doc: dict[str, Any]) -> None:
    labels = doc["spec"]["template"]["metadata"]["labels"]
    selector = doc["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= labels.items()


def test_csi_mode_daemonset_privileges_are_confined_to_the_csi_container() -> None:
    ds = render().get("DaemonSet")
    _assert_selector_matches(ds)
    c = _containers(ds)
    assert set(c) == {"csi", "registrar", "replicator"}
    assert [n for n, x in c.items() if x["securityContext"].get("privileged")] == ["csi"]
    for name in ("registrar", "replicator"):
        sc = c[name]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
    added = sorted(c["replicator"]["securityContext"]["capabilities"]["add"])
    assert added == ["CHOWN", "DAC_OVERRIDE", "FOWNER"]
    assert "add" not in c["registrar"]["securityContext"]["capabilities"]
    assert c["csi"]["securityContext"]["readOnlyRootFilesystem"] is True
    # Bidirectional propagation only where mounts are made; the replicator only receives them.
    propagation = {(n, m["name"]): m.get("mountPropagation") for n, x in c.items() for m in x["volumeMounts"]}
    assert {k for k, v in propagation.items() if v == "Bidirectional"} == {
        ("csi", "pods-dir"),
        ("csi", "ramdisk-parent"),
    }
    assert propagation[("replicator", "ramdisk-parent")] == "HostToContainer"
    for container in c.values():
        _assert_probes_name_declared_ports(container)


@pytest.mark.parametrize("values", [{}, {"ramdisk": {"mode": "hostPath"}}])
def test_the_ramdisk_keeper_is_a_sidecar_that_starts_before_the_replicator(values: dict) -> None:
    pod = render(values).get("DaemonSet")["spec"]["template"]["spec"]
    (keeper,) = pod["initContainers"]
    assert keeper["name"] in ("csi", "ramdisk") and keeper["restartPolicy"] == "Always"
    # kubelet starts the regular containers only after this passes: the tmpfs is mounted by then.
    assert keeper["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "csi-health"}
    assert [c["name"] for c in pod["containers"]][-1] == "replicator"
    hand_mounted = render({"ramdisk": {"mode": "hostPath", "manageTmpfs": False}}).get("DaemonSet")
    assert "initContainers" not in hand_mounted["spec"]["template"]["spec"]


def test_csi_mode_paths_agree_with_each_other_and_the_contract() -> None:
    r = render()
    ds = r.get("DaemonSet")
    c = _containers(ds)
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    csi_env, rep_env = _env(c["csi"]), _env(c["replicator"])
    assert csi_env["TIERCKPT_RAMDISK_PATH"] == rep_env["TIERCKPT_REPLICATOR_ROOT"] == Csi.HOST_ROOT
    assert volumes["ramdisk-parent"]["hostPath"]["path"] == "/var/lib/tierckpt"
    assert _mounts(c["csi"])["ramdisk-parent"]["mountPath"] == "/var/lib/tierckpt"
    registration = next(a for a in c["registrar"]["args"] if a.startswith("--kubelet-registration-path="))
    plugin_dir = volumes["plugin-dir"]["hostPath"]["path"]
    assert registration.split("=", 1)[1] == f"{plugin_dir}/csi.sock"
    assert plugin_dir == f"/var/lib/kubelet/plugins/{Csi.DRIVER}"
    assert csi_env["TIERCKPT_CSI_ENDPOINT"] == "unix:///csi/csi.sock"
    assert _mounts(c["csi"])["plugin-dir"]["mountPath"] == "/csi"
    pods_dir = volumes["pods-dir"]["hostPath"]["path"]
    assert csi_env["TIERCKPT_KUBELET_PODS_DIR"] == pods_dir == "/var/lib/kubelet/pods"
    assert c["csi"]["command"] == ["tierckpt-csi", "serve"]
    assert csi_env["TIERCKPT_RAMDISK_PREWARM"] == "true"
    assert "memory" not in c["csi"]["resources"].get("limits", {}), "a memory limit bounds the prewarm"
    driver = r.get("CSIDriver")
    assert driver["metadata"]["name"] == Csi.DRIVER
    assert driver["spec"] | {} == {
        **driver["spec"],
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "File",
    }
    assert ds["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"
    quota = r.get("ResourceQuota")
    assert quota["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["system-node-critical"]


def test_replicator_ports_probes_and_credentials() -> None:
    ds = render({"gcs": {"bucket": "b-1"}}).get("DaemonSet")
    rep = _containers(ds)["replicator"]
    ports = {p["name"]: p for p in rep["ports"]}
    assert ports["api"]["containerPort"] == ports["api"]["hostPort"] == 8470
    assert ports["data"]["containerPort"] == 8471 and "hostPort" not in ports["data"]
    # the probes on a port of their own, never published on the node (defect 4)
    assert ports["probes"]["containerPort"] == 8472 and "hostPort" not in ports["probes"]
    assert rep["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    assert rep["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
    assert _env(rep)["TIERCKPT_REPLICATOR_PROBE_PORT"] == "8472"
    env = _env(rep)
    assert env["TIERCKPT_REPLICATOR_AUTH"] == "tls" and "TIERCKPT_REPLICATOR_TOKEN_FILE" not in env
    assert env["TIERCKPT_REPLICATOR_ISSUER_URL"] == "https://tierckpt-issuer.tierckpt-system.svc:8443"
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ca"]["configMap"] == {
        "name": "tierckpt-ca",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    assert "token" not in volumes and "secret" not in str(volumes.get("ca"))  # never the CA's key
    assert rep["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}  # not the mTLS port
    legacy = render({"auth": {"mode": "token"}}).get("DaemonSet")
    legacy_env = _env(_containers(legacy)["replicator"])
    assert legacy_env["TIERCKPT_REPLICATOR_AUTH"] == "token"
    assert legacy_env["TIERCKPT_REPLICATOR_TOKEN_FILE"] == "/var/run/tierckpt/token/token"
    assert _mounts(_containers(legacy)["replicator"])["token"]["mountPath"] == "/var/run/tierckpt/token"
    token_volume = next(v for v in legacy["spec"]["template"]["spec"]["volumes"] if v["name"] == "token")
    assert token_volume["secret"] == {"secretName": "tierckpt-token", "defaultMode": 0o400}
    assert env["TIERCKPT_REPLICATOR_GCS_BUCKET"] == "b-1"
    assert "limits" not in rep["resources"], "a memory limit OOM-kills the replicator as replicas fill tmpfs"
    assert ds["spec"]["template"]["spec"].get("hostNetwork") is None
    host_net = render({"replicator": {"hostNetwork": True}, "networkPolicy": {"enabled": False}}).get(
        "DaemonSet"
    )
    assert host_net["spec"]["template"]["spec"]["hostNetwork"] is True
    assert all("hostPort" not in p for p in _containers(host_net)["replicator"]["ports"])


@pytest.mark.parametrize("manage", [True, False])
def test_hostpath_mode_has_no_csi_driver(manage: bool) -> None:
    r = render({"ramdisk": {"mode": "hostPath", "manageTmpfs": manage, "hostPath": "/mnt/ckpt/ram"}})
    assert r.all("CSIDriver") == []
    c = _containers(r.get("DaemonSet"))
    assert set(c) == ({"ramdisk", "replicator"} if manage else {"replicator"})
    privileged = [n for n, x in c.items() if x["securityContext"].get("privileged")]
    assert privileged == (["ramdisk"] if manage else [])
    if manage:
        assert c["ramdisk"]["command"] == ["tierckpt-csi", "ramdisk"]
        assert _env(c["ramdisk"])["TIERCKPT_RAMDISK_PATH"] == "/mnt/ckpt/ram"
    assert _env(c["replicator"])["TIERCKPT_REPLICATOR_ROOT"] == "/mnt/ckpt/ram"
    operator_env = _env(_containers(r.get("Deployment"))["operator"])
    assert operator_env["TIERCKPT_OPERATOR_RAMDISK_MODE"] == "hostPath"
    assert operator_env["TIERCKPT_OPERATOR_RAMDISK_HOST_PATH"] == "/mnt/ckpt/ram"


def test_operator_runs_restricted_with_probes_and_spread() -> None:
    r = render()
    dep = r.get("Deployment")
    _assert_selector_matches(dep)
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    op = _containers(dep)["operator"]
    sc = op["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    _assert_probes_name_declared_ports(op)
    assert dep["spec"]["replicas"] == 2 and _env(op)["TIERCKPT_OPERATOR_LEADER_ELECTION"] == "true"
    assert pod["affinity"]["podAntiAffinity"]
    assert r.get("PodDisruptionBudget")["spec"] == {"minAvailable": 1, "selector": dep["spec"]["selector"]}
    single = render({"operator": {"replicas": 1}})
    single_env = _env(_containers(single.get("Deployment"))["operator"])
    assert single_env["TIERCKPT_OPERATOR_LEADER_ELECTION"] == "false"
    assert "minAvailable" not in single.get("PodDisruptionBudget")["spec"]


def test_services_select_the_pods_and_name_their_ports() -> None:
    r = render()
    for svc in r.all("Service"):
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        workload = r.get("DaemonSet" if component == "replicator" else "Deployment")
        assert svc["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        declared = {p["name"] for c in _containers(workload).values() for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= declared
