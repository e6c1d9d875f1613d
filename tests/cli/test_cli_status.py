"""``tierckpt status`` against an emulated API server (tests/fixtures/k8s_emulator.py, as a process).

The tierckpt CRDs from the chart are applied, a CheckpointJob is created and its status written
through the status subresource, as the operator does; then the command reads it with a kubeconfig.
Covers: one job, the list, a missing job, an unreachable server, no kubeconfig, and that the
command's resource coordinates match the CRD.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cli.cli_helpers import assert_clean_error, cli
from tierckpt_cli.status import CRD_GROUP, CRD_PLURAL, CRD_VERSION

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "charts" / "tierckpt" / "crds" / "checkpointjobs.tierckpt.io.yaml"

STATUS = {
    "phase": "Running",
    "assignmentGeneration": 2,
    "nodes": ["gke-a-1", "gke-b-1"],
    "domains": ["zone-a", "zone-b"],
    "peers": [[1], [0]],
    "latestLocalStep": 300,
    "latestReplicatedStep": 300,
    "latestBackedUpStep": 200,
    "inventoryNodes": "2/2",
    "inventoryTime": "2026-11-26T00:00:00Z",
    "overQuota": "gke-b-1: job team-a_train_0123abcd rank 1 step 300 declares 64.0Gi, over the job's quota",
    "replicaGroups": {
        "groups": 2,
        "divergedRanks": "3",
        "step": 300,
        "bytes": {
            "written": 4 << 20,
            "writtenWithoutDedup": 8 << 20,
            "replicated": 1 << 20,
            "replicatedWithoutDedup": 8 << 20,
            "uploaded": 4 << 20,
            "uploadedWithoutDedup": 8 << 20,
        },
    },
    "restore": {
        "generation": 2,
        "step": 200,
        "freshStart": False,
        "worldSize": 16,
        "sources": {"local": "0-7", "gcs": "8-15"},
    },
    "conditions": [{"type": "Ready", "status": "True", "reason": "Restored", "message": "step 200 staged"}],
}


def _kubeconfig(path: Path, url: str, namespace: str = "team-a") -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emu",
                "clusters": [{"name": "emu", "cluster": {"server": url}}],
                "users": [{"name": "emu", "user": {"token": "dummy"}}],
                "contexts": [
                    {"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": namespace}}
                ],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port_file = tmp_path_factory.mktemp("emu") / "url"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "fixtures" / "k8s_emulator.py"), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "the API emulator did not start"
            time.sleep(0.05)
        yield json.loads(port_file.read_text())["url"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def kubeconfig(api_server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubernetes import client, config

    path = _kubeconfig(tmp_path_factory.mktemp("kube") / "config", api_server)
    api_client = config.new_client_from_config(config_file=str(path))
    client.ApiextensionsV1Api(api_client).create_custom_resource_definition(yaml.safe_load(CRD.read_text()))
    objects = client.CustomObjectsApi(api_client)
    for ns, name in (("team-a", "train"), ("team-b", "eval")):
        body = {
            "apiVersion": f"{CRD_GROUP}/{CRD_VERSION}",
            "kind": "CheckpointJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "jobSetName": name,
                "jobSetUID": "0123abcd-ffff",
                "jobId": f"{ns}_{name}_0123abcd",
                "numNodes": 2,
            },
        }
        objects.create_namespaced_custom_object(CRD_GROUP, CRD_VERSION, ns, CRD_PLURAL, body)
        objects.patch_namespaced_custom_object_status(
            CRD_GROUP, CRD_VERSION, ns, CRD_PLURAL, name, {"status": STATUS}
        )
    return path


def test_coordinates_match_the_crd() -> None:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == CRD_GROUP
    assert crd["spec"]["names"]["plural"] == CRD_PLURAL
    assert CRD_VERSION in [v["name"] for v in crd["spec"]["versions"] if v.get("served")]


def test_status_of_one_job(kubeconfig: Path) -> None:
    result = cli("status", "train", "--kubeconfig", str(kubeconfig), env={"COLUMNS": "200"})
    assert result.code == 0, result.output
    out = result.stdout
    assert "team-a/train" in out and "team-a_train_0123abcd" in out and "Running" in out
    assert "local 300, replicated 300, backed up 200" in out
    assert "restore: step 200 (local: ranks 0-7, gcs: ranks 8-15)" in out
    assert "gke-b-1" in out and "zone-b" in out and "Restored" in out
    # The replica groups' accounting, as the operator gathered it (kept by the CRD's schema).
    assert "replica groups: 2; ranks 3 DIFFER from their group (not deduplicated)" in out
    assert "over quota (not replicated, not backed up): gke-b-1: job team-a_train_0123abcd rank 1" in out
    assert "step 300: written 4.0 MiB of 8.0 MiB, replicated 1.0 MiB of 8.0 MiB, uploaded 4.0 MiB" in out


def test_status_json_is_the_object(kubeconfig: Path) -> None:
    result = cli("status", "eval", "-n", "team-b", "--kubeconfig", str(kubeconfig), "--json")
    assert result.code == 0, result.output
    obj = result.json()
    assert obj["metadata"]["name"] == "eval" and obj["status"]["latestBackedUpStep"] == 200


def test_status_lists_jobs(kubeconfig: Path) -> None:
    here = cli("status", "--kubeconfig", str(kubeconfig), "--json").json()
    assert [o["metadata"]["name"] for o in here] == ["train"]
    everywhere = cli("status", "-A", "--kubeconfig", str(kubeconfig), "--json").json()
    assert sorted(o["metadata"]["name"] for o in everywhere) == ["eval", "train"]
    table = cli("status", "-A", "--kubeconfig", str(kubeconfig), env={"COLUMNS": "200"})
    assert table.code == 0 and "team-b" in table.stdout and "Running" in table.stdout


def test_missing_job_is_a_clean_error(kubeconfig: Path) -> None:
    result = cli("status", "nope", "--kubeconfig", str(kubeconfig))
    assert_clean_error(result, 1, "CheckpointJob team-a/nope: not found")


def test_unreachable_server_and_missing_kubeconfig(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = _kubeconfig(tmp_path / "dead", f"http://127.0.0.1:{port}")
    assert_clean_error(cli("status", "train", "--kubeconfig", str(dead)), 1, "cannot reach the API server")
    result = cli("status", "--kubeconfig", str(tmp_path / "absent"), env={"KUBERNETES_SERVICE_HOST": ""})
    assert_clean_error(result, 2, "no usable kubeconfig")
