"""The node plugin's operations: publish a job's ramdisk directory into a pod, unpublish it, report use.

``NodePlugin`` is the logic behind the CSI Node service, free of gRPC types except the checked
``Publish`` request. All mutations run under one lock: kubelet may call concurrently, and admission
needs a consistent view of the node's reservations. Every publish is admitted: a job's later volume
that asks for no more than the job already holds changes nothing; one that asks for more is admitted
with its larger reservation (or refused), so no pod can grow a job's reservation past admission.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from tierckpt_csi.admission import JobUse, admit, mem_available
from tierckpt_csi.errors import already_exists, failed_precondition, not_found, resource_exhausted
from tierckpt_csi.mounts import MountEntry, bind_mount, mount_at, read_mountinfo, unmount
from tierckpt_csi.ramdisk import Ramdisk, RamdiskUsage, tree_bytes
from tierckpt_csi.requests import Publish, check_target
from tierckpt_csi.volumes import VolumeRecord, VolumeStore

__all__ = ["NodePlugin", "PluginSettings", "VolumeStats"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    node_id: str
    pods_dir: Path
    """kubelet's pods directory: every target path must lie under it."""
    default_reservation: int | None = None
    """Bytes a job reserves when its volume names none; None: the whole ramdisk (one job per node)."""
    memory_headroom: int = 1 << 30
    require_namespace_match: bool = True
    meminfo_path: str = "/proc/meminfo"


@dataclasses.dataclass(frozen=True)
class VolumeStats:
    job: str
    used: int
    available: int
    total: int
    inodes_used: int
    inodes_free: int


