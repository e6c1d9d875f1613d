"""Checkpointer settings: explicit arguments, then the operator's environment, then torch.distributed.

Resolution order for each identity field:

==============  ==================  =========================  ============================  =======
field           argument            operator env (contract)    torch.distributed / torchrun   default
==============  ==================  =========================  ============================  =======
``root``        ``root=``           ``TIERCKPT_ROOT``          —                             error
``job``         ``job=``            ``TIERCKPT_JOB``           —                             "local"
``rank``        ``rank=``           ``TIERCKPT_RANK``          ``get_rank()``, then ``RANK``  0
``world_size``  ``world_size=``     ``TIERCKPT_WORLD_SIZE``    ``get_world_size()``, then     1
                                                               ``WORLD_SIZE``
==============  ==================  =========================  ============================  =======
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from tierckpt.protocol.contract import Env
from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.format import check_job_id

__all__ = ["DEFAULT_JOB", "BusyPolicy", "DivergencePolicy", "Settings", "resolve"]

BusyPolicy = Literal["wait", "skip", "error"]
DivergencePolicy = Literal["log", "raise"]
DEFAULT_JOB = "local"
_BUSY = ("wait", "skip", "error")
_DIVERGENCE = ("log", "raise")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a ``Checkpointer`` is configured with."""

    root: Path
    """Ramdisk root; this rank writes under ``<root>/<job>/rank-<rank>/``."""
    job: str
    """Job id (a safe path component); the operator injects ``<namespace>_<jobset>_<uid8>``."""
    rank: int
    """Process rank (the torch.distributed rank)."""
    world_size: int
    keep: int = 2
    """Committed steps retained per rank (the newest always is). The pool keeps ``keep + 1`` slots."""
    on_busy: BusyPolicy = "wait"
    """A save arriving while one is still committing: ``wait`` for it, ``skip`` (logged), or ``error``."""
    overlap: bool = False
    """Copy device tensors on a side stream and return at once; registered optimizers wait before
    stepping. Everything that is not an optimizer's parameter or state is still copied before
    ``save`` returns."""
    device_staging: bool | None = None
    """CUDA tensors are snapshotted into spare device memory (at device-to-device speed) and drained to
    the ramdisk in the background, within ``device_budget``; what the budget cannot hold is copied in
    overlap mode. None (the default): on whenever a save holds CUDA tensors; False: off (plain or
    ``overlap`` saves); True: on, and said so in the log when no optimizer is registered."""
    device_budget: int | float = 0.5
    """Most device memory device staging may hold, per device: bytes (an int), or a fraction (a float
    in (0, 1]) of the device memory this process's peak has not needed so far."""
    restore_wait: float = 300.0
    """Seconds without progress in the replicator's restore status after which ``load`` stops waiting."""
    replicator_url: str | None = None
    """The node's replicator (from the operator); when set, ``load`` waits for its restore status."""
    max_file_bytes: int | None = None
    """Start a new data file past this size (None: one data file per step)."""
    crc_workers: int | None = None
    """Threads that checksum a save in the background (None: half the CPUs, at most 8). Restore
    verification always uses every CPU (training is waiting for it)."""
    pack_bytes: int = 1 << 20
    """CUDA tensors up to this size are packed: gathered on the device into a staging buffer laid out
    like their file region and copied as one DMA (0 disables packing)."""
    pack_limit: int = 256 << 20
    """Most device memory one device's packing staging buffer may take; a state whose small tensors
    need more is copied tensor by tensor."""
    lease_ttl: float = 60.0
    """Seconds a lease taken by ``load`` lasts (renewed while loading)."""
    writer_lock_timeout: float = 60.0
    """Seconds to wait for another process still holding this rank's writer lock."""
    on_divergence: DivergencePolicy = "log"
    """Replica groups: members whose tensors differ at a save are always reported (an error in the log,
    ``diverged`` in the manifest) and each keeps its own copy; ``raise`` also raises
    ``ReplicaDivergenceError`` from ``save`` once the snapshot is taken."""
    replica_timeout: float = 300.0
    """Replica groups: seconds a member that links the node writer's files waits for its COMMIT."""
    broadcast_load: bool = False
    """Replica groups: ``load`` reads each step on one member and broadcasts it to the others over the
    group's process group (``load(broadcast=...)`` overrides it per call)."""
    freeze_gc: bool = True
    """The first ``Checkpointer`` of a process collects garbage once and moves every object alive then
    (torch's modules, the model, the set-up's objects) out of the collector's generations
    (``gc.freeze()``), so that the objects saves create do not make the collector's occasional full pass
    walk all of them while training waits (0.19-0.23 s on an H200 host, once every dozen saves of a
    0.94 B-parameter model). False: leave the collector as it is."""

    def __post_init__(self) -> None:
        check_job_id(self.job)
        if self.rank < 0 or self.world_size < 1 or self.rank >= self.world_size:
            raise ContractError(f"rank {self.rank} is not within world size {self.world_size}")
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")
        if self.on_busy not in _BUSY:
            raise ValueError(f"on_busy must be one of {_BUSY}, got {self.on_busy!r}")
        if self.on_divergence not in _DIVERGENCE:
            raise ValueError(f"on_divergence must be one of {_DIVERGENCE}, got {self.on_divergence!r}")
        if not self.replica_timeout > 0:
            raise ValueError(f"replica_timeout must be positive, got {self.replica_timeout!r}")
        budget = self.device_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ValueError(f"device_budget must be bytes (int) or a fraction (float), got {budget!r}")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"device_budget as a fraction must be in (0, 1], got {budget}")
        if isinstance(budget, int) and budget < 0:
            raise ValueError(f"device_budget in bytes must be >= 0, got {budget}")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ContractError(f"${name}={raw!r} is not an integer") from None


def _env_float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ContractError(f"${name}={raw!r} is not a number") from None


def _dist() -> tuple[int, int] | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _first(*values: int | None, default: int) -> int:
    return next((v for v in values if v is not None), default)


def resolve(
    *,
    root: str | os.PathLike[str] | None = None,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
    **options: object,
) -> Settings:
    """Build ``Settings`` from arguments, the environment and torch.distributed (see the module doc)."""
    env = os.environ if env is None else env
    root = root if root is not None else env.get(Env.ROOT) or None
    if root is None:
        raise ContractError(f"no checkpoint root: pass root=... or set ${Env.ROOT} (a tmpfs directory)")
    dist = _dist()
    rank = _first(rank, _env_int(env, Env.RANK), dist and dist[0], _env_int(env, "RANK"), default=0)
    world_size = _first(
        world_size, _env_int(env, Env.WORLD_SIZE), dist and dist[1], _env_int(env, "WORLD_SIZE"), default=1
    )
    if "restore_wait" not in options and (wait := _env_float(env, Env.RESTORE_WAIT)) is not None:
        options["restore_wait"] = wait
    if "replicator_url" not in options and env.get(Env.REPLICATOR_URL):
        options["replicator_url"] = env[Env.REPLICATOR_URL]
    return Settings(
        root=Path(root),
        job=job or env.get(Env.JOB) or DEFAULT_JOB,
        rank=rank,
        world_size=world_size,
        **options,  # type: ignore[arg-type]
    )
