"""deploy/: the kubectl manifests are the chart's current output, and the examples are valid objects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.chart.chart_render import CHART, KUBE_VERSIONS, REPO
from tests.chart.crd_schema import validator_for
from tests.fixtures.shared_data import require_jobset_crd
from tierckpt.protocol.contract import Annotations

DEPLOY = REPO / "deploy"


def test_deploy_manifests_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "render-deploy.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = (tmp_path / "tierckpt.yaml").read_text()
    assert fresh == (DEPLOY / "tierckpt.yaml").read_text(), "deploy/ is stale: run scripts/render-deploy.sh"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_deploy_manifests_pass_kubernetes_validate_strict(version: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubernetes_validate",
            "--strict",
            "-k",
            version,
            str(DEPLOY / "tierckpt.yaml"),
        ],
        capture_output=True,
        text=True,
    )
    lines = out.stdout.splitlines()
    # The cert-manager Issuers and Certificates (the webhook's, the tierckpt CA's) are the only objects
    # without a bundled schema.
    warnings = [line for line in lines if line.startswith("WARN")]
    assert all("cert-manager.io/v1" in w for w in warnings) and len(warnings) == 4, out.stdout
    assert out.returncode == 0 and not [line for line in lines if line.startswith(("ERROR", "FATAL"))], (
        out.stdout
    )
    kinds = {d["kind"] for d in yaml.safe_load_all((DEPLOY / "tierckpt.yaml").read_text()) if d}
    assert {"Namespace", "CustomResourceDefinition", "DaemonSet", "Deployment", "CSIDriver"} <= kinds


def _examples(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "examples" / name).read_text()) if d]


def test_example_jobset_is_valid_and_opted_in() -> None:
    config_map, jobset = _examples("jobset.yaml")
    strict = validator_for(require_jobset_crd(), True)
    assert strict.errors(jobset) == []
    assert jobset["metadata"]["annotations"][Annotations.ENABLED] == "true"
    assert jobset["metadata"]["annotations"][Annotations.CONFIG] == "default"
    from tests.chart.chart_render import k8s_errors

    assert [e for v in KUBE_VERSIONS if (e := k8s_errors(config_map, v))] == []
    compile(config_map["data"]["train.py"], "train.py", "exec")  # the training script is valid Python
    # The strict validator catches what the API server would silently prune.
    typo = yaml.safe_load(yaml.safe_dump(jobset))
    typo["spec"]["replicatedJobs"][0]["template"]["spec"]["paralellism"] = 4
    assert any("paralellism" in e for e in strict.errors(typo))


def test_example_maxtext_jobset_is_valid_and_in_orbax_mode() -> None:
    from tierckpt_operator.jobsets import parse_jobset

    (jobset,) = _examples("maxtext-jobset.yaml")
    assert validator_for(require_jobset_crd(), True).errors(jobset) == []
    meta = jobset["metadata"]
    info = parse_jobset({**jobset, "metadata": {**meta, "uid": "0123456789abcdef"}})
    assert (info.mode, info.config_name, info.world_size) == ("orbax", "default", 8)
    (container,) = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert "local_checkpoint_directory=/local" in container["args"]


def test_example_checkpoint_configuration_matches_our_crd() -> None:
    (cpc,) = _examples("checkpointconfiguration.yaml")
    strict = validator_for(CHART / "crds" / "checkpointconfigurations.tierckpt.io.yaml", True)
    assert strict.errors(cpc) == []
    bad = yaml.safe_load(yaml.safe_dump(cpc))
    bad["spec"]["ramdisk"]["size"] = "48GB"
    bad["spec"]["replication"]["factr"] = 2
    errors = strict.errors(bad)
    assert any("ramdisk.size" in e for e in errors) and any("factr" in e for e in errors)
