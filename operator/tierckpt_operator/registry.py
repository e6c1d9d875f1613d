"""Every kopf handler of the operator, registered on an explicit registry (no module-level state).

Handlers are thin: read the event, call a pure function or poke a job controller, write the result.
Two roles share one registry builder:

* ``webhook``: the indices and the two admission webhooks. Every replica serves these.
* ``leader``: all of the above plus the JobSet lifecycle (CheckpointJob creation, per-job control
  loop and refresh timer, cleanup on deletion), configuration status and the watches that wake jobs.

kopf's index ids double as handler kwargs (see ``clusterview.INDEX_IDS``); pods and nodes are indexed
by the operator's own watch handlers into ``Runtime.watched``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import kopf

from tierckpt.protocol.contract import Annotations, Labels, job_id_for
from tierckpt.protocol.errors import ContractError
from tierckpt_operator import resources, webhooks
from tierckpt_operator.cleanup import purge_job
from tierckpt_operator.clusterview import (
    INDEX_IDS,
    CheckpointJobRecord,
    ConfigRecord,
    JobSetRecord,
)
from tierckpt_operator.decisions import JobState
from tierckpt_operator.events import post_event
from tierckpt_operator.jobsets import JobSetInfo, opt_in_value, parse_jobset
from tierckpt_operator.pods import replicator_of, worker_of
from tierckpt_operator.reconcile import checkpoint_job_body
from tierckpt_operator.resources import ConfigSpec
from tierckpt_operator.runtime import Runtime
from tierckpt_operator.settings import Settings

__all__ = ["build_registry"]

log = logging.getLogger(__name__)

JOBSET = (resources.JOBSET_GROUP, resources.JOBSET_VERSION, resources.JOBSETS)
CONFIG = (resources.GROUP, resources.VERSION, resources.CONFIGS)
CKJOB = (resources.GROUP, resources.VERSION, resources.JOBS)
OPTED = {Annotations.ENABLED: kopf.PRESENT}
ENABLED = {Annotations.ENABLED: "true"}
MANAGED = {Labels.MANAGED: "true"}


def _namespaced(namespace: str | None) -> str:
    """kopf types a handler's ``namespace`` as optional (cluster-scoped resources have none); every
    resource whose handlers use it here (JobSets, CheckpointJobs, pods) is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource arrived without a namespace")
    return namespace


def build_registry(settings: Settings, runtime: Runtime, *, role: str = "leader") -> kopf.OperatorRegistry:
    """A registry for ``role`` (``leader`` or ``webhook``)."""
    if role not in ("leader", "webhook"):
        raise ValueError(f"unknown role {role!r}")
    registry = kopf.OperatorRegistry()
    _lifecycle(registry, settings, runtime)
    _indices(registry, settings, runtime, leading=role == "leader")
    if settings.webhook_enabled:
        _admission(registry, settings, runtime)
    if role == "leader":
        _jobsets(registry, settings, runtime)
        _configs(registry, settings, runtime)
        _wakeups(registry, settings, runtime)
    return registry


# ------------------------------------------------------------------------------------ lifecycle


def _lifecycle(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime) -> None:
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if settings.server:
            return kopf.ConnectionInfo(server=settings.server.rstrip("/"), insecure=True)
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure_kopf(settings, runtime.settings)
        runtime.start()
        runtime.background(runtime.configs.run())

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await runtime.stop()


class DiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (what an object was when its change handlers last ran), built only for kinds with
    change handlers: pods and nodes have event handlers only, and kopf deep-copied every one of their
    events to build it anyway (about a sixth of kopf's CPU at 1,024 nodes)."""

    EVENTS_ONLY = frozenset({"Pod", "Node"})

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None
    ) -> kopf.BodyEssence:
        if body.get("kind") in self.EVENTS_ONLY:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        if body.get("kind") in self.EVENTS_ONLY:
            return None
        return super().fetch(body=body)


