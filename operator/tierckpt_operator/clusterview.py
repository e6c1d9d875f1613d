"""A read-only view of the cluster as the operator's indices hold it (pure: no API calls).

The indices are filled by the watches (see ``registry``): opted-in JobSets, configurations and
CheckpointJob states in kopf's indices (``INDEX_IDS``); training pods, replicator pods and node labels,
thousands each in a big cluster, in ``WatchedIndex``es the operator keeps from their watch events
(``WATCHED_IDS``: kopf holds every event of an indexed kind until every object of it is indexed, which
costs O(objects^2) per burst of events). The control loops and the webhooks read them through
``ClusterView``, so a reconcile costs no API request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from tierckpt_operator.decisions import JobState
from tierckpt_operator.jobsets import JobSetInfo
from tierckpt_operator.pods import ReplicatorPod, WorkerPod
from tierckpt_operator.resources import ConfigSpec

__all__ = [
    "INDEX_IDS",
    "WATCHED_IDS",
    "CheckpointJobRecord",
    "ClusterView",
    "ConfigRecord",
    "JobSetRecord",
    "WatchedIndex",
]

INDEX_IDS = ("tierckpt_jobsets", "tierckpt_configs", "tierckpt_ckjobs")
"""kopf's indices (few objects)."""
WATCHED_IDS = ("tierckpt_workers", "tierckpt_replicators", "tierckpt_nodes")
"""The operator's own (``WatchedIndex``), kept from watch events."""


@dataclasses.dataclass(frozen=True)
class JobSetRecord:
    """An opted-in JobSet: parsed, or the reason it cannot be served."""

    namespace: str
    name: str
    uid: str
    info: JobSetInfo | None = None
    error: str = ""
    deleting: bool = False


@dataclasses.dataclass(frozen=True)
class ConfigRecord:
    name: str
    spec: ConfigSpec | None = None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointJobRecord:
    namespace: str
    name: str
    uid: str
    state: JobState
    job_id: str = ""
    status: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)


K = TypeVar("K")
V = TypeVar("V")


class WatchedIndex(Mapping[K, tuple[V, ...]], Generic[K, V]):
    """key -> the values of the watched objects filed under it, kept from the objects' watch events:
    ``put(object, key, value)`` on every event (a value None files nothing), ``drop(object)`` when one
    is deleted. Read like a kopf index."""

    def __init__(self) -> None:
        self._by_key: dict[K, dict[str, V]] = {}
        self._key_of: dict[str, K] = {}

    def put(self, obj: str, key: K | None, value: V | None) -> None:
        self.drop(obj)
        if key is not None and value is not None:
            self._by_key.setdefault(key, {})[obj] = value
            self._key_of[obj] = key

    def drop(self, obj: str) -> None:
        key = self._key_of.pop(obj, None)
        if key is not None:
            values = self._by_key[key]
            values.pop(obj, None)
            if not values:
                del self._by_key[key]

    def __getitem__(self, key: K) -> tuple[V, ...]:
        return tuple(self._by_key[key].values())

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._by_key))

    def __len__(self) -> int:
        return len(self._by_key)


def _one(index: Mapping[K, Iterable[V]] | None, key: K) -> V | None:
    if index is None or key not in index:
        return None
    return next(iter(index[key]), None)


@dataclasses.dataclass(frozen=True)
class ClusterView:
    """Lookups over the indices; missing indices read as empty."""

    indices: Mapping[str, Any]

    def _index(self, name: str) -> Any:
        return self.indices.get(name) if hasattr(self.indices, "get") else self.indices[name]

    def jobset(self, namespace: str, name: str) -> JobSetRecord | None:
        index: Mapping[tuple[str, str], Iterable[JobSetRecord]] | None = self._index("tierckpt_jobsets")
        return _one(index, (namespace, name))

    def jobsets(self) -> list[JobSetRecord]:
        index = self._index("tierckpt_jobsets") or {}
        return [rec for key in index for rec in index[key]]

    def config(self, name: str) -> ConfigRecord | None:
        index: Mapping[str, Iterable[ConfigRecord]] | None = self._index("tierckpt_configs")
        return _one(index, name)

    def configs(self) -> list[ConfigRecord]:
        index = self._index("tierckpt_configs") or {}
        return [rec for key in index for rec in index[key]]

    def workers(self, namespace: str, jobset: str) -> list[WorkerPod]:
        index = self._index("tierckpt_workers")
        key = (namespace, jobset)
        return list(index[key]) if index is not None and key in index else []

    def replicator(self, node: str) -> ReplicatorPod | None:
        """The node's replicator, a ready one first."""
        index = self._index("tierckpt_replicators")
        if index is None or node not in index:
            return None
        pods = sorted(index[node], key=lambda p: (not p.ready, p.name))
        return pods[0] if pods else None

    def replicators(self) -> list[ReplicatorPod]:
        index = self._index("tierckpt_replicators") or {}
        return [pod for node in index for pod in index[node]]

    def node_labels(self, node: str) -> dict[str, str] | None:
        labels = _one(self._index("tierckpt_nodes"), node)
        return dict(labels) if labels is not None else None

    def nodes(self) -> dict[str, dict[str, str]]:
        index = self._index("tierckpt_nodes") or {}
        return {name: dict(labels) for name in index for labels in index[name]}

    def checkpoint_job(self, namespace: str, name: str) -> CheckpointJobRecord | None:
        index: Mapping[tuple[str, str], Iterable[CheckpointJobRecord]] | None = self._index("tierckpt_ckjobs")
        return _one(index, (namespace, name))
