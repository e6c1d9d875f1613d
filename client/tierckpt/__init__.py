"""tierckpt: multi-tier checkpointing for PyTorch (node RAM disk, peer nodes, GCS).

The training library: what a training pod needs. It imports no daemon, tool or service framework;
the daemons import only its kernel (``tierckpt.protocol`` and ``tierckpt.planning``).

``Checkpointer``, ``SaveHandle``, ``ReplicaGroup`` and ``replica_group_from_mesh`` are imported on first
use, so that importing the kernel (the replicator, the CLI) does not import torch. They need the
``torch`` extra (``pip install "tierckpt[torch]"``); the base install is the kernel and the CLI only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt.protocol import __version__
from tierckpt.protocol.errors import (
    ContractError,
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    ReplicaDivergenceError,
    RetryableError,
    SaveInProgressError,
    StateMismatchError,
    TierckptError,
    WorldSizeMismatchError,
)

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer
    from tierckpt.replica_group import ReplicaGroup, replica_group_from_mesh
    from tierckpt.snapshot.handle import SaveHandle

__all__ = [
    "Checkpointer",
    "ContractError",
    "CorruptShardError",
    "FormatError",
    "MissingCheckpointError",
    "RamdiskFullError",
    "ReplicaDivergenceError",
    "ReplicaGroup",
    "RetryableError",
    "SaveHandle",
    "SaveInProgressError",
    "StateMismatchError",
    "TierckptError",
    "WorldSizeMismatchError",
    "__version__",
    "replica_group_from_mesh",
]

_LAZY = {
    "Checkpointer": "tierckpt.checkpointer",
    "ReplicaGroup": "tierckpt.replica_group",
    "SaveHandle": "tierckpt.snapshot.handle",
    "replica_group_from_mesh": "tierckpt.replica_group",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    import importlib

    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name not in ("torch", "numpy"):
            raise
        raise ModuleNotFoundError(
            f"tierckpt.{name} belongs to the training library, which needs {exc.name}: "
            "pip install 'tierckpt[torch]' (an installed torch within its range stays as it is)",
            name=exc.name,
        ) from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
