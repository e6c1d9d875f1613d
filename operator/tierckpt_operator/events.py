"""Kubernetes Events about our objects, posted through kopf's event queue (the operator's third adapter)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

__all__ = ["post_event"]

log = logging.getLogger(__name__)


def post_event(ref: Mapping[str, Any] | None, kind: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event about ``ref`` (an object body or reference) through kopf's queue."""
    if not ref or not ref.get("metadata", {}).get("uid"):
        log.info("%s %s: %s", kind, reason, message)
        return
    try:
        # kopf.event takes a kopf.Body, its typed view of a raw object dict: wrap a copy of ours in one.
        body = kopf.Body(cast("kopf.RawBody", dict(ref)))
        kopf.event(body, type=kind, reason=reason, message=message[:1000])
    except LookupError:  # outside a running operator (unit tests): log only
        log.info("%s %s: %s", kind, reason, message)
