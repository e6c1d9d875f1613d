"""THE control messages between operator, replicators and training pods (spec: docs/replicator.md).

The replicator's state files (``format.state_dir``: ``<root>/.tierckpt/jobs/<job>/``, where no pod can
write), the restore progress it writes for the client (``<root>/<job>/control/``) and the control API's
bodies are these typed messages:
the peer assignment (``PeerAssignment``), the job's restore plan (``RestorePlan``), per-rank restore
progress (``RestoreStatus``), the job's backup and replication policy (``JobPolicy``), the three of them
for one node in one body (``NodePlan``, answered by ``NodePlanResult``), what a node holds
(``NodeInventory``, from which anyone computes the same restore step with
``tierckpt.planning.restore_plan``), a replicator's health (``NodeStatus``) and the answers of the API's
actions (``BackupResult``, ``RestoreAccepted``, ``PurgeResult``). Which endpoint carries which
message: ``tierckpt.protocol.api``.

Pure data and encoding, plus atomic reads and writes of the state and progress files. No network.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import os
import re
import urllib.parse
from pathlib import Path
from typing import ClassVar, Literal

from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.contract import CONTRACT_VERSION
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.protocol.format import Dir, as_tree, check_job_id, control_dir, state_dir, write_atomic
from tierckpt.protocol.quantity import MAX_BYTES, format_bytes

__all__ = [
    "MAX_ERASURE_FRAGMENTS",
    "MAX_FETCH_RANKS",
    "MAX_GENERATION",
    "PLAN_PARTS",
    "BackupResult",
    "FetchRequest",
    "FetchStatus",
    "JobPolicy",
    "JobStatus",
    "NodeInventory",
    "NodePlan",
    "NodePlanResult",
    "NodeStatus",
    "PeerAssignment",
    "PeerNode",
    "PurgeResult",
    "RankHoldings",
    "Redundancy",
    "RestoreAccepted",
    "RestorePlan",
    "RestoreState",
    "RestoreStatus",
    "StepBytes",
    "StepContent",
    "StepOverQuota",
    "Tier",
    "check_endpoint",
    "check_generation",
    "check_node_name",
    "fetch_request_name",
    "fetch_status_name",
    "read_control",
    "read_fetch_status",
    "read_restore_status",
    "restore_status_name",
    "write_control",
    "write_fetch_status",
    "write_restore_status",
]


class Tier(str, enum.Enum):
    """Where a rank's step can be restored from, fastest first."""

    LOCAL = "local"
    """This node's own primary copy."""
    REPLICA = "replica"
    """A replica this node holds for the rank."""
    PEER = "peer"
    """Another node's primary or replica, fetched over the network."""
    ERASURE = "erasure"
    """Rebuilt from erasure-coded fragments that other nodes hold (any ``k`` of ``k + m``)."""
    GCS = "gcs"

    @property
    def cost(self) -> int:
        return _TIER_COST[self]


_TIER_COST = {Tier.LOCAL: 0, Tier.REPLICA: 1, Tier.PEER: 2, Tier.ERASURE: 3, Tier.GCS: 4}


MAX_ERASURE_FRAGMENTS = 16
"""``k + m`` at most: one fragment per node, each on another node of the job."""

MAX_GENERATION = (1 << 53) - 1
"""The largest generation a peer assignment, restore plan or policy may carry (exact in every JSON
reader, and far from anything a counter reaches)."""
_NODE_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?")
_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_generation(what: str, generation: int) -> int:
    if not 0 <= generation <= MAX_GENERATION:
        raise FormatError(f"{what}: generation must be in 0..2**53-1")
    return generation


def check_node_name(name: str) -> str:
    """A node name: 1-253 of ``[A-Za-z0-9_.-]``, alphanumeric at both ends (Kubernetes node names fit)."""
    if not isinstance(name, str) or not _NODE_NAME_RE.fullmatch(name):
        raise FormatError(f"invalid node name {name!r}")
    return name


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".") if len(host) <= 253 else []
    return bool(labels) and all(_HOST_LABEL_RE.fullmatch(label) for label in labels)


