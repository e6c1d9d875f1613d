"""The ramdisk survives the driver: restart the plugin process (SIGKILL, like a DaemonSet pod deletion)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.csi.csi_helpers import (
    MiB,
    Node,
    PluginProcess,
    connect,
    mounts_at,
    publish_request,
    unpublish_request,
)
from tierckpt_csi._proto import csi_pb2
from tierckpt_csi.mounts import bind_mount, unmount
from tierckpt_csi.ramdisk import ensure_ramdisk

pytestmark = [pytest.mark.root, pytest.mark.e2e]

JOB_A = "team-a_llama_0a1b2c3d"
JOB_B = "team-a_mixtral_4e5f6a7b"


def test_restart_reuses_the_mounted_ramdisk_and_its_volumes(node: Node, processes: list) -> None:
    processes.append(first := PluginProcess(node))
    req = publish_request(node, JOB_A)
    with connect(node.endpoint) as c:
        c.node.NodePublishVolume(req)
    shard = os.path.join(req.target_path, "rank-00000", "data-00000.bin")
    os.makedirs(os.path.dirname(shard))
    payload = os.urandom(MiB)
    with open(shard, "wb") as f:
        f.write(payload)
    first.kill()

    assert "prewarmed the node's memory" in first.output()  # a new ramdisk: a node that just booted
    processes.append(second := PluginProcess(node))
    assert "reusing the tmpfs ramdisk" in second.output()
    assert "prewarmed" not in second.output()  # its memory was touched already
    assert mounts_at(node.ramdisk) == 1  # adopted, not stacked
    with open(shard, "rb") as f:  # the pod's mount never went away
        assert f.read() == payload
    with connect(node.endpoint) as c:
        c.node.NodePublishVolume(req)  # kubelet retrying: still idempotent after the restart
        assert mounts_at(req.target_path) == 1
        # The restarted plugin still knows job A holds the ramdisk.
        other = publish_request(node, JOB_B)
        with pytest.raises(grpc.RpcError) as info:
            c.node.NodePublishVolume(other)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.node.NodeUnpublishVolume(unpublish_request(req))
    assert (node.ramdisk / JOB_A / "rank-00000" / "data-00000.bin").read_bytes() == payload
    assert second.terminate() == 0
    assert mounts_at(node.ramdisk) == 1  # stopping the driver leaves the ramdisk mounted


def test_volumes_unmounted_while_the_driver_was_down_release_their_reservation(
    node: Node, processes: list
) -> None:
    processes.append(first := PluginProcess(node))
    a = publish_request(node, JOB_A)
    with connect(node.endpoint) as c:
        c.node.NodePublishVolume(a)
    first.kill()
    unmount(a.target_path)  # kubelet tore the pod down while no driver was running

    processes.append(PluginProcess(node))
    with connect(node.endpoint) as c:
        b = publish_request(node, JOB_B)
        c.node.NodePublishVolume(b)
        assert mounts_at(b.target_path) == 1


def test_restart_with_a_new_size_resizes_and_keeps_the_data(node: Node, processes: list) -> None:
    processes.append(first := PluginProcess(node, "32Mi"))
    (node.ramdisk / JOB_A).mkdir()
    (node.ramdisk / JOB_A / "kept").write_bytes(b"x" * 4096)
    first.kill()
    processes.append(PluginProcess(node, "48Mi"))
    st = os.statvfs(node.ramdisk)
    assert st.f_blocks * st.f_frsize == 48 * MiB
    assert (node.ramdisk / JOB_A / "kept").read_bytes() == b"x" * 4096


def test_a_non_tmpfs_mount_at_the_ramdisk_path_is_refused(node: Node) -> None:
    elsewhere = node.base / "disk"
    elsewhere.mkdir()
    node.ramdisk.mkdir()
    bind_mount(elsewhere, node.ramdisk, readonly=False)
    with pytest.raises(RuntimeError, match="refusing to stack a ramdisk"):
        ensure_ramdisk(node.ramdisk, 16 * MiB)


def test_health_and_metrics_endpoints(node: Node, processes: list) -> None:
    processes.append(proc := PluginProcess(node, "16Mi", "--health-address", "127.0.0.1:0"))
    port = int(re.search(r"/metrics on port (\d+)", proc.output()).group(1))
    with connect(node.endpoint) as c:
        c.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tierckpt_csi_calls_total", (("code", "OK"), ("method", "GetPluginInfo")))] >= 1
    assert samples[("tierckpt_ramdisk_size_bytes", ())] == 16 * MiB
    probe = [sys.executable, "-m", "tierckpt_csi", "probe", "--endpoint", node.endpoint]
    ready = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert ready.returncode == 0 and "ready" in ready.stdout
    proc.terminate()
    gone = subprocess.run([*probe, "--timeout", "1"], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 1
