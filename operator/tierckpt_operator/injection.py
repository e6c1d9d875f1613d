"""What the admission webhook adds to JobSets and pods of opted-in jobs (pure, idempotent).

JobSet (on CREATE): the label ``tierckpt.io/managed=true`` on every replicatedJob's pod template, so
their pods reach the pod webhook (its objectSelector) and the operator's pod watch.

Pod (on CREATE), ``inject(pod, Injection)``:

* the ramdisk: an inline CSI volume (driver ``Csi.DRIVER``, attributes job id and reservation), or a
  hostPath ``<host root>/<job id>``; mounted in every container at ``<mountRoot>/<job id>`` (a JobSet in
  Orbax mode: at ``<mountRoot>`` itself, Orbax's local checkpoint directory). Its
  name, ``tierckpt-ramdisk``, is reserved: a volume of the pod's own by that name (say a
  ``hostPath: /``) is REPLACED by ours, and every volumeMount of that name, in any container or init
  container, becomes exactly ours (our path, no subPath). Likewise ``tierckpt-podinfo``;
* the downward-API volume with the pod's annotations at ``TIERCKPT_PODINFO_DIR`` (the node rank
  arrives there, see ``tierckpt.protocol.contract.read_podinfo``);
* the environment of ``tierckpt.protocol.contract.Env``: job id, root, podinfo dir, the node-local replicator
  (``http://$(status.hostIP):<port>``), node, pod name and uid (in Orbax mode: no root, and
  ``JOBSET_NAME``, Orbax's default run name); variables the user set are kept;
* the configuration's node selector and tolerations, so the pod runs where replicators run;
* a *preferred* node affinity to the node that holds the rank this pod's indices map to.

Applying it twice gives the same pod, as the apiserver may re-invoke the webhook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tierckpt.protocol.contract import Annotations, Csi, Env, Labels

__all__ = [
    "AFFINITY_WEIGHT",
    "ORBAX_RUN_ENV",
    "PODINFO_VOLUME",
    "RAMDISK_VOLUME",
    "Injection",
    "inject",
    "label_pod_templates",
    "preferred_node",
]

RAMDISK_VOLUME = "tierckpt-ramdisk"
PODINFO_VOLUME = "tierckpt-podinfo"
_HOST_IP = "TIERCKPT_HOST_IP"
ORBAX_RUN_ENV = "JOBSET_NAME"
"""Orbax's run name when MaxText passes none (``initialize_multi_tier_checkpointing`` reads it)."""
AFFINITY_WEIGHT = 100


@dataclasses.dataclass(frozen=True)
class Injection:
    """Everything the pod mutation needs; built by the webhook from the JobSet and its configuration."""

    job_id: str
    mount_root: str = "/tierckpt"
    volume_mode: str = "csi"
    """``csi`` or ``hostPath``."""
    host_root: str = Csi.HOST_ROOT
    ramdisk_size: str = ""
    podinfo_dir: str = "/etc/tierckpt/podinfo"
    replicator_port: int = 8470
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict[str, Any], ...] = ()
    preferred_node: str | None = None
    mode: str = "native"
    """The JobSet's ``tierckpt.io/mode``."""
    jobset: str = ""
    """The JobSet's name (Orbax mode: ``JOBSET_NAME``)."""

    @property
    def mount_path(self) -> str:
        if self.mode == "orbax":  # Orbax's local checkpoint directory is a fixed path of the user's
            return self.mount_root.rstrip("/") or "/"
        return f"{self.mount_root.rstrip('/')}/{self.job_id}"

    def ramdisk_volume(self) -> dict[str, Any]:
        if self.volume_mode == "hostPath":
            path = f"{self.host_root.rstrip('/')}/{self.job_id}"
            return {"name": RAMDISK_VOLUME, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
        attributes = {Csi.JOB_ID: self.job_id}
        if self.ramdisk_size:
            attributes[Csi.RESERVATION] = self.ramdisk_size
        return {"name": RAMDISK_VOLUME, "csi": {"driver": Csi.DRIVER, "volumeAttributes": attributes}}

    def env(self) -> list[dict[str, Any]]:
        def field(path: str) -> dict[str, Any]:
            return {"fieldRef": {"fieldPath": path}}

        root = (
            [] if self.mode == "orbax" else [{"name": Env.ROOT, "value": self.mount_root.rstrip("/") or "/"}]
        )
        orbax = (
            [{"name": ORBAX_RUN_ENV, "value": self.jobset}] if self.mode == "orbax" and self.jobset else []
        )
        return [
            {"name": Env.JOB, "value": self.job_id},
            *root,
            *orbax,
            {"name": Env.PODINFO_DIR, "value": self.podinfo_dir},
            {"name": _HOST_IP, "valueFrom": field("status.hostIP")},
            {"name": Env.REPLICATOR_URL, "value": f"http://$({_HOST_IP}):{self.replicator_port}"},
            {"name": Env.NODE_NAME, "valueFrom": field("spec.nodeName")},
            {"name": Env.POD_NAME, "valueFrom": field("metadata.name")},
            {"name": Env.POD_UID, "valueFrom": field("metadata.uid")},
        ]


def label_pod_templates(jobset: dict[str, Any]) -> None:
    """Mark every replicatedJob's pods as managed (in place)."""
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        pod_template = rj.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {})
        labels = pod_template.setdefault("metadata", {}).setdefault("labels", {})
        labels[Labels.MANAGED] = "true"


