"""The node certificate signing endpoint: ``POST /v1/node-certificates`` on the operator's HTTPS port
(``--issuer-port``; every operator replica serves it, so any one behind the Service answers).

A replicator sends a ``CertificateRequest`` (its node's name and a CSR made with its own key) with its
projected ServiceAccount token (audience ``--token-audience``) as the bearer token. The operator signs
a certificate for that node only if

1. the API server authenticates the token for that audience (a TokenReview);
2. the token is the replicators' ServiceAccount's (``--replicator-service-account`` in ``--namespace``)
   and bound to a pod (``authentication.kubernetes.io/pod-name`` and ``pod-uid`` in the review's
   ``user.extra``);
3. that pod exists with that uid, is neither terminating nor finished, carries the replicator labels
   (``--replicator-selector``), is controlled by a DaemonSet, and is bound to the requested node (and
   to the node the token itself names, where the API server says: Kubernetes 1.30 and later);
4. the CSR's signature checks (the replicator holds the key).

The certificate names exactly that node (``Authority.node_certificate``), whatever else the CSR says.
A review must name the audience it was asked for: one that names none (an authenticator that does not
check audiences; for kube-apiserver, a token for its own audience) proves nothing for ours.

What a request may cost the API server is bounded (``tierckpt_operator.issuer_limits``): requests per
source address, reviews reused briefly per token, API calls in flight.

Answers: 200 ``CertificateIssued``; 401 without a token or with one the API server does not
authenticate for the audience; 403 for a token that does not prove that node; 400 for a malformed
request; 429 past the source's rate and 503 with every API call slot taken (both with Retry-After).
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tierckpt.protocol.api import ISSUE_CERTIFICATE
from tierckpt.protocol.certs import certificate_pem, csr_public_key
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.identity import CertificateIssued, CertificateRequest
from tierckpt_operator.credentials import OperatorCredentials
from tierckpt_operator.issuer_limits import InFlight, ReviewCache, SourceRate
from tierckpt_operator.kube import Kube
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.settings import Settings

__all__ = ["NodeCertificateIssuer", "Refusal", "pod_of_token", "pod_refusal"]

log = logging.getLogger(__name__)

POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
NODE_NAME = "authentication.kubernetes.io/node-name"
_MAX_BODY = 64 << 10


class Refusal(Exception):
    """No certificate: the HTTP status, the metrics outcome and why (and when to ask again)."""

    def __init__(self, status: int, outcome: str, message: str, *, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.status, self.outcome, self.retry_after = status, outcome, retry_after


def _one(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if isinstance(values, list) and len(values) == 1 and isinstance(values[0], str):
        return values[0]
    return None


def pod_of_token(review: Mapping[str, Any], settings: Settings) -> tuple[str, str, str | None]:
    """From a TokenReview's status: the token's pod name and uid, and the node it names (None where the
    API server does not say); ``Refusal`` unless it is a replicator pod's token for our audience."""
    if not review.get("authenticated"):
        raise Refusal(
            401, "unauthenticated", f"token not authenticated: {review.get('error') or 'no reason'}"
        )
    audiences, ours = review.get("audiences"), settings.token_audience
    if not isinstance(audiences, list) or ours not in audiences:
        named = audiences or "none"
        raise Refusal(
            401, "unauthenticated", f"token not valid for audience {ours} (the review names {named})"
        )
    user = review.get("user") or {}
    if user.get("username") != settings.replicator_user:
        raise Refusal(403, "refused", f"{user.get('username')!r} is not {settings.replicator_user}")
    extra = user.get("extra") or {}
    pod, uid = _one(extra, POD_NAME), _one(extra, POD_UID)
    if not pod or not uid:
        raise Refusal(403, "refused", "the token is not bound to a pod")
    return pod, uid, _one(extra, NODE_NAME)


def pod_refusal(pod: Mapping[str, Any] | None, uid: str, node: str, settings: Settings) -> str | None:
    """Why ``pod`` (the token's pod, as the API server has it) does not prove ``node``; None if it does."""
    if pod is None:
        return "the token's pod does not exist"
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("uid") != uid:
        return "the token's pod was replaced (uid differs)"
    if meta.get("deletionTimestamp") or status.get("phase") not in ("Pending", "Running"):
        return "the token's pod is terminating or finished"
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in settings.replicator_labels.items()):
        return "the token's pod is not a replicator (labels)"
    owners = [o for o in meta.get("ownerReferences") or [] if o.get("controller")]
    if [o.get("kind") for o in owners] != ["DaemonSet"]:
        return "the token's pod is not controlled by a DaemonSet"
    if spec.get("nodeName") != node:
        return f"the token's pod runs on node {spec.get('nodeName')!r}, not {node!r}"
    return None


