"""The operator's replicator adapter: the one control API client (``tierckpt.protocol.client``),
configured from the operator's settings (timeout, attempts, concurrency) and its credentials: its own
client certificate (``--auth tls``) or the mounted token Secret (legacy ``--auth token``)."""

from __future__ import annotations

from tierckpt.protocol.client import ReplicatorClient, RetryPolicy
from tierckpt.protocol.identity import TlsCredentials
from tierckpt.protocol.tokens import TokenFile
from tierckpt_operator.settings import Settings

__all__ = ["replicator_client"]


def replicator_client(settings: Settings, tls: TlsCredentials | None = None) -> ReplicatorClient:
    """The client every handler shares (open it inside the running event loop)."""
    return ReplicatorClient(
        token=TokenFile(settings.token_file) if settings.auth == "token" and settings.token_file else None,
        tls=tls,
        timeout=settings.http_timeout,
        retry=RetryPolicy(attempts=settings.http_retries),
        concurrency=settings.http_concurrency,
        keepalive=settings.http_keepalive,
    )
