"""Gather every node's inventory of a job and decide the restore plan (``restore_choice``).

This node's own inventory is read from disk; every other node in ``peers.json`` is asked over its
control API, all at once, each within ``timeout``. A node that does not answer is left out: its
holdings are unknown, and the plan is made from what the others (and the bucket) hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

from tenacity import AsyncRetrying, RetryCallState, retry_if_result, stop_after_attempt, wait_exponential

from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import NodeInventory, PeerAssignment, RestorePlan
from tierckpt.protocol.errors import ContractError, RetryableError

__all__ = ["compute_plan", "gather_inventories"]

log = logging.getLogger(__name__)


async def gather_inventories(
    own: NodeInventory, assignment: PeerAssignment | None, peers: ReplicatorClient
) -> list[NodeInventory]:
    """``own`` plus the inventories of every other assigned node that answers."""
    if assignment is None:
        return [own]
    names = sorted(n for n in assignment.nodes if n != own.node)

    async def ask(name: str) -> NodeInventory | None:
        try:
            inv = await peers.inventory(assignment.nodes[name].endpoint, own.job, node=name)
        except (RetryableError, ContractError) as exc:
            log.warning("restore %s: holdings of %s unknown: %s", own.job, name, exc)
            return None
        if inv is None:
            log.warning("restore %s: holdings of %s unknown: it has no inventory route", own.job, name)
        return inv

    answers = await asyncio.gather(*(ask(n) for n in names))
    return [own, *(a for a in answers if a is not None)]


async def compute_plan(
    job: str,
    own: Callable[[], Awaitable[NodeInventory]],
    assignment: PeerAssignment | None,
    peers: ReplicatorClient,
    *,
    attempts: int = 1,
    backoff: float = 1.0,
) -> RestorePlan:
    """The plan every replicator computes identically from the same inventories.

    A "nothing to restore" answer while some nodes did not answer could throw a job's progress away
    (they may hold the only copies), so that case is asked again, up to ``attempts`` times with
    growing pauses, before it is believed. Any other plan is safe to act on at once: every rank can
    restore its step.
    """
    expected = len(assignment.nodes) if assignment is not None else 1
    generation = assignment.attempt if assignment is not None else 0  # a plan's is the attempt

    async def ask_all() -> tuple[RestorePlan, list[NodeInventory]]:
        inventories = await gather_inventories(await own(), assignment, peers)
        return choose_restore(inventories, job=job, generation=generation), inventories

    def doubtful(got: tuple[RestorePlan, list[NodeInventory]]) -> bool:
        plan, inventories = got
        return plan.step is None and len(inventories) < expected

    def asking_again(attempt: RetryCallState) -> None:
        inventories = _result(attempt)[1]
        log.warning(
            "restore %s: nothing restorable among the %d of %d nodes that answered (%s); asking again",
            job,
            len(inventories),
            expected,
            _names(inventories),
        )

    rounds = AsyncRetrying(  # backoff, doubling, between rounds
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=backoff),
        retry=retry_if_result(doubtful),
        before_sleep=asking_again,
        retry_error_callback=_result,  # after the last round, its plan is believed
    )
    result: tuple[RestorePlan, list[NodeInventory]] = await rounds(ask_all)  # tenacity infers no result type
    plan, inventories = result
    log.info(
        "restore %s: step %s from %d of %d inventories (%s)",
        job,
        plan.step,
        len(inventories),
        expected,
        _names(inventories),
    )
    return plan


def _result(attempt: RetryCallState) -> tuple[RestorePlan, list[NodeInventory]]:
    assert attempt.outcome is not None
    return cast("tuple[RestorePlan, list[NodeInventory]]", attempt.outcome.result())


def _names(inventories: list[NodeInventory]) -> str:
    return ", ".join(sorted(i.node for i in inventories))
