"""The Kubernetes resources the operator reads and writes, and the typed view of a CheckpointConfiguration.

Pure: names and parsing only. The CRD YAMLs live in ``charts/tierckpt/crds/``; the defaults below are
the same as the CRD's (a test compares them), because the apiserver applies the CRD defaults but an
object read before defaulting (or an emulator) may lack them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.control import MAX_ERASURE_FRAGMENTS
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.protocol.quantity import parse_quantity
from tierckpt_operator.kube_rules import check_node_selector, check_positive_quantity, check_tolerations

__all__ = [
    "CONFIGS",
    "GROUP",
    "JOBS",
    "JOBSETS",
    "JOBSET_GROUP",
    "JOBSET_VERSION",
    "VERSION",
    "BackupPolicy",
    "ConfigSpec",
    "Retention",
]

GROUP = "tierckpt.io"
VERSION = "v1alpha1"
CONFIGS = "checkpointconfigurations"
JOBS = "checkpointjobs"
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSETS = "jobsets"

_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


@dataclasses.dataclass(frozen=True)
class Retention:
    keep_last: int = 3
    """Newest backups kept."""
    keep_every: int = 0
    """Also keep every backup whose step is a multiple of this (0 = none)."""


@dataclasses.dataclass(frozen=True)
class BackupPolicy:
    interval_steps: int = 0
    """Back up every N steps (0 = not by steps)."""
    interval_minutes: int = 30
    """Back up at most every N minutes (0 = not by time)."""
    retention: Retention = Retention()


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """A CheckpointConfiguration's spec, defaulted and checked."""

    name: str
    bucket: str
    prefix: str = "tierckpt"
    ramdisk_size: str = "64Gi"
    ramdisk_bytes: int = 64 << 30
    """``ramdisk_size`` in bytes: the job's reservation on each node, and its quota in the replicators
    (no rank's step can legitimately be larger; ``JobPolicy.quota_bytes``)."""
    mount_root: str = "/tierckpt"
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, Any], ...] = ()
    backup: BackupPolicy = BackupPolicy()
    replication_factor: int = 1
    erasure_data: int = 0
    erasure_parity: int = 0
    failure_domain_label: str = "topology.kubernetes.io/zone"
    delete_backups: bool = False
    generation: int = 0

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ConfigSpec:
        """Parse a CheckpointConfiguration object; a ``ContractError`` names the bad field."""
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        gcs = _obj(spec, "gcs")
        ramdisk = _obj(spec, "ramdisk")
        backup = _obj(spec, "backup")
        retention = _obj(backup, "retention")
        replication = _obj(spec, "replication")
        erasure = _obj(replication, "erasure")
        erasure_data, erasure_parity = _int(erasure, "data", 0, 0, 15), _int(erasure, "parity", 0, 0, 15)
        if (erasure_data, erasure_parity) != (0, 0) and not (
            erasure_data >= 1
            and erasure_parity >= 1
            and erasure_data + erasure_parity <= MAX_ERASURE_FRAGMENTS
        ):
            raise ContractError(
                "spec.replication.erasure needs data >= 1 and parity >= 1, at most "
                f"{MAX_ERASURE_FRAGMENTS} in all (or both 0 for replicas)"
            )
        bucket = gcs.get("bucket")
        if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket):
            raise ContractError(f"spec.gcs.bucket {bucket!r} is not a valid bucket name")
        prefix = _str(gcs, "prefix", cls.prefix)
        try:
            BucketLayout(prefix)
        except FormatError as exc:
            raise ContractError(f"spec.gcs.prefix: {exc}") from exc
        size = check_positive_quantity(ramdisk.get("size", cls.ramdisk_size), "spec.ramdisk.size")
        try:
            size_bytes = parse_quantity(size)
        except ValueError as exc:
            raise ContractError(f"spec.ramdisk.size: {exc}") from exc
        mount_root = ramdisk.get("mountRoot", cls.mount_root)
        if not isinstance(mount_root, str) or not mount_root.startswith("/") or ".." in mount_root.split("/"):
            raise ContractError(f"spec.ramdisk.mountRoot {mount_root!r} must be an absolute path")
        # copied into every opted-in pod: checked as Kubernetes would, before anything is copied
        selector = check_node_selector(spec.get("nodeSelector") or {})
        tolerations = check_tolerations(spec.get("tolerations") or [])
        return cls(
            name=str(meta.get("name", "")),
            bucket=bucket,
            prefix=prefix,
            ramdisk_size=size,
            ramdisk_bytes=size_bytes,
            mount_root=mount_root.rstrip("/") or "/",
            node_selector=selector,
            tolerations=tolerations,
            backup=BackupPolicy(
                interval_steps=_int(backup, "intervalSteps", BackupPolicy.interval_steps, 0),
                interval_minutes=_int(backup, "intervalMinutes", BackupPolicy.interval_minutes, 0),
                retention=Retention(
                    keep_last=_int(retention, "keepLast", Retention.keep_last, 1),
                    keep_every=_int(retention, "keepEvery", Retention.keep_every, 0),
                ),
            ),
            replication_factor=_int(replication, "factor", cls.replication_factor, 0, 8),
            erasure_data=erasure_data,
            erasure_parity=erasure_parity,
            failure_domain_label=_str(replication, "failureDomainLabel", cls.failure_domain_label),
            delete_backups=bool(spec.get("deleteBackupsOnJobSetDeletion", False)),
            generation=int(meta.get("generation") or 0),
        )

    @property
    def peers_per_node(self) -> int:
        """Nodes each node sends to: its replicas' holders, or with erasure coding its k + m fragments'."""
        return self.erasure_data + self.erasure_parity if self.erasure_data else self.replication_factor

    def selects(self, node_labels: Mapping[str, str]) -> bool:
        """Whether a node with these labels is one of this configuration's nodes."""
        return all(node_labels.get(k) == v for k, v in self.node_selector)

    def domain_of(self, node_labels: Mapping[str, str]) -> str:
        """The node's failure domain: the value of the configured label ("" when the label is absent)."""
        return node_labels.get(self.failure_domain_label, "")


def _obj(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = parent.get(key) or {}
    if not isinstance(value, Mapping):
        raise ContractError(f"spec field {key!r} must be an object")
    return value


def _str(parent: Mapping[str, Any], key: str, default: str) -> str:
    value = parent.get(key, default)
    if not isinstance(value, str):
        raise ContractError(f"spec field {key!r} must be a string, got {value!r}")
    return value


def _int(parent: Mapping[str, Any], key: str, default: int, lo: int, hi: int | None = None) -> int:
    value = parent.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ContractError(f"spec field {key!r} must be an integer {bound}, got {value!r}")
    return value
