"""The mutating webhooks as kube-apiserver calls them: AdmissionReview over HTTPS (certificate
verified), a base64 JSONPatch in the answer, applied to the object; re-invocation changes nothing."""

from __future__ import annotations

import base64
import json

import jsonpatch
import pytest

from tests.operator.operator_harness import PODS, eventually, jobset_body

pytestmark = [pytest.mark.e2e]

NS = "team"
POD_GVR = ("", "v1", "pods")


def _patched(body, response):
    assert response["allowed"], response
    if "patch" not in response:
        return body, []
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(body, ops), ops


def _pod(jobset, job_index=0, completion=0, attempt=0):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{jobset}-w-{job_index}-{completion}-",
            "namespace": NS,
            "labels": {
                "tierckpt.io/managed": "true",
                "jobset.sigs.k8s.io/jobset-name": jobset,
                "jobset.sigs.k8s.io/replicatedjob-name": "w",
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "jobset.sigs.k8s.io/job-global-index": str(job_index),
                "jobset.sigs.k8s.io/restart-attempt": str(attempt),
                "batch.kubernetes.io/job-completion-index": str(completion),
            },
        },
        "spec": {
            "containers": [
                {"name": "trainer", "image": "t", "env": [{"name": "TIERCKPT_ROOT", "value": "/mine"}]},
                {
                    "name": "sidecar",
                    "image": "s",
                    "volumeMounts": [{"name": "x", "mountPath": "/etc/tierckpt/podinfo"}],
                },
            ],
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


async def test_pod_injection_over_https(env):
    await env.cluster.config(
        ramdisk={"size": "32Gi", "mountRoot": "/ckpt"},
        nodeSelector={"pool": "gpu"},
        tolerations=[
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "tierckpt", "operator": "Exists"},
        ],
    )
    await env.start_operator()
    js = await env.cluster.create_jobset(NS, jobset_body("llm", [("w", 2, 2)]))
    for rj in js["spec"]["replicatedJobs"]:  # the JobSet webhook labelled every pod template
        assert rj["template"]["spec"]["template"]["metadata"]["labels"]["tierckpt.io/managed"] == "true"
    job = f"{NS}_llm_{js['metadata']['uid'].replace('-', '')[:8]}"
    await eventually(lambda: env.cluster.checkpoint_job(NS, "llm"), what="CheckpointJob")

    body = _pod("llm", 1, 1)
    pod, ops = _patched(body, await env.cluster.api.review("/mutate-pods", body, POD_GVR, "Pod", NS))
    assert all(op["op"] in ("add", "replace") for op in ops)
    assert pod["metadata"]["annotations"]["tierckpt.io/job-id"] == job
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tierckpt-ramdisk"]["csi"] == {
        "driver": "ramdisk.tierckpt.io",
        "volumeAttributes": {"tierckpt.io/job-id": job, "tierckpt.io/ramdisk-reservation": "32Gi"},
    }
    assert volumes["tierckpt-podinfo"]["downwardAPI"]["items"] == [
        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}
    ]
    trainer, sidecar = pod["spec"]["containers"]
    mounts = {m["name"]: m for m in trainer["volumeMounts"]}
    assert mounts["tierckpt-ramdisk"]["mountPath"] == f"/ckpt/{job}"
    assert mounts["tierckpt-podinfo"] == {
        "name": "tierckpt-podinfo",
        "mountPath": "/etc/tierckpt/podinfo",
        "readOnly": True,
    }
    env_ = {e["name"]: e for e in trainer["env"]}
    assert env_["TIERCKPT_ROOT"]["value"] == "/mine"  # the user's own value wins
    assert env_["TIERCKPT_JOB"]["value"] == job
    assert env_["TIERCKPT_PODINFO_DIR"]["value"] == "/etc/tierckpt/podinfo"
    assert env_["TIERCKPT_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert env_["TIERCKPT_REPLICATOR_URL"]["value"] == "http://$(TIERCKPT_HOST_IP):8470"
    names = [e["name"] for e in trainer["env"]]
    assert names.index("TIERCKPT_HOST_IP") < names.index("TIERCKPT_REPLICATOR_URL")  # $(VAR) expansion order
    assert env_["TIERCKPT_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the sidecar already used the podinfo path: its mount is left alone, the ramdisk still added
    assert [m["name"] for m in sidecar["volumeMounts"]] == ["x", "tierckpt-ramdisk"]
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert pod["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "tierckpt", "operator": "Exists"},
    ]
    assert "affinity" not in pod["spec"]  # no node holds data for this job yet

    again, ops = _patched(pod, await env.cluster.api.review("/mutate-pods", pod, POD_GVR, "Pod", NS))
    assert ops == [] and again == pod  # reinvocationPolicy IfNeeded: applying twice is a no-op


async def test_pod_prefers_the_node_holding_its_rank(env):
    await env.cluster.config()
    await env.start_operator()
    await env.cluster.create_jobset(NS, jobset_body("llm", [("w", 2, 2)]))
    await eventually(lambda: env.cluster.checkpoint_job(NS, "llm"), what="CheckpointJob")
    for name in ("hold-0", "hold-1", "hold-2"):
        assert (await env.kube.post("/api/v1/nodes", json={"metadata": {"name": name}})).status == 201
    # ranks 0..3 last lived on these nodes (as a previous attempt's assignment recorded them)
    status = {"nodes": ["hold-0", "hold-1", "hold-2", "gone"], "assignmentGeneration": 0}
    await env.cluster.patch(
        f"/apis/tierckpt.io/v1alpha1/namespaces/{NS}/checkpointjobs/llm/status", {"status": status}
    )

    async def preferred(job_index, completion):
        body = _pod("llm", job_index, completion, attempt=1)
        pod, _ = _patched(body, await env.cluster.api.review("/mutate-pods", body, POD_GVR, "Pod", NS))
        terms = (
            pod["spec"]
            .get("affinity", {})
            .get("nodeAffinity", {})
            .get("preferredDuringSchedulingIgnoredDuringExecution", [])
        )
        return [t["preference"]["matchFields"][0]["values"] for t in terms]

    await eventually(lambda: preferred(1, 0), what="index caught up")  # initial rank 2
    assert await preferred(0, 0) == [["hold-0"]]
    assert await preferred(1, 0) == [["hold-2"]]
    assert await preferred(1, 1) == []  # rank 3's node no longer exists: no preference
    created = await env.kube.post(PODS.format(ns=NS), json=_pod("llm"))
    assert created.status == 201  # plain API access still works (the webhook is the apiserver's business)


async def test_a_pod_volume_of_the_reserved_name_is_replaced(env):
    """A pod that brings its own ``tierckpt-ramdisk`` (a ``hostPath: /``) gets ours instead, and every
    mount of that name, in every container and init container, is exactly ours (defect 9)."""
    await env.cluster.config(ramdisk={"size": "8Gi", "mountRoot": "/ckpt"})
    await env.start_operator()
    js = await env.cluster.create_jobset(NS, jobset_body("evil", [("w", 1, 1)]))
    job = f"{NS}_evil_{js['metadata']['uid'].replace('-', '')[:8]}"
    await eventually(lambda: env.cluster.checkpoint_job(NS, "evil"), what="CheckpointJob")
    body = _pod("evil")
    host_root = {"name": "tierckpt-ramdisk", "hostPath": {"path": "/", "type": "Directory"}}
    body["spec"]["volumes"] = [host_root, {"name": "tierckpt-ramdisk", "emptyDir": {}}]
    evil_mount = {"name": "tierckpt-ramdisk", "mountPath": "/host", "subPath": "etc", "readOnly": False}
    body["spec"]["containers"][0]["volumeMounts"] = [dict(evil_mount)]
    body["spec"]["initContainers"] = [{"name": "init", "image": "i", "volumeMounts": [dict(evil_mount)]}]
    pod, _ = _patched(body, await env.cluster.api.review("/mutate-pods", body, POD_GVR, "Pod", NS))
    ramdisk = [v for v in pod["spec"]["volumes"] if v["name"] == "tierckpt-ramdisk"]
    assert ramdisk == [
        {
            "name": "tierckpt-ramdisk",
            "csi": {
                "driver": "ramdisk.tierckpt.io",
                "volumeAttributes": {"tierckpt.io/job-id": job, "tierckpt.io/ramdisk-reservation": "8Gi"},
            },
        }
    ]
    ours = {"name": "tierckpt-ramdisk", "mountPath": f"/ckpt/{job}"}
    for container in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
        assert [m for m in container["volumeMounts"] if m["name"] == "tierckpt-ramdisk"] == [ours]
    again, ops = _patched(pod, await env.cluster.api.review("/mutate-pods", pod, POD_GVR, "Pod", NS))
    assert ops == [] and again == pod
