"""THE replicator's control API, defined once: every endpoint's method, path, messages and statuses.

The replicator registers its routes from ``ENDPOINTS`` (``tierckpt_replicator.api.routes``), the one
client builds its requests from it (``tierckpt.protocol.client``), and the OpenAPI document and
``docs/replicator.md`` describe exactly these endpoints (tests check all three). Bodies are the typed
messages of ``tierckpt.protocol.control`` with their ``kind``/``version`` envelope.

Pure data: no HTTP library here.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from typing import Literal

from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import (
    BackupResult,
    JobPolicy,
    NodeInventory,
    NodePlan,
    NodePlanResult,
    NodeStatus,
    PeerAssignment,
    PurgeResult,
    RestoreAccepted,
    RestorePlan,
)
from tierckpt.protocol.format import JOB_ID_PATTERN
from tierckpt.protocol.identity import CertificateIssued, CertificateRequest
from tierckpt.protocol.orbax import OrbaxSession

__all__ = [
    "BACKUP",
    "ENDPOINTS",
    "HEALTHZ",
    "INVENTORY",
    "ISSUE_CERTIFICATE",
    "JOB_METRICS",
    "METRICS",
    "OPENAPI",
    "PATH_PARAMS",
    "PORTS",
    "PURGE",
    "PUT_NODE_PLAN",
    "PUT_ORBAX_SESSION",
    "PUT_PEERS",
    "PUT_POLICY",
    "PUT_RESTORE_PLAN",
    "READYZ",
    "RESTORE",
    "STATUS",
    "STATUS_MEANINGS",
    "Endpoint",
    "PathParam",
    "Port",
    "QueryFlag",
    "endpoint",
    "served_on",
]


@dataclasses.dataclass(frozen=True)
class PathParam:
    """A ``{name}`` segment of a path template: what it is and which values are valid."""

    name: str
    pattern: str
    description: str


@dataclasses.dataclass(frozen=True)
class QueryFlag:
    """A boolean query parameter (``?name=true``); absent means false."""

    name: str
    description: str


Port = Literal["api", "probes"]
"""Which of the replicator's HTTP servers serves an endpoint: ``api`` (``--api-port``: the operator,
peers and training pods) or ``probes`` (``--probe-port``: kubelet probes and Prometheus, a server of
its own that connections to the API port cannot starve)."""
PORTS: tuple[Port, ...] = ("api", "probes")

PATH_PARAMS = {
    "job": PathParam(
        "job",
        JOB_ID_PATTERN,
        "The job id: 1-253 of [A-Za-z0-9_.-], starting with a letter or digit "
        "(on Kubernetes <namespace>_<jobset>_<uid prefix>).",
    ),
}
"""Every path parameter of the API (a template's ``{name}`` must be one of these)."""

STATUS_MEANINGS = {
    200: "done; the body is the answer",
    202: "accepted; the work (restore staging) goes on in the background",
    400: "malformed request: an invalid job id or query value, a body that is not the endpoint's "
    "message, or a body for another job than the path's",
    401: "no credentials: no client certificate naming a tierckpt identity, or (legacy --auth token) no "
    "bearer token (answered with WWW-Authenticate: Bearer)",
    403: "not allowed: a node may only read the inventory of a job both nodes belong to (only the "
    "operator may call the rest), or (legacy --auth token) a wrong bearer token",
    409: "the body's generation is not newer than the one this node holds (the answer keeps it)",
    413: "the body is larger than the replicator's --max-request-bytes",
    502: "the backup failed",
    503: "unavailable: no bucket configured, a retryable failure, or (probe) not ready",
}
"""What each status the API answers with means (the same for every endpoint that uses it)."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One endpoint of the control API."""

    name: str
    """Its handler's name on the server and its method's name in the client; the OpenAPI operationId."""
    method: str
    path: str
    """The path template, e.g. ``/v1/jobs/{job}/inventory``."""
    request: type[Message] | None
    """The body's message; None: no body."""
    response: type[Message] | None
    """The success answer's message; None: not a message (probes, metrics, the OpenAPI document)."""
    status: int
    """The success status."""
    errors: tuple[int, ...]
    """Every other status it can answer with (see ``STATUS_MEANINGS``)."""
    summary: str
    query: tuple[QueryFlag, ...] = ()
    auth: bool = True
    """Whether the caller must authenticate (every ``/v1`` route; the probes are open)."""
    media_type: str = "application/json"
    ports: tuple[Port, ...] = ("api",)
    """The servers that serve it (``PORTS``)."""

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(re.findall(r"{(\w+)}", self.path))

    def url_path(self, **params: str) -> str:
        """The path with each parameter filled in, URL-quoted as one segment (``/`` included)."""
        if set(params) != set(self.path_params):
            raise ValueError(f"{self.name}: path parameters {sorted(params)} != {list(self.path_params)}")
        return self.path.format(**{k: urllib.parse.quote(str(v), safe="") for k, v in params.items()})


_AUTH = (401, 403)
_PUT = (400, *_AUTH, 409, 413)

INVENTORY = Endpoint(
    "inventory",
    "GET",
    "/v1/jobs/{job}/inventory",
    None,
    NodeInventory,
    200,
    (400, *_AUTH),
    "What this node holds of the job: committed primaries and replicas per rank, world size per "
    "step, steps complete in the bucket (a job it knows nothing of is an empty inventory).",
)
PUT_PEERS = Endpoint(
    "put_peers",
    "PUT",
    "/v1/jobs/{job}/peers",
    PeerAssignment,
    PeerAssignment,
    200,
    _PUT,
    "Store the job's peer assignment (control/peers.json) if its generation is newer; a node that "
    "gains a node rank starts staging its ranks.",
)
PUT_POLICY = Endpoint(
    "put_policy",
    "PUT",
    "/v1/jobs/{job}/policy",
    JobPolicy,
    JobPolicy,
    200,
    _PUT,
    "Store the job's backup and replication policy (control/policy.json) if its generation is newer "
    "(the same policy again is 200).",
)
PUT_RESTORE_PLAN = Endpoint(
    "put_restore_plan",
    "PUT",
    "/v1/jobs/{job}/restore-plan",
    RestorePlan,
    RestorePlan,
    202,
    _PUT,
    "Store the job's restore plan (control/restore.json) unless an older generation, and stage this "
    "node's ranks from it (the same plan again does not restart staging).",
)
PUT_NODE_PLAN = Endpoint(
    "put_node_plan",
    "PUT",
    "/v1/jobs/{job}/plan",
    NodePlan,
    NodePlanResult,
    200,
    (400, *_AUTH, 413),
    "Store what the operator has for this node of the job in one call: any of the policy, the peer "
    "assignment and the restore plan, each as its own endpoint stores it (policy, peers, then the plan); "
    "answers which parts were stored and which were refused for a newer generation held here. A plan "
    "addressed to another node is a 400.",
)
PUT_ORBAX_SESSION = Endpoint(
    "put_orbax_session",
    "PUT",
    "/v1/jobs/{job}/orbax-session",
    OrbaxSession,
    OrbaxSession,
    200,
    (*_PUT, 503),
    "Orbax mode: store this node's session of the job (its process id and the JAX coordinator for a "
    "restart attempt, written to jax-init-info.txt) if its generation is newer (the same session "
    "again is 200); a session for another node is a 400.",
)
BACKUP = Endpoint(
    "backup",
    "POST",
    "/v1/jobs/{job}/backup",
    None,
    BackupResult,
    200,
    (400, *_AUTH, 502, 503),
    "Back up this node's share of the job's newest step now; answers once it is in the bucket.",
)
RESTORE = Endpoint(
    "restore",
    "POST",
    "/v1/jobs/{job}/restore",
    None,
    RestoreAccepted,
    202,
    (400, *_AUTH),
    "Stage this node's ranks again (with the published restore plan, else a computed one).",
)
PURGE = Endpoint(
    "purge",
    "DELETE",
    "/v1/jobs/{job}",
    None,
    PurgeResult,
    200,
    (400, *_AUTH),
    "Delete the job's primaries, replicas and control files on this node (each step's COMMIT first).",
    query=(QueryFlag("bucket", "Also delete the job's backups from the bucket its policy names."),),
)
STATUS = Endpoint(
    "status",
    "GET",
    "/v1/status",
    None,
    NodeStatus,
    200,
    _AUTH,
    "This node's health, worker, ramdisk space, and per job its steps, replication and restores.",
)
JOB_METRICS = Endpoint(
    "job_metrics",
    "GET",
    "/v1/metrics",
    None,
    None,
    200,
    _AUTH,
    "Prometheus metrics with the per-job series, labelled with the job id (the probe port's /metrics "
    "has them over this node's jobs, naming none).",
    media_type="text/plain",
)
OPENAPI = Endpoint(
    "openapi",
    "GET",
    "/v1/openapi.json",
    None,
    None,
    200,
    _AUTH,
    "The OpenAPI 3.1 document of this API (request and response schemas of every endpoint).",
)
HEALTHZ = Endpoint(
    "healthz",
    "GET",
    "/healthz",
    None,
    None,
    200,
    (),
    'Liveness: always {"status": "ok"}.',
    auth=False,
    ports=PORTS,
)
READYZ = Endpoint(
    "readyz",
    "GET",
    "/readyz",
    None,
    None,
    200,
    (503,),
    'Readiness: {"status": "ok"} once the data endpoint listens, else 503 {"status": "unavailable"}.',
    auth=False,
    ports=PORTS,
)
METRICS = Endpoint(
    "metrics",
    "GET",
    "/metrics",
    None,
    None,
    200,
    (),
    "Prometheus metrics, naming no job (per-job series summed, or their largest or smallest, over this "
    "node's jobs), no tokens, paths or hosts; on the probe port only.",
    auth=False,
    media_type="text/plain",
    ports=("probes",),
)

ENDPOINTS: tuple[Endpoint, ...] = (
    INVENTORY,
    PUT_PEERS,
    PUT_POLICY,
    PUT_RESTORE_PLAN,
    PUT_NODE_PLAN,
    PUT_ORBAX_SESSION,
    BACKUP,
    RESTORE,
    PURGE,
    STATUS,
    JOB_METRICS,
    OPENAPI,
    HEALTHZ,
    READYZ,
    METRICS,
)
"""Every endpoint of the replicator's HTTP servers (``Endpoint.ports`` says which), nothing else."""

ISSUE_CERTIFICATE = Endpoint(
    "issue_certificate",
    "POST",
    "/v1/node-certificates",
    CertificateRequest,
    CertificateIssued,
    200,
    (400, 401, 403, 429, 503),
    "The operator's signing endpoint (on its issuer port, not a replicator's): a replicator sends its "
    "CSR with its projected ServiceAccount token and gets its node's certificate "
    "(``tierckpt_operator.issuer``, ``tierckpt_replicator.identity``).",
    ports=(),
)
"""The one endpoint of the operator's that replicators call; in no replicator server's table."""


def served_on(port: Port) -> tuple[Endpoint, ...]:
    """The endpoints the ``port`` server serves."""
    return tuple(ep for ep in ENDPOINTS if port in ep.ports)


def endpoint(name: str) -> Endpoint:
    """The endpoint called ``name``."""
    for ep in ENDPOINTS:
        if ep.name == name:
            return ep
    raise KeyError(f"no control API endpoint {name!r}")


def _check_table() -> None:
    names = [ep.name for ep in ENDPOINTS]
    if len(set(names)) != len(names) or len({(ep.method, ep.path) for ep in ENDPOINTS}) != len(names):
        raise AssertionError("control API endpoints must have unique names and (method, path)")
    for ep in ENDPOINTS:
        unknown = set(ep.path_params) - set(PATH_PARAMS)
        if not ep.ports or not set(ep.ports) <= set(PORTS) or (ep.auth and ep.ports != ("api",)):
            raise AssertionError(f"control API endpoint {ep.name}: bad ports {ep.ports}")
        if unknown or not set(ep.errors) <= set(STATUS_MEANINGS) or ep.status not in STATUS_MEANINGS:
            raise AssertionError(f"control API endpoint {ep.name}: undeclared parameter or status")


_check_table()
