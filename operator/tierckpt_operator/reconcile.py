"""One job's control loop: assign ranks, publish peers and policy, publish the restore plan, report status.

``JobController.reconcile`` is level-triggered and idempotent: it reads the cluster from the indices,
decides with the pure planners, performs only the writes that differ from what is already there,
and records the outcome in the CheckpointJob status. ``refresh`` gathers the replicators'
inventories for tier progress. Neither ever waits for all nodes: an unreachable replicator is retried
on the next round, and the restore plan is chosen without it once ``restore_grace`` has passed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from tierckpt.planning.placement import RankAssignment, peer_churn
from tierckpt.planning.restore_plan import BUCKET_PATIENCE, bucket_unknown
from tierckpt.protocol.client import ReplicatorClient, ReplicatorError
from tierckpt.protocol.control import (
    JobPolicy,
    NodeInventory,
    NodePlan,
    NodePlanResult,
    PeerAssignment,
    Redundancy,
    RestorePlan,
)
from tierckpt.protocol.orbax import OrbaxSession
from tierckpt_operator import resources
from tierckpt_operator.clusterview import CheckpointJobRecord, ClusterView, ConfigRecord
from tierckpt_operator.decisions import (
    AssignmentDecision,
    JobState,
    decide_assignment,
    decide_peers,
    group_partners,
    jax_coordinator,
    job_policy,
    orbax_sessions,
    peer_assignment,
    peer_views,
    restore_plan,
)
from tierckpt_operator.events import post_event
from tierckpt_operator.jobsets import JobSetInfo
from tierckpt_operator.kube import Kube
from tierckpt_operator.metrics import Metrics
from tierckpt_operator.resources import ConfigSpec
from tierckpt_operator.settings import Settings
from tierckpt_operator.status_fields import (
    condition,
    iso_time,
    merge_conditions,
    over_quota_text,
    rank_ranges,
    redundancy_of,
    redundancy_text,
    replica_groups,
    restore_summary,
    tier_progress,
)

__all__ = ["JobContext", "JobController", "JobKey", "checkpoint_job_body"]

log = logging.getLogger(__name__)
T = TypeVar("T")

JobKey = tuple[str, str]
"""An opted-in JobSet's (namespace, name)."""


@dataclasses.dataclass(frozen=True)
class JobContext:
    """What every job's control loop is given by the runtime that owns it (and nothing more)."""

    settings: Settings
    kube: Kube
    replicators: ReplicatorClient
    metrics: Metrics
    running: Callable[[], bool]
    """True between kopf's startup and cleanup: the loop may do I/O."""
    track_nodes: Callable[[JobKey, Sequence[str]], None]
    """Record the nodes a job uses, so that node and replicator events wake it."""
    forget_pod: Callable[[str, str], None] = lambda namespace, name: None
    """Drop a worker pod from the watched pods (it is gone from the API: its deletion event was lost)."""


