"""``Checkpointer``: save a state dict to the node's ramdisk in the time of one memory copy; load it back.

It orchestrates and touches no bytes itself: ``snapshot.flatten`` turns the state into a tree and
tensors, ``snapshot.layout`` places them, ``snapshot.pool`` hands out pre-faulted (and CUDA-pinned)
data files and prepares the next ones in the background, ``snapshot.copy`` fills them (or, with device
staging, ``snapshot.devstage``), and a background thread checksums and commits (``snapshot.commit``),
then applies retention and recycles the retired step's files for the next save
(``snapshot.rankdir``). Loading goes the other way (``snapshot.loader``, ``snapshot.restore``), after
any replicator finished staging (``snapshot.restore_wait``) and the ranks agreed on a step
(``snapshot.agree``).

API and semantics: docs/client.md. On-disk format: docs/format.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.protocol import leases
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    SaveInProgressError,
    StateMismatchError,
)
from tierckpt.protocol.format import CommitMarker, discard_step, rank_dir, step_dir
from tierckpt.settings import BusyPolicy, Settings, resolve
from tierckpt.snapshot import agree, loader, rankdir
from tierckpt.snapshot import objects as pickled
from tierckpt.snapshot.commit import StepIdentity, commit_files
from tierckpt.snapshot.copy import copy_cpu, copy_into
from tierckpt.snapshot.devstage import DeviceStager
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.flatten import FlatState, flatten
from tierckpt.snapshot.handle import SaveHandle
from tierckpt.snapshot.layout import LayoutPlan, TensorSpec, plan_layout
from tierckpt.snapshot.packing import SavePacker, pack_groups
from tierckpt.snapshot.pool import Slot, SlotPool
from tierckpt.snapshot.rankdir import WRITER_LOCK

__all__ = ["WRITER_LOCK", "Checkpointer"]

log = logging.getLogger(__name__)

_PLAN_CACHE = 4
_MISMATCH = "mismatch"


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
    slot: Slot
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
    staged: cuda.StagedTicket | None = None
    """Device staging: its copies; the optimizer hook waits for ``staged.release`` only."""
    source: dict[Any, Any] | None = None
    """The state dict saved (kept until committed, to bind it for a later load into it)."""
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once every tensor's bytes are in the mapping (or the save failed)."""
    started: float = dataclasses.field(default_factory=time.perf_counter)


