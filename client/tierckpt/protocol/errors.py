"""The tierckpt exception hierarchy.

Every error says what happened and why. The tree::

    TierckptError
    ├── FormatError            a file does not follow the on-ramdisk format (bad JSON, wrong version)
    │   ├── CorruptShardError  bytes on disk do not match their crc32c (or are missing, or short)
    │   ├── UnsafePathError    a path in a job's tree is a symlink or leads out of the tree
    │   └── WorldSizeMismatchError  a strict load: the step was saved by a job of another world size
    ├── MissingCheckpointError no committed step matches the request
    ├── StateMismatchError     a strict load: the checkpoint's structure, shapes or dtypes differ from the
    │                          destination's (nothing was copied)
    ├── RamdiskFullError       the ramdisk ran out of space (ENOSPC); the partial step was removed
    ├── SaveInProgressError    a save was refused because another is still running (policy "error")
    ├── ReplicaDivergenceError members of a replica group saved different tensors (policy "raise")
    ├── ContractError          operator/pod/replicator contract data is missing or malformed
    └── RetryableError         a transient failure (peer down, GCS 5xx, timeout); safe to retry
"""

from __future__ import annotations

__all__ = [
    "ContractError",
    "CorruptShardError",
    "FormatError",
    "MissingCheckpointError",
    "RamdiskFullError",
    "ReplicaDivergenceError",
    "RetryableError",
    "SaveInProgressError",
    "StateMismatchError",
    "TierckptError",
    "UnsafePathError",
    "WorldSizeMismatchError",
]


class TierckptError(Exception):
    """Base class of every error tierckpt raises on purpose."""


class FormatError(TierckptError):
    """A file does not follow the on-ramdisk format."""


class CorruptShardError(FormatError):
    """Bytes on disk do not match the crc32c recorded for them."""

    def __init__(self, message: str, *, path: str, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key = key

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable with its keyword-only fields: torch.distributed ships errors between ranks.
        return (_corrupt_shard_error, (str(self), self.path, self.key))


class UnsafePathError(FormatError):
    """A path inside a job's tree passes through a symlink or leads out of it (refused, never followed)."""


class WorldSizeMismatchError(FormatError):
    """A strict load found the step saved with another world size than the job's (a rank's shard of
    another partition of the state); nothing was copied."""


class MissingCheckpointError(TierckptError):
    """No committed step matches the request."""


class StateMismatchError(TierckptError, ValueError):
    """A strict load found the destination's structure, shapes or dtypes unlike the checkpoint's.

    ``mismatches`` lists each difference (``"model/w: checkpoint float32 (4, 2), destination float32
    (4, 3)"``). Raised before any byte is copied, so the destination is untouched.
    """

    def __init__(self, message: str, *, mismatches: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.mismatches = tuple(mismatches)

    def __reduce__(self) -> tuple[object, ...]:
        return (_state_mismatch_error, (str(self), self.mismatches))


class RamdiskFullError(TierckptError, OSError):
    """The ramdisk has no space left; the partial step was cleaned up."""


class SaveInProgressError(TierckptError):
    """A save arrived while another was still running."""


class ReplicaDivergenceError(TierckptError):
    """Members of a replica group saved different tensors at ``step`` (each kept its own copy)."""

    def __init__(self, message: str, *, step: int, differs: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.differs = differs

    def __reduce__(self) -> tuple[object, ...]:
        return (_replica_divergence_error, (str(self), self.step, self.differs))


class ContractError(TierckptError):
    """Data exchanged between operator, pod and replicator is missing or malformed."""


class RetryableError(TierckptError):
    """A transient failure: the same call may succeed later."""


def _corrupt_shard_error(message: str, path: str, key: str | None) -> CorruptShardError:
    return CorruptShardError(message, path=path, key=key)


def _state_mismatch_error(message: str, mismatches: tuple[str, ...]) -> StateMismatchError:
    return StateMismatchError(message, mismatches=mismatches)


def _replica_divergence_error(message: str, step: int, differs: tuple[int, ...]) -> ReplicaDivergenceError:
    return ReplicaDivergenceError(message, step=step, differs=differs)
