"""PyTorch Lightning: everything Lightning puts in a ``.ckpt``, saved per rank to the node's RAM disk.

::

    trainer = Trainer(callbacks=[TierckptCallback(every_n_steps=100)], strategy="ddp")
    trainer.fit(model, datamodule=dm)   # resumes from the newest step every rank holds, if any

**What is saved.** Lightning's own checkpoint contents (``_CheckpointConnector.dump_checkpoint``, what
``trainer.save_checkpoint`` writes): the module's weights, optimizers, LR schedulers, the precision
plugin (AMP ``GradScaler``), every loop's progress including the fit loop's data position (the state of
resumable data loaders), every callback's state, the hyper-parameters, the DataModule's ``state_dict``
and whatever the ``on_save_checkpoint`` hooks add. This callback's own state adds the RNG states
(torch, CUDA, numpy, python) of the rank, which Lightning's checkpoints do not hold; they are set again
just before the first resumed training batch, so dropout and other randomness continue exactly.

**When.** Every ``every_n_steps`` optimizer steps (from ``on_train_batch_end``), at the end of training,
and when Lightning stops on SIGTERM (a pod's preemption or deletion): Lightning turns the signal into
``SIGTERMException`` at the next batch boundary on every rank together, and ``on_exception`` saves that
step and waits for its commit, well within a pod's grace period (a copy into RAM). Other exceptions are
not saved: one can come out of the middle of a step (a half-applied optimizer update) or of one rank
while the others wait in a collective, so the state is not a step every rank can resume from; the last
periodic step is.

**Restore.** ``on_fit_start`` loads the newest step every rank holds (after the node's replicator staged
it from a peer or the bucket) and hands it to Lightning's own restore sequence (``restore_model``,
``restore_datamodule``, ``restore_callbacks``, then the Trainer's ``restore_training_state``), in the
order Lightning uses for strategies that restore after setup. Loading is strict: a module whose
architecture differs raises ``tierckpt.StateMismatchError`` before anything is copied. An explicit
``trainer.fit(ckpt_path=...)`` takes precedence (logged). Rank 0 says, with Lightning's
``rank_zero_info`` (shown by default), which step it resumed, when it was saved and where each rank's
copy came from (``integrations.resume``); and when that step already reached ``max_steps`` or
``max_epochs``, that the job is complete: Lightning's fit loop then trains nothing.

**Why a callback around Lightning's dump, not a ``CheckpointIO`` plugin.** A ``CheckpointIO`` would use
only public API, but (1) ``Strategy.save_checkpoint`` calls it on global rank 0 alone, so the other
ranks' nodes would hold nothing and every rank would restore rank 0's copy, losing per-rank state (RNG,
per-rank sampler position) and tierckpt's node-local restore; (2) ``FSDPStrategy`` and
``ModelParallelStrategy`` bypass ``CheckpointIO`` for sharded checkpoints (they write DCP with a
``FileSystemWriter``); (3) ``ckpt_path=`` must be chosen before ``fit`` (a fresh start needs None), and
``ModelCheckpoint`` manages files by path (top-k removal, ``last`` links). The callback touches one
private object, ``trainer._checkpoint_connector``: ``dump_checkpoint``, ``_loaded_checkpoint`` and the
``restore_*`` methods, whose names are stable since Lightning 1.6 and which the tests exercise against
the pinned Lightning; everything they restore is restored by Lightning itself, so resumption is exactly
Lightning's own.

**Sharded strategies.** With ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy``
(``state_dict_type="sharded"``) the weights and optimizer states are DTensor/ShardedTensor shards: they
go through PyTorch DCP with ``tierckpt.dcp.RamdiskWriter``/``RamdiskReader`` (one committed step per
rank, the same on-ramdisk format), together with each rank's remaining Lightning state (pickled, under
``lightning/rank-NNNNN``). On restore the ranks agree on the newest step every rank sees, load the shards
with ``torch.distributed.checkpoint.state_dict`` and let Lightning restore the rest. DCP on the ramdisk
works on any number of nodes: every node holds the metadata and a copy of every replicated item with its
ranks' shards, and a reshard has the node's replicator fetch what the node lacks (docs/dcp.md, "Several
nodes"). DeepSpeed (its own checkpoint engine, CUDA only) is refused with a clear error.

Lightning is imported only here, and only if installed (``lightning`` 2.x or ``pytorch_lightning``).
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from tierckpt.integrations.resume import complete_message, resume_message
from tierckpt.integrations.rng import collect_rng_states, set_rng_states

__all__ = ["TierckptCallback"]

log = logging.getLogger(__name__)

_REMAINDER_PREFIX = "lightning/rank-"


def _lightning(module: str) -> Any:
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return __import__(f"{package}.{module}", fromlist=["_"])
        except ImportError:
            continue
    return None


def _callback_base() -> type:
    """Lightning's ``Checkpoint`` callback type: Lightning runs checkpoint callbacks after all others, so
    a save in ``on_train_batch_end`` sees every other callback's state after the batch (as
    ``ModelCheckpoint`` does), and adds no default ``ModelCheckpoint`` beside it."""
    callbacks = _lightning("callbacks")
    base: type = object if callbacks is None else callbacks.Checkpoint
    return base


def _sharded(strategy: Any) -> bool:
    """Whether the strategy's weights and optimizer states are shards that need DCP."""
    strategies = _lightning("strategies")
    if strategies is None:
        return False
    deepspeed = getattr(strategies, "DeepSpeedStrategy", None)
    if deepspeed is not None and isinstance(strategy, deepspeed):
        raise NotImplementedError(
            "TierckptCallback does not support DeepSpeedStrategy (DeepSpeed writes its own checkpoint "
            "files); use ModelParallelStrategy or FSDPStrategy(state_dict_type='sharded')"
        )
    if isinstance(strategy, strategies.FSDPStrategy):
        if getattr(strategy, "_state_dict_type", "sharded") != "sharded":
            raise ValueError(
                "TierckptCallback needs FSDPStrategy(state_dict_type='sharded'): each rank saves its own "
                "shard (a 'full' state dict is gathered onto rank 0 at every save)"
            )
        return True
    modelparallel = getattr(strategies, "ModelParallelStrategy", None)
    if modelparallel is not None and isinstance(strategy, modelparallel):
        if not getattr(strategy, "_save_distributed_checkpoint", True):
            raise ValueError("TierckptCallback needs ModelParallelStrategy(save_distributed_checkpoint=True)")
        return True
    return False