def check_endpoint(endpoint: str) -> str:
    """A replicator endpoint: ``http(s)://host:port`` (a DNS name or an IP literal, a port 1-65535),
    optionally ``/?data=PORT``; no credentials, other path, query or fragment. ``""``: not known (yet);
    nothing is sent to such a node."""
    if endpoint == "":
        return endpoint
    try:
        parts = urllib.parse.urlsplit(endpoint)
        port = parts.port
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise FormatError(f"peer endpoint {endpoint!r} is not http(s)://host:port ({exc})") from exc
    host = parts.hostname or ""
    data = query.pop("data", None)
    ok = (
        re.fullmatch(r"[\x21-\x7e]{1,512}", endpoint) is not None  # printable ASCII, no spaces or newlines
        and parts.scheme in ("http", "https")
        and port is not None
        and 0 < port < 65536
        and _valid_host(host)
        and parts.username is None
        and parts.password is None
        and parts.path in ("", "/")
        and not parts.fragment
        and not query
        and (
            data is None
            or (len(data) == 1 and re.fullmatch(r"[0-9]{1,5}", data[0]) and 0 < int(data[0]) < 65536)
        )
    )
    if not ok:
        raise FormatError(f"peer endpoint {endpoint!r} is not http(s)://host:port[/?data=PORT]")
    return endpoint


@dataclasses.dataclass(frozen=True)
class PeerNode(Record):
    name: str
    endpoint: str
    """The node's replicator control API, ``http(s)://host:port``. Its streaming data endpoint is the
    same host at ``port + 1``, unless the endpoint names the data port as ``http://host:port/?data=PORT``
    (local mode, where the ports are not adjacent). API clients use only ``scheme://host:port``."""
    domain: str = ""
    """The node's failure domain (the configured label's value)."""

    def __post_init__(self) -> None:
        check_node_name(self.name)
        check_endpoint(self.endpoint)


_MAX_NODE_RANK = (1 << 31) - 1
_MAX_PROCS_PER_NODE = 1 << 16


@dataclasses.dataclass(frozen=True)
class PeerAssignment(Message):
    """``control/peers.json``: which nodes each node replicates to, and the node ranks.

    Written by the operator (through the replicator's control API) or from static configuration in
    local mode. ``generation`` increases with every change (the operator's: milliseconds since the
    epoch); replicators ignore older generations. ``attempt`` is the job's restart attempt the
    assignment belongs to, the scale of a restore plan's ``generation`` (``RestorePlan.stands_for``).
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
    num_nodes: int = 0
    """The job's node ranks, when ``node_ranks`` holds only part of them (a big job's nodes each get
    their neighbourhood of the plan: themselves, their peers, the nodes that send to them and those
    nodes' peers); 0: ``node_ranks`` holds them all."""
    attempt: int = 0
    """The job's restart attempt (the JobSet's, 1, 2, ...) these node ranks belong to; several
    assignments (generations) may share one attempt. 0: not known (static configuration, or an
    operator from before the field), so no published restore plan is taken for this attempt's."""

    def __post_init__(self) -> None:
        check_job_id(self.job)
        check_generation("peer assignment", self.generation)
        check_generation("peer assignment attempt", self.attempt)
        if not 0 <= self.num_nodes <= _MAX_NODE_RANK + 1 or (
            self.num_nodes and self.num_nodes < len(self.node_ranks)
        ):
            raise FormatError(
                f"peer assignment: num_nodes {self.num_nodes} for {len(self.node_ranks)} node ranks"
            )
        for name, peer in self.nodes.items():
            if name != peer.name:
                raise FormatError(f"peer assignment: node {name!r} is named {peer.name!r} inside")
        for node, targets in self.peers.items():
            unknown = [t for t in (node, *targets) if t not in self.nodes]
            if unknown:
                raise FormatError(f"peer assignment names unknown nodes {unknown}")
        unknown = [n for n in self.node_ranks if n not in self.nodes]
        if unknown:
            raise FormatError(f"peer assignment gives node ranks to unknown nodes {unknown}")
        if any(r < 0 or r > _MAX_NODE_RANK for r in self.node_ranks.values()):
            raise FormatError(f"peer assignment: node ranks must be in 0..{_MAX_NODE_RANK}")
        if not 0 <= self.procs_per_node <= _MAX_PROCS_PER_NODE:
            raise FormatError(f"peer assignment: procs_per_node must be in 0..{_MAX_PROCS_PER_NODE}")

    def process_ranks(self, node: str, world_size: int = 0) -> tuple[int, ...]:
        """The process ranks that run on ``node``: torchrun's contiguous block of its node rank.

        Node rank ``n`` with ``p`` processes per node holds ranks ``n*p .. n*p+p-1``. ``p`` is
        ``procs_per_node``, else ``world_size // nodes`` (``num_nodes``, or every node rank listed); ()
        if neither is known or ``node`` has no node rank. A replaced node learns its ranks this way
        before it holds any data.
        """
        n = self.node_ranks.get(node)
        p = self.procs_per_node
        nodes = self.num_nodes or len(self.node_ranks)
        if not p and world_size > 0 and nodes and world_size % nodes == 0:
            p = world_size // nodes
        if n is None or p <= 0:
            return ()
        ranks = range(n * p, (n + 1) * p)
        return tuple(r for r in ranks if world_size <= 0 or r < world_size)