class NodePlugin:
    def __init__(self, ramdisk: Ramdisk, settings: PluginSettings) -> None:
        self.ramdisk = ramdisk
        self.settings = settings
        self.store = VolumeStore(ramdisk.path)
        self._lock = threading.Lock()
        with self._lock:
            live = self.store.live(read_mountinfo(), ramdisk.device)
        log.info(
            "node plugin ready on %s: ramdisk %s, %d volume(s) published",
            settings.node_id,
            ramdisk.path,
            len(live),
        )

    # ------------------------------------------------------------------------------------ queries

    def usage(self) -> RamdiskUsage:
        return self.ramdisk.usage()

    def reservation_of(self, asked: int | None) -> int:
        if asked is not None:
            return asked
        return self.settings.default_reservation or self.usage().size

    def active_jobs(self, records: list[VolumeRecord]) -> dict[str, JobUse]:
        reserved: dict[str, int] = {}
        for r in records:
            reserved[r.job] = max(reserved.get(r.job, 0), r.reservation)
        return {job: JobUse(res, tree_bytes(self.ramdisk.job_path(job))) for job, res in reserved.items()}

    def published(self) -> list[VolumeRecord]:
        with self._lock:
            return self.store.live(read_mountinfo(), self.ramdisk.device)

    # ------------------------------------------------------------------------------------ publish

    def publish(self, req: Publish) -> bool:
        """Bind the job's directory at the target. Returns False if it already was (idempotent)."""
        with self._lock:
            mounts = read_mountinfo()
            if self._already_published(req, mounts):
                return False
            live = self.store.live(mounts, self.ramdisk.device)
            reservation = self.reservation_of(req.reservation)
            held = max((r.reservation for r in live if r.job == req.job), default=None)
            if held is None or reservation > held:  # a new job, or a job asking for more: admitted again
                self._admit(req.job, reservation, live)
            self._bind(req, reservation)
            return True

    def _already_published(self, req: Publish, mounts: list[MountEntry]) -> bool:
        entry = mount_at(req.target, mounts)
        record = self.store.get(req.volume_id)
        if entry is None:
            return False
        ours = entry.device == self.ramdisk.device
        if not ours or entry.root != f"/{req.job}":
            what = f"job {entry.root.lstrip('/')}'s ramdisk directory" if ours else f"a {entry.fstype} mount"
            raise already_exists(f"{req.target} already holds {what}; cannot publish job {req.job} there")
        if record is not None and (record.readonly != req.readonly or record.target_path != str(req.target)):
            raise already_exists(
                f"volume {req.volume_id} is already published at {record.target_path} "
                f"(readonly={record.readonly}) and the request differs"
            )
        if record is None:  # mounted before a restart lost the record: adopt it
            self.store.put(self._record(req, self.reservation_of(req.reservation)))
        return True

    def _admit(self, job: str, reservation: int, live: list[VolumeRecord]) -> None:
        usage = self.usage()
        verdict = admit(
            job,
            JobUse(reservation, tree_bytes(self.ramdisk.job_path(job))),
            self.active_jobs(live),
            ramdisk_size=usage.size,
            ramdisk_used=usage.used,
            mem_available=mem_available(self.settings.meminfo_path),
            headroom=self.settings.memory_headroom,
        )
        if not verdict.admitted:
            log.warning("refused job %s on node %s: %s", job, self.settings.node_id, verdict.reason)
            raise resource_exhausted(verdict.reason)

    def _record(self, req: Publish, reservation: int) -> VolumeRecord:
        return VolumeRecord(
            volume_id=req.volume_id,
            job=req.job,
            target_path=str(req.target),
            readonly=req.readonly,
            reservation=reservation,
            pod_namespace=req.pod_namespace,
            pod_name=req.pod_name,
            pod_uid=req.pod_uid,
            published_at=time.time(),
        )

    def _job_dir(self, req: Publish) -> Path:
        path = self.ramdisk.job_path(req.job)
        path.mkdir(mode=0o755, exist_ok=True)
        if req.mount_group is not None:
            os.chown(path, -1, req.mount_group)
            os.chmod(path, 0o2775)  # setgid: files the pod creates stay in its fsGroup
        return path

    def _bind(self, req: Publish, reservation: int) -> None:
        source = self._job_dir(req)
        req.target.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.store.put(self._record(req, reservation))
        try:
            bind_mount(source, req.target, readonly=req.readonly)
        except OSError:
            self.store.delete(req.volume_id)
            with contextlib.suppress(OSError):
                req.target.rmdir()
            raise
        log.info(
            "published job %s for pod %s/%s at %s (reservation %d bytes, readonly=%s)",
            req.job,
            req.pod_namespace,
            req.pod_name,
            req.target,
            reservation,
            req.readonly,
        )

    # ------------------------------------------------------------------------------------ unpublish

    def unpublish(self, volume_id: str, target_path: str) -> bool:
        """Unmount and remove the target. Returns False if there was nothing to undo (idempotent)."""
        target = check_target(target_path, self.settings.pods_dir)
        with self._lock:
            did = False
            while (entry := mount_at(target)) is not None:
                if entry.device != self.ramdisk.device:
                    raise failed_precondition(
                        f"{target} holds a {entry.fstype} mount, not the tierckpt ramdisk; not unmounting it"
                    )
                unmount(target)
                did = True
            self._remove_target(target)
            self.store.delete(volume_id)
        if did:
            log.info("unpublished volume %s from %s (the job's data stays on the ramdisk)", volume_id, target)
        return did

    @staticmethod
    def _remove_target(target: Path) -> None:
        try:
            target.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise failed_precondition(f"cannot remove {target} after unmounting: {exc.strerror}") from exc

    # ------------------------------------------------------------------------------------ stats

    def volume_stats(self, volume_path: str) -> VolumeStats:
        target = os.path.realpath(volume_path)
        record = next((r for r in self.store.all() if r.target_path == target), None)
        entry = mount_at(target)
        if record is None or entry is None or entry.device != self.ramdisk.device:
            raise not_found(f"no tierckpt volume is published at {volume_path}")
        used = tree_bytes(self.ramdisk.job_path(record.job))
        st = os.statvfs(self.ramdisk.path)
        free = st.f_bavail * st.f_frsize
        return VolumeStats(
            job=record.job,
            used=used,
            available=max(min(record.reservation - used, free), 0),
            total=record.reservation,
            inodes_used=st.f_files - st.f_ffree,
            inodes_free=st.f_ffree,
        )
