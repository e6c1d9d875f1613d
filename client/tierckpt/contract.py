"""THE contract between operator, training pod and replicator (spec: docs/format.md, "Contract").

It defines, in one place:

* the environment variables the operator's webhook injects and the client reads (``Env``);
* the JobSet and pod annotations and labels (``Annotations``, ``Labels``);
* how the pod's node rank arrives: the operator writes the ``tierckpt.io/node-rank`` annotation on
  the pod, and a downward-API volume exposes the pod's annotations as a file the client polls
  (``read_podinfo``). Stale pods never receive a rank, so they never see one;
* the control files in ``<root>/<job>/control/`` and their typed messages: the peer assignment
  (``PeerAssignment``), the job's restore plan (``RestorePlan``), per-rank restore progress
  (``RestoreStatus``), the job's backup and replication policy (``JobPolicy``);
* the inventory a replicator reports (``NodeInventory``), from which anyone can compute the same
  restore step with ``tierckpt.restore_choice``.

Pure data and encoding, plus atomic reads and writes of the control files. No network, no Kubernetes.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from pathlib import Path
from typing import ClassVar

from tierckpt._codec import Message
from tierckpt.bucket_layout import BucketLayout
from tierckpt.errors import ContractError, FormatError
from tierckpt.format import control_dir, write_atomic

__all__ = [
    "Annotations",
    "Csi",
    "Env",
    "JobPolicy",
    "Labels",
    "NodeInventory",
    "PeerAssignment",
    "PeerNode",
    "RankHoldings",
    "RestorePlan",
    "RestoreState",
    "RestoreStatus",
    "Tier",
    "job_id_for",
    "parse_podinfo",
    "read_control",
    "read_podinfo",
    "restore_status_name",
    "write_control",
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


_DNS_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


def job_id_for(namespace: str, name: str, uid: str) -> str:
    """The job id of a JobSet: unique across namespaces and re-creations, and a safe path component."""
    for what, value in (("namespace", namespace), ("name", name)):
        if not _DNS_RE.match(value or ""):
            raise ContractError(f"JobSet {what} {value!r} is not a DNS-1123 name")
    short = re.sub(r"[^a-z0-9]", "", uid.lower())[:8]
    if len(short) < 8:
        raise ContractError(f"JobSet uid {uid!r} is too short")
    return f"{namespace}_{name}_{short}"


# ------------------------------------------------------------------------------- downward API file

_PODINFO_LINE = re.compile(r'^([^=]+)="(.*)"$')


def parse_podinfo(text: str) -> dict[str, str]:
    """Parse the kubelet's downward-API ``annotations`` file: ``key="value"`` lines, Go-quoted."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _PODINFO_LINE.match(line.strip())
        if m:
            out[m.group(1)] = bytes(m.group(2), "utf-8").decode("unicode_escape")
    return out


def read_podinfo(podinfo_dir: str | os.PathLike[str]) -> dict[str, str]:
    try:
        return parse_podinfo((Path(podinfo_dir) / "annotations").read_text())
    except FileNotFoundError:
        return {}


# ------------------------------------------------------------------------------- typed messages


class Tier(str, enum.Enum):
    """Where a rank's step can be restored from, fastest first."""

    LOCAL = "local"
    """This node's own primary copy."""
    REPLICA = "replica"
    """A replica this node holds for the rank."""
    PEER = "peer"
    """Another node's primary or replica, fetched over the network."""
    GCS = "gcs"

    @property
    def cost(self) -> int:
        return _TIER_COST[self]


_TIER_COST = {Tier.LOCAL: 0, Tier.REPLICA: 1, Tier.PEER: 2, Tier.GCS: 3}


@dataclasses.dataclass(frozen=True)
class PeerNode:
    name: str
    endpoint: str
    """The node's replicator data endpoint, ``http://host:port``."""
    domain: str = ""
    """The node's failure domain (the configured label's value)."""


@dataclasses.dataclass(frozen=True)
class PeerAssignment(Message):
    """``control/peers.json``: which nodes each node replicates to, and the node ranks.

    Written by the operator (through the replicator's control API) or from static configuration in
    local mode. ``generation`` increases with every change; replicators ignore older generations.
    """

    KIND = "tierckpt.peers"
    VERSION = CONTRACT_VERSION
    FILE: ClassVar[str] = "peers.json"

    job: str
    generation: int
    nodes: dict[str, PeerNode]
    peers: dict[str, tuple[str, ...]]
    """Node name -> the names of the nodes it sends its ranks' shards to."""
    node_ranks: dict[str, int] = dataclasses.field(default_factory=dict)
    procs_per_node: int = 0
    """Training processes per node (torchrun ``--nproc-per-node``); 0 = derive from the world size."""

    def __post_init__(self) -> None:
        for node, targets in self.peers.items():
            unknown = [t for t in (node, *targets) if t not in self.nodes]
            if unknown:
                raise FormatError(f"peer assignment names unknown nodes {unknown}")

    def process_ranks(self, node: str, world_size: int = 0) -> tuple[int, ...]:
        """The process ranks that run on ``node``: torchrun's contiguous block of its node rank.

        Node rank ``n`` with ``p`` processes per node holds ranks ``n*p .. n*p+p-1``. ``p`` is
        ``procs_per_node``, else ``world_size // len(node_ranks)``; () if neither is known or ``node``
        has no node rank. A replaced node learns its ranks this way before it holds any data.
        """
        n = self.node_ranks.get(node)
        p = self.procs_per_node
        if not p and world_size > 0 and self.node_ranks and world_size % len(self.node_ranks) == 0:
            p = world_size // len(self.node_ranks)
        if n is None or p <= 0:
            return ()
        ranks = range(n * p, (n + 1) * p)
        return tuple(r for r in ranks if world_size <= 0 or r < world_size)


