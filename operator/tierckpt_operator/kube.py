"""The only module that calls the Kubernetes API beyond kopf (through the ``kubernetes`` client).

kopf watches, patches the objects its handlers run for, posts events and serves the webhook; this
adapter does the rest: create and update CheckpointJobs, annotate pods with their ranks, read a
JobSet the watch has not delivered yet, hold the leader Lease, and, for node certificates, review a
replicator's ServiceAccount token (TokenReview), read its pod and publish the CA certificate. The
client is synchronous, so every call runs in a worker thread, with at most ``concurrency`` calls in
flight.

A refusal of the API server is mapped to a typed error once, where the call is made (``api_error``, as
kopf's ``APIError`` family): a method says "absent is fine" with ``except NotFound``, "someone was first"
with ``except Conflict``, and never reads a status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import kubernetes
from kubernetes.client import ApiException

from tierckpt_operator import resources

__all__ = [
    "ClientError",
    "Conflict",
    "Forbidden",
    "Invalid",
    "Kube",
    "KubeError",
    "NotFound",
    "ServerError",
    "Unauthorized",
    "api_client",
    "api_error",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class KubeError(Exception):
    """The API server refused a call: its HTTP status, its reason and its message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status, self.reason, self.message = status, reason, message


class ClientError(KubeError):
    """A 4xx: the request itself is wrong (or its object is not as it thought)."""


class ServerError(KubeError):
    """A 5xx (or no status at all): the server failed; the same call may succeed later."""


class Unauthorized(ClientError):
    """401: the operator's credentials were not accepted."""


class Forbidden(ClientError):
    """403: RBAC does not allow the call (the chart's roles and the code disagree)."""


class NotFound(ClientError):
    """404: the object (or its kind) does not exist."""


class Conflict(ClientError):
    """409: it exists already, or it changed since it was read (a stale ``resourceVersion``)."""


class Invalid(ClientError):
    """422: the object breaks its schema."""


_BY_STATUS: dict[int, type[KubeError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: Invalid,
}


def api_error(exc: ApiException) -> KubeError:
    """The typed error of the client's ``ApiException``: by status, else by class of status; the reason
    and message of the Status object the server answered with (else the HTTP reason phrase)."""
    status = int(exc.status or 0)
    kind = _BY_STATUS.get(status) or (ClientError if 400 <= status < 500 else ServerError)
    body: Any = None
    if exc.body:
        with contextlib.suppress(ValueError, TypeError):
            body = json.loads(exc.body)
    status_object = body if isinstance(body, dict) else {}  # a Kubernetes Status, when the server sent one
    reason = str(status_object.get("reason") or exc.reason or "")
    return kind(status, reason, str(status_object.get("message") or ""))


def api_client(server: str = "", kubeconfig: str = "") -> kubernetes.client.ApiClient:
    """An API client: an explicit server URL (tests), else in-cluster, else the kubeconfig."""
    if server:
        cfg = kubernetes.client.Configuration(host=server.rstrip("/"))
        return kubernetes.client.ApiClient(cfg)
    cfg = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=kubeconfig or None, client_configuration=cfg)
    return kubernetes.client.ApiClient(cfg)


