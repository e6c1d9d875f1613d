"""Per-job quotas: the most bytes one rank's step may declare, to be sent to a peer, received, staged
or uploaded.

A training pod pays for what its files take on the ramdisk (allocated pages); a peer that receives a
step, and the bucket, pay for the sizes its manifest declares. A sparse file (``st_blocks * 512`` far
below ``st_size``) costs the pod nothing, and a manifest can declare any size: without a bound, one
pod could make every peer of its job, and the bucket, store terabytes of zeros. So every step is
checked against its job's quota before a byte of it is sent, reserved (preallocated) or uploaded.

The quota (``JobQuotas.of``) is the smallest of the limits that are set: the job's policy
(``JobPolicy.quota_bytes``: the operator sends the job's ramdisk size, ``spec.ramdisk.size``), the
node's ``--job-quota``, and the size of this node's ramdisk (no rank's step can be larger here).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from tierckpt.protocol.control import StepOverQuota
from tierckpt.protocol.errors import FormatError, TierckptError
from tierckpt.protocol.format import Manifest
from tierckpt.protocol.quantity import MAX_BYTES
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.stepio import open_files, open_job, rank_tree, read_header, step_name

__all__ = ["JobQuotas", "OverQuotaError"]


class OverQuotaError(TierckptError):
    """A rank's step declares more bytes than its job's quota: it is neither sent, received, staged nor
    uploaded."""

    def __init__(self, job: str, over: StepOverQuota) -> None:
        super().__init__(over.describe(job))
        self.over = over


def _allocated(fds: Sequence[int]) -> int:
    """What the open files take on their filesystem (their allocated blocks)."""
    return sum(os.fstat(fd).st_blocks * 512 for fd in fds)


@dataclasses.dataclass(frozen=True)
class JobQuotas:
    """The quota of each job on this node (see the module docstring); ``node_limit``: ``--job-quota``
    (0: none)."""

    root: Path
    policies: PolicyStore
    node_limit: int = 0

    def of(self, job: str) -> int:
        policy = self.policies.get(job)
        st = os.statvfs(self.root)
        limits = (policy.quota_bytes if policy is not None else 0, self.node_limit, st.f_blocks * st.f_frsize)
        return min((limit for limit in limits if limit > 0), default=MAX_BYTES)

    def over(self, manifest: Manifest, *, allocated: int = -1) -> StepOverQuota | None:
        """The step's refusal if it declares more than its job's quota, else None."""
        quota = self.of(manifest.job)
        if manifest.total_bytes <= quota:
            return None
        return StepOverQuota(manifest.rank, manifest.step, manifest.total_bytes, quota, allocated)

    def check(self, manifest: Manifest, *, fds: Sequence[int] = ()) -> None:
        """``OverQuotaError`` if the step declares more than its job's quota. ``fds``: its files, open
        here (a step of this node's): the error then says what they take (a sparse file: far less)."""
        over = self.over(manifest)
        if over is not None:
            allocated = _allocated(fds) if fds else -1
            raise OverQuotaError(manifest.job, dataclasses.replace(over, allocated=allocated))

    def committed_over(
        self, job: str, rank: int, step: int, *, declared: int, limit: int
    ) -> StepOverQuota | None:
        """The refusal of this node's committed primary of ``job``/``rank``/``step`` if it is over the job's
        quota: ``declared``, what its COMMIT says, is checked first (no file is read for a step within
        the quota); then its manifest (at most ``limit`` bytes), with what its files take here."""
        if declared <= self.of(job):
            return None
        try:
            with open_job(self.root, job) as tree:
                path = rank_tree(tree, "primary", rank).at(step_name(step))
                manifest = read_header(path, job=job, rank=rank, step_no=step, limit=limit).manifest
                with open_files(path, manifest) as fds:
                    return self.over(manifest, allocated=_allocated(fds))
        except (OSError, FormatError):  # unreadable (or a link: refused): refused for what it declares
            return StepOverQuota(rank, step, declared, self.of(job))
