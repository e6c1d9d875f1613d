"""``Checkpointer``: save a state dict to the node's ramdisk in the time of one memory copy; load it back.

It orchestrates and touches no bytes itself: ``snapshot.flatten`` turns the state into a tree and
tensors, ``snapshot.layout`` places them, ``snapshot.pool`` hands out pre-faulted (and CUDA-pinned)
data files and prepares the next ones in the background, ``snapshot.copy`` fills them (or, with device
staging, ``snapshot.devstage``), and a background thread checksums and commits (``snapshot.commit``),
then applies retention and recycles the retired step's files for the next save
(``snapshot.rankdir``). Loading goes the other way (``snapshot.loader``, ``snapshot.restore``), after
any replicator finished staging (``snapshot.restore_wait``) and the ranks agreed on a step
(``snapshot.agree``).

With a replica group (``replica_group``), every save first agrees with the other members on their
fingerprints (``replica_group``); a member that does not write for its node then commits by linking the
writer's files (``snapshot.linked``) instead of copying, and ``load(broadcast=True)`` reads on one
member and broadcasts (``snapshot.fanout``).

API and semantics: docs/client.md. On-disk format: docs/format.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestoreStatus
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    ReplicaDivergenceError,
    SaveInProgressError,
    StateMismatchError,
)
from tierckpt.protocol.format import (
    CommitMarker,
    FileEntry,
    TensorEntry,
    discard_step,
    job_dir,
    rank_dir,
    step_dir,
)
from tierckpt.protocol.replica import REPLICA_VERSION, ReplicaRecord, content_key
from tierckpt.replica_group import BUSY, FAILED, LEASED, Agreement, Membership, ReplicaGroup
from tierckpt.settings import BusyPolicy, Settings, resolve
from tierckpt.snapshot import agree, loader, rankdir, restore_wait, stateful
from tierckpt.snapshot import objects as pickled
from tierckpt.snapshot.commit import RecordFor, StepIdentity, commit_files
from tierckpt.snapshot.copy import copy_cpu, copy_into
from tierckpt.snapshot.devstage import DeviceStager, Speculation, StagedSave
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.fanout import load_broadcast
from tierckpt.snapshot.fingerprint import structure_digest
from tierckpt.snapshot.flatten import FlatState, flatten
from tierckpt.snapshot.handle import SaveHandle
from tierckpt.snapshot.layout import LayoutPlan, TensorSpec, plan_layout
from tierckpt.snapshot.linked import commit_linked
from tierckpt.snapshot.packing import SavePacker, pack_groups
from tierckpt.snapshot.pool import Slot, SlotPool
from tierckpt.snapshot.rankdir import WRITER_LOCK

__all__ = ["WRITER_LOCK", "Checkpointer"]

log = logging.getLogger(__name__)

_PLAN_CACHE = 4
_MISMATCH = "mismatch"
_CPU_COPY_LIMIT = 64 << 20
"""A device-staged save copies its CPU tensors aside (and leaves the slot to the commit thread) up to this
many bytes; beyond it, it takes the slot and copies them into it before returning."""


def _cpu_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_cuda)


def _outcome(error: BaseException | None) -> str | None:
    """What a rank tells the others about its load: None (loaded), a mismatch, or a failure."""
    if error is None:
        return None
    return _MISMATCH if isinstance(error, StateMismatchError) else "failed"


@dataclasses.dataclass
class _SaveJob:
    """One save between the training thread and the commit thread."""

    step: int
    path: Path
    slot: Slot | None
    """None while a device-staged save waits for the commit thread to take its slot."""
    plan: LayoutPlan
    flat: FlatState
    objects: bytes | None
    handle: SaveHandle
    deferred_cpu: list[int]
    """Indices of CPU tensors the commit thread copies (overlap mode)."""
    tickets: list[cuda.CopyTicket]
    protected: set[int] = dataclasses.field(default_factory=set)
    """Storages that only a registered optimizer's step mutates (overlap mode copies them later)."""
    deferred_ticket: cuda.CopyTicket | None = None
    staged: StagedSave | None = None
    """Device staging: its copies; the optimizer hook waits for ``staged.release`` only."""
    cpu_copies: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    """Device staging without a slot yet: copies of the CPU tensors, written into the slot later."""
    source: dict[Any, Any] | None = None
    """The state dict saved (kept until committed, to bind it for a later load into it)."""
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once every tensor's bytes are in the mapping (or the save failed)."""
    handed_over: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Device staging: set once the staging buffer's drain is issued (or the save failed): the next
    snapshot can then be ordered after it on the GPU, with no wait on the CPU."""
    started: float = dataclasses.field(default_factory=time.perf_counter)
    record: RecordFor | None = None
    """Replica groups: builds the step's replica record."""


