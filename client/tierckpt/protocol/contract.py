"""THE deployment contract between operator, training pod and replicator (spec: docs/format.md).

It defines, in one place:

* the environment variables the operator's webhook injects and the client reads (``Env``);
* the JobSet and pod annotations and labels (``Annotations``, ``Labels``);
* the node ramdisk as an inline CSI volume (``Csi``);
* how the pod's node rank arrives: the operator writes the ``tierckpt.io/node-rank`` annotation on
  the pod, and a downward-API volume exposes the pod's annotations as a file the client polls
  (``read_podinfo``). Stale pods never receive a rank, so they never see one;
* the job id of a JobSet (``job_id_for``).

The typed control messages (peers, restore plans, policies, inventories) are in
``tierckpt.protocol.control``. Pure data, plus reading the downward-API file. No network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tierckpt.protocol.errors import ContractError

__all__ = [
    "CONTRACT_VERSION",
    "MODES",
    "Annotations",
    "Csi",
    "Env",
    "Labels",
    "job_id_for",
    "parse_podinfo",
    "read_podinfo",
]

CONTRACT_VERSION = 1


class Env:
    """Environment variables injected into training containers (all optional for local use)."""

    ROOT = "TIERCKPT_ROOT"
    """Ramdisk root inside the container; the job's directory is ``$TIERCKPT_ROOT/$TIERCKPT_JOB``."""
    JOB = "TIERCKPT_JOB"
    """Job id: ``<namespace>_<jobset>_<uid[:8]>`` (see ``job_id_for``)."""
    RANK = "TIERCKPT_RANK"
    """Process rank, when not taken from torch.distributed or torchrun's RANK."""
    WORLD_SIZE = "TIERCKPT_WORLD_SIZE"
    PODINFO_DIR = "TIERCKPT_PODINFO_DIR"
    """Downward-API volume holding the pod's ``annotations`` file (node rank arrives there)."""
    REPLICATOR_URL = "TIERCKPT_REPLICATOR_URL"
    """The node-local replicator's control endpoint (``http://$(HOST_IP):<port>``)."""
    NODE_NAME = "TIERCKPT_NODE_NAME"
    POD_NAME = "TIERCKPT_POD_NAME"
    POD_UID = "TIERCKPT_POD_UID"
    RESTORE_WAIT = "TIERCKPT_RESTORE_WAIT"
    """Seconds without restore progress after which the client stops waiting (default 300)."""


class Annotations:
    """Annotation keys. JobSet opt-in keys are set by users; pod keys are set by the operator."""

    PREFIX = "tierckpt.io/"
    ENABLED = "tierckpt.io/enabled"
    """On a JobSet: ``"true"`` opts it in."""
    CONFIG = "tierckpt.io/config"
    """On a JobSet: the name of the CheckpointConfiguration to use."""
    MODE = "tierckpt.io/mode"
    """On a JobSet: how its processes checkpoint. ``native`` (the default): tierckpt's client. ``orbax``:
    stock Orbax multi-tier checkpointing (as MaxText uses it), through the ramdisk file protocol of GKE's
    replicator; the job directory is mounted at the configuration's ``ramdisk.mountRoot`` (Orbax's
    ``local_checkpoint_directory``), and each node's replicator writes ``jax-init-info.txt``
    (docs/orbax.md)."""
    NODE_RANK = "tierckpt.io/node-rank"
    """On a pod: its node rank, written by the operator once the pod is scheduled."""
    NUM_NODES = "tierckpt.io/num-nodes"
    JOB_ID = "tierckpt.io/job-id"
    ASSIGNMENT_GENERATION = "tierckpt.io/assignment-generation"
    """On a pod: the assignment generation (restart attempt) its rank belongs to."""
    COORDINATOR = "tierckpt.io/coordinator"
    """On a pod: the address of the pod holding node rank 0 (``<hostname>.<subdomain>`` or its IP), for
    launchers that need a rendezvous host (torchrun ``--master-addr``); ranks move with the data, so the
    JobSet's own index-0 pod is not necessarily rank 0."""
    REPLICATOR_ENDPOINT = "tierckpt.io/replicator-endpoint"
    """On a replicator pod (optional): its control API URL, overriding ``http://<pod IP>:<port>``."""


MODES = ("native", "orbax")
"""The values of ``Annotations.MODE``."""


class Labels:
    MANAGED = "tierckpt.io/managed"
    JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
    JOB_INDEX = "jobset.sigs.k8s.io/job-index"
    JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
    REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
    RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
    COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


class Csi:
    """The node ramdisk as an inline ephemeral CSI volume: driver name and volume attribute keys.

    The operator's webhook injects into opted-in pods a ``csi`` volume with ``driver: Csi.DRIVER`` and
    ``volumeAttributes`` {``Csi.JOB_ID``: job id, optionally ``Csi.RESERVATION``: a quantity such as
    ``"64Gi"``}; the node plugin (``tierckpt-csi``) bind-mounts ``<node ramdisk>/<job id>`` there. The
    job id's namespace must be the pod's own. The volume holds the job directory itself, so mount it at
    ``<root>/<job id>`` and set ``Env.ROOT`` to ``<root>``. In hostPath mode the webhook mounts
    ``<HOST_ROOT>/<job id>`` the same way (no isolation beyond the cluster's hostPath policy).
    """

    DRIVER = "ramdisk.tierckpt.io"
    JOB_ID = "tierckpt.io/job-id"
    """Volume attribute: the job id (same key as ``Annotations.JOB_ID``)."""
    RESERVATION = "tierckpt.io/ramdisk-reservation"
    """Volume attribute (optional): ramdisk bytes reserved for the job on the node, a quantity string.
    Absent: the node plugin's default (the whole ramdisk, i.e. one job per node)."""
    HOST_ROOT = "/var/lib/tierckpt/ramdisk"
    """Default host path of the node ramdisk (a tmpfs mounted once, surviving driver restarts)."""


_DNS_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")


def job_id_for(namespace: str, name: str, uid: str) -> str:
    """The job id of a JobSet: unique across namespaces and re-creations, and a safe path component."""
    for what, value in (("namespace", namespace), ("name", name)):
        if not _DNS_RE.fullmatch(value or ""):
            raise ContractError(f"JobSet {what} {value!r} is not a DNS-1123 name")
    short = re.sub(r"[^a-z0-9]", "", uid.lower())[:8]
    if len(short) < 8:
        raise ContractError(f"JobSet uid {uid!r} is too short")
    return f"{namespace}_{name}_{short}"


# ------------------------------------------------------------------------------- downward API file

_PODINFO_LINE = re.compile(r'([^=]+)="(.*)"')


def parse_podinfo(text: str) -> dict[str, str]:
    """Parse the kubelet's downward-API ``annotations`` file: ``key="value"`` lines, Go-quoted."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _PODINFO_LINE.fullmatch(line.strip())
        if m:
            out[m.group(1)] = bytes(m.group(2), "utf-8").decode("unicode_escape")
    return out


def read_podinfo(podinfo_dir: str | os.PathLike[str]) -> dict[str, str]:
    try:
        return parse_podinfo((Path(podinfo_dir) / "annotations").read_text())
    except FileNotFoundError:
        return {}