class TierckptCallback(_callback_base()):  # type: ignore[misc]
    """Save every ``every_n_steps`` optimizer steps and on SIGTERM; restore at the start of ``fit``.

    ``root``, ``job``: the ramdisk root and job id (default ``$TIERCKPT_ROOT`` / ``$TIERCKPT_JOB``, which
    the operator injects). ``keep``: committed steps kept per rank. ``restore``: resume from the newest
    common step at ``on_fit_start``. ``save_on_train_end``: save the last step too. ``save_on_sigterm``:
    save the step where Lightning stopped on SIGTERM. Other keyword arguments go to
    ``tierckpt.Checkpointer``.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        *,
        root: str | None = None,
        job: str | None = None,
        keep: int = 2,
        restore: bool = True,
        save_on_train_end: bool = True,
        save_on_sigterm: bool = True,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.root, self.job, self.keep = root, job, keep
        self.restore_on_start = restore
        self.save_on_train_end = save_on_train_end
        self.save_on_sigterm = save_on_sigterm
        self.options = checkpointer_options
        self.checkpointer: Any = None
        """The ``tierckpt.Checkpointer`` (per-rank strategies) of the running fit."""
        self.writer: Any = None
        """The ``tierckpt.dcp.RamdiskWriter`` (sharded strategies) of the running fit."""
        self.restored_step: int | None = None
        """The step ``on_fit_start`` restored (None: started fresh)."""
        self.last_saved_step: int | None = None
        self._rank = 0
        self._pending_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------- callback state

    def state_dict(self) -> dict[str, Any]:
        """Part of every checkpoint: this rank's RNG states (Lightning's own checkpoints have none)."""
        return {"rank": self._rank, "rng": collect_rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("rank") == self._rank and "rng" in state_dict:
            self._pending_rng = state_dict["rng"]  # set just before the first resumed batch

    # ------------------------------------------------------------------------------- hooks

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.checkpointer is not None or self.writer is not None:
            return
        self._rank = trainer.global_rank
        if _sharded(trainer.strategy):
            from tierckpt.dcp import RamdiskWriter

            self.writer = RamdiskWriter(
                self.root, self.job, rank=trainer.global_rank, world_size=trainer.world_size, keep=self.keep
            )
            return
        from tierckpt.checkpointer import Checkpointer

        self.checkpointer = Checkpointer(
            root=self.root,
            job=self.job,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            keep=self.keep,
            **self.options,
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.restore_on_start or (self.checkpointer is None and self.writer is None):
            return
        if trainer.ckpt_path is not None:
            log.warning(
                "rank %d: fit(ckpt_path=%r) given; not restoring from tierckpt", self._rank, trainer.ckpt_path
            )
            return
        step, checkpoint = (
            self._restore_sharded(trainer) if self.writer is not None else self._restore(trainer, pl_module)
        )
        if step is not None:
            log.info("rank %d resumed from step %d", self._rank, step)
            self._announce(trainer, step, checkpoint)
        self.restored_step = self.last_saved_step = step

    def _announce(self, trainer: Any, step: int, checkpoint: dict[str, Any]) -> None:
        """Say on rank 0, with Lightning's ``rank_zero_info`` (shown by default), where the job resumed
        from, and whether it was complete already (Lightning then trains nothing)."""
        info = _lightning("utilities").rank_zero_info  # logs on global rank 0 only
        where = self.checkpointer.settings if self.checkpointer is not None else self.writer
        info(resume_message(where.root, where.job, self._rank, step))  # every rank: a collective
        limit = _reached_limit(trainer, checkpoint)
        if limit is not None:
            info(complete_message(step, limit, "fit() returns without training"))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pending_rng is not None:
            set_rng_states(self._pending_rng)
            self._pending_rng = None

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self.last_saved_step:
            self.save(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer)
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        exceptions = _lightning("utilities.exceptions")
        sigterm = exceptions is not None and isinstance(exception, exceptions.SIGTERMException)
        if not sigterm or not self.save_on_sigterm or (self.checkpointer is None and self.writer is None):
            return
        step = trainer.global_step
        if step > 0 and step != self.last_saved_step:
            log.warning("rank %d: SIGTERM: saving step %d before exiting", self._rank, step)
            self.save(trainer)
        if self.checkpointer is not None:
            self.checkpointer.wait()  # committed before the process exits

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # ------------------------------------------------------------------------------- saving

    def save(self, trainer: Any) -> Any:
        """Save the current step now (every rank; collective for sharded strategies). Per-rank strategies
        return the ``SaveHandle`` (the commit continues in the background)."""
        if self.checkpointer is None and self.writer is None:
            raise RuntimeError("TierckptCallback.save before setup('fit')")
        step = trainer.global_step
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        handle = None
        if self.writer is not None:
            self._save_sharded(checkpoint, step)
        else:
            handle = self.checkpointer.save(step, checkpoint)
        self.last_saved_step = step
        return handle

    def _save_sharded(self, checkpoint: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        state = {
            "state_dict": checkpoint.pop("state_dict"),
            "optimizer_states": checkpoint.pop("optimizer_states"),
        }
        remainder = io.BytesIO()
        torch.save(checkpoint, remainder)
        state[f"{_REMAINDER_PREFIX}{self._rank:05d}"] = remainder.getvalue()
        dcp_save(state, checkpoint_id=step, storage_writer=self.writer)

    # ------------------------------------------------------------------------------- restoring

    def _restore(self, trainer: Any, pl_module: Any) -> tuple[int | None, dict[str, Any]]:
        checkpoint: dict[str, Any] = {
            "state_dict": pl_module.state_dict(),
            "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
        }
        step: int | None = self.checkpointer.load(checkpoint, allow_missing=True)
        if step is None:
            return None, checkpoint
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint
        if not trainer.strategy.restore_checkpoint_after_setup:  # otherwise the Trainer does it next
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()
        return step, checkpoint  # the Trainer restores precision, loops, optimizers and schedulers next

    def _restore_sharded(self, trainer: Any) -> tuple[int | None, dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        from tierckpt.dcp import RamdiskReader, dcp_steps
        from tierckpt.planning.common_step import newest_common_step
        from tierckpt.snapshot import agree

        step = newest_common_step(agree.all_gather(dcp_steps(self.writer.root, self.writer.job)))
        if step is None:
            return None, {}
        model, optimizers = trainer.strategy.model, trainer.optimizers
        key = f"{_REMAINDER_PREFIX}{self._rank:05d}"
        state: dict[str, Any] = {
            "state_dict": get_model_state_dict(model),
            "optimizer_states": [get_optimizer_state_dict(model, opt) for opt in optimizers],
            key: b"",
        }
        dcp_load(state, checkpoint_id=step, storage_reader=RamdiskReader(self.writer.root, self.writer.job))
        set_model_state_dict(model, state["state_dict"])
        for opt, saved in zip(optimizers, state["optimizer_states"], strict=True):
            set_optimizer_state_dict(model, opt, saved)
        remainder = torch.load(io.BytesIO(state[key]), weights_only=False)  # written by this rank
        trainer._checkpoint_connector._loaded_checkpoint = remainder  # the Trainer restores the rest next
        return step, remainder


def _reached_limit(trainer: Any, checkpoint: dict[str, Any]) -> str | None:
    """The limit a restored checkpoint already reached (``"max_steps=30"``), as Lightning's fit loop
    decides when it is done (global steps, epochs processed); None while there is training left."""
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    if max_steps not in (None, -1) and checkpoint.get("global_step", 0) >= max_steps:
        return f"max_steps={max_steps}"
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = fit_loop.get("epoch_progress", {}).get("current", {}).get("processed", 0)
    if max_epochs not in (None, -1) and epochs >= max_epochs:
        return f"max_epochs={max_epochs}"
    return None
