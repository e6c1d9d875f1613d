"""Pods and nodes as the operator sees them (pure): training pods, replicator pods, node labels.

These small frozen records are what the kopf indices hold, so a watch event costs one parse and the
planners never touch raw bodies.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from tierckpt.planning.placement import JobShape, Worker
from tierckpt.protocol.contract import Annotations, Labels
from tierckpt.protocol.control import check_endpoint, check_node_name
from tierckpt.protocol.errors import ContractError, FormatError

__all__ = ["ReplicatorPod", "WorkerPod", "replicator_of", "worker_of"]

log = logging.getLogger(__name__)

_FINISHED = ("Succeeded", "Failed")


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class WorkerPod:
    """A pod of an opted-in JobSet (label ``tierckpt.io/managed=true``)."""

    namespace: str
    name: str
    jobset: str
    replicated_job: str
    job_index: int
    completion_index: int
    attempt: int
    job_global_index: int | None = None
    node: str | None = None
    rank: int | None = None
    rank_generation: int | None = None
    num_nodes: int | None = None
    coordinator: str | None = None
    active: bool = True
    address: str = ""
    """How other pods reach it: ``<hostname>.<subdomain>`` (JobSet DNS), else the pod IP."""
    ip: str = ""
    """The pod IP (``status.podIP``), once the pod runs."""

    @property
    def job_key(self) -> tuple[str, str]:
        return self.namespace, self.jobset

    def initial_rank(self, shape: JobShape) -> int:
        return shape.initial_rank(
            self.replicated_job, self.job_index, self.completion_index, self.job_global_index
        )

    def as_worker(self, shape: JobShape) -> Worker | None:
        """The placement view, or None if the pod's indices do not fit the JobSet's shape."""
        try:
            initial = self.initial_rank(shape)
        except ContractError:
            return None
        return Worker(
            pod=self.name,
            initial_rank=initial,
            attempt=self.attempt,
            node=self.node,
            rank=self.rank,
            rank_generation=self.rank_generation,
            active=self.active,
        )


def worker_of(body: Mapping[str, Any]) -> WorkerPod | None:
    """Parse a training pod; None if it lacks the JobSet and Job index labels."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    jobset = labels.get(Labels.JOBSET_NAME)
    rjob = labels.get(Labels.REPLICATED_JOB)
    job_index = _int(labels.get(Labels.JOB_INDEX))
    completion = _int(labels.get(Labels.COMPLETION_INDEX, annotations.get(Labels.COMPLETION_INDEX)))
    if not jobset or not rjob or job_index is None or completion is None:
        return None
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    address = f"{hostname}.{subdomain}" if hostname and subdomain else status.get("podIP", "")
    return WorkerPod(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        jobset=jobset,
        replicated_job=rjob,
        job_index=job_index,
        completion_index=completion,
        attempt=_int(labels.get(Labels.RESTART_ATTEMPT)) or 0,
        job_global_index=_int(labels.get(Labels.JOB_GLOBAL_INDEX)),
        node=spec.get("nodeName") or None,
        rank=_int(annotations.get(Annotations.NODE_RANK)),
        rank_generation=_int(annotations.get(Annotations.ASSIGNMENT_GENERATION)),
        num_nodes=_int(annotations.get(Annotations.NUM_NODES)),
        coordinator=annotations.get(Annotations.COORDINATOR),
        active=not meta.get("deletionTimestamp") and status.get("phase") not in _FINISHED,
        address=address,
        ip=status.get("podIP", "") or "",
    )


@dataclasses.dataclass(frozen=True)
class ReplicatorPod:
    """A replicator pod: the node it serves and its control API endpoint."""

    node: str
    endpoint: str
    ready: bool
    name: str = ""


def replicator_of(body: Mapping[str, Any], port: int, scheme: str = "https") -> ReplicatorPod | None:
    """Parse a replicator pod; None until it is scheduled and has an address. ``scheme``: https (mutual
    TLS) or, with legacy ``--auth token``, http."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    node = spec.get("nodeName")
    endpoint = (meta.get("annotations") or {}).get(Annotations.REPLICATOR_ENDPOINT)
    if not endpoint:
        host = status.get("podIP") or status.get("hostIP")
        endpoint = f"{scheme}://{f'[{host}]' if host and ':' in host else host}:{port}" if host else ""
    if not node or not endpoint:
        return None
    try:
        check_node_name(node)
        check_endpoint(endpoint.rstrip("/"))
    except FormatError as exc:  # never copied into a peer assignment
        log.warning("ignoring replicator pod %s: %s", meta.get("name", "?"), exc)
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    ready = (
        not meta.get("deletionTimestamp")
        and status.get("phase") == "Running"
        and conditions.get("Ready", "True") == "True"
    )
    return ReplicatorPod(node=node, endpoint=endpoint.rstrip("/"), ready=ready, name=meta.get("name", ""))
