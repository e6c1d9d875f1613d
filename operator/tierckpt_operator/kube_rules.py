"""What Kubernetes accepts in what the operator copies into pods: node selector labels, tolerations,
a positive quantity. Pure; ``ContractError`` names the field and the rule.

The CheckpointConfiguration CRD states the same rules (its patterns are the ones below: a test checks
they are equal), so the API server refuses a bad configuration at once; the operator checks again
before copying anything into a pod, because a CRD's schema is not everything (an older CRD, an object
stored before the schema tightened, a cluster without CEL).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tierckpt.protocol.errors import ContractError

__all__ = [
    "EFFECTS",
    "LABEL_VALUE",
    "OPERATORS",
    "QUALIFIED_NAME",
    "QUANTITY",
    "check_node_selector",
    "check_positive_quantity",
    "check_tolerations",
]

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
QUALIFIED_NAME = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?{_NAME}$"
"""A label key or toleration key: an optional DNS subdomain prefix (at most 253 characters) and ``/``,
then a name of at most 63 characters (``validation.IsQualifiedName``)."""
LABEL_VALUE = rf"^({_NAME})?$"
"""A label value: empty, or a name of at most 63 characters (``validation.IsValidLabelValue``)."""
QUANTITY = r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
"""A quantity greater than zero (plain decimal digits and a suffix)."""
OPERATORS = ("Exists", "Equal")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_TOLERATION_FIELDS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_INT64 = 2**63

_qualified = re.compile(QUALIFIED_NAME)
_label_value = re.compile(LABEL_VALUE)
_quantity = re.compile(QUANTITY)


def _qualified_name(value: object) -> bool:
    if not isinstance(value, str) or not _qualified.fullmatch(value):
        return False
    prefix, _, _ = value.rpartition("/")
    return len(prefix) <= 253


def _label(value: object) -> bool:
    return isinstance(value, str) and _label_value.fullmatch(value) is not None


def check_node_selector(selector: object, where: str = "spec.nodeSelector") -> tuple[tuple[str, str], ...]:
    """The selector's (key, value) pairs, sorted; every key a qualified name, every value a label value."""
    if not isinstance(selector, Mapping):
        raise ContractError(f"{where} must map label names to strings")
    for key, value in selector.items():
        if not _qualified_name(key):
            raise ContractError(
                f"{where}: {key!r} is not a label name (a qualified name such as example.com/pool)"
            )
        if not _label(value):
            raise ContractError(
                f"{where}[{key}]: {value!r} is not a label value (63 characters of [A-Za-z0-9_.-])"
            )
    return tuple(sorted(selector.items()))


def check_tolerations(tolerations: object, where: str = "spec.tolerations") -> tuple[dict[str, Any], ...]:
    """Each toleration as Kubernetes validates it (``ValidateTolerations``)."""
    if not isinstance(tolerations, list):
        raise ContractError(f"{where} must be a list of tolerations")
    return tuple(_toleration(t, f"{where}[{i}]") for i, t in enumerate(tolerations))


def _toleration(t: object, where: str) -> dict[str, Any]:
    if not isinstance(t, Mapping):
        raise ContractError(f"{where} must be an object")
    unknown = set(t) - _TOLERATION_FIELDS
    if unknown:
        raise ContractError(f"{where}: unknown field(s) {sorted(unknown)}")
    key, op, value, effect = (t.get(k, "") for k in ("key", "operator", "value", "effect"))
    if key and not _qualified_name(key):
        raise ContractError(f"{where}.key {key!r} is not a qualified name")
    if op not in ("", *OPERATORS):
        raise ContractError(f"{where}.operator {op!r} must be Exists or Equal")
    if not key and op != "Exists":
        raise ContractError(f"{where}: operator must be Exists when key is empty")
    if op == "Exists" and value:
        raise ContractError(f"{where}.value must be empty when operator is Exists")
    if not _label(value):
        raise ContractError(f"{where}.value {value!r} is not a label value")
    if effect not in ("", *EFFECTS):
        raise ContractError(f"{where}.effect {effect!r} must be one of {', '.join(EFFECTS)}")
    if "tolerationSeconds" in t:
        seconds = t["tolerationSeconds"]
        if not isinstance(seconds, int) or isinstance(seconds, bool) or not -_INT64 <= seconds < _INT64:
            raise ContractError(f"{where}.tolerationSeconds {seconds!r} must be an integer")
        if effect != "NoExecute":
            raise ContractError(f"{where}.tolerationSeconds is only valid with effect NoExecute")
    return dict(t)


def check_positive_quantity(size: object, where: str) -> str:
    """A quantity such as 64Gi that is more than zero."""
    if not isinstance(size, str) or not _quantity.fullmatch(size):  # the pattern has a non-zero digit
        raise ContractError(f"{where} {size!r} is not a quantity above zero such as 64Gi")
    return size
