"""A pod as the operator's webhook mutates it, published by the plugin as kubelet would, checkpointing
through the real client: the step lands on the node ramdisk, in the job's directory, in the format."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.csi.csi_helpers import MiB, Node, thread_plugin
from tierckpt.protocol.contract import Csi, Env, job_id_for
from tierckpt.protocol.format import rank_dir, read_manifest, step_dir
from tierckpt_csi._proto import csi_pb2
from tierckpt_csi.mounts import bind_mount

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def _kubelet_publish_request(node: Node, pod: dict, volume: dict) -> csi_pb2.NodePublishVolumeRequest:
    """What kubelet sends for the pod's inline CSI volume (CSIDriver podInfoOnMount: true)."""
    meta = pod["metadata"]
    ctx = dict(volume["csi"]["volumeAttributes"])
    ctx.update(
        {
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.name": meta["name"],
            "csi.storage.k8s.io/pod.namespace": meta["namespace"],
            "csi.storage.k8s.io/pod.uid": meta["uid"],
            "csi.storage.k8s.io/serviceAccount.name": "default",
        }
    )
    mode = csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=f"csi-{uuid.uuid4().hex}",
        target_path=str(node.target(meta["uid"], volume["name"])),
        volume_capability=csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(), access_mode=mode
        ),
        volume_context=ctx,
    )


def test_webhook_injected_volume_is_published_and_the_client_checkpoints_into_it(node: Node) -> None:
    torch = pytest.importorskip("torch")
    from tierckpt.checkpointer import Checkpointer
    from tierckpt_operator.injection import Injection, inject

    job = job_id_for("ml", "llama", "0a1b2c3d-4e5f-6789-abcd-ef0123456789")
    pod = {
        "metadata": {"name": "llama-workers-0-0-x7k2p", "namespace": "ml", "uid": str(uuid.uuid4())},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
    }
    inject(pod, Injection(job_id=job, ramdisk_size="16Mi"))
    (volume,) = [v for v in pod["spec"]["volumes"] if "csi" in v]
    assert volume["csi"]["driver"] == Csi.DRIVER
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == f"{env[Env.ROOT]}/{env[Env.JOB]}"

    with thread_plugin(node, size=64 * MiB) as c:
        req = _kubelet_publish_request(node, pod, volume)
        c.node.NodePublishVolume(req)
        # The container runtime binds the volume at its mountPath inside the container's root.
        container_root = node.base / "container-rootfs"
        in_container = container_root / mount["mountPath"].lstrip("/")
        in_container.mkdir(parents=True)
        bind_mount(req.target_path, in_container, readonly=False)

        state = {"w": torch.arange(1024, dtype=torch.float32), "step": 7}
        with Checkpointer(
            root=container_root / env[Env.ROOT].lstrip("/"), job=env[Env.JOB], rank=0, world_size=1
        ) as ckpt:
            ckpt.save(7, state, blocking=True)

    committed = step_dir(rank_dir(node.ramdisk, job, 0), 7)
    manifest = read_manifest(committed)  # on the node ramdisk, where the replicator looks
    assert (manifest.job, manifest.rank, manifest.step) == (job, 0, 7)
    assert set(os.listdir(node.ramdisk)) == {job, ".tierckpt-csi"}  # only this job, and our records
