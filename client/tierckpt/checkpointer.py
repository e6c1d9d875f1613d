"""``Checkpointer``: save a state dict to the node's ramdisk in the time of one memory copy; load it back.

It orchestrates and touches no bytes itself. A save is planned first (``save_plan``: the state flattened,
laid out in data files, its objects pickled; a value), then written (``save_writer``: copied into a
pre-faulted, CUDA-pinned slot of the pool or, with device staging, snapshotted on the device first; a
background thread checksums, commits, applies retention and recycles the retired step's files). In a
replica group the grouped-save strategy (``grouped_save``) sits between the two: every save first agrees
with the other members on their fingerprints (``replica_group``), and a member that does not write for
its node commits by linking the writer's files instead of copying.

Loading goes the other way (``snapshot.loader``, ``snapshot.restore``), after any replicator finished
staging (``snapshot.restore_wait``) and the ranks agreed on a step (``snapshot.agree``);
``load(broadcast=True)`` in a replica group reads on one member and broadcasts (``snapshot.fanout``).

API and semantics: docs/client.md. On-disk format: docs/format.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.grouped_save import GroupedSave
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestoreStatus
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    ReplicaDivergenceError,
    StateMismatchError,
)
from tierckpt.protocol.format import CommitMarker, job_dir, rank_dir, step_dir
from tierckpt.replica_group import Membership, ReplicaGroup
from tierckpt.save_plan import SavePlanner, protected_storages
from tierckpt.save_writer import SaveWriter
from tierckpt.settings import BusyPolicy, Settings, resolve
from tierckpt.snapshot import agree, loader, rankdir, restore_wait, stateful
from tierckpt.snapshot.devstage import DeviceStager
from tierckpt.snapshot.fanout import load_broadcast
from tierckpt.snapshot.flatten import flatten
from tierckpt.snapshot.handle import SaveHandle
from tierckpt.snapshot.packing import SavePacker
from tierckpt.snapshot.pool import SlotPool
from tierckpt.snapshot.rankdir import WRITER_LOCK

__all__ = ["WRITER_LOCK", "Checkpointer"]

log = logging.getLogger(__name__)


@functools.cache
def _freeze_set_up() -> None:
    """Once per process (``Settings.freeze_gc``): collect, then move every object alive out of the
    collector's generations. A training process holds hundreds of thousands of long-lived objects
    (torch's modules and the model among them); each save keeps some objects alive for a while, which
    the collector promotes to its oldest generation, and once enough have been promoted it walks the
    whole generation in one pass, holding the GIL: measured once every dozen saves, 0.19-0.23 s
    (docs/benchmarks.md). Frozen, those objects are no longer walked; the ones created later still
    are, so cyclic garbage made from then on is still collected."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.debug(
        "froze %d objects out of the garbage collector's generations in %.3f s (freeze_gc=False keeps them)",
        gc.get_freeze_count(),
        time.perf_counter() - started,
    )


_MISMATCH = "mismatch"


