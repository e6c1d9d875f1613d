"""Who may do what on this node, from the identity in the peer's certificate (``--auth tls``).

One policy for the control API (``api.auth``) and the data plane (``replication.data_server``):

* the operator may call every endpoint of the control API (it alone assigns peers, publishes plans
  and policies, purges); it never uses the data plane;
* a node may only read the inventory of a job both nodes belong to, and on the data plane ``put`` a
  replica of, ``get`` a step of, report a corrupt copy of, or ``retire`` a surplus replica of (only of a
  rank it runs itself, checked by the data server) a job both belong to. It must name
  itself in the request (``DataRequest.node``): the name its certificate proves.

"Belongs to" is what THIS node knows of the job (``JobMembers``): the nodes of its peer assignment
(for a large job, this node's neighbourhood: its peers and the nodes that send to it, the only nodes
that ever need it) and the holders named by its restore plan. A job this node has no assignment for
has no members, so nobody reads it here. A certificate leaked from one node thus reads only the
jobs that node itself takes part in, and can never act as another node or as the operator.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tierckpt.protocol.control import RestorePlan, read_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.identity import Peer
from tierckpt_replicator.assignments import AssignmentStore

__all__ = ["NODE_ENDPOINTS", "JobMembers", "api_refusal", "data_refusal"]

NODE_ENDPOINTS = frozenset({"inventory"})
"""The only control API endpoints a node (not the operator) may call, and only for its own jobs."""


class JobMembers:
    """``members(job)``: the nodes this node knows to belong to ``job`` (its assignment's nodes and its
    restore plan's holders; empty for a job it has no assignment for)."""

    def __init__(self, root: Path, assignments: AssignmentStore) -> None:
        self.root, self.assignments = root, assignments

    def __call__(self, job: str) -> frozenset[str]:
        assignment = self.assignments.get(job)
        if assignment is None:
            return frozenset()
        members = set(assignment.nodes)
        with contextlib.suppress(FormatError, OSError):
            plan = read_control(self.root, job, RestorePlan.FILE, RestorePlan)
            if isinstance(plan, RestorePlan) and plan.stands_for(assignment) is None:
                members.update(n for holders in plan.holders.values() for n in holders)
        return frozenset(members)


def _member(peer: Peer, job: str, members: JobMembers, me: str) -> str | None:
    known = members(job)
    if me not in known or peer.node not in known:
        return f"{peer} is not a member of job {job} as this node knows it"
    return None


def api_refusal(
    peer: Peer | None, endpoint: str, job: str | None, members: JobMembers, me: str
) -> str | None:
    """Why ``peer`` may not call ``endpoint`` (for ``job``, when the path names one); None if it may."""
    if peer is None:
        return "no tierckpt identity in the client certificate"
    if peer.role == "operator":
        return None
    if endpoint not in NODE_ENDPOINTS or job is None:
        return f"{peer} may not call {endpoint} (nodes may only read inventories of their own jobs)"
    return _member(peer, job, members, me)


def data_refusal(
    peer: Peer | None, op: str, job: str, claimed: str, members: JobMembers, me: str
) -> str | None:
    """Why ``peer`` may not ``op`` (put, get, corrupt, retire) on ``job`` here; None if it may. ``claimed`` is
    the node the request says it comes from."""
    if peer is None or peer.role != "node":
        return f"{peer or 'a peer without a tierckpt identity'} may not use the data plane"
    if claimed != peer.node:
        return f"{peer} claims to be node {claimed!r}"
    if peer.node == me:
        return f"{peer} is this node itself"
    return _member(peer, job, members, me)
