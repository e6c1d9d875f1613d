"""tierckpt: multi-tier checkpointing for PyTorch (node RAM disk, peer nodes, GCS).

The client library. It depends on nothing in ``tierckpt_replicator`` or ``tierckpt_operator``;
those depend on it.

``Checkpointer`` and ``SaveHandle`` are imported on first use, so that ``import tierckpt.format``
(the replicator, the CLI) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt.errors import (
    ContractError,
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    RetryableError,
    SaveInProgressError,
    TierckptError,
)

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer
    from tierckpt.snapshot.handle import SaveHandle

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "ContractError",
    "CorruptShardError",
    "FormatError",
    "MissingCheckpointError",
    "RamdiskFullError",
    "RetryableError",
    "SaveHandle",
    "SaveInProgressError",
    "TierckptError",
    "__version__",
]

_LAZY = {"Checkpointer": "tierckpt.checkpointer", "SaveHandle": "tierckpt.snapshot.handle"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
