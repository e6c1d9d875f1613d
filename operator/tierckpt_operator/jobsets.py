"""What the operator needs from a JobSet, parsed and checked (pure).

A JobSet opts in with the annotation ``tierckpt.io/enabled: "true"`` and names its
CheckpointConfiguration with ``tierckpt.io/config`` (default: the operator's ``--default-config``);
``tierckpt.io/mode: orbax`` runs stock Orbax multi-tier checkpointing instead of tierckpt's client.
Every replicatedJob must be an Indexed Job whose completions equal its parallelism: node ranks come
from the JobSet's job indices and the Job's completion indices.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from tierckpt.planning.placement import JobShape, ReplicatedJob
from tierckpt.protocol.contract import MODES, Annotations, job_id_for
from tierckpt.protocol.errors import ContractError

__all__ = ["JobSetInfo", "check_jobset", "mode_of", "opt_in_value", "parse_jobset"]

_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class JobSetInfo:
    """An opted-in JobSet as the operator sees it."""

    namespace: str
    name: str
    uid: str
    job_id: str
    config_name: str
    shape: JobShape
    restarts: int = 0
    """``status.restarts``: the current restart attempt."""
    deleting: bool = False
    mode: str = "native"
    """``tierckpt.io/mode``: ``native`` or ``orbax``."""

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def world_size(self) -> int:
        return self.shape.world_size


def opt_in_value(annotations: Mapping[str, str] | None) -> bool:
    """Whether the JobSet opted in: ``"true"``/``"false"`` (any case); anything else is an error."""
    raw = (annotations or {}).get(Annotations.ENABLED)
    if raw is None:
        return False
    value = str(raw).strip().lower()
    if value in ("true", "false"):
        return value == "true"
    raise ContractError(f'annotation {Annotations.ENABLED}={raw!r} is invalid: use "true" or "false"')


def mode_of(annotations: Mapping[str, str] | None) -> str:
    """The JobSet's ``tierckpt.io/mode`` (``native`` when absent); anything but ``MODES`` is an error."""
    raw = (annotations or {}).get(Annotations.MODE, "native")
    value = str(raw).strip().lower()
    if value not in MODES:
        raise ContractError(
            f"annotation {Annotations.MODE}={raw!r} is invalid: use {' or '.join(map(repr, MODES))}"
        )
    return value


def check_jobset(body: Mapping[str, Any], default_config: str = "default") -> tuple[str, JobShape]:
    """The configuration name and node-rank shape of a JobSet (no uid needed, as at admission)."""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    opt_in_value(annotations)
    mode_of(annotations)
    config = annotations.get(Annotations.CONFIG, default_config)
    if not isinstance(config, str) or not _NAME.fullmatch(config):
        raise ContractError(
            f"annotation {Annotations.CONFIG}={config!r} is invalid: it must name a CheckpointConfiguration"
        )
    return config, _shape(body.get("spec") or {})


def parse_jobset(body: Mapping[str, Any], default_config: str = "default") -> JobSetInfo:
    """Parse an opted-in JobSet; a ``ContractError`` says what to fix."""
    meta = body.get("metadata") or {}
    config, shape = check_jobset(body, default_config)
    namespace, name, uid = meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", "")
    return JobSetInfo(
        namespace=namespace,
        name=name,
        uid=uid,
        job_id=job_id_for(namespace, name, uid),
        config_name=config,
        shape=shape,
        restarts=int((body.get("status") or {}).get("restarts") or 0),
        deleting=bool(meta.get("deletionTimestamp")),
        mode=mode_of(meta.get("annotations")),
    )


def _shape(spec: Mapping[str, Any]) -> JobShape:
    rjobs = spec.get("replicatedJobs") or []
    if not rjobs:
        raise ContractError("the JobSet has no replicatedJobs")
    out = []
    for i, rj in enumerate(rjobs):
        name = rj.get("name")
        where = f"spec.replicatedJobs[{i}] ({name!r})"
        job = ((rj.get("template") or {}).get("spec")) or {}
        if job.get("completionMode") != "Indexed":
            raise ContractError(
                f"{where} is not an Indexed Job: set template.spec.completionMode: Indexed "
                "(tierckpt derives node ranks from completion indices)"
            )
        parallelism = job.get("parallelism", 1)
        completions = job.get("completions", parallelism)
        if completions != parallelism:
            raise ContractError(
                f"{where}: completions ({completions}) must equal parallelism ({parallelism}): "
                "every pod of the Job is one node rank"
            )
        replicas = rj.get("replicas", 1)
        if not isinstance(replicas, int) or not isinstance(parallelism, int):
            raise ContractError(f"{where}: replicas and parallelism must be integers")
        out.append(ReplicatedJob(name=str(name), replicas=replicas, parallelism=parallelism))
    if len({rj.name for rj in out}) != len(out):
        raise ContractError("replicatedJob names must be unique")
    return JobShape(tuple(out))
