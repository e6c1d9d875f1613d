"""Fetch requests from training ranks: other ranks' steps that a DCP load on this node reads.

A DCP load under another sharding (fewer or more nodes, another world size) reads chunks that ranks of
other nodes wrote. Pods cannot call this daemon's API, so a rank asks through a file it writes into its
job directory, ``<job>/requests/fetch-rank-NNNNN.json`` (a ``control.FetchRequest``: a step and the ranks
whose step it needs); the client side is ``tierckpt.dcp.fetch``.

Everything in that file is untrusted (the pod wrote it). It is read through ``safefs.Beneath`` (no link
followed, bounded size), must decode as a ``FetchRequest`` of the job whose directory holds it and of the
rank its name says, and is only acted on for a step that the job's restore plan or some node's inventory
(or the bucket's listing) names, for ranks below that step's world size. Only committed steps of that
same job are ever fetched, and only into this node's replica store.

Each missing ``(rank, step)`` is fetched once per node, however many ranks ask for it: from a peer that
holds it (its primary or a replica), else from the bucket. A request that names a DCP save
(``FetchRequest.save_id``) counts a copy as held only if its manifest names that save, and shares only
fetches of that save: a replica here of another save of the step number (the run a job left saved it)
is dropped for the save's (``discard_step``: its COMMIT first), and a copy a peer or the bucket holds
of another save is passed over for the next source. "No node holds it" is only a verdict when
every node of the job answered: while some did not (cut off, restarting), or a source failed, the
fetch makes up to ``attempts`` rounds (1 s between them, doubling to ``retry_max``), each from the
inventories gathered again, before it fails; a gather that some node did not answer is never served to
a later round or request. Progress goes to
``<job>/control/fetch-rank-NNNNN.json`` (a ``control.FetchStatus``), refreshed every ``heartbeat`` seconds
so the client waits on progress, not on a fixed timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tierckpt.protocol import leases
from tierckpt.protocol.client import ReplicatorClient
from tierckpt.protocol.control import (
    FetchRequest,
    FetchStatus,
    NodeInventory,
    PeerAssignment,
    RestorePlan,
    RestoreState,
    Tier,
    write_fetch_status,
)
from tierckpt.protocol.errors import FormatError, RetryableError, TierckptError, UnsafePathError
from tierckpt.protocol.format import (
    COMMIT_LIMIT,
    COMMIT_NAME,
    dcp_save_id,
    decode_commit,
    discard_step,
    read_manifest,
    replica_rank_dir,
)
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.backup.jobs import NO_BACKUP, BackupPort
from tierckpt_replicator.inventory import list_jobs
from tierckpt_replicator.replication.ipc import FetchSource, FetchTask, TaskProgress
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.restore.gather import gather_inventories
from tierckpt_replicator.stepio import rank_tree, step_name

__all__ = ["FetchRequests", "check_request"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20
"""A request names at most ``MAX_FETCH_RANKS`` ranks: well under this."""
MAX_REQUESTS = 256
"""Request files looked at per job and scan (one per process rank of the node, in practice)."""
INVENTORY_TTL = 1.0
"""Seconds, from its start, that a gather of the job's inventories every node answered serves further
requests; no gather starts sooner after the last (a pod cannot make this node ask its peers more often
than that, however many requests it writes)."""
_NAME_RE = re.compile(r"fetch-rank-([0-9]{5,9})\.json")


def check_request(
    request: FetchRequest,
    *,
    job: str,
    rank: int,
    plan: RestorePlan | None,
    inventories: list[NodeInventory],
) -> int:
    """The world size of the requested step, once the request is found admissible (pure).

    Refused (``FormatError``) unless it is ``job``'s request of ``rank`` (what its file name says), for a
    step the restore plan or an inventory names, whose world size is known and consistent, with every
    requested rank below it.
    """
    if request.job != job or request.rank != rank:
        raise FormatError(
            f"a request of job {request.job!r} rank {request.rank} in the file of {job!r} rank {rank}"
        )
    step = request.step
    known = {inv.world_sizes[step] for inv in inventories if step in inv.world_sizes}
    if plan is not None and plan.step == step and plan.world_size > 0:
        known.add(plan.world_size)
    named = (plan is not None and plan.step == step) or any(
        step in inv.gcs or any(step in h.local or step in h.replica for h in inv.ranks.values())
        for inv in inventories
    )
    if not named:
        raise FormatError(f"step {step} is neither the restore plan's nor held by any node of job {job}")
    if len(known) != 1:
        raise FormatError(f"the world size of step {step} is {'unknown' if not known else sorted(known)}")
    world = known.pop()
    bad = [r for r in request.ranks if r >= world]
    if bad:
        raise FormatError(f"ranks {bad[:5]} do not exist in step {step} (world size {world})")
    return world


@dataclasses.dataclass(frozen=True)
class _Gathered:
    """One gather of a job's inventories: when it started, and the assigned nodes that did not answer."""

    started: float
    inventories: list[NodeInventory]
    unknown: tuple[str, ...]