def _configure_kopf(kopf_settings: kopf.OperatorSettings, settings: Settings) -> None:
    kopf_settings.persistence.finalizer = "tierckpt.io/cleanup"
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="tierckpt.io")
    kopf_settings.persistence.diffbase_storage = DiffBase(
        prefix="tierckpt.io", key="last-handled-configuration"
    )
    kopf_settings.posting.level = logging.WARNING
    # Retry API errors quickly at first (the default starts at 1 s, then 1, 2, 3 s): it also shortens a
    # shutdown that catches discovery requests in flight, i.e. a standby's promotion to leader.
    kopf_settings.networking.error_backoffs = (0.1, 0.5, 1, 2, 3, 5, 8, 13, 21)
    if settings.pod_selector:
        kopf_settings.watching.label_selectors["v1", "pods"] = settings.pod_selector
    if settings.webhook_enabled:
        cert_dir = settings.webhook_cert_dir
        kopf_settings.admission.server = kopf.WebhookServer(
            addr=settings.webhook_addr,
            port=settings.webhook_port,
            insecure=settings.webhook_insecure,
            certfile=f"{cert_dir}/tls.crt" if cert_dir else None,
            pkeyfile=f"{cert_dir}/tls.key" if cert_dir else None,
        )
        if not cert_dir and not settings.webhook_insecure:
            raise kopf.PermanentError(
                "the webhook needs --webhook-cert-dir (tls.crt, tls.key) or --webhook-insecure"
            )


# ------------------------------------------------------------------------------------ indices


def _indices(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime, *, leading: bool) -> None:
    """The indices; when ``leading``, a pod's or node's event also wakes the jobs it concerns, from the
    same handler (one handler an event: kopf's cost per handler call was a fifth of the operator's CPU
    at 1,024 nodes)."""

    @kopf.index(*JOBSET, id="tierckpt_jobsets", annotations=OPTED, registry=registry)
    def jobsets(
        body: kopf.Body, namespace: str | None, name: str, uid: str, meta: kopf.Meta, **_: Any
    ) -> Any:
        namespace = _namespaced(namespace)
        deleting = bool(meta.get("deletionTimestamp"))
        try:
            if not opt_in_value(meta.annotations):
                return {}
            info = parse_jobset(body, settings.default_config)
        except ContractError as exc:
            return {(namespace, name): JobSetRecord(namespace, name, uid, error=str(exc), deleting=deleting)}
        return {(namespace, name): JobSetRecord(namespace, name, uid, info=info, deleting=deleting)}

    @kopf.index(*CONFIG, id="tierckpt_configs", registry=registry)
    def configs(body: kopf.Body, name: str, **_: Any) -> Any:
        try:
            return {name: ConfigRecord(name, spec=ConfigSpec.from_body(body))}
        except ContractError as exc:
            return {name: ConfigRecord(name, error=str(exc))}

    # Pods and nodes: the operator's own indices, kept from the watch events (clusterview.WATCHED_IDS).
    # Each records the object, then (leading) wakes the jobs it concerns: a job woken by an event reads
    # the index with it. The event handlers are coroutines: kopf runs a plain function in a
    # thread of its executor, a hop per handler and event (thousands of them a second at scale).

    @kopf.on.event("v1", "pods", id="index-worker", labels=MANAGED, registry=registry)
    async def index_worker(
        body: kopf.Body, namespace: str | None, name: str, type: str | None, labels: kopf.Labels, **_: Any
    ) -> None:
        w = worker_of(body) if type != "DELETED" else None
        runtime.watched["tierckpt_workers"].put(f"{namespace}/{name}", w.job_key if w else None, w)
        if leading and (jobset := labels.get(Labels.JOBSET_NAME)):
            runtime.poke((_namespaced(namespace), jobset))

    @kopf.on.event("v1", "pods", id="index-replicator", labels=settings.replicator_labels, registry=registry)
    async def index_replicator(
        body: kopf.Body, namespace: str | None, name: str, type: str | None, spec: kopf.Spec, **kwargs: Any
    ) -> None:
        r = replicator_of(body, settings.replicator_api_port, settings.replicator_scheme)
        r = r if type != "DELETED" else None
        runtime.watched["tierckpt_replicators"].put(f"{namespace}/{name}", r.node if r else None, r)
        if leading:
            if node := spec.get("nodeName"):
                runtime.poke_node(node)
            runtime.configs.poke(runtime.view(kwargs))

    @kopf.on.event("v1", "nodes", id="index-node", registry=registry)
    async def index_node(name: str, labels: kopf.Labels, type: str | None, **kwargs: Any) -> None:
        known = tuple(sorted(labels.items())) if type != "DELETED" else None
        runtime.watched["tierckpt_nodes"].put(name, name, known)
        if leading:
            runtime.poke_node(name)
            runtime.configs.poke(runtime.view(kwargs))

    @kopf.index(*CKJOB, id="tierckpt_ckjobs", registry=registry)
    def ckjobs(
        namespace: str | None, name: str, uid: str, spec: kopf.Spec, status: kopf.Status, **_: Any
    ) -> Any:
        namespace = _namespaced(namespace)
        record = CheckpointJobRecord(
            namespace,
            name,
            uid,
            JobState.from_status(status),
            job_id=spec.get("jobId", ""),
            status=dict(status),
        )
        return {(namespace, name): record}


