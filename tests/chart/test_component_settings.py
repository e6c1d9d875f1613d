"""The environment the chart gives each container is what that component actually reads.

Each component parses its own settings from the rendered env (fieldRefs filled in as kubelet would), so a
renamed option or a typo'd variable fails here instead of being silently ignored on a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tests.chart.chart_render import NAMESPACE, render

FIELD_VALUES = {
    "spec.nodeName": "gke-node-1",
    "status.podIP": "10.8.0.7",
    "metadata.namespace": NAMESPACE,
    "metadata.name": "tierckpt-operator-5d9c-abcde",
}


def _env(container: dict[str, Any]) -> dict[str, str]:
    out = {}
    for e in container.get("env", []):
        out[e["name"]] = e["value"] if "value" in e else FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def _container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    pod = doc["spec"]["template"]["spec"]
    return next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name)


def _mount_for(container: dict[str, Any], path: str) -> str:
    """The volume whose mount holds ``path``."""
    mounts = [m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {container['name']}"
    return max(mounts, key=lambda m: len(m["mountPath"]))["name"]


def test_operator_reads_every_variable_the_chart_sets() -> None:

    from tierckpt.protocol.options import option_fields
    from tierckpt_operator.settings import ENV_PREFIX, Settings, parse_settings

    r = render()
    op = _container(r.get("Deployment"), "operator")
    env = _env(op)
    fields = {ENV_PREFIX + f.name.upper() for f in option_fields(Settings)}
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= fields
    s = parse_settings([], env)
    assert (s.namespace, s.pod_name, s.leader_election) == (NAMESPACE, FIELD_VALUES["metadata.name"], True)
    assert s.ramdisk_mode == "csi" and s.default_config == "default" and s.namespaces == ()
    s.check_credentials()
    assert (
        s.auth == "tls"
        and _mount_for(op, s.ca_cert_file) == _mount_for(op, s.ca_key_file) == "ca"
        and _mount_for(op, s.webhook_cert_dir + "/tls.crt") == "webhook-tls"
    )
    ports = {p["name"]: p["containerPort"] for p in op["ports"]}
    assert (s.webhook_port, s.metrics_port, s.issuer_port) == (
        ports["webhook"],
        ports["metrics"],
        ports["issuer"],
    )
    issuer = r.get("Service", "tierckpt-issuer")
    assert issuer["spec"]["ports"] == [
        {"name": "issuer", "port": s.issuer_port, "targetPort": "issuer", "protocol": "TCP"}
    ]
    assert f"tierckpt-issuer.{NAMESPACE}.svc" in s.issuer_names.split(",")
    ds = r.get("DaemonSet")
    assert s.replicator_labels.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert (
        s.replicator_user
        == f"system:serviceaccount:{NAMESPACE}:{ds['spec']['template']['spec']['serviceAccountName']}"
    )
    rep_ports = {p["name"]: p["containerPort"] for p in _container(ds, "replicator")["ports"]}
    assert (s.replicator_api_port, s.replicator_data_port) == (rep_ports["api"], rep_ports["data"])
    assert s.jax_coordinator_port == 8476
    legacy = parse_settings(
        [], _env(_container(render({"auth": {"mode": "token"}}).get("Deployment"), "operator"))
    )
    legacy.check_credentials()
    assert legacy.auth == "token" and legacy.token_file


def test_replicator_reads_every_variable_the_chart_sets(monkeypatch) -> None:

    from tierckpt.protocol.options import option_fields
    from tierckpt_replicator.settings import ENV_PREFIX, Settings, parse_settings

    ds = render({"gcs": {"bucket": "ckpt-bucket"}, "replicator": {"replicas": 2}}).get("DaemonSet")
    rep = _container(ds, "replicator")
    env = _env(rep)
    fields = {ENV_PREFIX + f.name.upper() for f in option_fields(Settings)}
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= fields
    monkeypatch.setenv("POD_IP", env["POD_IP"])  # the replicator reads POD_IP from its process environment
    s = parse_settings([], env)
    assert (s.node_name, s.advertise_host, s.replicas, s.gcs_bucket) == (
        "gke-node-1",
        "10.8.0.7",
        2,
        "ckpt-bucket",
    )
    assert str(s.root) == _env(_container(ds, "csi"))["TIERCKPT_RAMDISK_PATH"]
    assert _mount_for(rep, str(s.root)) == "ramdisk-parent"
    assert s.backup_chunks  # bucket layout 3 unless turned off for an upgrade
    whole = render({"gcs": {"bucket": "ckpt-bucket", "chunks": False}}).get("DaemonSet")
    assert not parse_settings([], _env(_container(whole, "replicator"))).backup_chunks
    s.check_credentials()
    assert s.auth == "tls" and _mount_for(rep, str(s.tls_ca)) == "ca"
    assert _mount_for(rep, str(s.issuer_token_file)) == "identity-token"
    assert (
        _mount_for(rep, str(s.identity_dir)) == "ramdisk-parent"
    )  # next to the ramdisk, not in a pod's view
    ports = {p["name"]: p["containerPort"] for p in rep["ports"]}
    assert (s.api_port, s.data_port) == (ports["api"], ports["data"])
    legacy = _container(render({"auth": {"mode": "token"}}).get("DaemonSet"), "replicator")
    old = parse_settings([], _env(legacy))
    old.check_credentials()
    assert old.auth == "token" and _mount_for(legacy, str(old.token_file)) == "token"


def _command_envvars(name: str) -> set[str]:
    from tierckpt_csi.cli import app

    params = typer.main.get_command(app).commands[name].params
    return {v for p in params for v in ([p.envvar] if isinstance(p.envvar, str) else (p.envvar or []))}


def test_csi_and_ramdisk_containers_read_every_variable_the_chart_sets() -> None:
    for values, container, command in (
        ({}, "csi", "serve"),
        ({"ramdisk": {"mode": "hostPath"}}, "ramdisk", "ramdisk"),
    ):
        c = _container(render(values).get("DaemonSet"), container)
        assert c["command"] == ["tierckpt-csi", command]
        env = _env(c)
        assert set(env) <= _command_envvars(command), set(env) - _command_envvars(command)
        assert _mount_for(c, env["TIERCKPT_RAMDISK_PATH"]) == "ramdisk-parent"
        if command == "serve":
            assert _mount_for(c, env["TIERCKPT_KUBELET_PODS_DIR"] + "/uid/volumes") == "pods-dir"
            assert _mount_for(c, env["TIERCKPT_CSI_ENDPOINT"].removeprefix("unix://")) == "plugin-dir"
