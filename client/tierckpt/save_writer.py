"""The I/O of a save (as DCP's ``StorageWriter``): copy a planned state into the ramdisk and commit it.

``SaveWriter.start`` takes a ``SavePlan`` and copies its tensors into a pre-faulted slot of data files
(``snapshot.pool``, ``snapshot.copy``) or, with device staging, into a device-staged snapshot first
(``snapshot.devstage``); it returns once training may change the state again. The rest runs on one
commit thread, in save order: deferred copies, the staging buffers' drain, checksums, sync and commit
(``snapshot.commit``), retention and recycling the retired step's files (``snapshot.rankdir``).
``start_linked`` commits a replica-group follower's step by linking its node writer's files
(``snapshot.linked``) on the same thread.

At most one save is in flight: ``admit`` waits for it, skips or refuses the next one (``on_busy``).
Overlap mode and device staging let ``save`` return before the tensors only an optimizer's step
mutates are copied; ``before_optimizer_step`` (a step pre-hook) makes that step wait for them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.protocol.control import RestoreStatus
from tierckpt.protocol.errors import RamdiskFullError, SaveInProgressError
from tierckpt.protocol.format import discard_step, rank_dir, step_dir
from tierckpt.save_plan import SavePlan
from tierckpt.settings import Settings
from tierckpt.snapshot import rankdir
from tierckpt.snapshot.bindings import BindingCache
from tierckpt.snapshot.commit import RecordFor, StepIdentity, commit_files
from tierckpt.snapshot.copy import copy_cpu, copy_into
from tierckpt.snapshot.devstage import DeviceStager, Speculation, StagedSave
from tierckpt.snapshot.flatten import FlatState, flatten
from tierckpt.snapshot.handle import SaveHandle
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.linked import commit_linked
from tierckpt.snapshot.loader import ManifestCache
from tierckpt.snapshot.packing import SavePacker
from tierckpt.snapshot.pool import Slot, SlotPool

__all__ = ["LinkedJob", "SaveJob", "SaveWriter"]

log = logging.getLogger(__name__)

_CPU_COPY_LIMIT = 64 << 20
"""A device-staged save copies its CPU tensors aside (and leaves the slot to the commit thread) up to this
many bytes; beyond it, it takes the slot and copies them into it before returning."""


def _cpu_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_cuda)


@dataclasses.dataclass
class SaveJob:
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
    protected: frozenset[int] = frozenset()
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
class LinkedJob:
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


class SaveWriter:
    """Writes and commits one rank's saves; owns the commit thread and what the saves in flight hold."""

    def __init__(
        self,
        settings: Settings,
        rank_path: Path,
        pool: SlotPool,
        *,
        packer: SavePacker,
        stager: DeviceStager | None,
        manifests: ManifestCache,
        bindings: BindingCache,
        restore_status: Callable[[], RestoreStatus | None],
    ) -> None:
        self.settings, self.rank_path, self.pool = settings, rank_path, pool
        self.packer, self.stager, self.manifests, self.bindings = packer, stager, manifests, bindings
        self.restore_status = restore_status
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-commit")
        self._closed = False
        self.inflight: SaveJob | None = None
        """The newest save this rank wrote itself (what the next one may have to wait for)."""
        self.linking: LinkedJob | None = None
        """The newest save committed by linking (replica groups)."""
        self.last: SaveHandle | None = None
        """The newest save that was not skipped (what ``Checkpointer.wait`` waits for)."""
        self.last_failed = -1
        """The newest step whose save failed (replica groups tell the other members)."""
        self.last_save: dict[str, Any] = {}
        """What the last save did (``Checkpointer.last_save``)."""
        self.registering: concurrent.futures.Future[None] | None = None
        """The pool's last warm-up (preparing and pinning slots in the background)."""
        self.planned_slots = False
        """Whether the pool was given a layout to prepare (``prepare()`` or a save)."""
        self._warned_overlap = False
        self._bound_first: weakref.ref[torch.Tensor] | None = None

    def close(self) -> None:
        """Let the commit thread finish the saves in flight, then stop it."""
        self._closed = True
        self._executor.shutdown(wait=True)

    def warm(self, layout: LayoutPlan | None) -> concurrent.futures.Future[None]:
        """Prepare (and pin) the pool's slots for ``layout`` in the background (``SlotPool.warm``)."""
        self.registering = self.pool.warm(layout)
        self.planned_slots = self.planned_slots or layout is not None
        return self.registering

    def use_cuda(self, flat: FlatState) -> None:
        """From the first CUDA tensor on, every slot is pinned (in this thread's device context)."""
        if not self.pool.register_cuda and any(cuda.is_cuda(t) for t in flat.tensors):
            self.pool.use_cuda(cuda.current_device())

    # ------------------------------------------------------------------------------- admission

    def admit(self, step: int) -> SaveHandle | None:
        """None when ``step`` may be saved now (after waiting, per ``on_busy``), else its skipped handle.

        Busy means the save in flight still needs what the next one would take: its slot being committed,
        or, device-staged, its staging buffer not yet handed to the drain (once it is, the next snapshot
        is ordered after the drain on the GPU, and the commits follow one another on the commit thread)."""
        job = self.inflight
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

    def make_room(self, step: int) -> str | None:
        """Retire an existing copy of ``step`` (a save replaces it); the reason when a reader's lease on it
        forbids that."""
        return rankdir.make_room(self.rank_path, step, self.pool)

    # ------------------------------------------------------------------------------- writing

    def start(
        self,
        plan: SavePlan,
        state_dict: dict[Any, Any],
        record: RecordFor | None = None,
        speculation: Speculation | None = None,
    ) -> SaveHandle:
        """Start copying the plan's tensors (into a slot, or a device-staged snapshot); the commit thread
        finishes."""
        step, flat, layout, objects = plan.step, plan.flat, plan.layout, plan.objects
        self.use_cuda(flat)
        path = step_dir(self.rank_path, step)
        staged = self._staged_save(plan, speculation)
        job = SaveJob(step, path, None, layout, flat, objects, SaveHandle(step), [], [], plan.protected)
        job.source, job.staged, job.record = state_dict, staged, record
        try:
            if staged is None or staged.needs_host or _cpu_bytes(flat.tensors) > _CPU_COPY_LIMIT:
                job.slot = self.pool.take(step, layout)  # else the commit thread takes it
            if staged is not None:
                self._start_device_copies(job, staged)
            else:
                self._start_copies(job)
        except BaseException:
            self.last_failed = step
            for ticket in job.tickets:  # nothing may still be writing into the slot
                with contextlib.suppress(Exception):
                    ticket.synchronize()
            if job.slot is not None:
                self.pool.forget(job.slot)
            discard_step(path)
            raise
        self.inflight = job
        self.last = job.handle
        waits = job.deferred_cpu or job.deferred_ticket is not None or (staged and staged.release.events)
        if not waits:
            job.handle._set_snapshot()
        self.warm(layout)  # spares for the next saves, off the training thread
        self._executor.submit(self._finish, job)
        nbytes = plan.logical_bytes
        self.last_save = {"step": step, "role": "writer", "written_bytes": nbytes, "logical_bytes": nbytes}
        return job.handle

    def _staged_save(self, plan: SavePlan, speculation: Speculation | None) -> StagedSave | None:
        """The device-staged snapshot of this save's CUDA tensors (None without device staging or CUDA)."""
        tensors, protected = plan.flat.tensors, plan.protected
        if self.stager is None or not any(t.is_cuda for t in tensors):
            return None
        if not protected and not self._warned_overlap and self.settings.device_staging:
            log.info(
                "device staging without a registered optimizer: CUDA tensors the budget cannot stage are "
                "copied before save returns"
            )
            self._warned_overlap = True
        flags = [t.untyped_storage().data_ptr() in protected for t in tensors] if protected else None
        return self.stager.plan(plan.layout, tensors, flags or [False] * len(tensors), speculation)

    def _start_copies(self, job: SaveJob) -> None:
        assert job.slot is not None
        views = job.slot.views(job.plan)
        tensors = job.flat.tensors
        packed = self.packer.packed(job.plan)
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
        packs = self.packer.copies(job.plan, files, tensors, later=False) if packed else []
        ticket = copy_into([views[i] for i in now], [tensors[i] for i in now], packed=packs)
        if ticket is not None:
            ticket.synchronize()
        gpu_later = [i for i in later if cuda.is_cuda(tensors[i])]
        job.deferred_cpu = [i for i in later if not cuda.is_cuda(tensors[i])]
        packs = self.packer.copies(job.plan, files, tensors, later=True) if packed else []
        if gpu_later or packs:
            job.deferred_ticket = cuda.copy_to_host(
                [views[i] for i in gpu_later], [tensors[i] for i in gpu_later], packs
            )
            job.tickets.append(job.deferred_ticket)
        if not job.deferred_cpu and job.deferred_ticket is None:
            job.copied.set()

    def _start_device_copies(self, job: SaveJob, staged: StagedSave) -> None:
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

    # ------------------------------------------------------------------------------- commit thread

    def _finish(self, job: SaveJob) -> None:
        """Commit thread: finish deferred copies, checksum, sync, commit, apply retention."""
        try:
            snapshot_s = self._finish_copies(job)
            s = self.settings
            assert job.slot is not None
            committed = commit_files(
                job.path,
                StepIdentity(s.job, s.rank, s.world_size, job.step),
                job.plan,
                job.slot.files,
                tree=job.flat.tree,
                objects=job.objects,
                object_count=len(job.flat.objects),
                workers=s.crc_workers,
                replica=job.record,
            )
            marker = committed.marker
            self.manifests.remember(committed.manifest, marker)
            self._bind_saved(job)
            job.flat = dataclasses.replace(job.flat, tensors=())  # release the sources
            job.source = None
            self.pool.committed(job.step, job.slot)
            rankdir.apply_retention(self.rank_path, s.keep, self.pool, job.step, self.restore_status())
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
            self.warm(job.plan)  # e.g. a spare that could not be prepared before

    def _finish_copies(self, job: SaveJob) -> float:
        """Commit thread: the copies ``start`` left (deferred CPU tensors, the staging buffers' drain); once
        every byte is in the slot, the snapshot is done. Returns how long the snapshot took."""
        if job.deferred_cpu:
            assert job.slot is not None
            views = job.slot.views(job.plan)
            copy_into([views[i] for i in job.deferred_cpu], [job.flat.tensors[i] for i in job.deferred_cpu])
        if job.staged is not None:
            job.staged.release.synchronize()
            job.handle._set_snapshot()
            self._drain(job, job.staged)
        for ticket in job.tickets:
            ticket.synchronize()
        if job.staged is not None and self.stager is not None:
            self.stager.clock.copies_done(job.staged.segments)
        job.handle._set_snapshot()
        job.copied.set()
        return time.perf_counter() - job.started

    def _drain(self, job: SaveJob, staged: StagedSave) -> None:
        """Commit thread: take the slot (if the save did not), write the CPU tensors' copies into it, and
        issue the staging buffers' drain into its files."""
        if job.slot is None:
            job.slot = self.pool.take(job.step, job.plan)
            if job.cpu_copies:
                views = job.slot.views(job.plan)
                copy_cpu([views[i] for i, _ in job.cpu_copies], [t for _, t in job.cpu_copies])
                job.cpu_copies = []
        job.tickets.append(staged.drain(job.slot.files))
        job.handed_over.set()

    def _bind_saved(self, job: SaveJob) -> None:
        """Remember where the saved dict's tensors are, so a load back into it skips the tree walk.

        Done once, then again only while saves keep passing the same tensor objects (a loop that
        builds a new state dict for every save never loads into one of those)."""
        tensors = job.flat.tensors
        if job.source is None or not tensors:
            return
        previous = None if self._bound_first is None else self._bound_first()
        if self._bound_first is not None and previous is not tensors[0]:
            return
        if self._bound_first is not None and self.bindings.resolve_saved(job.source, job.flat):
            return
        try:
            again = flatten(job.source, record_paths=True)
        except Exception as exc:  # the dict changed meanwhile: nothing to bind
            log.debug("not binding the state saved as step %d: %s", job.step, exc)
            return
        if self.bindings.remember_saved(job.source, again, tensors):
            self._bound_first = weakref.ref(tensors[0])

    def _fail(self, job: SaveJob, exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and not isinstance(exc, RamdiskFullError):
            exc = RamdiskFullError(
                errno.ENOSPC, f"ramdisk full while committing step {job.step}", str(job.path)
            )
        self.last_failed = job.step
        log.error("save of step %d failed, nothing was committed: %s", job.step, exc)
        if job.slot is not None:
            with contextlib.suppress(Exception):
                self.pool.forget(job.slot)
        with contextlib.suppress(Exception):
            discard_step(job.path)
        job.handle._set_failed(exc)

    # ------------------------------------------------------------------------------- linking

    def start_linked(self, plan: SavePlan, source: int, fingerprint: str, record: RecordFor) -> SaveHandle:
        """A replica-group follower's save: nothing to copy, the commit thread links the files of
        ``source`` (the member that writes for this node)."""
        flat = plan.flat
        handle = SaveHandle(plan.step)
        handle._set_snapshot()  # training may go on at once: no byte of the state is read any more
        job = LinkedJob(
            plan.step,
            step_dir(self.rank_path, plan.step),
            source,
            fingerprint,
            flat.keys,
            flat.tree,
            len(flat.objects),
            plan.objects,
            record,
            handle,
        )
        self.linking = job
        self.last = handle
        self._executor.submit(self._finish_linked, job)
        self.last_save = {
            "step": plan.step,
            "role": "linked",
            "written_bytes": len(plan.objects or b""),
            "logical_bytes": plan.logical_bytes,
        }
        return handle

    def _finish_linked(self, job: LinkedJob) -> None:
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
            self.manifests.remember(committed.manifest, committed.marker)
            rankdir.apply_retention(self.rank_path, s.keep, self.pool, job.step, self.restore_status())
        except BaseException as exc:
            self.last_failed = job.step
            log.error("save of step %d failed, nothing was committed: %s", job.step, exc)
            with contextlib.suppress(Exception):
                discard_step(job.path)
            job.handle._set_failed(exc)
            return
        log.debug("step %d committed by linking the files of rank %d", job.step, job.source)
        job.handle._set_committed(committed.marker)

    # ------------------------------------------------------------------------------- optimizer hooks

    def before_optimizer_step(self, *_: Any) -> None:
        """An optimizer step pre-hook: the step waits for the snapshot of what it mutates (overlap mode,
        device staging: on the GPU when it can, else on the CPU)."""
        if self.stager is not None:
            self.stager.clock.step_started()
        job = self.inflight
        if job is None or job.copied.is_set():
            return
        if job.staged is not None and not job.deferred_cpu:
            job.staged.release.block_stream()  # the GPU orders the update after the direct copies only
            return
        if job.deferred_ticket is not None and not job.deferred_cpu:
            job.deferred_ticket.block_stream()  # the GPU orders the update after the copy; no CPU wait
            return
        job.copied.wait()

    def after_optimizer_step(self, *_: Any) -> None:
        """An optimizer step post-hook: device staging times the GPU between optimizer steps."""
        if self.stager is not None:
            self.stager.clock.step_finished()