class Kube:
    """Async wrappers of the few API calls the operator makes itself."""

    def __init__(self, client: kubernetes.client.ApiClient, concurrency: int = 16) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.leases = kubernetes.client.CoordinationV1Api(client)
        self.authentication = kubernetes.client.AuthenticationV1Api(client)
        self._slots = asyncio.Semaphore(concurrency)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async with self._slots:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except ApiException as exc:
                raise api_error(exc) from exc

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------------------ CheckpointJobs

    async def create_checkpoint_job(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create it; None if it already exists (creation is idempotent)."""
        ns = body["metadata"]["namespace"]
        try:
            created = await self._call(
                self.custom.create_namespaced_custom_object,
                resources.GROUP,
                resources.VERSION,
                ns,
                resources.JOBS,
                dict(body),
            )
        except Conflict:
            return None
        return _custom_object(created)

    async def patch_checkpoint_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Merge-patch the status; False if the CheckpointJob is gone."""
        try:
            await self._call(
                self.custom.patch_namespaced_custom_object_status,
                resources.GROUP,
                resources.VERSION,
                namespace,
                resources.JOBS,
                name,
                {"status": dict(status)},
            )
            return True
        except NotFound:
            return False

    async def patch_config_status(self, name: str, status: Mapping[str, Any]) -> bool:
        """Merge-patch a CheckpointConfiguration's status; False if it is gone."""
        try:
            await self._call(
                self.custom.patch_cluster_custom_object_status,
                resources.GROUP,
                resources.VERSION,
                resources.CONFIGS,
                name,
                {"status": dict(status)},
            )
            return True
        except NotFound:
            return False

    async def delete_checkpoint_job(self, namespace: str, name: str) -> None:
        with contextlib.suppress(NotFound):
            await self._call(
                self.custom.delete_namespaced_custom_object,
                resources.GROUP,
                resources.VERSION,
                namespace,
                resources.JOBS,
                name,
            )

    async def get_jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = await self._call(
                self.custom.get_namespaced_custom_object,
                resources.JOBSET_GROUP,
                resources.JOBSET_VERSION,
                namespace,
                resources.JOBSETS,
                name,
            )
        except NotFound:
            return None
        return _custom_object(found)

    # ------------------------------------------------------------------------------ pods

    async def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge the annotations into the pod; False if the pod is gone. The answer (the whole pod) is
        not turned into the client's model objects: a job of thousands of pods gets thousands of these."""

        def patch() -> None:
            raw: Any = self.core.patch_namespaced_pod(  # an HTTP response, with _preload_content=False
                name, namespace, {"metadata": {"annotations": dict(annotations)}}, _preload_content=False
            )
            raw.read()
            raw.release_conn()

        try:
            await self._call(patch)
            return True
        except NotFound:
            return False

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API returns it (JSON field names); None if it does not exist."""
        try:
            pod = await self._call(self.core.read_namespaced_pod, name, namespace)
        except NotFound:
            return None
        return cast("dict[str, Any]", self.client.sanitize_for_serialization(pod))

    # ------------------------------------------------------------------------------ identity

    async def review_token(self, token: str, audience: str) -> dict[str, Any]:
        """The API server's verdict on a ServiceAccount token for ``audience``: a TokenReview's status
        (``authenticated``, ``user``, ``audiences``, ``error``), as JSON."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        review = await self._call(self.authentication.create_token_review, body)
        answer = cast("dict[str, Any]", self.client.sanitize_for_serialization(review))
        return cast("dict[str, Any]", answer.get("status") or {})

    async def publish_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        """Create the ConfigMap, or replace its data if it exists."""
        body = {"metadata": {"name": name, "namespace": namespace}, "data": dict(data)}
        try:
            await self._call(self.core.create_namespaced_config_map, namespace, body)
        except Conflict:
            await self._call(self.core.patch_namespaced_config_map, name, namespace, {"data": dict(data)})

    # ------------------------------------------------------------------------------ leader Lease

    async def try_lease(self, namespace: str, name: str, holder: str, duration: float) -> bool:
        """Take or renew the Lease if it is ours, free or expired; True while we hold it.

        Optimistic concurrency: the patch carries the resourceVersion we read, so two candidates
        racing for an expired Lease cannot both win.
        """
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": holder, "leaseDurationSeconds": max(1, int(duration)), "renewTime": stamp}
        try:
            lease = await self._call(self.leases.read_namespaced_lease, name, namespace)
        except NotFound:
            return await self._create_lease(namespace, name, {**spec, "acquireTime": stamp})
        current = lease.spec.holder_identity if lease.spec else None
        renewed = lease.spec.renew_time if lease.spec else None
        held_for = (lease.spec.lease_duration_seconds or duration) if lease.spec else duration
        expired = renewed is None or (now - renewed).total_seconds() > held_for
        if current not in (holder, None, "") and not expired:
            return False
        if current != holder:
            spec["acquireTime"] = stamp
        patch = {"metadata": {"resourceVersion": _resource_version(lease)}, "spec": spec}
        try:
            await self._call(self.leases.patch_namespaced_lease, name, namespace, patch)
            return True
        except Conflict:
            return False

    async def _create_lease(self, namespace: str, name: str, spec: Mapping[str, Any]) -> bool:
        """Create the Lease as its holder; False if another candidate created it first."""
        body = {"metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}
        try:
            await self._call(self.leases.create_namespaced_lease, namespace, body)
            return True
        except Conflict:
            return False

    async def release_lease(self, namespace: str, name: str, holder: str) -> None:
        """Give the Lease up (clean shutdown), so a standby takes over without waiting for expiry."""
        try:
            lease = await self._call(self.leases.read_namespaced_lease, name, namespace)
            if lease.spec is None or lease.spec.holder_identity != holder:
                return
            patch = {
                "metadata": {"resourceVersion": _resource_version(lease)},
                "spec": {"holderIdentity": ""},
            }
            await self._call(self.leases.patch_namespaced_lease, name, namespace, patch)
        except KubeError as exc:
            log.warning("could not release lease %s/%s: %s", namespace, name, exc)


def _custom_object(obj: object) -> dict[str, Any]:
    """The client types a custom object as ``object``; it is the decoded JSON body, a dict."""
    return cast("dict[str, Any]", obj)


def _resource_version(lease: kubernetes.client.V1Lease) -> str | None:
    """The version a patch must match (optimistic concurrency); a Lease read from the server has metadata."""
    assert lease.metadata is not None
    return lease.metadata.resource_version
