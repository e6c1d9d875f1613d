"""Helpers for the CSI node plugin tests (imported by conftest.py and the tests as ``csi_helpers``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc

from tierckpt.protocol.contract import Csi
from tierckpt_csi._proto import csi_pb2, csi_pb2_grpc

MiB = 1 << 20
_SINGLE_NODE_WRITER = csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER


@dataclasses.dataclass
class Node:
    """One simulated node: its ramdisk path, kubelet pods dir and CSI socket."""

    base: Path
    ramdisk: Path
    pods: Path
    endpoint: str

    def target(self, pod_uid: str, volume: str = "tierckpt") -> Path:
        """Where kubelet asks an inline CSI volume to be published; kubelet creates the parent."""
        parent = self.pods / pod_uid / "volumes" / "kubernetes.io~csi" / volume
        parent.mkdir(parents=True, exist_ok=True)
        return parent / "mount"


def unmount_all_under(base: Path) -> None:
    """Detach every mount below ``base``, deepest first (bind mounts, then the tmpfs)."""
    from tierckpt_csi.mounts import is_under, read_mountinfo, unmount

    root = os.path.realpath(base)
    for _ in range(100):
        mounted = [m for m in read_mountinfo() if is_under(m.mount_point, root)]
        if not mounted:
            return
        deepest = max(mounted, key=lambda m: (m.mount_point.count("/"), m.mount_id))
        with contextlib.suppress(OSError):
            unmount(deepest.mount_point)
    raise RuntimeError(f"could not unmount everything under {base}")


@dataclasses.dataclass
class Client:
    identity: csi_pb2_grpc.IdentityStub
    node: csi_pb2_grpc.NodeStub
    channel: grpc.Channel


@contextlib.contextmanager
def connect(endpoint: str) -> Iterator[Client]:
    channel = grpc.insecure_channel(endpoint)
    try:
        yield Client(csi_pb2_grpc.IdentityStub(channel), csi_pb2_grpc.NodeStub(channel), channel)
    finally:
        channel.close()


@contextlib.contextmanager
def thread_plugin(node: Node, size: int = 64 * MiB, **settings) -> Iterator[Client]:
    """The plugin's real gRPC server in this process, on the node's unix socket."""
    from tierckpt_csi.plugin import NodePlugin, PluginSettings
    from tierckpt_csi.ramdisk import ensure_ramdisk
    from tierckpt_csi.server import PluginServer

    disk = ensure_ramdisk(node.ramdisk, size, huge="never")
    server = PluginServer(
        NodePlugin(disk, PluginSettings(node_id="node-a", pods_dir=node.pods, **settings)),
        node.endpoint,
        workers=4,
    )
    server.start()
    try:
        with connect(node.endpoint) as client:
            yield client
    finally:
        server.stop(grace=1)


class PluginProcess:
    """``python -m tierckpt_csi serve`` as a child process (the DaemonSet container)."""

    def __init__(self, node: Node, size: str = "64Mi", *extra: str) -> None:
        self.log = node.base / f"plugin-{uuid.uuid4().hex[:6]}.log"
        cmd = [
            sys.executable,
            "-m",
            "tierckpt_csi",
            "serve",
            "--node-id",
            "node-a",
            "--endpoint",
            node.endpoint,
            "--ramdisk",
            str(node.ramdisk),
            "--ramdisk-size",
            size,
            "--huge",
            "never",
            "--pods-dir",
            str(node.pods),
            "--health-address",
            "",
            *extra,
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.endpoint = node.endpoint
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with connect(self.endpoint) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"plugin exited with {self.proc.returncode}:\n{self.output()}")
                with contextlib.suppress(grpc.RpcError):
                    if client.identity.Probe(csi_pb2.ProbeRequest(), timeout=1).ready.value:
                        return
                time.sleep(0.05)
        raise TimeoutError(f"plugin not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as when the node's container runtime kills the DaemonSet pod."""
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> int:
        self.proc.terminate()
        return self.proc.wait(10)


def publish_request(
    node: Node,
    job: str,
    *,
    pod_uid: str | None = None,
    namespace: str | None = None,
    volume_id: str | None = None,
    readonly: bool = False,
    reservation: str | None = None,
    mount_group: str = "",
) -> csi_pb2.NodePublishVolumeRequest:
    """What kubelet sends for an inline ephemeral volume of the ramdisk driver (podInfoOnMount on)."""
    pod_uid = pod_uid or str(uuid.uuid4())
    namespace = namespace if namespace is not None else job.split("_", 1)[0]
    ctx = {
        "csi.storage.k8s.io/ephemeral": "true",
        "csi.storage.k8s.io/pod.name": f"trainer-{pod_uid[:5]}",
        "csi.storage.k8s.io/pod.namespace": namespace,
        "csi.storage.k8s.io/pod.uid": pod_uid,
        "csi.storage.k8s.io/serviceAccount.name": "default",
        Csi.JOB_ID: job,
    }
    if reservation is not None:
        ctx[Csi.RESERVATION] = reservation
    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(volume_mount_group=mount_group),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=_SINGLE_NODE_WRITER),
    )
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id or f"csi-{uuid.uuid4().hex}",
        target_path=str(node.target(pod_uid)),
        volume_capability=cap,
        readonly=readonly,
        volume_context=ctx,
    )


def unpublish_request(req: csi_pb2.NodePublishVolumeRequest) -> csi_pb2.NodeUnpublishVolumeRequest:
    return csi_pb2.NodeUnpublishVolumeRequest(volume_id=req.volume_id, target_path=req.target_path)


def mounts_at(path: str | Path) -> int:
    from tierckpt_csi.mounts import read_mountinfo

    want = os.path.realpath(path)
    return sum(1 for m in read_mountinfo() if m.mount_point == want)
