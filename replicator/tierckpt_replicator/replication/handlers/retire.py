"""``retire``: a rank's primary says this node's replicas of it (that step and older) are surplus;
drop them unless the restore plan names them or a reader leased them."""

from __future__ import annotations

import contextlib
import logging

from tierckpt.protocol import leases
from tierckpt.protocol.format import committed_steps, discard_step, read_manifest
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.replicas import pinned_steps
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status
from tierckpt_replicator.stepio import open_job, rank_tree, step_name

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    """Drop this node's replicas of a rank (that step and older ones) its primary says are surplus.
    Only the node that runs the rank in this node's own peer assignment may ask (a peer of the job
    cannot drop another node's copies). A step the published restore plan names, or one a reader
    leased, stays (``409``: the sender asks again later); "no replica held" is an answer too."""
    assignment = t.ctx.members.assignments.get(req.job)
    status, message = Status.OK, "no replica held"
    try:
        job = open_job(t.ctx.root, req.job)
    except FileNotFoundError:
        job = None
    with contextlib.ExitStack() as stack:
        if job is not None:
            stack.enter_context(job)
            parent = rank_tree(job, "replica", req.rank)
            steps = [s for s in committed_steps(parent) if s <= req.step]
            if steps:
                newest = parent.at(step_name(steps[-1]))
                world = read_manifest(newest, limit=t.ctx.config.transfer.max_manifest_bytes).world_size
                owns = assignment is not None and req.rank in assignment.process_ranks(req.node, world)
                if t.ctx.tokens is None and not owns:
                    raise Reject(Status.FORBIDDEN, f"{req.node} does not run rank {req.rank} of {req.job}")
                status, message = _drop_surplus(t, parent, req, steps)
    t.event(req, status, message=message)
    t.reply(conn, DataReply(status=status, message=message))


def _drop_surplus(t: Transfers, parent: Beneath, req: DataRequest, steps: list[int]) -> tuple[int, str]:
    pinned = pinned_steps(t.ctx.root, req.job)
    with leases.lock(parent):  # a reader leasing meanwhile either sees the step stay or learns it is gone
        kept = sorted((set(steps) & pinned) | (set(steps) & set(leases.leased_steps(parent))))
        dropped = [s for s in steps if s not in kept]
        for s in dropped:
            discard_step(parent.at(step_name(s)))
    if dropped:
        log.info(
            "%s rank %d: replica steps %s retired (surplus, says %s)",
            req.job,
            req.rank,
            dropped,
            req.node,
        )
    if kept:
        return Status.CONFLICT, f"replica steps {kept} kept: named by the restore plan or read now"
    return Status.OK, f"replica steps {dropped} retired"