@dataclasses.dataclass
class _Fetch:
    """One ``(rank, step)`` of one save being brought to this node, shared by every request that needs it."""

    done: int = 0
    total: int = 0
    task: asyncio.Task[Tier] | None = None


class FetchRequests:
    """Reads the request files of every job on each ``scan()`` and serves each new request once."""

    def __init__(
        self,
        *,
        root: Path,
        node: str,
        assignments: AssignmentStore,
        supervisor: WorkerSupervisor,
        peers: ReplicatorClient,
        own_inventory: Callable[[str], Awaitable[NodeInventory]],
        plan_of: Callable[[str], RestorePlan | None],
        backup: BackupPort = NO_BACKUP,
        heartbeat: float = 1.0,
        attempts: int = 1,
        backoff: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        self.root, self.node, self.assignments, self.supervisor = root, node, assignments, supervisor
        self.peers, self.own_inventory, self.plan_of, self.backup = peers, own_inventory, plan_of, backup
        self.heartbeat, self.attempts, self.backoff, self.retry_max = heartbeat, attempts, backoff, retry_max
        self._seen: dict[tuple[str, int], str] = {}
        self._serving: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._fetches: dict[tuple[str, int, int, str], _Fetch] = {}
        """(job, rank, step, save_id) -> its fetch in flight."""
        self._refused: set[tuple[str, str]] = set()
        self._gathered: dict[str, _Gathered] = {}
        self._gathering: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ scanning

    async def scan(self) -> None:
        """Start serving every request file not seen before (cheap: a listing per job)."""
        for job in list_jobs(self.root):
            try:
                with Beneath.open(self.root, job) as tree:
                    names = sorted(n for n in tree.listdir("requests") if _NAME_RE.fullmatch(n))[
                        :MAX_REQUESTS
                    ]
                    found = {name: self._read(tree, job, name) for name in names}
            except (OSError, UnsafePathError) as exc:
                log.warning("job %s: cannot read its requests: %s", job, exc)
                continue
            present = set()
            for name, request in found.items():
                if request is None:
                    continue
                key = (job, request.rank)
                present.add(key)
                if self._seen.get(key) != request.id:
                    self._seen[key] = request.id
                    old = self._serving.pop(key, None)
                    if old is not None:
                        old.cancel()
                    self._serving[key] = asyncio.create_task(
                        self._serve(job, request), name=f"fetch-{job}-{name}"
                    )
            for key in [k for k in self._seen if k[0] == job and k not in present]:
                self._seen.pop(key)  # answered and removed by the client

    def _read(self, tree: Beneath, job: str, name: str) -> FetchRequest | None:
        m = _NAME_RE.fullmatch(name)
        assert m is not None
        try:
            request = FetchRequest.from_bytes(tree.read_bytes(f"requests/{name}", limit=MAX_REQUEST_BYTES))
            if request.job != job or request.rank != int(m.group(1)):
                raise FormatError(f"names job {request.job!r} rank {request.rank}")
        except (OSError, FormatError, UnsafePathError) as exc:
            if (job, f"{name}:{exc}") not in self._refused:  # log each bad file once
                self._refused.add((job, f"{name}:{exc}"))
                log.warning("job %s: ignoring request %s: %s", job, name, exc)
            return None
        return request

    async def forget(self, job: str) -> None:
        """Stop serving ``job``'s requests (the job is being purged). Returns once they have ended, so
        none of their status writes (which create the job's directory) comes after the purge."""
        stopped: list[asyncio.Task[Any]] = [
            self._serving.pop(k) for k in [k for k in self._serving if k[0] == job]
        ]
        for key in [k for k in self._fetches if k[0] == job]:
            fetch = self._fetches.pop(key).task
            if fetch is not None:
                stopped.append(fetch)
        for task in stopped:
            task.cancel()
        if stopped:
            await asyncio.wait(stopped)
        self._seen = {k: v for k, v in self._seen.items() if k[0] != job}
        self._gathered.pop(job, None)

    async def close(self) -> None:
        tasks = [*self._serving.values(), *(f.task for f in self._fetches.values() if f.task is not None)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ serving one request

    async def _serve(self, job: str, request: FetchRequest) -> None:
        current = FetchStatus(job, request.rank, request.id, request.step, RestoreState.STAGING)

        def publish(status: FetchStatus) -> None:
            nonlocal current
            current = dataclasses.replace(status, updated_at=time.time())
            self._write(job, current)

        publish(current)
        beat = asyncio.create_task(self._heartbeat(lambda: current, publish))
        try:
            final = await self._answer(job, request, publish)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: the client must still learn that the request failed
            log.exception("job %s: serving the request of rank %d failed", job, request.rank)
            final = dataclasses.replace(
                current, state=RestoreState.FAILED, message=f"replicator error: {exc!r}"
            )
        finally:
            beat.cancel()
        publish(final)

    async def _answer(
        self, job: str, request: FetchRequest, progress: Callable[[FetchStatus], None]
    ) -> FetchStatus:
        base = FetchStatus(job, request.rank, request.id, request.step, RestoreState.STAGING)
        gathered = await self._inventories(job)
        inventories = gathered.inventories
        try:
            check_request(
                request, job=job, rank=request.rank, plan=self.plan_of(job), inventories=inventories
            )
        except FormatError as exc:
            log.warning("job %s: refusing the fetch request of rank %d: %s", job, request.rank, exc)
            return dataclasses.replace(base, state=RestoreState.FAILED, message=f"refused: {exc}")
        step = request.step
        fetches = {}
        for rank in request.ranks:
            key = (job, rank, step, request.save_id)
            fetch = self._fetches.get(key)  # one in flight: share it
            if fetch is None:
                fetch = _Fetch()
                fetch.task = asyncio.create_task(
                    self._fetch(job, rank, step, request.save_id, fetch, gathered)
                )
                fetch.task.add_done_callback(functools.partial(self._finished, key, fetch))
                self._fetches[key] = fetch
            fetches[rank] = fetch
        log.info(
            "job %s: rank %d needs step %d of ranks %s on this node",
            job,
            request.rank,
            step,
            list(request.ranks),
        )
        pending = {f.task for f in fetches.values() if f.task is not None}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=self.heartbeat)
            progress(
                dataclasses.replace(
                    base,
                    bytes_done=sum(f.done for f in fetches.values()),
                    bytes_total=sum(f.total for f in fetches.values()),
                )
            )
        sources: dict[int, Tier] = {}
        failures = []
        for rank, fetch in fetches.items():
            assert fetch.task is not None
            try:
                sources[rank] = fetch.task.result()
            except (TierckptError, RetryableError, OSError) as exc:
                failures.append(f"rank {rank}: {exc}")
        done = dataclasses.replace(
            base,
            bytes_done=sum(f.done for f in fetches.values()),
            bytes_total=sum(f.total for f in fetches.values()),
            sources=sources,
        )
        if failures:
            return dataclasses.replace(done, state=RestoreState.FAILED, message="; ".join(failures))
        moved = sorted(r for r, t in sources.items() if t != Tier.LOCAL)
        return dataclasses.replace(
            done, state=RestoreState.READY, message=f"fetched ranks {moved}" if moved else "all here already"
        )

    async def _inventories(self, job: str) -> _Gathered:
        """Every node's inventory of ``job``, gathered at most once per ``INVENTORY_TTL``.

        A gather serves later callers only if every assigned node answered, and only for
        ``INVENTORY_TTL`` from its start (one that waited out a timeout is already old). After one that
        some node did not answer, the next waits out the rest of the TTL and asks every node again: a
        node cut off a moment ago may answer now, and holds what the fetch needs.
        """
        lock = self._gathering.setdefault(job, asyncio.Lock())
        async with lock:
            cached = self._gathered.get(job)
            if cached is not None:
                age = time.monotonic() - cached.started
                if age < INVENTORY_TTL:
                    if not cached.unknown:
                        return cached
                    await asyncio.sleep(INVENTORY_TTL - age)
            assignment = self.assignments.get(job)
            started = time.monotonic()
            found = await gather_inventories(await self.own_inventory(job), assignment, self.peers)
            expected = set(assignment.nodes) if assignment is not None else set()
            gathered = _Gathered(started, found, tuple(sorted(expected - {inv.node for inv in found})))
            self._gathered[job] = gathered
            return gathered

    def _finished(self, key: tuple[str, int, int, str], fetch: _Fetch, _task: object = None) -> None:
        if self._fetches.get(key) is fetch:  # a later request checks again what is here
            del self._fetches[key]

    async def _fetch(
        self, job: str, rank: int, step: int, save_id: str, fetch: _Fetch, gathered: _Gathered
    ) -> Tier:
        """Bring ``rank``'s ``step`` (of DCP save ``save_id``, if one is named) here, in up to
        ``attempts`` rounds, the first from ``gathered``, each later one from the inventories gathered
        again; a round that finds no holder while every node answered is the last."""
        for attempt in range(1, self.attempts + 1):
            if _held(self.root, job, rank, step, save_id):
                return Tier.LOCAL
            if attempt > 1:
                gathered = await self._inventories(job)
            sources = _sources(rank, step, gathered.inventories, self.assignments.get(job), self.node)
            in_bucket = any(step in inv.gcs for inv in gathered.inventories)
            try:
                return await self._fetch_once(job, rank, step, save_id, sources, in_bucket, fetch)
            except RetryableError as exc:
                unknown = gathered.unknown
                why = f"{exc} (holdings of {', '.join(unknown)} unknown)" if unknown else str(exc)
                if (not unknown and not sources and not in_bucket) or attempt == self.attempts:
                    raise RetryableError(why) from exc
                wait = min(self.backoff * 2 ** (attempt - 1), self.retry_max)
                log.warning(
                    "job %s: rank %d step %d, attempt %d: %s; asking again in %.0f s",
                    job,
                    rank,
                    step,
                    attempt,
                    why,
                    wait,
                )
                await asyncio.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _fetch_once(
        self,
        job: str,
        rank: int,
        step: int,
        save_id: str,
        sources: tuple[FetchSource, ...],
        in_bucket: bool,
        fetch: _Fetch,
    ) -> Tier:
        """One round: a peer that holds it, else the bucket; with a ``save_id``, only a copy of that save
        (the worker passes over a peer's copy of another save; what arrives is checked here)."""
        reasons = []
        if save_id:
            _drop_other_save(self.root, job, rank, step, save_id)
        if sources:
            task = FetchTask(
                id=self.supervisor.next_id(),
                job=job,
                rank=rank,
                step=step,
                sources=sources,
                into="replica",
                save_id=save_id,
            )

            def progress(p: TaskProgress) -> None:
                fetch.done, fetch.total = p.bytes_done, p.bytes_total

            try:
                result = await self.supervisor.run_task(task, progress)
            except RetryableError as exc:
                result = None
                reasons.append(str(exc))
            if result is not None and result.ok:
                node = result.outcomes[-1].node
                if not save_id or _held(self.root, job, rank, step, save_id):  # checked, not taken on trust
                    log.info("job %s: rank %d step %d fetched from %s", job, rank, step, node)
                    return Tier.LOCAL if result.outcomes[-1].status == "already" else Tier.PEER
                reasons.append(f"{node}: the copy it gave is not of save {save_id}")
            elif result is not None:
                reasons.extend(f"{o.node}: {o.status} {o.message}".strip() for o in result.outcomes)
        if in_bucket:

            def on_bytes(done: int) -> None:
                fetch.done = done

            try:
                await self.backup.fetch_rank(
                    job, step, rank, replica_rank_dir(self.root, job, rank), on_bytes
                )
            except (TierckptError, OSError) as exc:
                reasons.append(f"bucket: {exc}")
            else:
                if _held(self.root, job, rank, step, save_id):
                    log.info("job %s: rank %d step %d fetched from the bucket", job, rank, step)
                    return Tier.GCS
                reasons.append(
                    f"bucket: it holds another save of the step, not {save_id}"
                    if _held(self.root, job, rank, step)
                    else "bucket: the fetch returned without a committed step"
                )
        raise RetryableError("; ".join(reasons) or "no node holds it and it is not in the bucket")

    # ------------------------------------------------------------------ status files

    async def _heartbeat(
        self, current: Callable[[], FetchStatus], publish: Callable[[FetchStatus], None]
    ) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            publish(current())

    def _write(self, job: str, status: FetchStatus) -> None:
        try:
            with Beneath.open(self.root, job) as tree:
                write_fetch_status(tree, status)
        except (OSError, UnsafePathError) as exc:  # a full ramdisk or a planted link: the next write retries
            log.warning("job %s: cannot write the fetch status of rank %d: %s", job, status.rank, exc)


def _held(root: Path, job: str, rank: int, step: int, save_id: str = "") -> bool:
    """Whether ``rank``'s ``step`` is committed on this node (primary or replica), and with a
    ``save_id``, whether that copy's manifest names that DCP save; read without following any link the
    pod may have planted in its job tree, manifests bounded (``read_manifest``)."""
    name = f"rank-{rank:05d}/step-{step:012d}"
    try:
        with Beneath.open(root, job) as tree:
            for rel in (name, f"replicas/{name}"):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError, FormatError, UnsafePathError):
                    where = f"{rel}/{COMMIT_NAME}"
                    marker = decode_commit(tree.read_bytes(where, limit=COMMIT_LIMIT), where)
                    if (marker.job, marker.rank, marker.step) != (job, rank, step):
                        continue
                    if not save_id or dcp_save_id(read_manifest(tree.at(rel))) == save_id:
                        return True
    except (OSError, UnsafePathError):
        return False
    return False