@dataclasses.dataclass(frozen=True)
class RankHoldings(Record):
    """Committed steps of one rank held by one node."""

    local: tuple[int, ...] = ()
    replica: tuple[int, ...] = ()
    fragments: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Step -> (index of the erasure-coded fragment held, ``k``: fragments needed to rebuild it)."""


@dataclasses.dataclass(frozen=True)
class Redundancy(Record):
    """How many live copies beyond their primary this node's ranks have, against the job's factor.

    ``copies``: the fewest peers confirmed (and, at every reconcile, found) to hold any local rank's
    newest step; a step younger than the grace (``--reconcile-interval``) is still being replicated
    and counts as fully replicated. ``degraded_since``: wall clock since when some rank has had fewer
    than ``factor`` copies (None: at full redundancy)."""

    factor: int
    copies: int
    degraded_since: float | None = None

    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None


@dataclasses.dataclass(frozen=True)
class StepContent(Record):
    """A committed step that saved in a replica group, as the node holding it reports it.

    ``content`` is recomputed by the reporting node from the manifest's files and tensors
    (``tierckpt.protocol.replica.content_key``), never copied from the record; two steps of members of
    one group whose ``content`` is equal hold the same bytes (their crc32c were checked when written or
    received). ``diverged``: the members differed at this save (the record says so), or the record's
    content key does not match the manifest; such a step is never deduplicated against another."""

    rank: int
    step: int
    copy: Literal["local", "replica"]
    group: str
    members: tuple[int, ...]
    content: str
    diverged: bool = False
    written_bytes: int = 0
    """Bytes of the step the client wrote (hard-linked data files not counted)."""
    logical_bytes: int = 0
    """Bytes a save without deduplication writes (every file of the step)."""


@dataclasses.dataclass(frozen=True)
class StepBytes(Record):
    """One node's bytes of one step against what they would be without replica group dedup."""

    step: int
    written: int = 0
    """Bytes the node's training ranks wrote to its ramdisk (data files linked between members: once)."""
    written_logical: int = 0
    replicated: int = 0
    """Bytes this node sent to peers for the step's ranks."""
    replicated_logical: int = 0
    """What those copies would have sent without dedup (linked data files counted)."""
    uploaded: int = 0
    """Bytes this node uploaded to the bucket for the step."""
    uploaded_logical: int = 0
    """What its share of the uploads would have been without dedup."""