@dataclasses.dataclass(frozen=True)
class RankHoldings:
    """Committed steps of one rank held by one node."""

    local: tuple[int, ...] = ()
    replica: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class NodeInventory(Message):
    """What one node's replicator holds for a job. Served at ``GET /v1/jobs/{job}/inventory``."""

    KIND = "tierckpt.inventory"
    VERSION = CONTRACT_VERSION

    job: str
    node: str
    endpoint: str
    updated_at: float
    ranks: dict[int, RankHoldings]
    world_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    """Step -> world size recorded in its manifests (steps of different world sizes never mix)."""
    gcs: tuple[int, ...] = ()
    """Steps this node knows to be complete in the bucket (complete manifest object present)."""
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class RestorePlan(Message):
    """``control/restore.json``: the step the whole job restores, and each rank's source tier.

    ``step`` is None when no step is restorable by every rank (a fresh start). Computed by the pure
    ``tierckpt.restore_choice.choose_restore`` from inventories, so any party gets the same answer.
    """

    KIND = "tierckpt.restore-plan"
    VERSION = CONTRACT_VERSION
    FILE: ClassVar[str] = "restore.json"

    job: str
    step: int | None
    world_size: int
    sources: dict[int, Tier]
    """Rank -> fastest tier holding it."""
    holders: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Rank -> nodes holding a copy (primary or replica), fastest first."""
    generation: int = 0
    decided_at: float = 0.0


class RestoreState(str, enum.Enum):
    PENDING = "pending"
    STAGING = "staging"
    READY = "ready"
    NONE = "none"
    """Nothing to restore: start fresh."""
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class RestoreStatus(Message):
    """``control/restore-rank-<rank:05d>.json``: written by the replicator while it stages a rank.

    The client waits while ``updated_at`` keeps moving, not on a fixed timeout, and loads once
    ``state`` is ``ready`` (or starts fresh on ``none``).
    """

    KIND = "tierckpt.restore-status"
    VERSION = CONTRACT_VERSION

    job: str
    rank: int
    state: RestoreState
    step: int | None
    source: Tier | None
    bytes_done: int
    bytes_total: int
    updated_at: float
    message: str = ""


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


@dataclasses.dataclass(frozen=True)
class JobPolicy(Message):
    """``control/policy.json``: the job's backup and replication policy, from its CheckpointConfiguration.

    Sent by the operator with ``PUT /v1/jobs/{job}/policy`` to every replicator of the job (alongside
    the peers) and again whenever the configuration changes; ``generation`` increases with every
    change and replicators ignore older ones. A replicator backs the job up with it instead of its own
    node flags (``--gcs-bucket``, ``--gcs-prefix``, ``--backup-interval*``, ``--backup-keep-*``); the
    bucket is reached with the node's own GCS credentials and endpoint.
    """

    KIND = "tierckpt.job-policy"
    VERSION = CONTRACT_VERSION
    FILE: ClassVar[str] = "policy.json"

    job: str
    generation: int
    bucket: str = ""
    """GCS bucket of the job's backups; "" leaves the node's ``--gcs-bucket`` in force."""
    prefix: str = "tierckpt"
    """Object prefix inside the bucket."""
    backup_interval_steps: int = 0
    """Back up once this many steps passed since the newest complete backup (0: not by steps)."""
    backup_interval_minutes: float = 30.0
    """Back up once this many minutes passed since the newest complete backup (0: not by time)."""
    keep_last: int = 3
    """Newest complete backups kept."""
    keep_every: int = 0
    """Also keep the oldest complete backup of every window of this many steps (0: off)."""
    replication_factor: int = 1
    """Peers each node sends its ranks' shards to."""
    delete_backups_on_deletion: bool = False
    """Whether the job's backups are deleted with the job."""
    config: str = ""
    """The CheckpointConfiguration it came from (informational)."""

    def __post_init__(self) -> None:
        if self.bucket and not _BUCKET_RE.match(self.bucket):
            raise FormatError(f"job policy: {self.bucket!r} is not a valid bucket name")
        BucketLayout(self.prefix)  # raises FormatError for an unsafe prefix
        if self.keep_last < 1:
            raise FormatError("job policy: keep_last must be at least 1")
        for name in ("generation", "backup_interval_steps", "backup_interval_minutes", "keep_every"):
            if getattr(self, name) < 0:
                raise FormatError(f"job policy: {name} must not be negative")
        if not 0 <= self.replication_factor <= 8:
            raise FormatError("job policy: replication_factor must be in [0, 8]")


def restore_status_name(rank: int) -> str:
    return f"restore-rank-{rank:05d}.json"


def write_control(root: str | os.PathLike[str], job: str, name: str, msg: Message) -> Path:
    """Atomically write a control file into ``<root>/<job>/control/``."""
    if "/" in name or name.startswith("."):
        raise ContractError(f"invalid control file name {name!r}")
    d = control_dir(root, job)
    d.mkdir(parents=True, exist_ok=True)
    path = d / name
    write_atomic(path, msg.to_bytes())
    return path


def read_control(root: str | os.PathLike[str], job: str, name: str, cls: type[Message]) -> Message | None:
    """Read a control file, or None if absent. A malformed file raises ``FormatError``."""
    try:
        body = (control_dir(root, job) / name).read_bytes()
    except FileNotFoundError:
        return None
    return cls.from_bytes(body)
