"""Smoke test of the packaged entry points as separate processes: ``tierckpt-operator`` (the console
script) against the API emulator running standalone (``python tests/fixtures/k8s_emulator.py``), driven
through the ``kubernetes`` client. Ends with SIGTERM: the operator must exit cleanly.

``check_operator_process`` is the scenario; tests/images runs it on the operator of the built image."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import kubernetes
import pytest

from tests.operator.operator_harness import free_port, jobset_body, load_crds
from tierckpt.protocol.api import ISSUE_CERTIFICATE
from tierckpt.protocol.certs import Authority
from tierckpt.protocol.contract import Annotations

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TESTS = Path(__file__).resolve().parents[1]


def _wait(predicate, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except kubernetes.client.ApiException:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def emulator(tmp_path):
    port_file = tmp_path / "emulator.json"
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "fixtures" / "k8s_emulator.py"), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait(port_file.exists, 30, "the emulator")
        yield json.loads(port_file.read_text())["url"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_console_script_against_standalone_emulator(emulator, tmp_path):
    def start(args: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        exe = Path(sys.executable).with_name("tierckpt-operator")
        with open(log, "wb") as out:
            full = {**os.environ, **env}
            cmd = [str(exe), *args]
            return subprocess.Popen(cmd, env=full, stdout=out, stderr=out, start_new_session=True)

    check_operator_process(emulator, tmp_path, start)


def check_operator_process(
    emulator: str,
    tmp_path: Path,
    start: Callable[[list[str], Mapping[str, str], Path], subprocess.Popen[bytes]],
    *,
    host: str = "127.0.0.1",
) -> None:
    """``start(args, env, log)`` starts ``tierckpt-operator`` with ``args`` and the variables ``env``
    (files they name are under ``tmp_path``), its output to ``log``, as the leader of a process group
    of its own; it listens on ``host`` and reaches the API emulator at ``emulator``. The operator must
    rank a JobSet's pods, answer its probes, metrics and signing endpoint, and exit 0 on SIGTERM (to
    its process group, as a container runtime stops a container)."""
    api = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=emulator))
    ext = kubernetes.client.ApiextensionsV1Api(api)
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    for crd in load_crds():
        ext.create_custom_resource_definition(crd)
    core.create_namespace({"metadata": {"name": "team"}})
    custom.create_cluster_custom_object(
        "tierckpt.io",
        "v1alpha1",
        "checkpointconfigurations",
        {"metadata": {"name": "default"}, "spec": {"gcs": {"bucket": "bkt"}}},
    )
    for i in range(2):
        core.create_node({"metadata": {"name": f"node-{i}", "labels": {"topology.kubernetes.io/zone": "z"}}})
    body = jobset_body("smoke", [("w", 1, 2)])
    js = custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "team", "jobsets", body)
    log = tmp_path / "operator.log"
    Authority.create().save(tmp_path / "ca.crt", tmp_path / "ca.key")  # the chart's CA Secret
    env = {
        "TIERCKPT_OPERATOR_CA_CERT_FILE": str(tmp_path / "ca.crt"),
        "TIERCKPT_OPERATOR_CA_KEY_FILE": str(tmp_path / "ca.key"),
        "TIERCKPT_OPERATOR_ISSUER_PORT": str(free_port()),
        "TIERCKPT_OPERATOR_ISSUER_ADDR": host,
        "TIERCKPT_OPERATOR_ISSUER_NAMES": f"localhost,{host}",
        "TIERCKPT_OPERATOR_SERVER": emulator,
        "TIERCKPT_OPERATOR_WEBHOOK_INSECURE": "true",
        "TIERCKPT_OPERATOR_WEBHOOK_PORT": str(free_port()),
        "TIERCKPT_OPERATOR_METRICS_PORT": str(free_port()),
        "TIERCKPT_OPERATOR_DEBOUNCE": "0.05",
    }
    proc = start(["--resync-interval", "2"], env, log)
    try:
        ck = _wait(
            lambda: custom.get_namespaced_custom_object(
                "tierckpt.io", "v1alpha1", "team", "checkpointjobs", "smoke"
            ),
            what="the CheckpointJob",
        )
        assert ck["spec"]["jobId"] == f"team_smoke_{js['metadata']['uid'].replace('-', '')[:8]}"
        labels = {
            "jobset.sigs.k8s.io/jobset-name": "smoke",
            "jobset.sigs.k8s.io/replicatedjob-name": "w",
            "jobset.sigs.k8s.io/job-index": "0",
            "jobset.sigs.k8s.io/restart-attempt": "0",
            "tierckpt.io/managed": "true",
        }
        for c in range(2):
            pod = {
                "metadata": {
                    "name": f"smoke-w-0-{c}",
                    "labels": {**labels, "batch.kubernetes.io/job-completion-index": str(c)},
                },
                "spec": {"nodeName": f"node-{c}", "containers": [{"name": "t", "image": "t"}]},
            }
            core.create_namespaced_pod("team", pod)

        def ranks():
            pods = core.list_namespaced_pod("team", label_selector="tierckpt.io/managed=true").items
            got = {p.spec.node_name: (p.metadata.annotations or {}).get(Annotations.NODE_RANK) for p in pods}
            return got if all(got.values()) else None

        assert _wait(ranks, what="rank annotations") == {"node-0": "0", "node-1": "1"}
        probes = f"http://{host}:{env['TIERCKPT_OPERATOR_METRICS_PORT']}"
        assert urllib.request.urlopen(f"{probes}/healthz", timeout=5).status == 200
        assert urllib.request.urlopen(f"{probes}/readyz", timeout=5).status == 200
        metrics = urllib.request.urlopen(f"{probes}/metrics", timeout=5).read().decode()
        assert "tierckpt_operator_rank_assignments_total 1.0" in metrics
        # the signing endpoint: HTTPS with a certificate of the CA; no token, no certificate
        issuer = f"https://{host}:{env['TIERCKPT_OPERATOR_ISSUER_PORT']}{ISSUE_CERTIFICATE.path}"
        answer = httpx.post(issuer, content=b"{}", verify=str(tmp_path / "ca.crt"), trust_env=False)
        assert answer.status_code == 401
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        print(log.read_text()[-3000:])
