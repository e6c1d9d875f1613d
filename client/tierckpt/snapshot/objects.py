"""``objects.pkl``: the step's non-tensor user objects, pickled; read back with a restricted unpickler.

A step may come from another tier (a peer's replica, the bucket), and pickle runs whatever callable the
bytes name: a tampered ``objects.pkl`` would run code in the training process. Its crc32c does not
help (it comes from the same source). So the unpickler resolves only the globals on an allowlist, the
way ``torch.load(weights_only=True)`` does:

* plain value types: the builtin scalars and containers, ``frozenset``, ``bytearray``, ``complex``,
  ``slice``, ``range``, the ``collections`` containers, ``datetime``, ``decimal.Decimal``,
  ``fractions.Fraction``, ``uuid.UUID``, and numpy scalars, dtypes and arrays (their elements
  unpickled by this same unpickler);
* torch's own ``weights_only`` allowlist (dtypes, ``torch.Size``, tensor rebuilds and the like);
* what the user registered with ``torch.serialization.add_safe_globals([...])`` (their own classes,
  for instance): the same registration ``torch.load`` honours.

Anything else raises ``UnsafeObjectError`` (a ``FormatError``: the step is not loadable as is, and a
load with ``fallback=True`` tries an older one), naming the global and how to allow it. Unlike torch's
own unpickler, every pickle protocol is read (the client writes the highest).
"""

from __future__ import annotations

import _compat_pickle
import collections
import datetime
import decimal
import fractions
import functools
import io
import pickle
import uuid
from collections.abc import Callable
from typing import Any

from tierckpt.protocol.errors import FormatError

__all__ = ["UnsafeObjectError", "allowed_globals", "dumps", "loads"]

_PLAIN: tuple[Any, ...] = (
    bool,
    int,
    float,
    str,
    bytes,
    tuple,
    list,
    dict,
    set,
    frozenset,
    bytearray,
    complex,
    slice,
    range,
    collections.OrderedDict,
    collections.Counter,
    collections.deque,
    collections.defaultdict,
    datetime.date,
    datetime.time,
    datetime.datetime,
    datetime.timedelta,
    datetime.timezone,
    decimal.Decimal,
    fractions.Fraction,
    uuid.UUID,
)
_NUMPY = ("multiarray.scalar", "multiarray._reconstruct")
"""numpy's own reconstructors, under ``numpy.core`` (numpy 1) or ``numpy._core`` (numpy 2)."""


class UnsafeObjectError(FormatError):
    """``objects.pkl`` names a global that is not on the allowlist (nothing was called)."""


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@functools.cache
def _builtin_globals() -> dict[str, Any]:
    allowed = {_name(t): t for t in _PLAIN}
    allowed["_codecs.encode"] = __import__("codecs").encode  # bytes at pickle protocol 2
    try:
        import numpy as np

        allowed.update({"numpy.dtype": np.dtype, "numpy.ndarray": np.ndarray})
        for core in ("numpy.core", "numpy._core"):
            for attr in _NUMPY:
                module, _, name = f"{core}.{attr}".rpartition(".")
                try:
                    allowed[f"{module}.{name}"] = getattr(__import__(module, fromlist=[name]), name)
                except (ImportError, AttributeError):
                    continue
    except ImportError:
        pass
    # torch's own weights_only allowlist (dtypes, Size, tensor rebuild functions): private, so read
    # defensively; the plain types above stand without it.
    try:
        from torch import _weights_only_unpickler

        allowed.update(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):
        pass
    return allowed


def allowed_globals() -> dict[str, Any]:
    """``module.name`` -> object of every global ``loads`` resolves now (the user's registrations with
    ``torch.serialization.add_safe_globals`` included, as they stand at the call)."""
    allowed = dict(_builtin_globals())
    try:
        import torch.serialization

        for entry in torch.serialization.get_safe_globals():
            obj, name = entry if isinstance(entry, tuple) else (entry, _name(entry))
            allowed[name] = obj
    except (ImportError, AttributeError):
        pass
    return allowed


class _Unpickler(pickle.Unpickler):
    def __init__(self, body: bytes, allowed: dict[str, Any], where: str) -> None:
        super().__init__(io.BytesIO(body))
        self._allowed, self._where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (protocols 0-2 write "__builtin__.set"), mapped as pickle's own find_class does
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = f"{module}.{name}"
        if key not in self._allowed:
            raise UnsafeObjectError(
                f"{self._where}: refusing to unpickle {key} (not an allowed type). If you trust every tier "
                f"this checkpoint comes from, allow it with torch.serialization.add_safe_globals([{name}])"
            )
        return self._allowed[key]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeObjectError(f"{self._where}: persistent ids are not part of the format")


def loads(body: bytes, where: str = "objects.pkl") -> Any:
    """Unpickle ``body``, resolving only allowed globals (``UnsafeObjectError`` otherwise; any other
    malformation raises ``FormatError``)."""
    try:
        return _Unpickler(body, allowed_globals(), where).load()
    except FormatError:
        raise
    except Exception as exc:  # a malformed stream: whatever pickle raised while reading it
        raise FormatError(f"{where}: cannot unpickle: {type(exc).__name__}: {exc}") from exc


dumps: Callable[[Any], bytes] = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
"""How ``objects.pkl`` is written."""
