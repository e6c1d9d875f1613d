"""A PyTorch Lightning callback that checkpoints to the node's RAM disk with ``tierckpt.Checkpointer``.

::

    from lightning.pytorch import Trainer
    from tierckpt.integrations.lightning import TierckptCallback

    trainer = Trainer(callbacks=[TierckptCallback(every_n_steps=100)], ...)
    trainer.fit(model)          # resumes from the newest step every rank holds, if there is one

Each rank saves its own state (the LightningModule's ``state_dict``, every optimizer and LR scheduler,
and the fit loop's progress) every ``every_n_steps`` optimizer steps, blocking training only for the
copy into the ramdisk; the node's replicator takes it to peers and to GCS. At ``on_fit_start`` the
callback restores the newest step every rank holds (staged by the replicator after a failure), so
``global_step``, the epoch and the optimizer state continue where they were. Keep Lightning's own
``ModelCheckpoint`` for the occasional durable export if you want one; this callback is the fast path.

As with Lightning's own checkpoints, a resume in the middle of an epoch replays the exact batches only
if the dataloader is resumable (``state_dict``/``load_state_dict``); at an epoch boundary it is exact
(checked against Lightning 2.6: weights after resuming equal an uninterrupted run's, bit for bit).

Lightning is imported only by this module, and only if it is installed: without it the callback is a
plain object with the same hooks (which is how it is tested). Works with ``lightning`` (2.x) and
``pytorch_lightning``. Strategies whose ``state_dict`` is sharded (FSDP) save each rank's shard.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["TierckptCallback"]

log = logging.getLogger(__name__)


def _callback_base() -> type:
    for module in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            return __import__(module, fromlist=["Callback"]).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    return object


class TierckptCallback(_callback_base()):  # type: ignore[misc]
    """Save every ``every_n_steps`` optimizer steps to the ramdisk; restore at the start of ``fit``.

    ``root``, ``job``: the ramdisk root and job id (default: ``$TIERCKPT_ROOT`` / ``$TIERCKPT_JOB``,
    which the operator injects). ``keep``: committed steps kept per rank. ``restore``: resume from the
    newest common step at ``on_fit_start``. ``save_on_train_end``: save the last step too. Other
    keyword arguments go to ``tierckpt.Checkpointer``.
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
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.root, self.job, self.keep = root, job, keep
        self.restore_on_start = restore
        self.save_on_train_end = save_on_train_end
        self.options = checkpointer_options
        self.checkpointer: Any = None
        self.restored_step: int | None = None
        """The step ``on_fit_start`` restored (None: started fresh)."""
        self.last_saved_step: int | None = None

    # ------------------------------------------------------------------------------- state

    @staticmethod
    def training_state(trainer: Any, pl_module: Any) -> dict[str, Any]:
        """What one rank checkpoints: model, optimizers, LR schedulers and the fit loop's progress."""
        return {
            "model": pl_module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
            "fit_loop": trainer.fit_loop.state_dict(),
        }

    @staticmethod
    def apply_state(trainer: Any, pl_module: Any, state: dict[str, Any]) -> None:
        pl_module.load_state_dict(state["model"])
        for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        for cfg, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            cfg.scheduler.load_state_dict(saved)
        trainer.fit_loop.load_state_dict(state["fit_loop"])

    # ------------------------------------------------------------------------------- hooks

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.checkpointer is not None:
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
        if not self.restore_on_start or self.checkpointer is None:
            return
        state = self.training_state(trainer, pl_module)
        step = self.checkpointer.load(state, allow_missing=True)
        if step is not None:
            self.apply_state(trainer, pl_module, state)
            log.info(
                "rank %d resumed from step %d (global_step %d)",
                trainer.global_rank,
                step,
                trainer.global_step,
            )
        self.restored_step = self.last_saved_step = step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self.last_saved_step:
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end and trainer.global_step > 0 and trainer.global_step != self.last_saved_step:
            self.save(trainer, pl_module)
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None

    # ------------------------------------------------------------------------------- saving

    def save(self, trainer: Any, pl_module: Any) -> Any:
        """Save the current step now; returns the ``SaveHandle`` (commit continues in the background)."""
        if self.checkpointer is None:
            raise RuntimeError("TierckptCallback.save before setup('fit')")
        step = trainer.global_step
        handle = self.checkpointer.save(step, self.training_state(trainer, pl_module))
        self.last_saved_step = step
        return handle