@dataclasses.dataclass
class _LinkedJob:
    """A replica-group save committed by linking the node writer's files (nothing to copy)."""

    step: int
    path: Path
    source: int
    fingerprint: str
    keys: tuple[str, ...]
    tree: Any
    object_count: int
    objects: bytes | None
    record: RecordFor
    handle: SaveHandle
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the source member reports that its save of this step failed."""


class Checkpointer:
    """Per-rank checkpoints in node RAM: fast asynchronous ``save``, verified in-place ``load``.

    Arguments left as None come from the environment the operator injects (``TIERCKPT_ROOT``,
    ``TIERCKPT_JOB``, ``TIERCKPT_RANK``, ``TIERCKPT_WORLD_SIZE``), then torch.distributed, then
    torchrun's ``RANK``/``WORLD_SIZE``, then rank 0 of 1. Other options: see ``settings.Settings``.
    Holds an exclusive lock on its rank directory until ``close()``.

    ``replica_group``: the ranks holding the same tensors as this one (a list of ranks, or a
    ``ReplicaGroup``, e.g. ``replica_group_from_mesh(mesh, "replicate")``). Its members construct their
    Checkpointers together and save the same steps together; on each node one of them writes, the
    others link its files (docs/client.md, "Replica groups").
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        keep: int = 2,
        on_busy: BusyPolicy = "wait",
        overlap: bool = False,
        replica_group: ReplicaGroup | Sequence[int] | None = None,
        **options: Any,
    ) -> None:
        self.settings: Settings = resolve(
            root=root,
            job=job,
            rank=rank,
            world_size=world_size,
            keep=keep,
            on_busy=on_busy,
            overlap=overlap,
            **options,
        )
        s = self.settings
        self.rank_path = rank_dir(s.root, s.job, s.rank)
        self.rank_path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = rankdir.lock_writer(self.rank_path, s.writer_lock_timeout)
        self._closed = False
        self._pool = SlotPool(self.rank_path, target=s.keep + 1)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-commit")
        self._inflight: _SaveJob | None = None
        self._linking: _LinkedJob | None = None
        self._last: SaveHandle | None = None
        """The newest save that was not skipped (what ``wait`` waits for)."""
        self._last_failed = -1
        """The newest step whose save failed (replica groups tell the other members)."""
        self._last_save: dict[str, Any] = {}
        self._structure: tuple[LayoutPlan, int] | None = None
        self._group: Membership | None = None
        self._plans: collections.OrderedDict[tuple[Any, ...], LayoutPlan] = collections.OrderedDict()
        self._last_plan: tuple[tuple[Any, ...], LayoutPlan] | None = None
        self._manifests = loader.ManifestCache(capacity=s.keep + 2)
        self._loader = loader.StepLoader(s, self._pool, self._manifests)
        self._packer = SavePacker()
        self._stager = DeviceStager(s.device_budget) if s.device_staging is not False else None
        """Device staging (on unless ``device_staging=False``); it only acts on CUDA tensors."""
        self._registering: concurrent.futures.Future[None] | None = None
        self._planned_slots = False  # the pool was given a layout to prepare (prepare() or a save)
        """The pool's last warm-up (preparing and pinning slots in the background)."""
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._warned_overlap = False
        self._bound_first: weakref.ref[torch.Tensor] | None = None
        try:
            if replica_group is not None:
                self._group = Membership.resolve(
                    ReplicaGroup.of(replica_group),
                    rank=s.rank,
                    world_size=s.world_size,
                    job_path=job_dir(s.root, s.job),
                    rank_path_of=lambda r: rank_dir(s.root, s.job, r),
                )
                if not self._group.writer:
                    self._pool.target = 0  # its steps link the node writer's files: no slots of its own
            rankdir.clean_up_after_crash(self.rank_path, s.keep, self._pool, self._restore_status())
            if cuda.in_use():
                self._pool.use_cuda(cuda.current_device())
            self._registering = self._pool.warm(None)  # adopted spares: page tables and pinning, off-thread
        except BaseException:
            self._release()
            raise
        log.info("checkpointer for job %s rank %d/%d at %s", s.job, s.rank, s.world_size, self.rank_path)

    # ------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the save in flight, stop the commit thread, unmap everything, release the lock.

        Files stay on disk: committed steps remain loadable, spares are adopted by the next writer.
        """
        if self._closed:
            return
        try:
            self.wait()
        except Exception as exc:  # already reported through its handle and the log
            log.debug("last save failed: %s", exc)
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._pool.stop_building()
        self._executor.shutdown(wait=True)
        for handles in self._optimizers.values():
            for handle in handles:
                handle.remove()
        self._optimizers.clear()
        self._pool.close()
        self._packer.close()
        if self._stager is not None:
            self._stager.close()
        self._loader.staging.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    @property
    def _overlapping(self) -> bool:
        """Whether saves may return before optimizer-owned tensors are copied (overlap, device staging)."""
        return self.settings.overlap or self._stager is not None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")

    def _restore_status(self) -> RestoreStatus | None:
        """The replicator's restore status of this rank: retention keeps the step it stages."""
        s = self.settings
        return restore_wait.current_status(s.root, s.job, s.rank)

    # ------------------------------------------------------------------------------- queries

    def committed_steps(self) -> list[int]:
        """This rank's committed steps on the ramdisk, oldest first."""
        return sorted(rankdir.scan_steps(self.rank_path).committed)

    def latest_step(self) -> int | None:
        """This rank's newest committed step (no collective; ``load`` is what agrees across ranks)."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------------------- save

    def save(self, step: int, state_dict: dict[Any, Any], *, blocking: bool = False) -> SaveHandle:
        """Snapshot ``state_dict`` as ``step``; returns once training may change it again.

        Checksums, sync and commit continue in the background (``handle.wait()`` or
        ``blocking=True`` waits for them). At most one save is in flight; another one arriving
        meanwhile waits, is skipped or raises, per ``on_busy``.

        In a replica group, a collective over the group: the members compare fingerprints, and a
        member that links its node writer's files returns without copying anything. Members whose
        tensors differ each write their own copy; with ``on_divergence="raise"``, ``save`` then raises
        ``ReplicaDivergenceError`` after the snapshot (the save still commits: ``wait()``).
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        state_dict = self._expand(state_dict).state
        divergence: ReplicaDivergenceError | None = None
        if self._group is None:
            handle = self._save_alone(step, state_dict)
        else:
            handle, divergence = self._save_in_group(self._group, step, state_dict)
        if blocking:
            handle.wait()
        if divergence is not None:
            raise divergence
        return handle

    def _expand(self, state_dict: dict[Any, Any], *, for_load: bool = False) -> stateful.Expanded:
        """``state_dict`` with its stateful values (modules, optimizers...) as their state dicts; the
        optimizers among them are registered (overlap mode and device staging never wait for them)."""
        expanded = stateful.expand(state_dict, for_load=for_load)
        for optimizer in expanded.optimizers:
            self.register_optimizer(optimizer)
        return expanded

    def _save_alone(self, step: int, state_dict: dict[Any, Any]) -> SaveHandle:
        refused = self._admit(step)
        if refused is not None:
            return refused
        # The GPU copies the last save's tensors while this one is flattened and planned.
        speculation = self._stager.speculate() if self._stager is not None else None
        flat = flatten(state_dict)
        protected = self._protected() if self._overlapping else set()
        plan = self._plan(flat, protected)
        refused = self._make_room(step)
        if refused is not None:
            return refused
        return self._start(step, state_dict, flat, plan, protected, speculation=speculation)

    def _start(
        self,
        step: int,
        state_dict: dict[Any, Any],
        flat: FlatState,
        plan: LayoutPlan,
        protected: set[int],
        record: RecordFor | None = None,
        speculation: Speculation | None = None,
    ) -> SaveHandle:
        """Start copying ``flat`` (into a slot, or a device-staged snapshot); the commit thread finishes."""
        objects = pickled.dumps(list(flat.objects)) if flat.objects else None
        self._use_cuda(flat)
        path = step_dir(self.rank_path, step)
        staged = self._staged_save(flat, plan, protected, speculation)
        job = _SaveJob(step, path, None, plan, flat, objects, SaveHandle(step), [], [], protected)
        job.source, job.staged, job.record = state_dict, staged, record
        try:
            if staged is None or staged.needs_host or _cpu_bytes(flat.tensors) > _CPU_COPY_LIMIT:
                job.slot = self._pool.take(step, plan)  # else the commit thread takes it
            if staged is not None:
                self._start_device_copies(job, staged)
            else:
                self._start_copies(job)
        except BaseException:
            self._last_failed = step
            for ticket in job.tickets:  # nothing may still be writing into the slot
                with contextlib.suppress(Exception):
                    ticket.synchronize()
            if job.slot is not None:
                self._pool.forget(job.slot)
            discard_step(path)
            raise
        self._inflight = job
        self._last = job.handle
        waits = job.deferred_cpu or job.deferred_ticket is not None or (staged and staged.release.events)
        if not waits:
            job.handle._set_snapshot()
        self._registering = self._pool.warm(plan)  # spares for the next saves, off the training thread
        self._planned_slots = True
        self._executor.submit(self._finish, job)
        nbytes = sum(f.size for f in plan.files) + len(objects or b"")
        self._last_save = {"step": step, "role": "writer", "written_bytes": nbytes, "logical_bytes": nbytes}
        return job.handle

    def _staged_save(
        self, flat: FlatState, plan: LayoutPlan, protected: set[int], speculation: Speculation | None
    ) -> StagedSave | None:
        """The device-staged snapshot of this save's CUDA tensors (None without device staging or CUDA)."""
        if self._stager is None or not any(t.is_cuda for t in flat.tensors):
            return None
        if not protected and not self._warned_overlap and self.settings.device_staging:
            log.info(
                "device staging without a registered optimizer: CUDA tensors the budget cannot stage are "
                "copied before save returns"
            )
            self._warned_overlap = True
        flags = [t.untyped_storage().data_ptr() in protected for t in flat.tensors] if protected else None
        return self._stager.plan(plan, flat.tensors, flags or [False] * len(flat.tensors), speculation)

    # ------------------------------------------------------------------------------- replica groups

    def _save_in_group(
        self, group: Membership, step: int, state_dict: dict[Any, Any]
    ) -> tuple[SaveHandle, ReplicaDivergenceError | None]:
        """Agree with the other members, then write (or link) this rank's copy of ``step``.

        An error before the exchange is still taken to it (as a refusal), then raised: the other members
        skip the save instead of waiting in the collective."""
        error: Exception | None = None
        flat, plan, protected = None, None, set()
        try:
            refusal = self._busy_refusal()
            flat = flatten(state_dict)
            protected = self._protected() if self._overlapping else set()
            plan = self._plan(flat, protected)
            if not refusal:
                # Replacing an existing step retires it now, even if another member then refuses the save.
                reason = rankdir.make_room(self.rank_path, step, self._pool)
                if reason is not None:
                    log.warning("step %d: %s", step, reason)
                    refusal = LEASED
        except Exception as exc:
            error, refusal = exc, FAILED
        agreement = group.agree(
            flat.keys if flat is not None else (),
            flat.tensors if flat is not None else (),
            structure=self._structure_of(plan, flat) if plan is not None and flat is not None else 0,
            refusal=refusal,
            last_failed=self._last_failed,
        )
        if error is not None:
            raise error
        assert flat is not None and plan is not None
        self._settle_link(agreement)
        if agreement.refused:
            reason = f"replica group {group.id} skips step {step}: {agreement.refusal_text()}"
            if self.settings.on_busy == "error":
                raise SaveInProgressError(reason)
            log.info("skipped the save of step %d: %s", step, reason)
            return SaveHandle.skipped_save(step, reason), None
        divergence = self._report_divergence(group, step, agreement) if agreement.diverged else None
        record = self._record_for(group, agreement)
        if agreement.source is None:
            handle = self._start(step, state_dict, flat, plan, protected, record=record)
        else:
            handle = self._start_linked(step, flat, plan, agreement, record)
        self._last_save.update(
            group=group.id,
            source=self.settings.rank if agreement.source is None else agreement.source,
            diverged=agreement.diverged,
            fingerprint_s=agreement.fingerprint_s,
            exchange_s=agreement.exchange_s,
        )
        return handle, divergence

    def _busy_refusal(self) -> int:
        """``BUSY`` when the previous save still commits and ``on_busy`` does not wait (0 otherwise).

        Decided by the group together: one member skipping alone would leave the others waiting."""
        job = self._inflight
        if job is None or job.handle.done():
            return 0
        if self.settings.on_busy == "wait":
            with contextlib.suppress(Exception):  # its failure belongs to its own handle
                job.handle.wait()
            return 0
        return BUSY

    def _structure_of(self, plan: LayoutPlan, flat: FlatState) -> int:
        """The structure hash of the fingerprint, once per plan (the same plan: the same keys and shapes)."""
        if self._structure is None or self._structure[0] is not plan:
            self._structure = (plan, structure_digest(flat.keys, flat.tensors))
        return self._structure[1]

    def _settle_link(self, agreement: Agreement) -> None:
        """Before a new save: finish the previous linked save (abandoned if its source reported its save
        of that step failed; the source, having waited for its own commit, knows by now)."""
        job = self._linking
        if job is None or job.handle.done():
            return
        if agreement.failed.get(job.source) == job.step:
            job.cancelled.set()
        with contextlib.suppress(Exception):
            job.handle.wait()

    def _record_for(self, group: Membership, agreement: Agreement) -> RecordFor:
        source, rank = agreement.source, self.settings.rank

        def record(
            files: tuple[FileEntry, ...], tensors: tuple[TensorEntry, ...], linked: int
        ) -> ReplicaRecord:
            total = sum(f.size for f in files)
            return ReplicaRecord(
                version=REPLICA_VERSION,
                group=group.id,
                members=group.group.members,
                role="writer" if source is None else "linked",
                source=rank if source is None else source,
                node=group.node,
                fingerprint=agreement.fingerprint,
                diverged=agreement.diverged,
                differs=agreement.differs,
                content=content_key(files, tensors),
                written_bytes=total - linked,
                logical_bytes=total,
            )

        return record

    def _report_divergence(
        self, group: Membership, step: int, agreement: Agreement
    ) -> ReplicaDivergenceError | None:
        classes = " | ".join(str(list(c)) for c in agreement.classes)
        named = "; ".join(
            f"rank {m} differs in {', '.join(keys)}" for m, keys in sorted(agreement.differing_keys.items())
        )
        message = (
            f"replica group {group.id}: the members' tensors differ at step {step} (equal fingerprints: "
            f"{classes}){': ' + named if named else ''}; every member keeps its own copy. A replica that "
            "drifted apart is a training bug (a missed gradient all-reduce, a rank-dependent update)"
        )
        log.error("rank %d: %s", self.settings.rank, message)
        if self.settings.on_divergence == "raise":
            return ReplicaDivergenceError(message, step=step, differs=agreement.differs)
        return None

    def _start_linked(
        self, step: int, flat: FlatState, plan: LayoutPlan, agreement: Agreement, record: RecordFor
    ) -> SaveHandle:
        """A follower's save: nothing to copy, the commit thread links the node writer's files."""
        assert agreement.source is not None
        objects = pickled.dumps(list(flat.objects)) if flat.objects else None
        handle = SaveHandle(step)
        handle._set_snapshot()  # training may go on at once: no byte of the state is read any more
        job = _LinkedJob(
            step,
            step_dir(self.rank_path, step),
            agreement.source,
            agreement.fingerprint,
            flat.keys,
            flat.tree,
            len(flat.objects),
            objects,
            record,
            handle,
        )
        self._linking = job
        self._last = handle
        self._executor.submit(self._finish_linked, job)
        logical = sum(f.size for f in plan.files) + len(objects or b"")
        self._last_save = {
            "step": step,
            "role": "linked",
            "written_bytes": len(objects or b""),
            "logical_bytes": logical,
        }
        return handle

    def _finish_linked(self, job: _LinkedJob) -> None:
        """Commit thread: wait for the source member's commit, link its files, commit this rank's step."""
        s = self.settings
        try:
            committed = commit_linked(
                job.path,
                StepIdentity(s.job, s.rank, s.world_size, job.step),
                step_dir(rank_dir(s.root, s.job, job.source), job.step),
                fingerprint=job.fingerprint,
                keys=job.keys,
                tree=job.tree,
                objects=job.objects,
                object_count=job.object_count,
                record=job.record,
                timeout=s.replica_timeout,
                cancelled=job.cancelled,
            )
            self._manifests.remember(committed.manifest, committed.marker)
            rankdir.apply_retention(self.rank_path, s.keep, self._pool, job.step, self._restore_status())
        except BaseException as exc:
            self._last_failed = job.step
            log.error("save of step %d failed, nothing was committed: %s", job.step, exc)
            with contextlib.suppress(Exception):
                discard_step(job.path)
            job.handle._set_failed(exc)
            return
        log.debug("step %d committed by linking the files of rank %d", job.step, job.source)
        job.handle._set_committed(committed.marker)

    def _use_cuda(self, flat: FlatState) -> None:
        """From the first CUDA tensor on, every slot is pinned (in this thread's device context)."""
        if not self._pool.register_cuda and any(cuda.is_cuda(t) for t in flat.tensors):
            self._pool.use_cuda(cuda.current_device())

    def _admit(self, step: int) -> SaveHandle | None:
        """None when ``step`` may be saved now (after waiting, per ``on_busy``), else its skipped handle.

        Busy means the save in flight still needs what the next one would take: its slot being committed,
        or, device-staged, its staging buffer not yet handed to the drain (once it is, the next snapshot
        is ordered after the drain on the GPU, and the commits follow one another on the commit thread)."""
        job = self._inflight
        if job is None or (job.handed_over.is_set() if job.staged is not None else job.handle.done()):
            return None
        policy = self.settings.on_busy
        if policy == "skip":
            reason = f"step {job.step} is still committing"
            log.info("skipped the save of step %d: %s", step, reason)
            return SaveHandle.skipped_save(step, reason)
        if policy == "error":
            raise SaveInProgressError(f"cannot save step {step}: step {job.step} is still committing")
        if job.staged is not None:
            job.handed_over.wait()
        else:
            with contextlib.suppress(Exception):  # its failure belongs to its own handle
                job.handle.wait()
        return None

    def _plan(self, flat: FlatState, protected: set[int] | frozenset[int] = frozenset()) -> LayoutPlan:
        """The layout for this state; the same plan object for the same keys, dtypes, shapes, devices
        (and, in overlap mode, the same optimizer-owned tensors)."""
        s = self.settings
        tensors = flat.tensors
        later = (
            [t.untyped_storage().data_ptr() in protected for t in tensors]
            if protected
            else [False] * len(tensors)
        )
        shapes = tuple((t.dtype, t.shape, t.device) for t in tensors)
        last = self._last_plan
        if last is not None and last[0] == (flat.keys, shapes, later):
            return last[1]  # a loop saves the same state: no need to group and look up again
        groups = pack_groups(tensors, later, max_bytes=s.pack_bytes, limit=s.pack_limit)
        signature = (flat.keys, shapes, groups)
        plan = self._plans.get(signature)
        if plan is None:
            specs = []
            for key, t, group in zip(flat.keys, tensors, groups, strict=True):
                name = dtype_name(t.dtype)
                assert name is not None  # flatten only keeps storable dtypes
                specs.append(TensorSpec(key, name, tuple(t.shape), group))
            plan = plan_layout(specs, max_file_bytes=self.settings.max_file_bytes)
            self._plans[signature] = plan
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        self._plans.move_to_end(signature)
        self._last_plan = ((flat.keys, shapes, later), plan)
        return plan

    def _make_room(self, step: int) -> SaveHandle | None:
        """Saving a step that already exists replaces it, unless a reader holds a lease on it."""
        reason = rankdir.make_room(self.rank_path, step, self._pool)
        if reason is None:
            return None
        log.warning("skipped the save of step %d: %s", step, reason)
        return SaveHandle.skipped_save(step, reason)

    def _protected(self) -> set[int]:
        """Storages that only a registered optimizer's step mutates (overlap mode defers them)."""
        out: set[int] = set()
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                out.update(p.untyped_storage().data_ptr() for p in group["params"])
            for state in opt.state.values():
                out.update(
                    v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)
                )
        return out

    def _start_copies(self, job: _SaveJob) -> None:
        assert job.slot is not None
        views = job.slot.views(job.plan)
        tensors = job.flat.tensors
        packed = self._packer.packed(job.plan)
        direct = [i for i in range(len(tensors)) if i not in packed] if packed else range(len(tensors))
        now, later = list(direct), []
        if self.settings.overlap:
            protected = job.protected
            if not protected and not self._warned_overlap:
                log.warning("overlap=True but no optimizer is registered: saves wait for every copy")
                self._warned_overlap = True
            later = [i for i in now if tensors[i].untyped_storage().data_ptr() in protected]
            now = [i for i in now if tensors[i].untyped_storage().data_ptr() not in protected]
        files = job.slot.files
        packs = self._packer.copies(job.plan, files, tensors, later=False) if packed else []
        ticket = copy_into([views[i] for i in now], [tensors[i] for i in now], packed=packs)
        if ticket is not None:
            ticket.synchronize()
        gpu_later = [i for i in later if cuda.is_cuda(tensors[i])]
        job.deferred_cpu = [i for i in later if not cuda.is_cuda(tensors[i])]
        packs = self._packer.copies(job.plan, files, tensors, later=True) if packed else []
        if gpu_later or packs:
            job.deferred_ticket = cuda.copy_to_host(
                [views[i] for i in gpu_later], [tensors[i] for i in gpu_later], packs
            )
            job.tickets.append(job.deferred_ticket)
        if not job.deferred_cpu and job.deferred_ticket is None:
            job.copied.set()

    def _start_device_copies(self, job: _SaveJob, staged: StagedSave) -> None:
        """Device staging: the CUDA tensors' snapshot (``StagedSave``: no CPU wait unless the budget forces
        one); the CPU tensors (an optimizer's step counters, RNG states) are copied before returning, into
        the slot or, while the commit thread has yet to take it, aside."""
        tensors = job.flat.tensors
        cpu = [i for i, t in enumerate(tensors) if not t.is_cuda and t.numel()]
        views = None if job.slot is None else job.slot.views(job.plan)
        staged.issue(views)
        if views is not None:
            copy_cpu([views[i] for i in cpu], [tensors[i] for i in cpu])
        else:
            job.cpu_copies = [(i, tensors[i].detach().clone()) for i in cpu]
        staged.blocking.synchronize()

    def _finish(self, job: _SaveJob) -> None:
        """Commit thread: finish deferred copies, checksum, sync, commit, apply retention."""
        try:
            if job.deferred_cpu:
                assert job.slot is not None
                views = job.slot.views(job.plan)
                copy_into(
                    [views[i] for i in job.deferred_cpu], [job.flat.tensors[i] for i in job.deferred_cpu]
                )
            if job.staged is not None:
                job.staged.release.synchronize()
                job.handle._set_snapshot()
                self._drain(job, job.staged)
            for ticket in job.tickets:
                ticket.synchronize()
            if job.staged is not None and self._stager is not None:
                self._stager.clock.copies_done(job.staged.segments)
            job.handle._set_snapshot()
            job.copied.set()
            snapshot_s = time.perf_counter() - job.started
            s = self.settings
            who = StepIdentity(s.job, s.rank, s.world_size, job.step)
            assert job.slot is not None
            committed = commit_files(
                job.path,
                who,
                job.plan,
                job.slot.files,
                tree=job.flat.tree,
                objects=job.objects,
                object_count=len(job.flat.objects),
                workers=s.crc_workers,
                replica=job.record,
            )
            marker = committed.marker
            self._manifests.remember(committed.manifest, marker)
            self._bind_saved(job)
            job.flat = dataclasses.replace(job.flat, tensors=())  # release the sources
            job.source = None
            self._pool.committed(job.step, job.slot)
            rankdir.apply_retention(
                self.rank_path, self.settings.keep, self._pool, job.step, self._restore_status()
            )
        except BaseException as exc:
            for ticket in job.tickets:  # nothing may still be writing into the slot or the staging
                with contextlib.suppress(Exception):
                    ticket.synchronize()
            job.copied.set()
            job.handed_over.set()
            self._fail(job, exc)
            return
        log.debug(
            "step %d committed: %d bytes, snapshot %.3f s, commit %.3f s",
            job.step,
            marker.total_bytes,
            snapshot_s,
            time.perf_counter() - job.started,
        )
        job.handle._set_committed(marker)
        if not self._closed:
            self._pool.warm(job.plan)  # e.g. a spare that could not be prepared before

    def _drain(self, job: _SaveJob, staged: StagedSave) -> None:
        """Commit thread: take the slot (if the save did not), write the CPU tensors' copies into it, and
        issue the staging buffers' drain into its files."""
        if job.slot is None:
            job.slot = self._pool.take(job.step, job.plan)
            if job.cpu_copies:
                views = job.slot.views(job.plan)
                copy_cpu([views[i] for i, _ in job.cpu_copies], [t for _, t in job.cpu_copies])
                job.cpu_copies = []
        job.tickets.append(staged.drain(job.slot.files))
        job.handed_over.set()

    def _bind_saved(self, job: _SaveJob) -> None:
        """Remember where the saved dict's tensors are, so a load back into it skips the tree walk.

        Done once, then again only while saves keep passing the same tensor objects (a loop that
        builds a new state dict for every save never loads into one of those)."""
        tensors = job.flat.tensors
        if job.source is None or not tensors:
            return
        previous = None if self._bound_first is None else self._bound_first()
        if self._bound_first is not None and previous is not tensors[0]:
            return
        if self._bound_first is not None and self._loader.bindings.resolve_saved(job.source, job.flat):
            return
        try:
            again = flatten(job.source, record_paths=True)
        except Exception as exc:  # the dict changed meanwhile: nothing to bind
            log.debug("not binding the state saved as step %d: %s", job.step, exc)
            return
        if self._loader.bindings.remember_saved(job.source, again, tensors):
            self._bound_first = weakref.ref(tensors[0])

    def _fail(self, job: _SaveJob, exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and not isinstance(exc, RamdiskFullError):
            exc = RamdiskFullError(
                errno.ENOSPC, f"ramdisk full while committing step {job.step}", str(job.path)
            )
        self._last_failed = job.step
        log.error("save of step %d failed, nothing was committed: %s", job.step, exc)
        if job.slot is not None:
            with contextlib.suppress(Exception):
                self._pool.forget(job.slot)
        with contextlib.suppress(Exception):
            discard_step(job.path)
        job.handle._set_failed(exc)

    def wait(self, timeout: float | None = None) -> CommitMarker | None:
        """Wait for the save in flight (if any) to commit; returns its marker or raises its error."""
        handle = self._last
        return None if handle is None else handle.wait(timeout)

    @property
    def last_save(self) -> dict[str, Any]:
        """What the last save (not skipped) did: ``step``, ``role`` (``writer``: wrote its files;
        ``linked``: linked its node writer's), ``written_bytes`` and ``logical_bytes`` (what it wrote,
        and what a save without deduplication writes: its manifest's replica record says the same once
        committed); in a replica group also ``group``, ``source``, ``diverged``, ``fingerprint_s`` and
        ``exchange_s`` (the training thread's cost of comparing fingerprints)."""
        return dict(self._last_save)

    @property
    def replica_group(self) -> ReplicaGroup | None:
        """This rank's replica group (None without one)."""
        return None if self._group is None else self._group.group

    @property
    def last_load_timings(self) -> dict[str, float]:
        """Phases of the last ``load`` on this rank, in seconds (``manifest_s``, ``map_s``, ``bind_s``,
        ``tree_s``, ``h2d_s``, ``verify_wait_s``, ``copy_s``, ``total_s``): what a slow restore spent its
        time on; ``bound`` is 1.0 when the destination's tensors were found without walking the tree."""
        return dict(self._loader.last_timings)

    @property
    def device_staging_bytes(self) -> int:
        """Device memory held for staging: packed copies of small CUDA tensors (save and restore) and
        device staging's buffers."""
        stager = 0 if self._stager is None else self._stager.device_bytes
        return self._packer.device_bytes + self._loader.staging.device_bytes + stager

    @property
    def last_snapshot(self) -> dict[str, float]:
        """Device staging: how the last save's CUDA bytes were copied (``staged_bytes``, ``direct_bytes``,
        ``blocking_bytes``, ``wanted_bytes``, ``allowed_bytes``) and the measurements that decided it
        (``window_s``, ``d2h_gbps``; -1 before the first measurement). Empty without device staging."""
        return {} if self._stager is None else dict(self._stager.last)

    def prepare(
        self, state_dict: dict[Any, Any], *, blocking: bool = True
    ) -> concurrent.futures.Future[None]:
        """Pre-fault (and pin) all ``keep + 1`` slots for this state's layout, off the save path.

        ``blocking=False`` returns at once: the slots are prepared on a background thread while training
        starts, and a save arriving meanwhile takes a slot that is ready (or the one being prepared),
        never a half-prepared one. The returned future completes when every slot is ready.

        ``load`` does this in the background for the state it loads (or finds nothing for): the state a
        job loads is the state it saves.
        """
        self._check_open()
        flat = flatten(self._expand(state_dict).state)
        self._use_cuda(flat)
        protected = self._protected() if self._overlapping else set()
        future = self._registering = self._pool.warm(self._plan(flat, protected))
        self._planned_slots = True
        if blocking:
            future.result()
        return future

    def _prepare_saves(self, state_dict: dict[Any, Any]) -> None:
        """After a load: prepare the slots for this state in the background (``prepare(blocking=False)``),
        so the first saves find them ready; a state that cannot be prepared is left to the first save.
        Once the pool knows a layout (an earlier prepare or save), it keeps its slots ready itself: a
        later load skips the flatten and planning (milliseconds on the restore path)."""
        if self._planned_slots or (self._group is not None and not self._group.writer):
            return
        try:
            self.prepare(state_dict, blocking=False)
        except Exception as exc:  # e.g. a state that cannot be flattened: the save will say so
            log.debug("not preparing slots after the load: %s", exc)

    # ------------------------------------------------------------------------------- overlap

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Overlap mode: ``optimizer.step()`` waits for the snapshot copy of its parameters and state.

        With device staging, the hooks also time the GPU between optimizer steps (what the copy can hide).
        """
        if optimizer in self._optimizers:
            return
        handles = [optimizer.register_step_pre_hook(self._before_step)]
        if self._stager is not None:
            handles.append(optimizer.register_step_post_hook(self._after_step))
        self._optimizers[optimizer] = handles

    def _after_step(self, *_: Any) -> None:
        if self._stager is not None:
            self._stager.clock.step_finished()

    def _before_step(self, *_: Any) -> None:
        if self._stager is not None:
            self._stager.clock.step_started()
        job = self._inflight
        if job is None or job.copied.is_set():
            return
        if job.staged is not None and not job.deferred_cpu:
            job.staged.release.block_stream()  # the GPU orders the update after the direct copies only
            return
        if job.deferred_ticket is not None and not job.deferred_cpu:
            job.deferred_ticket.block_stream()  # the GPU orders the update after the copy; no CPU wait
            return
        job.copied.wait()

    # ------------------------------------------------------------------------------- load

    def load(
        self,
        state_dict: dict[Any, Any],
        step: int | None = None,
        *,
        fallback: bool = False,
        allow_missing: bool = False,
        verify: bool = True,
        device: torch.device | str | None = None,
        strict: bool = True,
        broadcast: bool | None = None,
    ) -> int | None:
        """Fill ``state_dict`` in place from a committed step and return that step.

        Without ``step``, the newest step every rank holds (agreed over torch.distributed when it is
        initialised, or named by the replicator's restore plan). Checksums are verified unless
        ``verify=False``. A corrupt step (a checksum mismatch, a missing or short file) raises
        ``CorruptShardError``, or with ``fallback=True`` the next older common step is tried (on all
        ranks together). Nothing to load raises ``MissingCheckpointError``, or returns None with
        ``allow_missing=True``. New tensors (paths the destination lacks) are created on ``device``
        (default CPU).

        ``strict`` (default): a destination unlike the checkpoint (a tensor of another shape or dtype,
        keys holding tensors on one side only; see ``snapshot.compare``) raises ``StateMismatchError``
        before anything is copied, on every rank, without falling back; a step saved with another world
        size raises ``WorldSizeMismatchError`` (like a corrupt step, on every rank). ``strict=False``:
        mismatched tensors are replaced (logged), missing entries created, and a shard of another world
        size loaded as is.

        ``broadcast`` (default: the ``broadcast_load`` setting), in a replica group: the lowest member
        reads the step and broadcasts its tensors to the others over the group's process group, when
        every member holds it with the same content (``snapshot.fanout``).
        """
        self._check_open()
        with contextlib.suppress(Exception):
            self.wait()
        candidates = loader.candidates(self.settings, self.rank_path, step, fallback=fallback)
        if not candidates:
            if allow_missing:
                log.info("no checkpoint to load for rank %d; starting fresh", self.settings.rank)
                self._prepare_saves(state_dict)
                return None
            raise MissingCheckpointError(
                f"no committed step {'' if step is None else step} that every rank holds in {self.rank_path}"
            )
        last: BaseException | None = None
        fan_out = self.settings.broadcast_load if broadcast is None else broadcast
        expanded = self._expand(state_dict, for_load=True)
        for n, candidate in enumerate(candidates):
            error = self._try_load(
                expanded.state, candidate, verify=verify, device=device, strict=strict, broadcast=fan_out
            )
            outcomes = agree.all_gather(_outcome(error))
            failed = [r for r, o in enumerate(outcomes) if o is not None]
            if not failed:
                if n:
                    log.warning("loaded step %d after falling back from step %d", candidate, candidates[0])
                expanded.finish_load(state_dict)
                self._prepare_saves(expanded.state)
                return candidate
            mismatched = [r for r, o in enumerate(outcomes) if o == _MISMATCH]
            if error is not None:
                last = error
            elif mismatched:
                last = StateMismatchError(
                    f"step {candidate}: rank(s) {mismatched} found the checkpoint unlike their state "
                    "(their error names the differences)"
                )
            else:
                last = CorruptShardError(
                    f"step {candidate}: rank(s) {failed} could not load their shard", path=str(self.rank_path)
                )
            if not fallback or mismatched:  # an older step would not fit either
                raise last
            log.warning("step %d is not loadable (%s); falling back", candidate, last)
        raise MissingCheckpointError(
            f"no committed step could be loaded; the oldest tried failed: {last}"
        ) from last

    def _try_load(
        self,
        state_dict: dict[Any, Any],
        step: int,
        *,
        verify: bool,
        device: torch.device | str | None,
        strict: bool,
        broadcast: bool = False,
    ) -> BaseException | None:
        """Load one step; the error that made it fail, if one did. Every failure of the step's files is
        returned, never raised, so every rank reaches the agreement (``agree.all_ok``) that follows."""
        path = step_dir(self.rank_path, step)
        group = self._group
        try:
            with leases.hold(self.rank_path, step, f"client-{os.getpid()}", ttl=self.settings.lease_ttl):
                if broadcast and group is not None and len(group.order) > 1:
                    fan_out = functools.partial(load_broadcast, self._loader, group)
                    fan_out(state_dict, step, path, verify=verify, device=device, strict=strict)
                else:
                    self._loader.load(state_dict, step, path, verify=verify, device=device, strict=strict)
            if self._pool.register_cuda:
                self._registering = self._pool.warm(None)  # pin for later saves, in the background
        except (FormatError, MissingCheckpointError, StateMismatchError) as exc:
            log.error("could not load step %d: %s", step, exc)
            return exc
        except OSError as exc:  # a file the step needs is gone or unreadable: the step is corrupt
            log.error("could not load step %d: %s", step, exc)
            return CorruptShardError(f"step {step}: {exc}", path=str(getattr(exc, "filename", None) or path))
        return None