def inject(pod: dict[str, Any], plan: Injection) -> None:
    """Add the ramdisk, podinfo, environment and placement to ``pod`` (in place, idempotent)."""
    meta = pod.setdefault("metadata", {})
    meta.setdefault("labels", {})[Labels.MANAGED] = "true"
    meta.setdefault("annotations", {})[Annotations.JOB_ID] = plan.job_id
    spec = pod.setdefault("spec", {})
    volumes = spec.setdefault("volumes", [])
    _put_by_name(volumes, plan.ramdisk_volume())
    _put_by_name(
        volumes,
        {
            "name": PODINFO_VOLUME,
            "downwardAPI": {
                "items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
            },
        },
    )
    ours = (
        {"name": RAMDISK_VOLUME, "mountPath": plan.mount_path},
        {"name": PODINFO_VOLUME, "mountPath": plan.podinfo_dir, "readOnly": True},
    )
    for container in spec.get("initContainers") or []:
        for mount in ours:  # an init container keeps only the mounts of our volumes it asked for
            if container.get("volumeMounts"):
                _put_by_name(container["volumeMounts"], mount, add=False)
    for container in spec.get("containers") or []:
        for mount in ours:
            _add_mount(container, mount)
        env = container.setdefault("env", [])
        for var in plan.env():
            _add_by_name(env, var)
    _place(spec, plan)


def _add_by_name(items: list[dict[str, Any]], item: dict[str, Any]) -> None:
    if not any(existing.get("name") == item["name"] for existing in items):
        items.append(item)


def _put_by_name(items: list[dict[str, Any]], item: dict[str, Any], *, add: bool = True) -> None:
    """``item`` is the one entry of its name: the first entry of that name becomes ``item``, later
    ones are dropped; without one, ``item`` is appended when ``add``."""
    named = [i for i, existing in enumerate(items) if existing.get("name") == item["name"]]
    for i in reversed(named[1:]):
        del items[i]
    if named:
        items[named[0]] = dict(item)
    elif add:
        items.append(dict(item))


def _add_mount(container: dict[str, Any], mount: dict[str, Any]) -> None:
    """Our mount replaces any of the same (reserved) name; it is added unless the container already
    mounts something else at its path (the user's choice for their own container)."""
    mounts = container.setdefault("volumeMounts", [])
    if any(m.get("name") == mount["name"] for m in mounts):
        _put_by_name(mounts, mount)
    elif not any(m.get("mountPath") == mount["mountPath"] for m in mounts):
        mounts.append(dict(mount))


def _place(spec: dict[str, Any], plan: Injection) -> None:
    selector: dict[str, str] = spec.setdefault("nodeSelector", {})
    for key, value in plan.node_selector:
        selector.setdefault(key, value)
    if not selector:
        del spec["nodeSelector"]
    if plan.tolerations:
        tolerations = spec.setdefault("tolerations", [])
        for toleration in plan.tolerations:
            if dict(toleration) not in tolerations:
                tolerations.append(dict(toleration))
    if plan.preferred_node:
        term = {
            "weight": AFFINITY_WEIGHT,
            "preference": {
                "matchFields": [{"key": "metadata.name", "operator": "In", "values": [plan.preferred_node]}]
            },
        }
        node_affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
        preferred = node_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
        if term not in preferred:
            preferred.append(term)


def preferred_node(
    rank_nodes: tuple[str, ...] | None, initial_rank: int | None, alive: Mapping[str, Any] | None = None
) -> str | None:
    """The node holding the rank a pod's indices map to, if known (and, given ``alive``, still there)."""
    if rank_nodes is None or initial_rank is None or not 0 <= initial_rank < len(rank_nodes):
        return None
    node = rank_nodes[initial_rank] or None
    if node is not None and alive is not None and node not in alive:
        return None
    return node