@dataclasses.dataclass(frozen=True)
class StepOverQuota(Record):
    """A committed step of a rank this node runs that is neither replicated nor backed up: its manifest
    declares more bytes than the job's quota (``JobPolicy.quota_bytes``, the node's ``--job-quota``, its
    ramdisk's size). Sparse files cost the pod nothing there but a peer and the bucket all of them."""

    rank: int
    step: int
    bytes: int
    """What the step's manifest declares."""
    quota: int
    """The job's quota on this node."""
    allocated: int = -1
    """Bytes its files take on this node's ramdisk (-1: not measured); far fewer than ``bytes``: sparse."""

    def describe(self, job: str) -> str:
        """``job J rank R step S declares 64.0Gi, over the job's quota of 1.0Gi (its files take 8.0Ki on
        this node's ramdisk: sparse)``."""
        text = (
            f"job {job} rank {self.rank} step {self.step} declares {format_bytes(self.bytes)}, over the "
            f"job's quota of {format_bytes(self.quota)}"
        )
        if self.allocated >= 0:
            sparse = ": sparse" if self.allocated < self.bytes // 2 else ""
            text += f" (its files take {format_bytes(self.allocated)} on this node's ramdisk{sparse})"
        return text


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
    gcs_pending: bool = False
    """This node's look at the bucket had not answered (a slow or unreachable bucket) and it knew no
    earlier one: ``gcs`` is then unknown, not empty. A restore plan waits for a node that knows."""
    domain: str = ""
    redundancy: Redundancy | None = None
    """Replicas of this node's ranks against the job's replication factor (None: no local ranks)."""
    contents: tuple[StepContent, ...] = ()
    """The committed steps held here that saved in a replica group (replicators dedup copies by it)."""
    diverged: tuple[int, ...] = ()
    """Local ranks whose newest step differs from another member's of its group (not deduplicated)."""
    step_bytes: StepBytes | None = None
    """This node's bytes of its newest step against what they would be without dedup."""
    restoring: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> state (``RestoreState`` value) of this node's current restore staging: a peer waiting
    to fetch a rank from this node (a restore's fan-out) follows it."""
    over_quota: tuple[StepOverQuota, ...] = ()
    """This node's newest steps refused for the job's quota: neither replicated nor backed up."""


@dataclasses.dataclass(frozen=True)
class RestorePlan(Message):
    """``control/restore.json``: the step the whole job restores, and each rank's source tier.

    ``step`` is None when no step is restorable by every rank (a fresh start). Computed by the pure
    ``tierckpt.planning.restore_plan.choose_restore`` from inventories, so any party gets the same answer.

    ``generation`` is the job's restart attempt the plan is for (``PeerAssignment.attempt``), never a
    peer generation: the operator publishes one plan per attempt, while the peer assignment may change
    many times within it. A replicator stages the published plan while it stands for its assignment's
    attempt (``stands_for``) and computes its own only when it does not.
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
    """The restart attempt the plan is for (0: none known)."""
    decided_at: float = 0.0

    def __post_init__(self) -> None:
        check_job_id(self.job)
        check_generation("restore plan", self.generation)
        if self.step is not None and self.step < 0:
            raise FormatError("restore plan: step must not be negative")
        if self.world_size < 0 or any(r < 0 for r in self.sources):
            raise FormatError("restore plan: world size and ranks must not be negative")

    def stands_for(self, assignment: PeerAssignment | None) -> str | None:
        """None if this plan is the one to stage under ``assignment`` (it is for the assignment's
        attempt or a later one; any plan stands where no assignment is known), else why not."""
        if assignment is None:
            return None
        if assignment.attempt == 0:
            return f"peer assignment generation {assignment.generation} names no attempt"
        if self.generation < assignment.attempt:
            return f"the plan is for attempt {self.generation}, the node ranks for {assignment.attempt}"
        return None

    def left_behind(self, step: int, committed_at: float) -> bool:
        """Whether a rank's ``step``, committed at ``committed_at``, was saved by the run the job went back
        from when it restored this plan's step: above that step (any step, for a fresh start) and
        committed before the plan was decided. Training saves that step number again; until then the
        step is nobody's newest (nothing sends or uploads it), and the client's first commit retires it.
        False for every step when the decision time is unknown (0)."""
        above = self.step is None or step > self.step
        return above and self.decided_at > 0.0 and committed_at <= self.decided_at


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


MAX_FETCH_RANKS = 1 << 16
"""Most rank-steps one ``FetchRequest`` may name (a request names at most the step's world size)."""
_REQUEST_ID_RE = re.compile(r"[0-9a-f]{32}")
_SAVE_ID_RE = re.compile(r"[0-9a-f-]{0,64}")


@dataclasses.dataclass(frozen=True)
class FetchRequest(Message):
    """``<job>/requests/fetch-rank-<rank:05d>.json``: a training rank asks its node's replicator for
    other ranks' committed steps (a DCP load under another sharding reads them).

    Written by the client, so the replicator treats it as untrusted: it fetches only committed steps of
    the job whose directory holds the file, only a step the job's restore plan or some inventory
    names, and only ranks below that step's world size. Each named ``(rank, step)`` ends up committed
    on this node (as a replica, if it is not a primary here); several requests naming the same one
    share one fetch. With a ``save_id``, a copy counts only if its manifest names that DCP save (one of
    another save of the step number is replaced by the save's). Progress: ``FetchStatus`` in
    ``control/fetch-rank-<rank:05d>.json``.
    """

    KIND = "tierckpt.fetch-request"
    VERSION = CONTRACT_VERSION

    job: str
    rank: int
    """The requesting process rank (the file is named after it)."""
    id: str
    """32 lowercase hex digits, new for every request: the status that answers it carries the same."""
    step: int
    ranks: tuple[int, ...]
    """The ranks whose ``step`` is needed on this node, each once."""
    requested_at: float = 0.0
    save_id: str = ""
    """The DCP save the load reads (its metadata's ``save_id``, a uuid): at most 64 of ``[0-9a-f-]``;
    ``""``: any committed copy of the step will do (a request of an older client)."""

    def __post_init__(self) -> None:
        if not _REQUEST_ID_RE.fullmatch(self.id):
            raise FormatError("fetch request: id must be 32 lowercase hex digits")
        if not _SAVE_ID_RE.fullmatch(self.save_id):
            raise FormatError("fetch request: save_id must be at most 64 of [0-9a-f-]")
        if self.rank < 0 or self.step < 0 or any(r < 0 for r in self.ranks):
            raise FormatError("fetch request: ranks and step must not be negative")
        if len(self.ranks) > MAX_FETCH_RANKS or len(set(self.ranks)) != len(self.ranks):
            raise FormatError(f"fetch request: at most {MAX_FETCH_RANKS} distinct ranks")


@dataclasses.dataclass(frozen=True)
class FetchStatus(Message):
    """``control/fetch-rank-<rank:05d>.json``: the replicator's progress on one ``FetchRequest``.

    ``ready``: every named rank-step is committed on this node; ``failed``: one cannot be fetched
    (``message`` says why). The client waits while ``updated_at`` keeps moving, as for restores.
    """

    KIND = "tierckpt.fetch-status"
    VERSION = CONTRACT_VERSION

    job: str
    rank: int
    id: str
    """The ``FetchRequest.id`` this answers."""
    step: int
    state: RestoreState
    bytes_done: int = 0
    bytes_total: int = 0
    sources: dict[int, Tier] = dataclasses.field(default_factory=dict)
    """Rank -> where its step came from (``local`` when it was already on this node)."""
    updated_at: float = 0.0
    message: str = ""


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_MAX_KEEP = 1 << 20
_MAX_MINUTES = 60 * 24 * 366 * 100
"""A century: longer backup intervals are certainly a mistake."""


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
    erasure_data: int = 0
    """Erasure coding instead of replicas: ``k`` data fragments of each rank's newest step (0: off)."""
    erasure_parity: int = 0
    """... and ``m`` parity fragments, on ``k + m`` other nodes: any ``m`` of them may be lost."""
    delete_backups_on_deletion: bool = False
    """Whether the job's backups are deleted with the job."""
    quota_bytes: int = 0
    """The most bytes one rank's step may declare in its manifest to be sent to a peer, received from
    one or uploaded: the job's ramdisk size (``spec.ramdisk.size``), which no rank can legitimately
    exceed (sparse files can, at no cost on the ramdisk). 0: no limit from the policy (the node's
    ``--job-quota`` and its ramdisk's size still apply)."""
    config: str = ""
    """The CheckpointConfiguration it came from (informational)."""

    def __post_init__(self) -> None:
        check_job_id(self.job)
        check_generation("job policy", self.generation)
        if self.bucket and not _BUCKET_RE.fullmatch(self.bucket):
            raise FormatError(f"job policy: {self.bucket!r} is not a valid bucket name")
        BucketLayout(self.prefix)  # raises FormatError for an unsafe prefix
        if not 1 <= self.keep_last <= _MAX_KEEP:
            raise FormatError(f"job policy: keep_last must be in 1..{_MAX_KEEP}")
        for name, top in (
            ("backup_interval_steps", MAX_GENERATION),
            ("backup_interval_minutes", _MAX_MINUTES),
            ("keep_every", MAX_GENERATION),
        ):
            value = getattr(self, name)
            if not (0 <= value <= top and math.isfinite(value)):  # bounds first: a huge int is no float
                raise FormatError(f"job policy: {name} must be a finite number in 0..{top}")
        if not 0 <= self.replication_factor <= 8:
            raise FormatError("job policy: replication_factor must be in [0, 8]")
        if not 0 <= self.quota_bytes <= MAX_BYTES:  # the largest Kubernetes quantity of bytes
            raise FormatError(f"job policy: quota_bytes must be in 0..{MAX_BYTES}")
        k, m = self.erasure_data, self.erasure_parity
        if (k, m) != (0, 0) and not (k >= 1 and m >= 1 and k + m <= MAX_ERASURE_FRAGMENTS):
            raise FormatError(
                f"job policy: erasure coding needs erasure_data >= 1, erasure_parity >= 1 and at most "
                f"{MAX_ERASURE_FRAGMENTS} fragments in all (or both 0: replicas)"
            )

    @property
    def erasure(self) -> tuple[int, int] | None:
        """``(k, m)`` when the job is erasure-coded instead of replicated."""
        return (self.erasure_data, self.erasure_parity) if self.erasure_data else None


def restore_status_name(rank: int) -> str:
    return f"restore-rank-{rank:05d}.json"


def fetch_request_name(rank: int) -> str:
    """The file name of rank ``rank``'s ``FetchRequest`` in ``<job>/requests/``."""
    return f"fetch-rank-{rank:05d}.json"


def fetch_status_name(rank: int) -> str:
    """The file name of the ``FetchStatus`` answering rank ``rank`` in ``<job>/control/``."""
    return f"fetch-rank-{rank:05d}.json"


_CONTROL_LIMIT = 16 << 20
"""The largest state or progress file read."""


def _check_name(name: str) -> str:
    if "/" in name or name.startswith(".") or not name:
        raise ContractError(f"invalid control file name {name!r}")
    return name


def write_control(root: str | os.PathLike[str], job: str, name: str, msg: Message) -> Path:
    """Atomically write one of the replicator's state files (``format.state_dir``: no pod can write
    there; ``root`` is the node ramdisk, trusted)."""
    d = state_dir(root, job)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / _check_name(name)
    write_atomic(path, msg.to_bytes())
    return path


def read_control(root: str | os.PathLike[str], job: str, name: str, cls: type[Message]) -> Message | None:
    """Read one of the replicator's state files, or None if absent. A malformed file raises
    ``FormatError``."""
    try:
        body = (state_dir(root, job) / _check_name(name)).read_bytes()
    except FileNotFoundError:
        return None
    return cls.from_bytes(body)


def write_restore_status(job_tree: Dir, status: RestoreStatus) -> None:
    """Write ``control/restore-rank-N.json`` in the job's directory (``job_tree``: the replicator passes
    the job's ``Beneath``), atomically and through no link: the pod can write the directory too."""
    with as_tree(job_tree) as job:
        job.makedirs("control")
        job.write_atomic(f"control/{restore_status_name(status.rank)}", status.to_bytes())


def write_fetch_status(job_tree: Dir, status: FetchStatus) -> None:
    """Write ``control/fetch-rank-N.json`` in the job's directory, as ``write_restore_status`` does."""
    with as_tree(job_tree) as job:
        job.makedirs("control")
        job.write_atomic(f"control/{fetch_status_name(status.rank)}", status.to_bytes())


def read_fetch_status(root: str | os.PathLike[str], job: str, rank: int) -> FetchStatus | None:
    """The replicator's answer to ``rank``'s fetch request, or None if there is none yet."""
    try:
        with as_tree(control_dir(root, job)) as control:
            body = control.read_bytes(fetch_status_name(rank), limit=_CONTROL_LIMIT)
    except FileNotFoundError:
        return None
    return FetchStatus.from_bytes(body)


def read_restore_status(root: str | os.PathLike[str], job: str, rank: int) -> RestoreStatus | None:
    """The restore progress the replicator wrote for ``rank``, or None if there is none yet. A
    malformed file raises ``FormatError``."""
    try:
        with as_tree(control_dir(root, job)) as control:
            body = control.read_bytes(restore_status_name(rank), limit=_CONTROL_LIMIT)
    except FileNotFoundError:
        return None
    return RestoreStatus.from_bytes(body)


@dataclasses.dataclass(frozen=True)
class JobStatus(Record):
    job: str
    generation: int
    """Generation of the peer assignment in force (-1: none)."""
    node_rank: int | None
    local: dict[int, tuple[int, ...]]
    """Rank -> committed primary steps on this node."""
    replicas: dict[int, tuple[int, ...]]
    """Rank -> committed replica steps held for other nodes."""
    replicated_to: dict[int, tuple[str, ...]]
    """Rank -> peers known to hold its newest local step (a replica, or an erasure-coded fragment)."""
    backed_up: tuple[int, ...]
    local_bytes: int
    replica_bytes: int
    lag_seconds: float
    """Age of the oldest newest-local step still short of its K replicas (0: all replicated)."""
    last_replication_at: float
    restore_step: int | None
    restore: dict[int, str]
    """Rank -> restore state of the last staging run on this node."""
    backup_error: str = ""
    """The backup service's last error for this job ('' if the last attempt succeeded)."""
    redundancy: Redundancy | None = None
    """Replicas of this node's ranks against the job's replication factor (None: no local ranks)."""
    groups: tuple[str, ...] = ()
    """Replica groups of this node's newest local steps (``ReplicaRecord.group``)."""
    diverged: tuple[int, ...] = ()
    """Local ranks whose newest step differs from another member's of its group (not deduplicated)."""
    step_bytes: StepBytes | None = None
    """Bytes of this node's newest local step against what they would be without dedup."""
    over_quota: tuple[StepOverQuota, ...] = ()
    """Newest local steps refused for the job's quota (neither replicated nor backed up)."""


@dataclasses.dataclass(frozen=True)
class NodeStatus(Message):
    KIND = "tierckpt.replicator-status"
    VERSION = CONTRACT_VERSION

    node: str
    domain: str
    endpoint: str
    software_version: str
    started_at: float
    healthy: bool
    problems: tuple[str, ...]
    worker_up: bool
    worker_restarts: int
    replicas_k: int
    ramdisk_free_bytes: int
    ramdisk_total_bytes: int
    jobs: tuple[JobStatus, ...]


@dataclasses.dataclass(frozen=True)
class BackupResult(Message):
    """The answer of ``POST /v1/jobs/{job}/backup``: this node's share of ``step`` is in the bucket."""

    KIND = "tierckpt.backup-result"
    VERSION = CONTRACT_VERSION

    job: str
    step: int | None
    """The step backed up; None when this node holds no committed step of the job."""


@dataclasses.dataclass(frozen=True)
class RestoreAccepted(Message):
    """The answer of ``POST /v1/jobs/{job}/restore``: staging of this node's ranks has started."""

    KIND = "tierckpt.restore-accepted"
    VERSION = CONTRACT_VERSION

    job: str
    staging: bool = True
    """Always true: staging runs in the background; progress is in the ``RestoreStatus`` files."""


@dataclasses.dataclass(frozen=True)
class PurgeResult(Message):
    """The answer of ``DELETE /v1/jobs/{job}[?bucket=true]``."""

    KIND = "tierckpt.purge-result"
    VERSION = CONTRACT_VERSION

    job: str
    purged: bool
    """Whether this node held anything of the job (now deleted); False: there was nothing to delete."""
    bucket: bool = False
    """Whether the job's backups were deleted from the bucket too (the request's ``bucket=true``)."""


PLAN_PARTS = ("policy", "peers", "restore_plan")
"""The parts of a ``NodePlan``, in the order a replicator applies them (the policy first: a new node's
staging may need its bucket; the peers before the restore plan: the plan stands for their attempt)."""


@dataclasses.dataclass(frozen=True)
class NodePlan(Message):
    """The body of ``PUT /v1/jobs/{job}/plan``: what the operator has for one node of a job, in one
    message: the parts the node does not hold yet of the job's policy, its peer assignment (at scale the
    node's own neighbourhood of the peer plan) and the restore plan. The node stores each part as its
    own endpoint would (``PUT .../policy``, ``.../peers``, ``.../restore-plan``), in ``PLAN_PARTS``'
    order, and answers which it stored. At least one part; each for the message's job."""

    KIND = "tierckpt.node-plan"
    VERSION = CONTRACT_VERSION

    job: str
    node: str
    """The node it is for: a replicator refuses (400) a plan addressed to another node."""
    policy: JobPolicy | None = None
    peers: PeerAssignment | None = None
    restore_plan: RestorePlan | None = None

    def __post_init__(self) -> None:
        check_job_id(self.job)
        check_node_name(self.node)
        parts = [p for p in self.parts() if p is not None]
        if not parts:
            raise FormatError("node plan: no part (policy, peers or restore plan)")
        others = sorted({p.job for p in parts} - {self.job})
        if others:
            raise FormatError(f"node plan for job {self.job!r} holds parts for {others}")

    def parts(self) -> tuple[JobPolicy | None, PeerAssignment | None, RestorePlan | None]:
        """The parts in ``PLAN_PARTS``' order (None: not sent)."""
        return self.policy, self.peers, self.restore_plan


@dataclasses.dataclass(frozen=True)
class NodePlanResult(Message):
    """The answer of ``PUT /v1/jobs/{job}/plan``: which parts the node stored, and which it refused
    because it holds a newer generation (the part's own endpoint would answer 409)."""

    KIND = "tierckpt.node-plan-result"
    VERSION = CONTRACT_VERSION

    job: str
    node: str
    stored: tuple[str, ...] = ()
    """The parts stored (or held already: the same part again), by ``PLAN_PARTS`` name."""
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    """Part -> the newer generation this node holds instead."""

    def __post_init__(self) -> None:
        unknown = sorted((set(self.stored) | set(self.refused)) - set(PLAN_PARTS))
        if unknown:
            raise FormatError(f"node plan result names unknown parts {unknown}")
