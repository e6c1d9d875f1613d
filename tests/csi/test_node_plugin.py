"""The CSI node plugin through its real gRPC interface on a unix socket, with real tmpfs and bind mounts."""

from __future__ import annotations

import errno
import os
import stat
import uuid

import grpc
import pytest

import tierckpt
from tests.csi.csi_helpers import MiB, Node, mounts_at, publish_request, thread_plugin, unpublish_request
from tierckpt.protocol.contract import Csi
from tierckpt_csi._proto import csi_pb2
from tierckpt_csi.volumes import STATE_DIR_NAME

pytestmark = [pytest.mark.root, pytest.mark.e2e]

JOB_A = "team-a_llama_0a1b2c3d"
JOB_B = "team-a_mixtral_4e5f6a7b"


def _code(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


def test_identity_and_node_info(node: Node) -> None:
    with thread_plugin(node) as c:
        info = c.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
        assert (info.name, info.vendor_version) == (Csi.DRIVER, tierckpt.__version__)
        plugin_caps = c.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
        assert list(plugin_caps.capabilities) == []
        assert c.identity.Probe(csi_pb2.ProbeRequest()).ready.value is True
        caps = c.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities
        rpc = csi_pb2.NodeServiceCapability.RPC
        assert {cap.rpc.type for cap in caps} == {rpc.GET_VOLUME_STATS, rpc.VOLUME_MOUNT_GROUP}
        assert c.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-a"
        # Services this driver does not offer answer UNIMPLEMENTED, as CSI requires.
        code, _ = _code(c.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(volume_id="v"))
        assert code == grpc.StatusCode.UNIMPLEMENTED


def test_publish_binds_the_job_directory_and_unpublish_keeps_its_data(node: Node) -> None:
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A)
        c.node.NodePublishVolume(req)
        target = req.target_path
        assert mounts_at(target) == 1
        (node.ramdisk / JOB_A / "from-ramdisk").write_bytes(b"node side")
        with open(os.path.join(target, "rank-00000"), "wb") as f:
            f.write(b"pod side")
        assert sorted(os.listdir(target)) == ["from-ramdisk", "rank-00000"]
        assert (node.ramdisk / JOB_A / "rank-00000").read_bytes() == b"pod side"

        c.node.NodeUnpublishVolume(unpublish_request(req))
        assert mounts_at(target) == 0 and not os.path.exists(target)
        # The checkpoint outlives the pod: that is the point of the ramdisk.
        assert (node.ramdisk / JOB_A / "rank-00000").read_bytes() == b"pod side"
        assert list((node.ramdisk / STATE_DIR_NAME / "volumes").iterdir()) == []


def test_publish_and_unpublish_are_idempotent(node: Node) -> None:
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A)
        c.node.NodePublishVolume(req)
        c.node.NodePublishVolume(req)
        assert mounts_at(req.target_path) == 1
        c.node.NodeUnpublishVolume(unpublish_request(req))
        c.node.NodeUnpublishVolume(unpublish_request(req))
        never = publish_request(node, JOB_A)
        c.node.NodeUnpublishVolume(unpublish_request(never))  # never published: still OK
        assert mounts_at(req.target_path) == 0


def test_incompatible_republish_is_already_exists(node: Node) -> None:
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A)
        c.node.NodePublishVolume(req)
        ro = csi_pb2.NodePublishVolumeRequest()
        ro.CopyFrom(req)
        ro.readonly = True
        assert _code(c.node.NodePublishVolume, ro)[0] == grpc.StatusCode.ALREADY_EXISTS
        other_job = csi_pb2.NodePublishVolumeRequest()
        other_job.CopyFrom(req)
        other_job.volume_id = "csi-other"
        other_job.volume_context[Csi.JOB_ID] = JOB_B
        assert _code(c.node.NodePublishVolume, other_job)[0] == grpc.StatusCode.ALREADY_EXISTS
        assert mounts_at(req.target_path) == 1


def test_pods_see_only_their_own_job(node: Node) -> None:
    with thread_plugin(node, default_reservation=16 * MiB) as c:
        a, b = publish_request(node, JOB_A), publish_request(node, JOB_B)
        c.node.NodePublishVolume(a)
        c.node.NodePublishVolume(b)
        with open(os.path.join(b.target_path, "secret-of-b"), "wb") as f:
            f.write(b"b")
        with open(os.path.join(a.target_path, "mine"), "wb") as f:
            f.write(b"a")
        assert os.listdir(a.target_path) == ["mine"]
        assert os.listdir(b.target_path) == ["secret-of-b"]
        # Nothing above the job directory is reachable through the mount.
        assert os.path.realpath(os.path.join(a.target_path, "..")) == os.path.dirname(a.target_path)
        assert not os.path.exists(os.path.join(a.target_path, "..", JOB_B))

        # A pod of another namespace cannot name this namespace's job.
        thief = publish_request(node, JOB_A, namespace="team-b")
        code, details = _code(c.node.NodePublishVolume, thief)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in details
        assert not os.path.exists(thief.target_path)