class Checkpointer:
    """Per-rank checkpoints in node RAM: fast asynchronous ``save``, verified in-place ``load``.

    Arguments left as None come from the environment the operator injects (``TIERCKPT_ROOT``,
    ``TIERCKPT_JOB``, ``TIERCKPT_RANK``, ``TIERCKPT_WORLD_SIZE``), then torch.distributed, then
    torchrun's ``RANK``/``WORLD_SIZE``, then rank 0 of 1. Other options: see ``settings.Settings``.
    Holds an exclusive lock on its rank directory until ``close()``.
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
        self._plans: collections.OrderedDict[tuple[Any, ...], LayoutPlan] = collections.OrderedDict()
        self._manifests = loader.ManifestCache(capacity=s.keep + 2)
        self._loader = loader.StepLoader(s, self._pool, self._manifests)
        self._packer = SavePacker()
        self._stager = DeviceStager(s.device_budget) if s.device_staging else None
        self._registering: concurrent.futures.Future[None] | None = None
        """The pool's last warm-up (preparing and pinning slots in the background)."""
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._warned_overlap = False
        self._bound_first: weakref.ref[torch.Tensor] | None = None
        try:
            rankdir.clean_up_after_crash(self.rank_path, s.keep, self._pool)
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

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")

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
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        refused = self._admit(step)
        if refused is not None:
            return refused
        flat = flatten(state_dict)
        protected = self._protected() if self.settings.overlapping else set()
        plan = self._plan(flat, protected)
        refused = self._make_room(step)
        if refused is not None:
            return refused
        objects = pickled.dumps(list(flat.objects)) if flat.objects else None
        self._use_cuda(flat)
        path = step_dir(self.rank_path, step)
        try:
            slot = self._pool.take(step, plan)
        except BaseException:
            discard_step(path)
            raise
        job = _SaveJob(step, path, slot, plan, flat, objects, SaveHandle(step), [], [], protected)
        job.source = state_dict
        try:
            if self._stager is not None:
                self._start_device_copies(job)
            else:
                self._start_copies(job)
        except BaseException:
            for ticket in job.tickets:  # nothing may still be writing into the slot
                with contextlib.suppress(Exception):
                    ticket.synchronize()
            self._pool.forget(slot)
            discard_step(path)
            raise
        self._inflight = job
        if not job.deferred_cpu and job.deferred_ticket is None and job.staged is None:
            job.handle._set_snapshot()
        self._executor.submit(self._finish, job)
        self._registering = self._pool.warm(plan)  # spares for the next saves, off the training thread
        if blocking:
            job.handle.wait()
        return job.handle

    def _use_cuda(self, flat: FlatState) -> None:
        """From the first CUDA tensor on, every slot is pinned (in this thread's device context)."""
        if not self._pool.register_cuda and any(cuda.is_cuda(t) for t in flat.tensors):
            self._pool.use_cuda(cuda.current_device())

    def _admit(self, step: int) -> SaveHandle | None:
        job = self._inflight
        if job is None or job.handle.done():
            return None
        policy = self.settings.on_busy
        if policy == "skip":
            reason = f"step {job.step} is still committing"
            log.info("skipped the save of step %d: %s", step, reason)
            return SaveHandle.skipped_save(step, reason)
        if policy == "error":
            raise SaveInProgressError(f"cannot save step {step}: step {job.step} is still committing")
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
        groups = pack_groups(tensors, later, max_bytes=s.pack_bytes, limit=s.pack_limit)
        signature = (flat.keys, tuple((t.dtype, t.shape) for t in tensors), groups)
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

    def _start_device_copies(self, job: _SaveJob) -> None:
        """Device staging: CUDA tensors go through ``DeviceStager`` (no CPU wait unless the budget forces
        one); CPU tensors (an optimizer's step counters, RNG states) are copied before returning, so the
        optimizer's hook never waits on the CPU."""
        assert self._stager is not None
        views = job.slot.views(job.plan)
        tensors = job.flat.tensors
        packed = self._packer.packed(job.plan)
        protected = job.protected
        if not protected and not self._warned_overlap:
            log.info(
                "device staging without a registered optimizer: every CUDA tensor is staged or copied "
                "before save returns"
            )
            self._warned_overlap = True
        dsts, srcs, guarded, cpu_now = [], [], [], []
        for i, t in enumerate(tensors):
            if i in packed or t.numel() == 0:
                continue
            if cuda.is_cuda(t):
                dsts.append(views[i])
                srcs.append(t)
                guarded.append(t.untyped_storage().data_ptr() in protected)
            else:
                cpu_now.append(i)
        files = job.slot.files
        packs = (
            self._packer.copies(job.plan, files, tensors, later=False)
            + self._packer.copies(job.plan, files, tensors, later=True)
            if packed
            else []
        )
        if srcs or packs:
            job.staged = self._stager.snapshot(dsts, srcs, guarded, packs)
            job.tickets.append(job.staged.landed)
        if cpu_now:
            copy_cpu([views[i] for i in cpu_now], [tensors[i] for i in cpu_now])
        if job.staged is not None:
            job.staged.blocking.synchronize()
        else:
            job.copied.set()

    def _finish(self, job: _SaveJob) -> None:
        """Commit thread: finish deferred copies, checksum, sync, commit, apply retention."""
        try:
            if job.deferred_cpu:
                views = job.slot.views(job.plan)
                copy_into(
                    [views[i] for i in job.deferred_cpu], [job.flat.tensors[i] for i in job.deferred_cpu]
                )
            if job.staged is not None:
                job.staged.release.synchronize()
                job.handle._set_snapshot()
            for ticket in job.tickets:
                ticket.synchronize()
            if job.staged is not None and self._stager is not None:
                self._stager.clock.copies_done(job.staged.segments)
            job.handle._set_snapshot()
            job.copied.set()
            snapshot_s = time.perf_counter() - job.started
            s = self.settings
            who = StepIdentity(s.job, s.rank, s.world_size, job.step)
            committed = commit_files(
                job.path,
                who,
                job.plan,
                job.slot.files,
                tree=job.flat.tree,
                objects=job.objects,
                object_count=len(job.flat.objects),
                workers=s.crc_workers,
            )
            marker = committed.marker
            self._manifests.remember(committed.manifest, marker)
            self._bind_saved(job)
            job.flat = dataclasses.replace(job.flat, tensors=())  # release the sources
            job.source = None
            self._pool.committed(job.step, job.slot)
            rankdir.apply_retention(self.rank_path, self.settings.keep, self._pool)
        except BaseException as exc:
            for ticket in job.tickets:  # nothing may still be writing into the slot or the staging
                with contextlib.suppress(Exception):
                    ticket.synchronize()
            job.copied.set()
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
        log.error("save of step %d failed, nothing was committed: %s", job.step, exc)
        with contextlib.suppress(Exception):
            self._pool.forget(job.slot)
        with contextlib.suppress(Exception):
            discard_step(job.path)
        job.handle._set_failed(exc)

    def wait(self, timeout: float | None = None) -> CommitMarker | None:
        """Wait for the save in flight (if any) to commit; returns its marker or raises its error."""
        job = self._inflight
        return None if job is None else job.handle.wait(timeout)

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
        """
        self._check_open()
        flat = flatten(state_dict)
        self._use_cuda(flat)
        protected = self._protected() if self.settings.overlapping else set()
        future = self._registering = self._pool.warm(self._plan(flat, protected))
        if blocking:
            future.result()
        return future

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
        """
        self._check_open()
        with contextlib.suppress(Exception):
            self.wait()
        candidates = loader.candidates(self.settings, self.rank_path, step, fallback=fallback)
        if not candidates:
            if allow_missing:
                log.info("no checkpoint to load for rank %d; starting fresh", self.settings.rank)
                return None
            raise MissingCheckpointError(
                f"no committed step {'' if step is None else step} that every rank holds in {self.rank_path}"
            )
        last: BaseException | None = None
        for n, candidate in enumerate(candidates):
            error = self._try_load(state_dict, candidate, verify=verify, device=device, strict=strict)
            outcomes = agree.all_gather(_outcome(error))
            failed = [r for r, o in enumerate(outcomes) if o is not None]
            if not failed:
                if n:
                    log.warning("loaded step %d after falling back from step %d", candidate, candidates[0])
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
    ) -> BaseException | None:
        """Load one step; the error that made it fail, if one did. Every failure of the step's files is
        returned, never raised, so every rank reaches the agreement (``agree.all_ok``) that follows."""
        path = step_dir(self.rank_path, step)
        try:
            with leases.hold(self.rank_path, step, f"client-{os.getpid()}", ttl=self.settings.lease_ttl):
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
