"""tierckpt: multi-tier checkpointing for PyTorch (node RAM disk, peer nodes, GCS).

The client library. It depends on nothing in ``tierckpt_replicator`` or ``tierckpt_operator``;
those depend on it.
"""

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

__version__ = "0.1.0"

__all__ = [
    "ContractError",
    "CorruptShardError",
    "FormatError",
    "MissingCheckpointError",
    "RamdiskFullError",
    "RetryableError",
    "SaveInProgressError",
    "TierckptError",
    "__version__",
]