# ------------------------------------------------------------------------------------ admission


def _admission(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime) -> None:
    @kopf.on.mutate(*JOBSET, id="mutate-jobsets", operation="CREATE", annotations=ENABLED, registry=registry)
    def mutate_jobset(body: kopf.Body, patch: kopf.Patch, warnings: list[str], **kwargs: Any) -> None:
        webhooks.jobset_mutation(body, runtime.view(kwargs), settings, warnings)
        patch.fns.append(webhooks.apply_jobset())
        runtime.metrics.webhook_mutations.labels("jobset", "ok").inc()

    @kopf.on.mutate("v1", "pods", id="mutate-pods", operation="CREATE", labels=MANAGED, registry=registry)
    async def mutate_pod(body: kopf.Body, patch: kopf.Patch, **kwargs: Any) -> None:
        try:
            plan = await webhooks.pod_mutation(body, runtime.view(kwargs), settings, runtime.kube.get_jobset)
        except kopf.AdmissionError:
            runtime.metrics.webhook_mutations.labels("pod", "refused").inc()
            raise
        patch.fns.append(webhooks.apply_pod(plan))
        runtime.metrics.webhook_mutations.labels("pod", "ok").inc()


# ------------------------------------------------------------------------------------ JobSets


def _jobsets(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime) -> None:
    @kopf.on.resume(*JOBSET, id="opt-in", annotations=OPTED, registry=registry)
    @kopf.on.create(*JOBSET, id="opt-in", annotations=OPTED, registry=registry)
    async def opt_in(
        body: kopf.Body, meta: kopf.Meta, namespace: str | None, name: str, uid: str, **_: Any
    ) -> None:
        namespace = _namespaced(namespace)
        try:
            if not opt_in_value(meta.annotations):
                return
        except ContractError as exc:
            post_event(body, "Warning", "InvalidAnnotation", str(exc))
            raise kopf.PermanentError(str(exc)) from exc
        info: JobSetInfo | None
        try:
            info, error = parse_jobset(body, settings.default_config), None
        except ContractError as exc:
            info, error = None, exc
        created = await runtime.kube.create_checkpoint_job(checkpoint_job_body(info, namespace, name, uid))
        runtime.poke((namespace, name))
        if info is None:
            post_event(body, "Warning", "InvalidJobSet", f"not checkpointed: {error}")
            raise kopf.PermanentError(str(error))
        if created is not None:
            post_event(
                body,
                "Normal",
                "CheckpointingEnabled",
                f"job {info.job_id}: {info.world_size} node ranks, configuration {info.config_name}",
            )

    @kopf.daemon(
        *JOBSET,
        id="control-loop",
        annotations=ENABLED,
        cancellation_backoff=2.0,
        cancellation_timeout=10,
        registry=registry,
    )
    async def control_loop(
        namespace: str | None, name: str, stopped: kopf.DaemonStopped, **kwargs: Any
    ) -> None:
        namespace = _namespaced(namespace)
        indices = {k: kwargs[k] for k in INDEX_IDS}
        await runtime.controller((namespace, name)).run(lambda: runtime.view(indices), stopped)

    @kopf.timer(
        *JOBSET,
        id="refresh",
        annotations=ENABLED,
        interval=settings.refresh_interval,
        initial_delay=min(5.0, settings.refresh_interval),
        registry=registry,
    )
    async def refresh(namespace: str | None, name: str, **kwargs: Any) -> None:
        ctl = runtime.controllers.get((_namespaced(namespace), name))
        if ctl is not None:
            await ctl.refresh(runtime.view(kwargs))

    @kopf.on.delete(*JOBSET, id="cleanup", annotations=ENABLED, retries=5, backoff=5, registry=registry)
    async def cleanup(
        body: kopf.Body, namespace: str | None, name: str, uid: str, retry: int, **kwargs: Any
    ) -> None:
        namespace = _namespaced(namespace)
        cluster = runtime.view(kwargs)
        rec = cluster.jobset(namespace, name)
        info = rec.info if rec is not None else None
        try:
            job_id = info.job_id if info else job_id_for(namespace, name, uid)
        except ContractError:
            return
        cfg = cluster.config(info.config_name) if info else None
        result = await purge_job(runtime.replicators, cluster, job_id, cfg.spec if cfg else None)
        if (result.failed or result.backups_deleted is False) and retry < 4:
            raise kopf.TemporaryError(f"{result.summary()}; retrying", delay=5 * (retry + 1))
        kind = "Warning" if result.failed or result.backups_deleted is False else "Normal"
        post_event(body, kind, "JobDataPurged", f"job {job_id}: {result.summary()}")
        await runtime.kube.delete_checkpoint_job(namespace, name)
        runtime.forget((namespace, name))


