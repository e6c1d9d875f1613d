"""Kubernetes resource quantities ("64Gi", "1.5G", "512M", "1e9") to bytes, and bytes back to text.

A byte count is read with the part of the Kubernetes quantity grammar that fits one: no sign, no
milli/micro/nano suffixes, and an exponent or a suffix, not both. The arithmetic is exact (``Decimal``
with enough digits for the text), rounded up to a whole byte. The CSI plugin reads ramdisk
reservations with it, the operator a CheckpointConfiguration's ramdisk size (the job's quota).
"""

from __future__ import annotations

import decimal
import math
import re

__all__ = ["MAX_BYTES", "format_bytes", "parse_quantity"]

MAX_BYTES = 2**63 - 1
"""The largest quantity accepted (Kubernetes' own limit for an integer quantity)."""

_BYTES = re.compile(r"((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([KMGTPE]i|[kMGTPE])?")
_UNITS = {
    "": 1,
    **{s: 1000 ** (i + 1) for i, s in enumerate("kMGTPE")},
    **{f"{s}i": 1024 ** (i + 1) for i, s in enumerate("KMGTPE")},
}
_MAX_DIGITS = len(str(MAX_BYTES))


def parse_quantity(text: str) -> int:
    """Bytes in a non-negative quantity, rounded up to a whole byte. Raises ``ValueError`` if malformed
    or larger than ``MAX_BYTES``."""
    value = str(text).strip()
    if value.startswith("-"):
        raise ValueError(f"invalid quantity {text!r}: a size cannot be negative")
    match = _BYTES.fullmatch(value)
    if match is None or (match.group(2) and "e" in match.group(1).lower()):
        raise ValueError(f"invalid quantity {text!r}: use e.g. 64Gi, 500M or 1073741824")
    number = decimal.Decimal(match.group(1))
    too_large = ValueError(f"invalid quantity {text!r}: larger than the largest size, {MAX_BYTES} bytes")
    if number and number.adjusted() > _MAX_DIGITS:  # 1e99999999999: refused before any arithmetic
        raise too_large
    exact = decimal.Context(prec=len(value) + 2 * _MAX_DIGITS, Emin=decimal.MIN_EMIN, Emax=decimal.MAX_EMAX)
    total = exact.multiply(number, decimal.Decimal(_UNITS[match.group(2) or ""]))
    if total > MAX_BYTES:
        raise too_large
    return math.ceil(total)


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