def _drop_other_save(root: Path, job: str, rank: int, step: int, save_id: str) -> None:
    """Discard this node's replica of ``rank``'s ``step`` unless it is a copy of DCP save ``save_id``
    (another save of the step number, or torn), so the save's can be committed in its place: its COMMIT
    first (``discard_step``), so a crash leaves no step rather than a torn one. Never while it is leased
    (being read or sent): ``RetryableError``. A primary of another save is left to its rank."""
    with Beneath.open(root, job) as tree:
        parent = rank_tree(tree, "replica", rank)
        if not parent.exists(step_name(step)) or _held(root, job, rank, step, save_id):
            return
        with leases.lock(parent):
            if step in leases.leased_steps(parent):
                raise RetryableError(f"another save of step {step} of rank {rank} is being read here")
            discard_step(parent.at(step_name(step)))
    log.info(
        "job %s: dropped this node's replica of rank %d step %d (not of save %s)", job, rank, step, save_id
    )


def _sources(
    rank: int, step: int, inventories: list[NodeInventory], assignment: PeerAssignment | None, node: str
) -> tuple[FetchSource, ...]:
    """Peers holding ``rank``'s ``step``: primary holders first, then replica holders (by node name)."""
    if assignment is None:
        return ()
    primary, replica = [], []
    for inv in sorted(inventories, key=lambda i: i.node):
        h = inv.ranks.get(rank)
        if h is None or inv.node == node or inv.node not in assignment.nodes:
            continue
        if step in h.local:
            primary.append(inv.node)
        elif step in h.replica:
            replica.append(inv.node)
    return tuple(FetchSource.peer(assignment, name) for name in primary + replica)