def checkpoint_job_body(info: JobSetInfo | None, namespace: str, name: str, uid: str) -> dict[str, Any]:
    """A new CheckpointJob for a JobSet, owned by it (garbage-collected with it)."""
    spec: dict[str, Any] = {"jobSetName": name, "jobSetUID": uid, "jobId": info.job_id if info else ""}
    if info is not None:
        spec.update(
            configName=info.config_name,
            numNodes=info.world_size,
            replicatedJobs=[
                {"name": rj.name, "replicas": rj.replicas, "parallelism": rj.parallelism}
                for rj in info.shape.replicated_jobs
            ],
        )
    owner = {
        "apiVersion": f"{resources.JOBSET_GROUP}/{resources.JOBSET_VERSION}",
        "kind": "JobSet",
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "apiVersion": f"{resources.GROUP}/{resources.VERSION}",
        "kind": "CheckpointJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "tierckpt-operator"},
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


@dataclasses.dataclass(frozen=True)
class _Outgoing:
    """A node's peer assignment and the digest of its content without the generation."""

    message: PeerAssignment
    content: str


def _content_digest(msg: PeerAssignment) -> str:
    return hashlib.sha1(dataclasses.replace(msg, generation=1).to_bytes(), usedforsecurity=False).hexdigest()


@dataclasses.dataclass
class _Restore:
    plan: RestorePlan
    acked: set[str] = dataclasses.field(default_factory=set)
    """Nodes that accepted the plan, including any that left the job since (a node replaced)."""

    def delivered(self, nodes: Sequence[str]) -> int:
        """How many of the job's ``nodes`` hold the plan (a node that left counts no more)."""
        return len(self.acked & set(nodes))


class JobController:
    """The memory and the control loop of one opted-in JobSet."""

    def __init__(self, ctx: JobContext, key: JobKey) -> None:
        self.ctx = ctx
        self.key = key
        self.wake = asyncio.Event()
        self.state: JobState | None = None
        self.ref: dict[str, Any] | None = None
        self.status: dict[str, Any] = {}
        self.peer_digest: str | None = None
        self.partners: tuple[tuple[int, ...], ...] = ()
        """Node rank -> node ranks hosting its replica groups' other members (from the inventories;
        the next peer plan prefers them)."""
        self.delivered: dict[str, str] = {}
        """Node -> digest of the peer assignment it accepted."""
        self.outgoing: dict[str, _Outgoing] | None = None
        """Node -> its peer assignment of the current plan (made when the plan changes)."""
        self.policy: JobPolicy | None = None
        self.policy_delivered: dict[str, int] = {}
        """Node -> generation of the policy it accepted."""
        self.sessions: dict[str, OrbaxSession] = {}
        """Orbax mode: node -> the session it accepted for the current attempt."""
        self.assigned_at = 0.0
        self.restore: _Restore | None = None
        self.job_id = ""
        self._said: dict[str, str] = {}
        self._asking: tuple[tuple[str, ...], asyncio.Future[list[NodeInventory]]] | None = None
        """The round of inventories in flight, for these nodes."""

    # ------------------------------------------------------------------------------ loop

    async def run(self, cluster_of: Callable[[], ClusterView], stopped: Any) -> None:
        """Reconcile on every poke (debounced) and at least every ``resync_interval``."""
        s = self.ctx.settings
        self.wake.set()
        while not stopped:
            await _wait_any(self.wake.wait(), stopped.wait(), timeout=s.resync_interval)
            if stopped:
                return
            await asyncio.sleep(s.debounce)
            self.wake.clear()
            if not self.ctx.running():
                continue
            started = time.monotonic()
            try:
                await self.reconcile(cluster_of())
                self.ctx.metrics.reconciles.labels("ok").inc()
            except Exception as exc:
                self.ctx.metrics.reconciles.labels("error").inc()
                log.exception("reconcile of %s/%s failed", *self.key)
                self._event("Warning", "ReconcileFailed", f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(min(30.0, s.debounce * 10))
                self.wake.set()
            finally:
                self.ctx.metrics.reconcile_seconds.observe(time.monotonic() - started)

    # ------------------------------------------------------------------------------ reconcile

    async def reconcile(self, cluster: ClusterView) -> None:
        ns, name = self.key
        rec = cluster.jobset(ns, name)
        if rec is None or rec.deleting:
            return
        ck = cluster.checkpoint_job(ns, name)
        if ck is None:
            await self._ensure_checkpoint_job(rec.info, rec.uid)
            return
        state = self._adopt(ck)
        if rec.info is not None:
            self.job_id = rec.info.job_id
        if rec.info is None:
            await self._report("Invalid", [condition("ConfigResolved", False, "InvalidJobSet", rec.error)])
            return
        info = rec.info
        cfg = cluster.config(info.config_name)
        if cfg is None or cfg.spec is None:
            await self._config_missing(info, cfg)
            return
        spec = cfg.spec
        domains = self._domains(cluster, info, spec, state)
        decision = decide_assignment(info, cluster.workers(ns, name), state, domains)
        if decision.assignment is None:
            if await self._forget_vanished(decision.suspects):
                self.wake.set()  # decide again without them
            await self._waiting(decision)
            return
        state = await self._deliver_ranks(state, decision, decision.assignment)
        self._plan_policy(info, spec)
        state = self._plan_peers(info, spec, state, cluster)
        if info.mode == "orbax":  # before the plan: Orbax's processes wait for jax-init-info.txt
            await self._send_plans(state, cluster, restore=False)
            await self._publish_sessions(info, state, decision.coordinator_ip, cluster)
        state = await self._plan_restore(info, state, cluster)
        await self._send_plans(state, cluster)
        await self._report_running(info, state)

    def _adopt(self, ck: CheckpointJobRecord) -> JobState:
        """Take the job's state from its CheckpointJob the first time (a restarted operator carries on)."""
        self.ref = {
            "apiVersion": f"{resources.GROUP}/{resources.VERSION}",
            "kind": "CheckpointJob",
            "metadata": {"name": ck.name, "namespace": ck.namespace, "uid": ck.uid},
        }
        if self.state is None:
            self.state = ck.state
            self.status = dict(ck.status)
            self.job_id = self.job_id or ck.job_id
        return self.state

    async def _ensure_checkpoint_job(self, info: JobSetInfo | None, uid: str) -> None:
        body = checkpoint_job_body(info, *self.key, uid)
        created = await self.ctx.kube.create_checkpoint_job(body)
        if created is not None:
            log.info("created CheckpointJob %s/%s", *self.key)

    def _domains(
        self, cluster: ClusterView, info: JobSetInfo, spec: ConfigSpec, state: JobState
    ) -> dict[str, str]:
        nodes = {w.node for w in cluster.workers(*info.key) if w.node}
        nodes |= {n for n in state.nodes if n}
        out = {}
        for node in nodes:
            labels = cluster.node_labels(node)
            if labels is not None:
                out[node] = spec.domain_of(labels)
        return out

    async def _config_missing(self, info: JobSetInfo, cfg: ConfigRecord | None) -> None:
        if cfg is None:
            message = f"CheckpointConfiguration {info.config_name!r} does not exist"
            reason = "ConfigNotFound"
        else:
            message = f"CheckpointConfiguration {info.config_name!r} is invalid: {cfg.error}"
            reason = "ConfigInvalid"
        self._event_once("config", "Warning", reason, message)
        await self._report("Pending", [condition("ConfigResolved", False, reason, message)])

    async def _forget_vanished(self, pods: Sequence[str]) -> bool:
        """Look the pods up in the API; forget those it no longer has. True if any was forgotten.

        The watched pods come from watch events, and a deletion can be missed: kopf resumes a watch
        from its last resource version and, when that is too old (410), lists again without telling
        which objects vanished meanwhile. A replaced pod then stays next to its replacement, two pods
        for one rank, and the ranks are never assigned (found at 4,096 nodes on the API emulator)."""
        ns = self.key[0]
        gone = [pod for pod in pods if await self.ctx.kube.get_pod(ns, pod) is None]
        for pod in gone:
            log.warning(
                "job %s/%s: pod %s is gone from the API but its deletion was never seen (a lost watch "
                "event): forgetting it",
                *self.key,
                pod,
            )
            self.ctx.forget_pod(ns, pod)
        return bool(gone)

    async def _waiting(self, decision: AssignmentDecision) -> None:
        if decision.problem:
            self._event_once("assign", "Warning", "AssignmentBlocked", decision.problem)
        message = decision.problem or (
            f"attempt {decision.attempt}: {decision.scheduled}/{decision.needed} pods scheduled"
        )
        await self._report(
            "Scheduling",
            [
                condition("ConfigResolved", True, "Resolved"),
                condition("RanksAssigned", False, "WaitingForPods", message),
            ],
        )

    # ------------------------------------------------------------------------------ ranks

    async def _deliver_ranks(
        self, state: JobState, decision: AssignmentDecision, a: RankAssignment
    ) -> JobState:
        """Write each pod's rank annotations (only those that differ), then adopt the new state."""
        ns = self.key[0]
        new_generation = state.generation != decision.attempt
        results = await _gather(
            self.ctx.kube.annotate_pod(ns, pod, ann) for pod, ann in decision.writes.items()
        )
        failed = [str(r) for r in results if isinstance(r, BaseException)]
        if failed:
            raise RuntimeError(f"could not annotate {len(failed)} pods: {failed[0]}")
        if new_generation:
            self.assigned_at = time.time()
            self.restore = None
            self.ctx.metrics.assignments.inc()
            self.ctx.metrics.ranks_moved.inc(len(a.moved))
            moved = f" (moved: {rank_ranges(a.moved)})" if a.moved else ""
            self._event(
                "Normal",
                "RanksAssigned",
                f"attempt {decision.attempt}: {len(a.ranks)} node ranks assigned; {len(a.sticky)} stayed on "
                f"their nodes, {len(a.moved)} moved to new nodes, {len(a.fresh)} new{moved}",
            )
        self.state = decision.state
        self.ctx.track_nodes(self.key, decision.state.nodes)
        return decision.state

    # ------------------------------------------------------------------------------ peers

    def _plan_peers(
        self, info: JobSetInfo, spec: ConfigSpec, state: JobState, cluster: ClusterView
    ) -> JobState:
        """Plan the peers again if the nodes, domains, partners or endpoints changed (each node's message
        made once per plan, in ``outgoing``)."""
        peers = decide_peers(state, spec.peers_per_node, self.partners)
        endpoints = {n: rep.endpoint for n in state.nodes if (rep := cluster.replicator(n))}
        digest = _digest(  # the attempt too: each attempt's node ranks go out with it (a plan's generation)
            state.generation, state.nodes, state.domains, peers, self.partners, sorted(endpoints.items())
        )
        if digest != self.peer_digest or self.outgoing is None:
            before = state.peers
            # Milliseconds since the epoch: newer than anything an earlier operator sent, even if
            # that one's status write was lost (replicators refuse generations not newer than theirs).
            generation = max(state.peer_generation + 1, int(time.time() * 1000))
            state = self.state = dataclasses.replace(state, peers=peers, peer_generation=generation)
            self.peer_digest = digest
            self.outgoing = self._peer_messages(info, state, endpoints)
            if peers != before:
                churn = peer_churn(before, peers) if before else 0
                domains = len(set(state.domains))
                self._event(
                    "Normal",
                    "PeersPlanned",
                    f"peer generation {state.peer_generation}: {spec.peers_per_node} peers per "
                    f"node across {domains} failure domain(s); {churn} edges changed",
                )
        return state

    def _peer_messages(
        self, info: JobSetInfo, state: JobState, endpoints: dict[str, str]
    ) -> dict[str, _Outgoing]:
        """Each node's message and its content digest (the generation left out: a node whose view did
        not change is not sent it again), made once per plan. Up to ``peers_full_view_max`` nodes every
        node gets the whole map (one message, encoded once); beyond, each its own neighbourhood."""
        if len(state.nodes) <= self.ctx.settings.peers_full_view_max:
            full = peer_assignment(info.job_id, state, endpoints)
            one = _Outgoing(full, _content_digest(full))
            return dict.fromkeys(state.nodes, one)
        before = self.outgoing or {}
        views = peer_views(
            info.job_id, state, endpoints, self.partners, {n: o.message for n, o in before.items()}
        )
        return {
            node: out
            if (out := before.get(node)) is not None and out.message is msg
            else _Outgoing(msg, _content_digest(msg))
            for node, msg in views.items()
        }

    # ------------------------------------------------------------------------------ policy

    def _plan_policy(self, info: JobSetInfo, spec: ConfigSpec) -> None:
        """The configuration's backup policy for every replicator of the job (a new generation when the
        configuration changed)."""
        wanted = job_policy(info.job_id, spec)
        if self.policy is None or dataclasses.replace(self.policy, generation=0) != wanted:
            # milliseconds, like the peers: newer than what an earlier operator sent, and growing
            previous = self.policy.generation if self.policy is not None else 0
            self.policy = dataclasses.replace(wanted, generation=max(previous + 1, int(time.time() * 1000)))
            log.info(
                "%s/%s: policy generation %d from configuration %s",
                *self.key,
                self.policy.generation,
                spec.name,
            )

    # ------------------------------------------------------------------------------ delivery

    async def _send_plans(self, state: JobState, cluster: ClusterView, *, restore: bool = True) -> None:
        """Send every ready replicator of the job, in one call, the parts it does not hold yet of the
        policy, its peers and (with ``restore``) the restore plan (``NodePlan``)."""
        todo = {}
        for node in sorted(set(state.nodes)):
            rep = cluster.replicator(node)
            if rep is not None and rep.ready and (plan := self._plan_for(node, restore=restore)):
                todo[node] = (rep.endpoint, plan)
        results = await _gather(self._put_plan(ep, plan, node) for node, (ep, plan) in todo.items())
        failures = []
        for (node, (_, plan)), result in zip(todo.items(), results, strict=True):
            if isinstance(result, BaseException):
                failures.append(f"{node}: {result}")
                self.ctx.metrics.replicator_calls.labels("put_node_plan", "error").inc()
            else:
                self.ctx.metrics.replicator_calls.labels("put_node_plan", "ok").inc()
                failures += self._took(node, plan, result)
        if failures:
            self._event_once(
                "plans", "Warning", "PlansNotDelivered", f"{len(failures)} node(s): {failures[0]}"
            )
            self._retry_later()
        elif (
            restore
            and self.restore is not None
            and self.restore.delivered(state.nodes) < len(set(state.nodes))
        ):
            self._retry_later()  # a replicator not ready yet: its plan is due when it is

    def _plan_for(self, node: str, *, restore: bool) -> NodePlan | None:
        """What ``node`` lacks of the job's plans (None: it holds them all)."""
        policy = self.policy
        if policy is not None and self.policy_delivered.get(node) == policy.generation:
            policy = None
        out = (self.outgoing or {}).get(node)
        peers = out.message if out is not None and self.delivered.get(node) != out.content else None
        plan = self.restore.plan if restore and self.restore and node not in self.restore.acked else None
        if policy is None and peers is None and plan is None:
            return None
        return NodePlan(job=self.job_id, node=node, policy=policy, peers=peers, restore_plan=plan)

    def _took(self, node: str, sent: NodePlan, result: NodePlanResult) -> list[str]:
        """Record the parts ``node`` stored; the parts it refused, as failures."""
        if "policy" in result.stored and sent.policy is not None:
            self.policy_delivered[node] = sent.policy.generation
        out = (self.outgoing or {}).get(node)
        if "peers" in result.stored and out is not None and out.message is sent.peers:
            self.delivered[node] = out.content
        restore = self.restore
        if "restore_plan" in result.stored and restore is not None and restore.plan is sent.restore_plan:
            restore.acked.add(node)
        if "policy" in result.refused:
            self.policy = None  # it holds a newer generation: send a fresh one next round
        if "peers" in result.refused:
            self.peer_digest = None  # likewise: plan the peers again with a newer generation...
            if self.outgoing is not None:
                self.outgoing.pop(node, None)  # ...for this node too (its view would be kept otherwise)
        refused = sorted(result.refused.items())
        return [f"{node}: holds a newer {part} (generation {g})" for part, g in refused]

    async def _put_plan(self, endpoint: str, plan: NodePlan, node: str) -> NodePlanResult:
        """``PUT .../plan``, or each part on its own endpoint on a replicator from before it (404)."""
        replicators = self.ctx.replicators
        try:
            return await replicators.put_node_plan(endpoint, plan, node=node)
        except ReplicatorError as exc:
            if exc.status != 404:
                raise
        stored: list[str] = []
        refused: dict[str, int] = {}

        async def put(name: str, call: Awaitable[object]) -> None:
            try:
                await call
                stored.append(name)
            except ReplicatorError as exc:
                if exc.status != 409:
                    raise
                refused[name] = 0  # a newer one is held (its generation is in the 409's answer)

        if plan.policy is not None:
            await put("policy", replicators.put_policy(endpoint, plan.policy, node=node))
        if plan.peers is not None:
            await put("peers", replicators.put_peers(endpoint, plan.peers, node=node))
        if plan.restore_plan is not None:
            await put("restore_plan", replicators.put_restore_plan(endpoint, plan.restore_plan, node=node))
        return NodePlanResult(job=plan.job, node=node, stored=tuple(stored), refused=refused)

    # ------------------------------------------------------------------------------ orbax

    async def _publish_sessions(
        self, info: JobSetInfo, state: JobState, address: str, cluster: ClusterView
    ) -> None:
        """Orbax mode: send every node its session for this attempt (its process id, the JAX coordinator
        on the IP of the pod of node rank 0), as GKE's controller writes jax-init-info.txt."""
        coordinator = jax_coordinator(address, self.ctx.settings.jax_coordinator_port)
        if coordinator is None:  # the rank 0 pod has no IP yet: it comes when the pod runs
            self._retry_later()
            return
        wanted = orbax_sessions(info.job_id, state, coordinator)
        todo = {
            node: (rep.endpoint, session)
            for node, session in wanted.items()
            if self.sessions.get(node) != session
            and (rep := cluster.replicator(node)) is not None
            and rep.ready
        }
        results = await _gather(
            self.ctx.replicators.put_orbax_session(ep, s, node=n) for n, (ep, s) in todo.items()
        )
        failures = []
        for (node, (_, session)), result in zip(todo.items(), results, strict=True):
            if isinstance(result, BaseException):
                failures.append(f"{node}: {result}")
                self.ctx.metrics.replicator_calls.labels("put_orbax_session", "error").inc()
            else:
                self.sessions[node] = session
                self.ctx.metrics.replicator_calls.labels("put_orbax_session", "ok").inc()
        self.sessions = {n: s for n, s in self.sessions.items() if wanted.get(n) == s}
        if failures:
            self._event_once(
                "sessions", "Warning", "SessionsNotDelivered", f"{len(failures)} node(s): {failures[0]}"
            )
            self._retry_later()

    # ------------------------------------------------------------------------------ restore

    async def _plan_restore(self, info: JobSetInfo, state: JobState, cluster: ClusterView) -> JobState:
        """Choose the attempt's restore plan from the inventories, once every replicator is ready or
        ``restore_grace`` has passed (sent by ``_send_plans``)."""
        attempt = state.generation
        if self.restore is None or self.restore.plan.generation != attempt:
            if state.restore_generation == attempt:
                return state  # published before this operator (re)started; replicators hold it
            missing = [n for n in state.nodes if not (r := cluster.replicator(n)) or not r.ready]
            waited = time.time() - self.assigned_at
            if missing and waited < self.ctx.settings.restore_grace:
                self._retry_later(self.ctx.settings.restore_grace - waited)
                return state
            invs = await self._inventories(state.nodes, cluster)
            if bucket_unknown(invs) and waited < self.ctx.settings.restore_grace + BUCKET_PATIENCE:
                log.info(
                    "%s/%s: no replicator has listed the bucket yet (slow to answer); asking again before "
                    "choosing the restore step",
                    *self.key,
                )
                self._retry_later(2.0)
                return state
            # Orbax restores only onto the topology it saved from: steps of as many processes as nodes
            world = len(state.nodes) if info.mode == "orbax" else None
            plan = restore_plan(info.job_id, state, invs, world, time.time())
            self.restore = _Restore(plan)
            state = self.state = dataclasses.replace(state, restore_generation=attempt)
            self._restore_event(plan, len(invs), missing)
        return state

    def _restore_event(self, plan: RestorePlan, answered: int, missing: list[str]) -> None:
        without = f"; chosen without {len(missing)} unready replicator(s)" if missing else ""
        if plan.step is None:
            self._event(
                "Normal",
                "FreshStart",
                f"attempt {plan.generation}: no complete step in any tier, "
                f"training starts fresh ({answered} inventories){without}",
            )
            return
        sources = restore_summary(plan, 0)["sources"]
        text = ", ".join(f"{tier} {ranks}" for tier, ranks in sources.items())
        self._event(
            "Normal",
            "RestorePlanned",
            f"attempt {plan.generation} restores step {plan.step} (ranks by source: {text}){without}",
        )

    async def _inventories(self, nodes: Sequence[str], cluster: ClusterView) -> list[NodeInventory]:
        """Every node's inventory. One round at a time: a caller that finds a round in flight for the same
        nodes shares its answers (the refresh timer's and a reconcile choosing the restore plan would
        otherwise ask every node twice, as they did at 1,024 nodes)."""
        key = tuple(nodes)
        asking = self._asking
        if asking is None or asking[0] != key or asking[1].done():
            asking = self._asking = (key, asyncio.ensure_future(self._ask_inventories(nodes, cluster)))
        return await asyncio.shield(asking[1])

    async def _ask_inventories(self, nodes: Sequence[str], cluster: ClusterView) -> list[NodeInventory]:
        """Every node's inventory, in at most half of ``--http-concurrency`` calls at once: the rest stays
        free for the plans (at 4,096 nodes on an overloaded VM the refresh round's calls timed out and
        retried while a replaced node's six calls waited behind them for 233 s)."""
        job = self.job_id
        targets = {n: rep.endpoint for n in nodes if (rep := cluster.replicator(n))}
        slots = asyncio.Semaphore(max(1, self.ctx.settings.http_concurrency // 2))

        async def ask(endpoint: str, node: str) -> NodeInventory | None:
            async with slots:
                return await self.ctx.replicators.inventory(endpoint, job, node=node)

        results = await _gather(ask(ep, n) for n, ep in targets.items())
        out = []
        for node, result in zip(targets, results, strict=True):
            if isinstance(result, NodeInventory):
                out.append(result if result.node else dataclasses.replace(result, node=node))
                self.ctx.metrics.replicator_calls.labels("inventory", "ok").inc()
            elif result is None:
                self.ctx.metrics.replicator_calls.labels("inventory", "ok").inc()
            else:
                self.ctx.metrics.replicator_calls.labels("inventory", "error").inc()
                log.info("no inventory from %s: %s", node, result)
        return out

    # ------------------------------------------------------------------------------ refresh

    async def refresh(self, cluster: ClusterView) -> None:
        """Gather inventories and report the newest local, replicated and backed-up steps."""
        state = self.state
        if not self.ctx.running() or state is None or not state.nodes or self.ref is None or not self.job_id:
            return
        invs = await self._inventories(state.nodes, cluster)
        progress = tier_progress(invs)
        partners = group_partners(invs, len(state.nodes))
        if partners and partners != self.partners:
            self.partners = partners
            log.info("job %s: replica groups seen; peers prefer the nodes of other members", self.job_id)
        fields: dict[str, Any] = {
            "latestLocalStep": progress.local,
            "latestReplicatedStep": progress.replicated,
            "latestBackedUpStep": progress.backed_up,
            "inventoryTime": iso_time(time.time()),
            "inventoryNodes": f"{len(invs)}/{len(set(state.nodes))}",
        }
        if (groups := replica_groups(invs)) is not None:
            fields["replicaGroups"] = groups
        fields["overQuota"] = over = over_quota_text(invs)
        if over is None:
            self._said.pop("quota", None)
        else:
            self._event_once("quota", "Warning", "QuotaExceeded", f"not replicated, not backed up: {over}")
        redundancy = redundancy_of(invs)
        if redundancy is not None:
            fields["redundancy"] = redundancy_text(redundancy)
            since = redundancy.degraded_since
            fields["degradedSince"] = iso_time(since) if since is not None else None
            self._redundancy_changed(redundancy)
        await self._write(fields)

    def _redundancy_changed(self, redundancy: Redundancy) -> None:
        """An Event and the metric when the job goes below its replication factor or is healed again."""
        self.ctx.metrics.job_degraded(self.key, redundancy.degraded)
        was = self.status.get("degradedSince") is not None
        text = redundancy_text(redundancy)
        if redundancy.degraded and not was:
            self.ctx.metrics.redundancy_changes.labels("degraded").inc()
            self._event("Warning", "Degraded", f"below its replication factor: {text}; re-replicating")
        elif was and not redundancy.degraded:
            self.ctx.metrics.redundancy_changes.labels("healed").inc()
            self._event("Normal", "Healed", f"back at full redundancy: {text}")

    # ------------------------------------------------------------------------------ status

    async def _report_running(self, info: JobSetInfo, state: JobState) -> None:
        nodes = set(state.nodes)
        published = sum(1 for n in nodes if n in self.delivered)
        restored = self.restore.delivered(state.nodes) if self.restore else 0
        if self.restore is None:  # published by an earlier run of the operator, or not yet chosen
            restore_ok = state.restore_generation == state.generation
        else:
            restore_ok = restored == len(nodes)
        peers_ok = published == len(nodes)
        conditions = [
            condition("ConfigResolved", True, "Resolved", f"CheckpointConfiguration {info.config_name}"),
            condition("RanksAssigned", True, "Assigned", f"attempt {state.generation}: {len(nodes)} ranks"),
            condition(
                "PeersPublished",
                peers_ok,
                "Published" if peers_ok else "Pending",
                f"generation {state.peer_generation}: {published}/{len(nodes)} nodes",
            ),
            condition(
                "RestorePlanned",
                restore_ok,
                "Published" if restore_ok else "Pending",
                f"{restored}/{len(nodes)} nodes",
            ),
        ]
        if info.mode == "orbax":
            sessions = sum(1 for n in nodes if n in self.sessions)
            conditions.append(
                condition(
                    "SessionsPublished",
                    sessions == len(nodes),
                    "Published" if sessions == len(nodes) else "Pending",
                    f"Orbax sessions of attempt {state.generation}: {sessions}/{len(nodes)} nodes",
                )
            )
        ready = all(c["status"] == "True" for c in conditions)
        conditions.append(condition("Ready", ready, "Ready" if ready else "NotReady"))
        extra: dict[str, Any] = {"peersPublished": published, "ranksAssigned": len(state.nodes)}
        if self.restore is not None:
            extra["restore"] = restore_summary(self.restore.plan, restored)
        await self._report("Running" if ready else "Restoring", conditions, extra)

    async def _report(
        self, phase: str, conditions: list[dict[str, Any]], extra: dict[str, Any] | None = None
    ) -> None:
        fields: dict[str, Any] = {"phase": phase, **(extra or {})}
        if self.state is not None and self.state.generation is not None:
            fields.update(self.state.to_status())
        fields["conditions"] = merge_conditions(self.status.get("conditions"), conditions, time.time())
        await self._write(fields)

    async def _write(self, fields: dict[str, Any]) -> None:
        """Merge-patch the status fields that changed since the last write."""
        changed = {k: v for k, v in fields.items() if self.status.get(k, _MISSING) != v}
        if not changed:
            return
        if await self.ctx.kube.patch_checkpoint_job_status(*self.key, changed):
            self.status.update(changed)

    # ------------------------------------------------------------------------------ events

    def _event(self, kind: str, reason: str, message: str) -> None:
        log.info("%s/%s %s: %s", *self.key, reason, message)
        post_event(self.ref, kind, reason, message)

    def _event_once(self, topic: str, kind: str, reason: str, message: str) -> None:
        """Post an event unless the same one was the last on this topic (no repeats every round)."""
        if self._said.get(topic) != f"{reason}:{message}":
            self._said[topic] = f"{reason}:{message}"
            self._event(kind, reason, message)

    def _retry_later(self, delay: float | None = None) -> None:
        debounce = self.ctx.settings.debounce
        delay = max(debounce, delay if delay is not None else 5 * debounce)
        asyncio.get_running_loop().call_later(delay, self.wake.set)


_MISSING = object()


async def _wait_any(*aws: Awaitable[Any], timeout: float) -> None:
    """Wait until one of ``aws`` completes or ``timeout`` passes; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _digest(*parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode(), usedforsecurity=False).hexdigest()


async def _gather(calls: Iterable[Awaitable[T]]) -> list[T | BaseException]:
    """Run calls concurrently (the adapters bound concurrency), returning results or exceptions."""
    return list(await asyncio.gather(*calls, return_exceptions=True))
