"""The operator's replicator adapter: the one control API client (``tierckpt.protocol.client``),
configured from the operator's settings (timeout, attempts, concurrency, the mounted token Secret)."""

from __future__ import annotations

from tierckpt.protocol.client import ReplicatorClient, RetryPolicy
from tierckpt.protocol.tokens import TokenFile
from tierckpt_operator.settings import Settings

__all__ = ["replicator_client"]


def replicator_client(settings: Settings) -> ReplicatorClient:
    """The client every handler shares (open it inside the running event loop)."""
    return ReplicatorClient(
        token=TokenFile(settings.token_file) if settings.token_file else None,
        timeout=settings.http_timeout,
        retry=RetryPolicy(attempts=settings.http_retries),
        concurrency=settings.http_concurrency,
    )
