"""Validation of NodePublish/NodeUnpublish requests into plain, checked values (pure but for realpath).

Every rule here is a security or correctness boundary: a target path must lie under kubelet's pods
directory (and, with pod info, under that pod's own directory) with no traversal or symlink escape; the
job id must be a safe path component (``tierckpt.protocol.format.check_job_id``) and, by default, belong to
the
pod's namespace, so a pod can only ever be given its own namespace's job directories.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path, PurePosixPath

from tierckpt.protocol.contract import Csi
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import check_job_id
from tierckpt.protocol.quantity import parse_quantity
from tierckpt_csi._proto import csi_pb2
from tierckpt_csi.errors import invalid

__all__ = ["EPHEMERAL", "POD_NAME", "POD_NAMESPACE", "POD_UID", "Publish", "check_target", "parse_publish"]

EPHEMERAL = "csi.storage.k8s.io/ephemeral"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"

MAX_GID = 2**32 - 2
"""The largest group id (``(gid_t)-1`` means "no change" to chown)."""
_GID_RE = re.compile(r"[0-9]{1,10}")
_UID_RE = re.compile(r"[0-9A-Za-z-]{1,64}")
_DNS_LABEL_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")

_SINGLE_NODE_MODES = {
    csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER,
    csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
    csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_SINGLE_WRITER,
    csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_MULTI_WRITER,
}


@dataclasses.dataclass(frozen=True)
class Publish:
    volume_id: str
    target: Path
    job: str
    readonly: bool
    reservation: int | None
    """Bytes asked for through the volume attribute, or None for the driver's default."""
    mount_group: int | None
    """The pod's fsGroup, passed by kubelet when the driver has VOLUME_MOUNT_GROUP."""
    pod_namespace: str
    pod_name: str
    pod_uid: str


def check_target(target_path: str, pods_dir: Path, pod_uid: str = "") -> Path:
    """The target path, resolved, if it is safely inside kubelet's pods dir (and the pod's own dir)."""
    if not target_path:
        raise invalid("target_path is required")
    pure = PurePosixPath(target_path)
    if not pure.is_absolute() or any(part in (".", "..") for part in target_path.split("/")[1:] if part):
        raise invalid(f"target_path {target_path!r} must be an absolute path without . or .. components")
    parent = Path(os.path.realpath(pure.parent))
    target = parent / pure.name
    if target.is_symlink():
        raise invalid(f"target_path {target_path!r} is a symbolic link")
    root = Path(os.path.realpath(pods_dir))
    if pod_uid:
        if not _safe_name(pod_uid):
            raise invalid(f"pod uid {pod_uid!r} is not a valid uid")
        root = root / pod_uid
    if root not in target.parents:
        raise invalid(f"target_path {target_path!r} is outside {root}: refusing to mount there")
    return target


def _safe_name(name: str) -> bool:
    """A pod uid: ASCII letters, digits and dashes (Kubernetes uids are UUIDs)."""
    return bool(_UID_RE.fullmatch(name))


def _check_capability(req: csi_pb2.NodePublishVolumeRequest) -> int | None:
    if not req.HasField("volume_capability"):
        raise invalid("volume_capability is required")
    cap = req.volume_capability
    if cap.WhichOneof("access_type") != "mount":
        raise invalid("only mount access is supported (the ramdisk is a directory, not a block device)")
    if cap.access_mode.mode not in _SINGLE_NODE_MODES:
        raise invalid(
            f"access mode {csi_pb2.VolumeCapability.AccessMode.Mode.Name(cap.access_mode.mode)} "
            "is not supported: the ramdisk is node-local"
        )
    if cap.mount.fs_type not in ("", "tmpfs"):
        raise invalid(f"fs_type {cap.mount.fs_type!r} is not supported (the ramdisk is tmpfs)")
    group = cap.mount.volume_mount_group
    if group and not (_GID_RE.fullmatch(group) and int(group) <= MAX_GID):  # ASCII digits: "²" is not a gid
        raise invalid(f"volume_mount_group {group!r} is not a numeric gid in 0..{MAX_GID}")
    return int(group) if group else None


def _job(ctx: dict[str, str], namespace: str, require_namespace: bool) -> str:
    job = ctx.get(Csi.JOB_ID, "")
    if not job:
        raise invalid(f"volume attribute {Csi.JOB_ID!r} is required (the operator's webhook sets it)")
    try:
        check_job_id(job)
    except FormatError as exc:
        raise invalid(str(exc)) from exc
    if require_namespace and not job.startswith(f"{namespace}_"):
        raise invalid(
            f"job {job!r} does not belong to the pod's namespace {namespace!r}: a pod may only "
            "mount its own namespace's checkpoints"
        )
    return job


def _reservation(ctx: dict[str, str]) -> int | None:
    text = ctx.get(Csi.RESERVATION, "")
    if not text:
        return None
    try:
        value = parse_quantity(text)
    except ValueError as exc:
        raise invalid(f"volume attribute {Csi.RESERVATION!r}: {exc}") from exc
    if value <= 0:
        raise invalid(f"volume attribute {Csi.RESERVATION!r} must be positive, got {text!r}")
    return value


def parse_publish(
    req: csi_pb2.NodePublishVolumeRequest, *, pods_dir: Path, require_namespace: bool = True
) -> Publish:
    """Check a NodePublishVolume request; raise ``CsiError(INVALID_ARGUMENT)`` naming what is wrong."""
    if not req.volume_id:
        raise invalid("volume_id is required")
    ctx = dict(req.volume_context)
    if ctx.get(EPHEMERAL) != "true":
        raise invalid(
            f"{Csi.DRIVER} serves only inline ephemeral volumes (volume_context "
            f"{EPHEMERAL}=true); it has no persistent volumes"
        )
    if req.staging_target_path:
        raise invalid("staging_target_path given, but this driver does not stage volumes")
    namespace, uid = ctx.get(POD_NAMESPACE, ""), ctx.get(POD_UID, "")
    if not namespace or not uid:
        raise invalid("pod namespace and uid are missing: the CSIDriver object needs podInfoOnMount: true")
    if not _DNS_LABEL_RE.fullmatch(namespace):
        raise invalid(f"pod namespace {namespace!r} is not a Kubernetes namespace name")
    mount_group = _check_capability(req)
    return Publish(
        volume_id=req.volume_id,
        target=check_target(req.target_path, pods_dir, uid),
        job=_job(ctx, namespace, require_namespace),
        readonly=req.readonly,
        reservation=_reservation(ctx),
        mount_group=mount_group,
        pod_namespace=namespace,
        pod_name=ctx.get(POD_NAME, ""),
        pod_uid=uid,
    )