def test_readonly_publish_cannot_be_written(node: Node) -> None:
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A, readonly=True)
        c.node.NodePublishVolume(req)
        with pytest.raises(OSError) as info:
            open(os.path.join(req.target_path, "x"), "wb").close()
        assert info.value.errno == errno.EROFS


def test_volume_mount_group_makes_the_job_dir_group_writable(node: Node) -> None:
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A, mount_group="2000")
        c.node.NodePublishVolume(req)
        st = os.stat(node.ramdisk / JOB_A)
        assert st.st_gid == 2000
        assert stat.S_IMODE(st.st_mode) == 0o2775


def test_overcommitted_ramdisk_is_resource_exhausted(node: Node) -> None:
    with thread_plugin(node) as c:  # 64 MiB ramdisk, a job reserves all of it by default
        a1, a2 = publish_request(node, JOB_A), publish_request(node, JOB_A)
        c.node.NodePublishVolume(a1)
        c.node.NodePublishVolume(a2)  # a second pod of an admitted job needs no new reservation
        b = publish_request(node, JOB_B, reservation="8Mi")
        code, details = _code(c.node.NodePublishVolume, b)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "overcommitted" in details and JOB_A in details
        assert not os.path.exists(b.target_path)
        too_big = publish_request(node, "team-c_big_00000000", reservation="1Gi")
        code, details = _code(c.node.NodePublishVolume, too_big)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "only 64.0Mi" in details
        # The reservation lasts while any pod of job A has its volume; then it is released (data stays).
        c.node.NodeUnpublishVolume(unpublish_request(a1))
        assert _code(c.node.NodePublishVolume, b)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.node.NodeUnpublishVolume(unpublish_request(a2))
        c.node.NodePublishVolume(b)
        assert mounts_at(b.target_path) == 1


def test_every_publish_is_admitted_a_second_volume_cannot_grow_the_reservation(node: Node) -> None:
    """Defect 5: a pod of an admitted job mounting another volume of that job with a bigger reservation
    went unchecked, and the node then refused every other job."""
    with thread_plugin(node) as c:  # 64 MiB ramdisk
        c.node.NodePublishVolume(publish_request(node, JOB_A, reservation="8Mi"))
        same = publish_request(node, JOB_A, reservation="8Mi")
        c.node.NodePublishVolume(same)  # the same reservation again: nothing to admit
        greedy = publish_request(node, JOB_A, reservation="1Gi")
        code, details = _code(c.node.NodePublishVolume, greedy)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "only 64.0Mi" in details
        assert not os.path.exists(greedy.target_path)
        hog = publish_request(node, JOB_A, reservation="60Mi")
        b = publish_request(node, JOB_B, reservation="40Mi")
        c.node.NodePublishVolume(b)  # job A still holds 8 MiB: B fits
        assert _code(c.node.NodePublishVolume, hog)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # 60 + 40 > 64
        assert mounts_at(b.target_path) == 1 and mounts_at(same.target_path) == 1
        grown = publish_request(node, JOB_A, reservation="20Mi")
        c.node.NodePublishVolume(grown)  # more, but it fits next to B: admitted with 20 MiB
        third = publish_request(node, "team-a_extra_11111111", reservation="8Mi")
        assert _code(c.node.NodePublishVolume, third)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # 20+40+8 > 64


def test_reservations_that_fit_are_admitted_together(node: Node) -> None:
    with thread_plugin(node) as c:
        a = publish_request(node, JOB_A, reservation="40Mi")
        b = publish_request(node, JOB_B, reservation="24Mi")
        c.node.NodePublishVolume(a)
        c.node.NodePublishVolume(b)
        third = publish_request(node, "team-a_extra_11111111", reservation="1Mi")
        assert _code(c.node.NodePublishVolume, third)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.node.NodeUnpublishVolume(unpublish_request(b))
        c.node.NodePublishVolume(third)
        assert mounts_at(third.target_path) == 1


def test_memory_overcommit_is_resource_exhausted(node: Node) -> None:
    # No node has MemAvailable beyond a petabyte of headroom: the ramdisk's possible growth cannot fit.
    with thread_plugin(node, memory_headroom=1 << 50) as c:
        req = publish_request(node, JOB_A)
        code, details = _code(c.node.NodePublishVolume, req)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "MemAvailable" in details and "memory overcommitted" in details
        assert mounts_at(req.target_path) == 0


def _without(req: csi_pb2.NodePublishVolumeRequest, edit) -> csi_pb2.NodePublishVolumeRequest:
    out = csi_pb2.NodePublishVolumeRequest()
    out.CopyFrom(req)
    edit(out)
    return out


