"""Kubernetes resource quantities ("64Gi", "1.5G", "512M", "1e9") to bytes, and bytes back to text.

``kubernetes.utils.parse_quantity`` does the arithmetic. It hands any text that ``Decimal()`` accepts
to ``Decimal()`` ("1 Gi", "NaN", "1_000", "-1Gi", "1e3Gi" and non-ASCII digits all pass), so a byte
count is first checked against the part of the Kubernetes quantity grammar that fits one: no sign,
no milli/micro/nano suffixes, and an exponent or a suffix, not both.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

__all__ = ["MAX_BYTES", "format_bytes", "parse_quantity"]

MAX_BYTES = 2**63 - 1
"""The largest quantity accepted (Kubernetes' own limit for an integer quantity)."""

_BYTES = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[KMGTPE]i|[kMGTPE])?")


def parse_quantity(text: str) -> int:
    """Bytes in a non-negative quantity, rounded up to a whole byte. Raises ``ValueError`` if malformed
    or larger than ``MAX_BYTES``."""
    value = str(text).strip()
    if value.startswith("-"):
        raise ValueError(f"invalid quantity {text!r}: a size cannot be negative")
    if not _BYTES.fullmatch(value):
        raise ValueError(f"invalid quantity {text!r}: use e.g. 64Gi, 500M or 1073741824")
    # Imported here: the kubernetes package loads its whole API client (about 0.3 s), which only the
    # commands that read sizes need.
    from kubernetes.utils.quantity import parse_quantity as kubernetes_quantity

    try:
        number: Decimal = kubernetes_quantity(value)
    except ValueError as exc:  # an exponent beyond Decimal's range
        raise ValueError(f"invalid quantity {text!r}: {exc}") from exc
    if number > MAX_BYTES:
        raise ValueError(f"invalid quantity {text!r}: larger than the largest size, {MAX_BYTES} bytes")
    return math.ceil(number)


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``64.0Gi``; below 1Ki the exact byte count."""
    if n < 1024:
        return f"{n}B"
    value = float(n)
    for unit in ("Ki", "Mi", "Gi", "Ti"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f}{unit}"
    return f"{value / 1024:.1f}Pi"
