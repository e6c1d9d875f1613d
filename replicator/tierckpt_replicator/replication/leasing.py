"""A lease handle for replicator code that renews leases on its own schedule.

The lease protocol itself (files, locking, expiry) is ``tierckpt.leases``; this is only a small
stateful handle over it: ``write()`` acquires the lease the first time and renews it afterwards,
``release()`` drops it. Code that just needs a lease for a block uses ``tierckpt.leases.hold``.
"""

from __future__ import annotations

from pathlib import Path

from tierckpt import leases
from tierckpt.format import Lease

__all__ = ["LeaseHandle"]


class LeaseHandle:
    def __init__(self, rank_path: Path, step: int, holder: str, ttl: float = leases.DEFAULT_TTL) -> None:
        self.rank_path, self.step, self.holder, self.ttl = Path(rank_path), step, holder, ttl
        self.lease: Lease | None = None

    def write(self) -> None:
        """Acquire (first call; ``MissingCheckpointError`` if the step is not committed) or renew."""
        if self.lease is None:
            self.lease = leases.acquire(self.rank_path, self.step, self.holder, ttl=self.ttl)
        else:
            self.lease = leases.renew(self.rank_path, self.lease, ttl=self.ttl)

    def release(self) -> None:
        if self.lease is not None:
            leases.release(self.rank_path, self.lease)
            self.lease = None