BAD_PUBLISHES = {
    "no volume id": lambda r: r.ClearField("volume_id"),
    "no target path": lambda r: r.ClearField("target_path"),
    "no capability": lambda r: r.ClearField("volume_capability"),
    "block access": lambda r: r.volume_capability.block.SetInParent(),
    "multi-node access": lambda r: setattr(
        r.volume_capability.access_mode, "mode", csi_pb2.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER
    ),
    "not ephemeral": lambda r: r.volume_context.pop("csi.storage.k8s.io/ephemeral"),
    "no pod info": lambda r: r.volume_context.pop("csi.storage.k8s.io/pod.uid"),
    "no job id": lambda r: r.volume_context.pop(Csi.JOB_ID),
    "job id traversal": lambda r: r.volume_context.__setitem__(Csi.JOB_ID, "team-a_../../etc"),
    "job id dot-dot": lambda r: r.volume_context.__setitem__(Csi.JOB_ID, ".."),
    "bad reservation": lambda r: r.volume_context.__setitem__(Csi.RESERVATION, "lots"),
    "relative target": lambda r: setattr(r, "target_path", "pods/x/mount"),
    "target traversal": lambda r: setattr(r, "target_path", r.target_path + "/../../../../../../etc"),
    "target outside pods dir": lambda r: setattr(r, "target_path", "/etc/tierckpt-test"),
    "target in another pod": lambda r: setattr(
        r, "target_path", r.target_path.replace(r.volume_context["csi.storage.k8s.io/pod.uid"], "other-pod")
    ),
    "staging path": lambda r: setattr(r, "staging_target_path", "/var/lib/kubelet/plugins/x"),
    "non-numeric group": lambda r: setattr(r.volume_capability.mount, "volume_mount_group", "wheel"),
    "superscript-digit group": lambda r: setattr(r.volume_capability.mount, "volume_mount_group", "\u00b2"),
    "arabic-digit group": lambda r: setattr(r.volume_capability.mount, "volume_mount_group", "\u0662\u0660"),
    "negative group": lambda r: setattr(r.volume_capability.mount, "volume_mount_group", "-1"),
    "group past the gid range": lambda r: setattr(
        r.volume_capability.mount, "volume_mount_group", "4294967295"
    ),
    "huge group": lambda r: setattr(r.volume_capability.mount, "volume_mount_group", "9" * 40),
    "reservation 1e400": lambda r: r.volume_context.__setitem__(Csi.RESERVATION, "1e400"),
    "reservation NaN": lambda r: r.volume_context.__setitem__(Csi.RESERVATION, "NaN"),
    "job id with a newline": lambda r: r.volume_context.__setitem__(Csi.JOB_ID, "team-a_llama_0a1b2c3d\n"),
    "job id with unicode digits": lambda r: r.volume_context.__setitem__(Csi.JOB_ID, "team-a_llama_\u0661"),
    "pod uid with a slash": lambda r: r.volume_context.__setitem__("csi.storage.k8s.io/pod.uid", "a/b"),
}


@pytest.mark.parametrize("case", sorted(BAD_PUBLISHES))
def test_bad_publish_is_invalid_argument(node: Node, case: str) -> None:
    with thread_plugin(node) as c:
        req = _without(publish_request(node, JOB_A), BAD_PUBLISHES[case])
        code, details = _code(c.node.NodePublishVolume, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details
        assert not os.path.exists("/etc/tierckpt-test")
        assert not (node.ramdisk / JOB_A).exists()


def test_symlinked_target_parent_cannot_escape_the_pods_dir(node: Node) -> None:
    outside = node.base / "outside"
    outside.mkdir()
    pod = str(uuid.uuid4())
    (node.pods / pod / "volumes").mkdir(parents=True)
    os.symlink(outside, node.pods / pod / "volumes" / "kubernetes.io~csi")
    with thread_plugin(node) as c:
        req = publish_request(node, JOB_A, pod_uid=pod)
        code, _ = _code(c.node.NodePublishVolume, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert list((outside / "tierckpt").iterdir()) == []  # kubelet made the parent; we made nothing
        assert mounts_at(outside / "tierckpt" / "mount") == 0


def test_bad_unpublish_is_invalid_argument(node: Node) -> None:
    with thread_plugin(node) as c:
        for req in (
            csi_pb2.NodeUnpublishVolumeRequest(target_path=str(node.target("p"))),
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="v"),
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=str(node.ramdisk)),
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=f"{node.pods}/p/../../../ramdisk"),
        ):
            assert _code(c.node.NodeUnpublishVolume, req)[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert mounts_at(node.ramdisk) == 1


def test_volume_stats_report_the_jobs_bytes(node: Node) -> None:
    with thread_plugin(node, default_reservation=32 * MiB) as c:
        req = publish_request(node, JOB_A)
        c.node.NodePublishVolume(req)
        with open(os.path.join(req.target_path, "shard"), "wb") as f:
            f.write(os.urandom(3 * MiB))
        resp = c.node.NodeGetVolumeStats(
            csi_pb2.NodeGetVolumeStatsRequest(volume_id=req.volume_id, volume_path=req.target_path)
        )
        by_unit = {u.unit: u for u in resp.usage}
        nbytes = by_unit[csi_pb2.VolumeUsage.BYTES]
        assert nbytes.used >= 3 * MiB and nbytes.total == 32 * MiB
        assert nbytes.available == nbytes.total - nbytes.used
        missing = csi_pb2.NodeGetVolumeStatsRequest(volume_id="x", volume_path=str(node.target("nobody")))
        assert _code(c.node.NodeGetVolumeStats, missing)[0] == grpc.StatusCode.NOT_FOUND