class NodeCertificateIssuer:
    """The endpoint (``handle``) and its HTTPS server (``start``)."""

    def __init__(
        self, settings: Settings, kube: Kube, credentials: OperatorCredentials, metrics: Metrics
    ) -> None:
        self.settings, self.kube, self.credentials, self.metrics = settings, kube, credentials, metrics
        self.lifetime = datetime.timedelta(hours=settings.cert_hours)
        self.rate = SourceRate(settings.issuer_rate, settings.issuer_burst)
        self.reviews = ReviewCache(settings.review_cache_seconds)
        self.api_calls = InFlight(settings.issuer_api_calls)

    async def start(self) -> web.AppRunner:
        server = self.credentials.server
        if server is None:
            raise ValueError("the signing endpoint needs --issuer-names")
        app = web.Application(client_max_size=_MAX_BODY)
        app.add_routes([web.post(ISSUE_CERTIFICATE.path, self.handle)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(
            runner,
            self.settings.issuer_addr,
            self.settings.issuer_port,
            ssl_context=server.server(clients=False),
        )
        await site.start()
        log.info("node certificate signing endpoint on port %d", self.settings.issuer_port)
        return runner

    async def handle(self, request: web.Request) -> web.Response:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        source = request.remote or "?"
        try:
            if wait := self.rate.wait(source):
                raise Refusal(429, "throttled", f"too many requests from {source}", retry_after=wait)
            if scheme.lower() != "bearer" or not token.strip():
                raise Refusal(
                    401, "unauthenticated", "a bearer token (the projected ServiceAccount token) is required"
                )
            body = await request.read()
            issued = await self.issue(token.strip(), body)
        except Refusal as answer:
            self.metrics.node_certificates.labels(answer.outcome).inc()
            headers = {}
            if answer.retry_after:  # a flood of these is counted, not logged line by line
                headers["Retry-After"] = str(max(1, math.ceil(answer.retry_after)))
                log.debug("node certificate request from %s deferred (%d): %s", source, answer.status, answer)
            else:
                log.warning("node certificate refused (%d) to %s: %s", answer.status, source, answer)
            return web.json_response({"detail": str(answer)}, status=answer.status, headers=headers)
        self.metrics.node_certificates.labels("issued").inc()
        return web.Response(body=issued.to_bytes(), content_type="application/json")

    async def issue(self, token: str, body: bytes) -> CertificateIssued:
        """The certificate the request earns; ``Refusal`` with the status otherwise."""
        try:
            req = CertificateRequest.from_bytes(body)
        except FormatError as exc:
            raise Refusal(400, "malformed", f"malformed certificate request: {exc}") from exc
        with self.api_calls.slot() as held:
            if not held:
                raise Refusal(503, "busy", "too many certificate requests being checked", retry_after=1.0)
            audience = self.settings.token_audience
            review = await self.reviews.review(token, lambda: self.kube.review_token(token, audience))
            pod_name, uid, token_node = pod_of_token(review, self.settings)
            if token_node is not None and token_node != req.node:
                raise Refusal(403, "refused", f"the token is bound to node {token_node!r}, not {req.node!r}")
            pod = await self.kube.get_pod(self.settings.namespace, pod_name)
        why = pod_refusal(pod, uid, req.node, self.settings)
        if why is not None:
            raise Refusal(403, "refused", f"{why} (pod {self.settings.namespace}/{pod_name})")
        try:
            key = csr_public_key(req.csr)
            cert = self.credentials.authority.node_certificate(key, req.node, self.lifetime)
        except (FormatError, ValueError) as exc:
            raise Refusal(400, "malformed", f"unusable certificate request: {exc}") from exc
        log.info(
            "issued a certificate for node %s to pod %s/%s (valid until %s)",
            req.node,
            self.settings.namespace,
            pod_name,
            cert.not_valid_after_utc.isoformat(),
        )
        return CertificateIssued(
            node=req.node,
            certificate=certificate_pem(cert).decode(),
            ca=self.credentials.authority.pem.decode(),
            not_after=cert.not_valid_after_utc.timestamp(),
        )
