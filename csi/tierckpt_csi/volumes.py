"""Published volumes, recorded on the ramdisk itself so they survive driver restarts (and die with it).

Each NodePublishVolume writes a ``VolumeRecord`` before it mounts; NodeUnpublishVolume deletes it after
it unmounts. Records whose target is no longer a bind mount of the ramdisk (a crash between the two
steps, or a node whose kubelet cleaned up while the driver was down) are stale and dropped on load.
The directory is hidden (``.tierckpt-csi``): not a valid job id, so replicators skip it, and no pod sees
it because pods get only their job's directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
from pathlib import Path

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import write_atomic
from tierckpt_csi.mounts import MountEntry

__all__ = ["STATE_DIR_NAME", "VolumeRecord", "VolumeStore"]

log = logging.getLogger(__name__)

STATE_DIR_NAME = ".tierckpt-csi"


@dataclasses.dataclass(frozen=True)
class VolumeRecord(Message):
    """One published inline volume: which job's directory is bound where, for which pod."""

    KIND = "tierckpt.csi-volume"
    VERSION = 1

    volume_id: str
    job: str
    target_path: str
    readonly: bool
    reservation: int
    pod_namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    published_at: float = 0.0


class VolumeStore:
    """The records under ``<ramdisk>/.tierckpt-csi/volumes/``, one JSON file per volume id."""

    def __init__(self, ramdisk: Path) -> None:
        self.dir = ramdisk / STATE_DIR_NAME / "volumes"
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir.parent, 0o700)

    def _path(self, volume_id: str) -> Path:
        # Volume ids are arbitrary strings in CSI; hash them into safe file names.
        return self.dir / (hashlib.sha256(volume_id.encode()).hexdigest()[:40] + ".json")

    def get(self, volume_id: str) -> VolumeRecord | None:
        try:
            record = VolumeRecord.from_bytes(self._path(volume_id).read_bytes())
        except FileNotFoundError:
            return None
        except FormatError as exc:
            log.warning("dropping unreadable volume record for %s: %s", volume_id, exc)
            self.delete(volume_id)
            return None
        return record if record.volume_id == volume_id else None

    def put(self, record: VolumeRecord) -> None:
        write_atomic(self._path(record.volume_id), record.to_bytes())

    def delete(self, volume_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(volume_id))

    def all(self) -> list[VolumeRecord]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append(VolumeRecord.from_bytes(path.read_bytes()))
            except (FileNotFoundError, FormatError) as exc:
                log.warning("ignoring unreadable volume record %s: %s", path.name, exc)
        return out

    def live(self, mounts: list[MountEntry], device: str) -> list[VolumeRecord]:
        """Records whose target is still a bind mount of the ramdisk (``device``); drops the rest."""
        bound = {(m.mount_point, m.root) for m in mounts if m.device == device}
        keep = []
        for record in self.all():
            if (os.path.realpath(record.target_path), f"/{record.job}") in bound:
                keep.append(record)
            else:
                log.info(
                    "dropping stale record of volume %s (job %s): %s is no longer mounted",
                    record.volume_id,
                    record.job,
                    record.target_path,
                )
                self.delete(record.volume_id)
        return keep