# ------------------------------------------------------------------------------------ configurations


def _configs(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime) -> None:
    @kopf.on.resume(*CONFIG, id="replan", registry=registry)
    @kopf.on.update(*CONFIG, id="replan", registry=registry)
    @kopf.on.create(*CONFIG, id="replan", registry=registry)
    def replan(body: kopf.Body, name: str, reason: str, **kwargs: Any) -> None:
        keys = [
            (rec.namespace, rec.name)
            for rec in runtime.view(kwargs).jobsets()
            if rec.info is not None and rec.info.config_name == name
        ]
        for key in keys:
            runtime.poke(key)
        if reason == "update":
            post_event(body, "Normal", "Replanning", f"configuration changed: re-planning {len(keys)} job(s)")

    @kopf.on.event(*CONFIG, id="config-changed", registry=registry)
    async def config_changed(**kwargs: Any) -> None:
        runtime.configs.poke(runtime.view(kwargs))


# ------------------------------------------------------------------------------------ wake-ups


def _wakeups(registry: kopf.OperatorRegistry, settings: Settings, runtime: Runtime) -> None:
    @kopf.on.event(*JOBSET, id="jobset-changed", annotations=OPTED, registry=registry)
    async def jobset_changed(namespace: str | None, name: str, **_: Any) -> None:
        runtime.poke((_namespaced(namespace), name))

    @kopf.on.event(*CKJOB, id="checkpointjob-changed", registry=registry)
    async def checkpoint_job_changed(namespace: str | None, name: str, type: str | None, **_: Any) -> None:
        if type in (None, "ADDED", "DELETED"):  # not our own status writes
            runtime.poke((_namespaced(namespace), name))
