"""Tensor dtype names as written in manifests, their item sizes, and their torch and numpy types (pure).

A manifest names a dtype by torch's name without the ``torch.`` prefix. The table below is the
format's closed list (docs/format.md, "Dtypes"); a name this torch build lacks is still understood
(its item size is known), it just cannot be turned into a tensor here.
"""

from __future__ import annotations

import numpy as np
import torch

from tierckpt.protocol.errors import FormatError

__all__ = ["ITEMSIZE", "dtype_name", "itemsize", "numpy_dtype", "torch_dtype"]

ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
"""Every dtype the format stores as raw bytes, with its size in bytes per element."""

_BY_TORCH: dict[torch.dtype, str] = {
    getattr(torch, name): name for name in ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)
}

_NUMPY: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        *("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    )
}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest name of a torch dtype, or None if the format cannot store it as raw bytes."""
    return _BY_TORCH.get(dtype)


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise FormatError(f"unknown tensor dtype {name!r}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest name; ``FormatError`` if unknown or missing from this torch build."""
    itemsize(name)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dtype


def numpy_dtype(name: str) -> np.dtype | None:
    """The native-endian numpy dtype of a manifest name, when numpy has one."""
    return _NUMPY.get(name)
