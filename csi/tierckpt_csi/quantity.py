"""Kubernetes resource quantities ("64Gi", "1.5G", "512M", "1e9") to bytes, and bytes back to text."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = ["format_bytes", "parse_quantity"]

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY_RE = re.compile(
    r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
)


def parse_quantity(text: str) -> int:
    """Bytes in a non-negative quantity, rounded up to a whole byte. Raises ``ValueError`` if malformed."""
    m = _QUANTITY_RE.match(str(text).strip())
    if not m or (m.group(2) and m.group(3)):
        raise ValueError(f"invalid quantity {text!r}: use e.g. 64Gi, 500M or 1073741824")
    try:
        number = Decimal(m.group(1) + (m.group(2) or ""))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"invalid quantity {text!r}") from exc
    return math.ceil(number * _SUFFIX[m.group(3) or ""])


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
