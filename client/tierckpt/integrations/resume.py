"""What the framework adapters tell the user when a job resumes, and when it has nothing left to train.

Each adapter logs these once, on rank 0, where a user sees them with default logging settings (through
its framework's own logger where it has one): which step was resumed, when it was saved (an old step is
the sign of a ramdisk left by an earlier run of the same job id) and from which tier each rank's copy
came (``snapshot.restore_wait.restored_from``). No framework is imported here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tierckpt.protocol.control import Tier
from tierckpt.protocol.text import duration, rank_ranges
from tierckpt.snapshot import agree
from tierckpt.snapshot.restore_wait import restored_from

__all__ = ["complete_message", "resume_message"]

_WHERE = {
    Tier.LOCAL: "this node's RAM disk",
    Tier.REPLICA: "a replica this node held (staged by the replicator)",
    Tier.PEER: "a peer node (fetched by the replicator)",
    Tier.ERASURE: "erasure-coded fragments on other nodes (rebuilt by the replicator)",
    Tier.GCS: "the GCS bucket (downloaded by the replicator)",
}


def resume_message(root: str | os.PathLike[str], job: str, rank: int, step: int) -> str:
    """The sentence that says where the job resumed from. A collective (every rank tells where its copy
    of ``step`` came from): call it on every rank after the load; rank 0 logs it."""
    restored = restored_from(Path(root), job, rank, step)
    gathered = agree.all_gather((restored.tier.value, restored.committed_at))
    by_tier: dict[Tier, list[int]] = {}
    for r, (tier, _) in enumerate(gathered):
        by_tier.setdefault(Tier(tier), []).append(r)
    sources = ", ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)} from {_WHERE[tier]}"
        for tier, ranks in sorted(by_tier.items(), key=lambda item: item[0].cost)
    )
    saved = max(at for _, at in gathered)
    age = f"saved {duration(time.time() - saved)} ago" if saved else "saved at an unknown time"
    return (
        f"tierckpt: resumed job {job!r} from step {step} ({age}): {sources}. To start from scratch "
        f"instead, use another job id ($TIERCKPT_JOB) or remove {Path(root) / job}"
    )


def complete_message(step: int, limit: str, what: str) -> str:
    """The sentence that says the resumed job was already complete: ``step`` reached ``limit``
    (``"max_steps=30"``); ``what`` the framework does now (``"fit() returns without training"``)."""
    return f"tierckpt: the job is already complete: step {step} reached {limit}, so {what}"