def _outcome(error: BaseException | None) -> str | None:
    """What a rank tells the others about its load: None (loaded), a mismatch, or a failure."""
    if error is None:
        return None
    return _MISMATCH if isinstance(error, StateMismatchError) else "failed"


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
        if s.freeze_gc:
            _freeze_set_up()
        self.rank_path = rank_dir(s.root, s.job, s.rank)
        self.rank_path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = rankdir.lock_writer(self.rank_path, s.writer_lock_timeout)
        self._closed = False
        self._pool = SlotPool(self.rank_path, target=s.keep + 1)
        self._manifests = loader.ManifestCache(capacity=s.keep + 2)
        self._loader = loader.StepLoader(s, self._pool, self._manifests)
        self._packer = SavePacker()
        self._stager = DeviceStager(s.device_budget) if s.device_staging is not False else None
        """Device staging (on unless ``device_staging=False``); it only acts on CUDA tensors."""
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._planner = SavePlanner(s)
        self._plan_ahead: concurrent.futures.Future[None] | None = None
        """A fresh job's plan of its whole state once its optimizer has stepped (``_plan_at_first_step``)."""
        self._writer = SaveWriter(
            s,
            self.rank_path,
            self._pool,
            packer=self._packer,
            stager=self._stager,
            manifests=self._manifests,
            bindings=self._loader.bindings,
            restore_status=self._restore_status,
        )
        self._group: Membership | None = None
        self._grouped: GroupedSave | None = None
        try:
            if replica_group is not None:
                self._group = self._join(ReplicaGroup.of(replica_group))
                self._grouped = GroupedSave(self._group, s, self._planner, self._writer, self._protected)
            rankdir.clean_up_after_crash(self.rank_path, s.keep, self._pool, self._restore_status())
            if cuda.in_use():
                self._pool.use_cuda(cuda.current_device())
            self._writer.warm(None)  # adopted spares: page tables and pinning, off-thread
        except BaseException:
            self._release()
            raise
        log.info("checkpointer for job %s rank %d/%d at %s", s.job, s.rank, s.world_size, self.rank_path)

    def _join(self, group: ReplicaGroup) -> Membership:
        """This rank's place in its replica group (a collective over the group)."""
        s = self.settings
        membership = Membership.resolve(
            group,
            rank=s.rank,
            world_size=s.world_size,
            job_path=job_dir(s.root, s.job),
            rank_path_of=lambda r: rank_dir(s.root, s.job, r),
        )
        if not membership.writer:
            self._pool.target = 0  # its steps link the node writer's files: no slots of its own
        return membership

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
        if self._plan_ahead is not None:  # a thread of its own may still be planning (milliseconds)
            concurrent.futures.wait([self._plan_ahead], timeout=10)
        self._pool.stop_building()
        self._writer.close()
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

    def _protected(self) -> frozenset[int]:
        """Storages that only a registered optimizer's step mutates (copied last, when saves may return
        before them)."""
        return protected_storages(self._optimizers) if self._overlapping else frozenset()

    @property
    def _registering(self) -> concurrent.futures.Future[None] | None:
        """The pool's last warm-up (preparing and pinning slots in the background)."""
        return self._writer.registering

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
        if self._grouped is None:
            handle = self._save_alone(step, state_dict)
        else:
            handle, divergence = self._grouped.save(step, state_dict)
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
        refused = self._writer.admit(step)
        if refused is not None:
            return refused
        # The GPU copies the last save's tensors while this one is flattened and planned.
        speculation = self._stager.speculate() if self._stager is not None else None
        plan = self._planner.plan(step, state_dict, self._protected())
        reason = self._writer.make_room(step)  # saving a step that exists replaces it, unless leased
        if reason is not None:
            log.warning("skipped the save of step %d: %s", step, reason)
            return SaveHandle.skipped_save(step, reason)
        return self._writer.start(plan, state_dict, speculation=speculation)

    # ------------------------------------------------------------------------------- results

    def wait(self, timeout: float | None = None) -> CommitMarker | None:
        """Wait for the save in flight (if any) to commit; returns its marker or raises its error."""
        handle = self._writer.last
        return None if handle is None else handle.wait(timeout)

    @property
    def last_save(self) -> dict[str, Any]:
        """What the last save (not skipped) did: ``step``, ``role`` (``writer``: wrote its files;
        ``linked``: linked its node writer's), ``written_bytes`` and ``logical_bytes`` (what it wrote,
        and what a save without deduplication writes: its manifest's replica record says the same once
        committed); in a replica group also ``group``, ``source``, ``diverged``, ``fingerprint_s`` and
        ``exchange_s`` (the training thread's cost of comparing fingerprints)."""
        return dict(self._writer.last_save)

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
        expanded = self._expand(state_dict)
        flat = flatten(expanded.state)
        self._writer.use_cuda(flat)
        future = self._writer.warm(self._planner.layout(flat, self._protected()))
        self._plan_at_first_step(state_dict, expanded.optimizers)
        if blocking:
            future.result()
        return future

    def _plan_at_first_step(
        self, state_dict: dict[Any, Any], optimizers: list[torch.optim.Optimizer]
    ) -> None:
        """A fresh job prepares its slots from ``load``, before the first step, when its optimizers have
        no state yet (torch creates it at their first step): that layout holds the model alone. Once an
        optimizer without state has stepped, plan the whole state again, on a thread of its own, so the
        warm-up refits the spares from the first step on rather than from the first save (which would
        otherwise flatten and lay out the new state, and take a slot still sized for the model)."""
        fresh = [o for o in optimizers if not o.state]
        if not fresh or self._plan_ahead is not None:
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._plan_ahead = done
        fired = threading.Event()

        def plan() -> None:
            try:
                if not self._closed:
                    log.debug("the optimizer stepped for the first time: preparing slots for the whole state")
                    self.prepare(state_dict, blocking=False)
            except Exception as exc:  # e.g. closed meanwhile, or a state that cannot be flattened
                log.debug("not preparing slots after the first optimizer step: %s", exc)
            finally:
                done.set_result(None)

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not fired.is_set():  # hooks cannot be removed while torch runs them: a no-op from now on
                fired.set()
                threading.Thread(target=plan, name="tierckpt-plan", daemon=True).start()

        for optimizer in fresh:
            self._optimizers[optimizer].append(optimizer.register_step_post_hook(after_step))

    def _prepare_saves(self, state_dict: dict[Any, Any]) -> None:
        """After a load: prepare the slots for this state in the background (``prepare(blocking=False)``),
        so the first saves find them ready; a state that cannot be prepared is left to the first save.
        Once the pool knows a layout (an earlier prepare or save), it keeps its slots ready itself: a
        later load skips the flatten and planning (milliseconds on the restore path)."""
        if self._writer.planned_slots or (self._group is not None and not self._group.writer):
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
        handles = [optimizer.register_step_pre_hook(self._writer.before_optimizer_step)]
        if self._stager is not None:
            handles.append(optimizer.register_step_post_hook(self._writer.after_optimizer_step))
        self._optimizers[optimizer] = handles

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
                self._writer.warm(None)  # pin for later saves, in the background
        except (FormatError, MissingCheckpointError, StateMismatchError) as exc:
            log.error("could not load step %d: %s", step, exc)
            return exc
        except OSError as exc:  # a file the step needs is gone or unreadable: the step is corrupt
            log.error("could not load step %d: %s", step, exc)
            return CorruptShardError(f"step {step}: {exc}", path=str(getattr(exc, "filename", None) or path))
        return None
