"""The two mutating webhooks: what they decide for an admission review (no kopf decorators here).

``/mutate-jobsets`` labels the pod templates of an opted-in JobSet (and warns about what will not
work); ``/mutate-pods`` injects the ramdisk, environment and placement into a pod of an opted-in
JobSet. A pod whose JobSet or configuration is unusable is refused with the reason: the Job
controller retries, so the pod starts once the problem is fixed, and never runs believing it has
checkpoints that it does not have.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import kopf

from tierckpt.protocol.errors import ContractError
from tierckpt_operator.clusterview import ClusterView, JobSetRecord
from tierckpt_operator.injection import Injection, inject, label_pod_templates, preferred_node
from tierckpt_operator.jobsets import check_jobset, opt_in_value, parse_jobset
from tierckpt_operator.pods import worker_of
from tierckpt_operator.settings import Settings

__all__ = ["apply_jobset", "apply_pod", "jobset_mutation", "pod_mutation"]

log = logging.getLogger(__name__)

FetchJobSet = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


def jobset_mutation(
    body: Mapping[str, Any], cluster: ClusterView, settings: Settings, warnings: list[str]
) -> None:
    """Check an opted-in JobSet at creation; the caller applies ``label_pod_templates``."""
    try:
        config, _ = check_jobset(body, settings.default_config)
    except ContractError as exc:
        warnings.append(f"tierckpt: this JobSet will not be checkpointed: {exc}")
        return
    rec = cluster.config(config)
    if rec is None:
        warnings.append(
            f"tierckpt: CheckpointConfiguration {config!r} does not exist; its pods wait until it does"
        )
    elif rec.spec is None:
        warnings.append(f"tierckpt: CheckpointConfiguration {config!r} is invalid: {rec.error}")


async def pod_mutation(
    body: Mapping[str, Any], cluster: ClusterView, settings: Settings, fetch: FetchJobSet
) -> Injection:
    """The injection for a managed pod; ``kopf.AdmissionError`` if the pod cannot be served."""
    worker = worker_of(body)
    if worker is None:
        raise kopf.AdmissionError(
            "tierckpt: managed pod lacks the JobSet and Job completion index labels", code=400
        )
    namespace = (body.get("metadata") or {}).get("namespace") or worker.namespace
    rec = cluster.jobset(namespace, worker.jobset)
    if rec is None:
        rec = await _fetched(fetch, namespace, worker.jobset, settings)
    if rec is None or rec.info is None:
        why = rec.error if rec is not None else "not found or not opted in"
        raise kopf.AdmissionError(f"tierckpt: JobSet {namespace}/{worker.jobset}: {why}", code=400)
    info = rec.info
    cfg = cluster.config(info.config_name)
    if cfg is None or cfg.spec is None:
        why = "does not exist" if cfg is None else f"is invalid: {cfg.error}"
        raise kopf.AdmissionError(f"tierckpt: CheckpointConfiguration {info.config_name!r} {why}", code=400)
    try:
        initial = worker.initial_rank(info.shape)
    except ContractError as exc:
        raise kopf.AdmissionError(f"tierckpt: {exc}", code=400) from exc
    ck = cluster.checkpoint_job(namespace, worker.jobset)
    nodes = cluster.nodes()
    spec = cfg.spec
    return Injection(
        job_id=info.job_id,
        mount_root=spec.mount_root,
        volume_mode=settings.ramdisk_mode,
        host_root=settings.ramdisk_host_path,
        ramdisk_size=spec.ramdisk_size,
        podinfo_dir=settings.podinfo_dir,
        replicator_port=settings.replicator_api_port,
        node_selector=spec.node_selector,
        tolerations=spec.tolerations,
        preferred_node=preferred_node(ck.state.nodes if ck else None, initial, nodes or None),
        mode=info.mode,
        jobset=info.name,
    )


async def _fetched(fetch: FetchJobSet, namespace: str, name: str, settings: Settings) -> JobSetRecord | None:
    """Read a JobSet the watch has not delivered yet (rare: the pod raced the JobSet's watch event)."""
    body = await fetch(namespace, name)
    if body is None:
        return None
    meta = body.get("metadata") or {}
    try:
        if not opt_in_value(meta.get("annotations")):
            return None
        info = parse_jobset(body, settings.default_config)
    except ContractError as exc:
        return JobSetRecord(namespace, name, meta.get("uid", ""), error=str(exc))
    return JobSetRecord(namespace, name, info.uid, info=info)


def _editable(body: kopf.RawBody) -> dict[str, Any]:
    """kopf hands a patch function the raw body, typed as a ``TypedDict`` of the known fields; it is a
    plain dict, which the injection edits in place, arbitrary keys included."""
    return cast("dict[str, Any]", body)


def apply_pod(plan: Injection) -> kopf.PatchFn:
    return lambda pod: inject(_editable(pod), plan)


def apply_jobset() -> kopf.PatchFn:
    return lambda jobset: label_pod_templates(_editable(jobset))
