"""Hugging Face ``Trainer`` whose checkpoints go to the node's RAM disk and resume exactly.

::

    from tierckpt.integrations.hf import TierckptTrainer

    trainer = TierckptTrainer(model=model, args=TrainingArguments(save_steps=100, ...), train_dataset=ds)
    trainer.train()      # resumes from the newest step every rank holds, if there is one

``TierckptTrainer`` is ``transformers.Trainer`` with its checkpointing moved into tierckpt, at the two
places the Trainer itself checkpoints:

* **saving**: ``_save_checkpoint`` (called on every rank whenever ``save_strategy``/``save_steps`` say
  so) saves one step per rank with ``tierckpt.Checkpointer``: the model's ``state_dict``, optimizer, LR
  scheduler, AMP ``GradScaler``, this rank's RNG states and the ``TrainerState`` (with the states of
  stateful callbacks), instead of writing ``checkpoint-N`` directories;
* **resuming**: ``train()`` (with ``resume_from_checkpoint`` None or True) loads the newest step every rank
  holds into the model in place, strictly (a model of another architecture raises
  ``tierckpt.StateMismatchError`` before anything is copied), and hands the rest to the Trainer's own
  resume path: the ``TrainerState`` is staged as ``trainer_state.json`` in a private temporary directory
  passed on as ``resume_from_checkpoint``, so the Trainer computes the epoch and the batches to skip
  (the data position) exactly as for its own checkpoints, and the loading methods it calls
  (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
  ``_load_rng_state``) take the states from that step. A path given as ``resume_from_checkpoint``
  resumes from that ``checkpoint-N`` directory as usual. Rank 0 says which step it resumed, when it was
  saved and where each rank's copy came from (a warning: the level Python and transformers show by
  default). A step that already reached ``max_steps`` (or else ``num_train_epochs``) is a finished job
  launched again: ``train()`` warns and returns at once, with that step's ``TrainerState``, instead of
  training one step more as ``Trainer`` resumed from its final checkpoint does.

A ``TrainerCallback`` alone cannot do this: the Trainer decides the data position from the checkpoint
it resumes, before any callback runs. The methods overridden are private to ``transformers``; the
tests run them against the pinned version. DeepSpeed and FSDP runs of the Trainer keep their own
checkpoint engines (refused here with a clear error): for FSDP with tierckpt use Accelerate
(``tierckpt.integrations.accelerate``) or DCP.

* **preemption**: a SIGTERM during ``train()`` (Kubernetes deleting the pod; torchrun forwards it to
  its workers) ends training at the end of the current step, which is saved first (every rank saves the
  step it reached; a restore takes the newest step every rank holds). Once that step has committed the
  signal is delivered again to the handler that was there before, by default ending the process, so the
  code after ``train()`` (a final ``save_model``, say) does not run as if training had finished.
  ``tierckpt_received_sigterm`` tells a callback that it came.

``TierckptTrainer(..., tierckpt={"root": ..., "job": ..., "keep": 2, "resume": True,
"save_on_sigterm": True})`` overrides the ``$TIERCKPT_ROOT``/``$TIERCKPT_JOB`` defaults; other keys go
to ``tierckpt.Checkpointer``. Mix
``TierckptTrainerMixin`` into another ``Trainer`` subclass (``class T(TierckptTrainerMixin, SFTTrainer)``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from tierckpt.integrations.lazy import framework_subclass
from tierckpt.integrations.resume import complete_message, resume_message

__all__ = ["TierckptTrainer", "TierckptTrainerMixin"]

log = logging.getLogger(__name__)

_STATE_NAME = "trainer_state.json"  # the name transformers reads the TrainerState from


class TierckptTrainerMixin:
    """The tierckpt checkpointing of ``TierckptTrainer``, for any ``transformers.Trainer`` subclass."""

    def __init__(self, *args: Any, tierckpt: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(tierckpt or {})
        self.tierckpt_resume: bool = bool(options.pop("resume", True))
        self.tierckpt_save_on_sigterm: bool = bool(options.pop("save_on_sigterm", True))
        self.tierckpt_received_sigterm = False
        """Set by a SIGTERM during ``train()``: the step that ends now is saved, then training stops."""
        self.tierckpt_options = options
        self.tierckpt_restored_step: int | None = None
        """The step ``train()`` resumed from (None: started fresh or from a directory)."""
        self._tierckpt: Any = None
        self._tierckpt_loaded: dict[str, Any] | None = None
        self._tierckpt_dir: str | None = None
        self.add_callback(_sigterm_callback(self))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------- the checkpointer

    def _tierckpt_checkpointer(self) -> Any:
        if self._tierckpt is None:
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # type: ignore[attr-defined]
                raise NotImplementedError(
                    "TierckptTrainer does not checkpoint DeepSpeed or FSDP runs of the Trainer (they write "
                    "their own checkpoint files); use tierckpt.integrations.accelerate or tierckpt.dcp"
                )
            from tierckpt.checkpointer import Checkpointer

            args = self.args  # type: ignore[attr-defined]
            options = {"keep": 2, **self.tierckpt_options}
            self._tierckpt = Checkpointer(rank=args.process_index, world_size=args.world_size, **options)
        return self._tierckpt

    def _tierckpt_state(self) -> dict[str, Any]:
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        from tierckpt.integrations.rng import collect_rng_states

        return {
            "model": self.model.state_dict(),  # type: ignore[attr-defined]
            "optimizer": self.optimizer.state_dict(),  # type: ignore[attr-defined]
            "scheduler": self.lr_scheduler.state_dict(),  # type: ignore[attr-defined]
            "scaler": None if scaler is None else scaler.state_dict(),
            "rng": collect_rng_states(),
            "trainer_state": json.dumps(dataclasses.asdict(self.state)),
        }

    # ------------------------------------------------------------------------------- saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Where the Trainer saves ``checkpoint-N``: save the step to the ramdisk instead (every rank)."""
        from transformers.trainer_callback import ExportableState

        if self.hp_search_backend is None and trial is None:  # type: ignore[attr-defined]
            self.store_flos()  # type: ignore[attr-defined]
        state = self.state
        for cb in [*self.callback_handler.callbacks, self.control]:  # type: ignore[attr-defined]
            if isinstance(cb, ExportableState):  # as the Trainer records them before saving its state
                name = type(cb).__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        self._tierckpt_checkpointer().save(state.global_step, self._tierckpt_state())
        log.info("saved step %d to the ramdisk", state.global_step)

    # ------------------------------------------------------------------------------- resuming

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; None or True first resume from the newest step on the ramdisk, if any."""
        previous = self._tierckpt_catch_sigterm()
        try:
            if resume_from_checkpoint in (None, True) and self.tierckpt_resume:
                staged = self._tierckpt_restore()
                if staged is not None:
                    finished = self._tierckpt_finished()
                    if finished is not None:
                        return finished
                    resume_from_checkpoint = staged
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._tierckpt_loaded = None
            if self._tierckpt_dir is not None:
                shutil.rmtree(self._tierckpt_dir, ignore_errors=True)
                self._tierckpt_dir = None
            if self._tierckpt is not None:
                self._tierckpt.close()  # every save committed
                self._tierckpt = None
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
                if self.tierckpt_received_sigterm:
                    log.warning("SIGTERM: the last step is committed; passing the signal on")
                    signal.raise_signal(signal.SIGTERM)

    def _tierckpt_catch_sigterm(self) -> Any:
        """Install the SIGTERM handler for ``train()``; returns the one it replaces (None: not installed)."""
        if not self.tierckpt_save_on_sigterm or threading.current_thread() is not threading.main_thread():
            return None
        self.tierckpt_received_sigterm = False

        def received(signum: int, frame: FrameType | None) -> None:
            if not self.tierckpt_received_sigterm:
                log.warning("SIGTERM: training stops after the current step, which is saved first")
            self.tierckpt_received_sigterm = True

        return signal.signal(signal.SIGTERM, received)

    def _tierckpt_restore(self) -> str | None:
        """Load the newest common step (the model in place); stage its TrainerState for the Trainer."""
        loaded: dict[str, Any] = {
            "model": self.model.state_dict(),  # type: ignore[attr-defined]
            "optimizer": {},
            "scheduler": {},
            "scaler": None,
            "rng": None,
            "trainer_state": None,
        }
        step = self._tierckpt_checkpointer().load(loaded, allow_missing=True)
        self.tierckpt_restored_step = step
        if step is None:
            return None
        self._tierckpt_loaded = loaded
        self._tierckpt_dir = tempfile.mkdtemp(prefix="tierckpt-hf-")
        with open(os.path.join(self._tierckpt_dir, _STATE_NAME), "w") as f:
            f.write(loaded["trainer_state"])
        where = self._tierckpt.settings
        message = resume_message(where.root, where.job, where.rank, step)  # every rank: a collective
        if self.is_world_process_zero():  # type: ignore[attr-defined]
            log.warning("%s", message)
        return self._tierckpt_dir

    def _tierckpt_finished(self) -> Any:
        """When the step just loaded already reached the end of training (``max_steps``, or else
        ``num_train_epochs``): say so on rank 0, take its ``TrainerState`` and return ``train()``'s
        ``TrainOutput`` without training. None while there is training left."""
        from transformers import TrainerState
        from transformers.trainer_utils import TrainOutput

        assert self._tierckpt_loaded is not None and self._tierckpt_dir is not None
        saved = json.loads(self._tierckpt_loaded["trainer_state"])
        args = self.args  # type: ignore[attr-defined]
        if args.max_steps > 0:
            limit = f"max_steps={args.max_steps}" if saved["global_step"] >= args.max_steps else None
        else:
            done = (saved.get("epoch") or 0.0) >= args.num_train_epochs
            limit = f"num_train_epochs={args.num_train_epochs:g}" if done else None
        if limit is None:
            return None
        self.state = TrainerState.load_from_json(os.path.join(self._tierckpt_dir, _STATE_NAME))
        if self.is_world_process_zero():  # type: ignore[attr-defined]
            log.warning(
                "%s", complete_message(self.state.global_step, limit, "train() returns without training")
            )
        return TrainOutput(self.state.global_step, 0.0, {})

    def _restoring(self, checkpoint: str | None) -> dict[str, Any] | None:
        return self._tierckpt_loaded if checkpoint is not None and checkpoint == self._tierckpt_dir else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._restoring(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # else: the weights were loaded in place by _tierckpt_restore

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        loaded = self._restoring(checkpoint)
        if loaded is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        self.optimizer.load_state_dict(loaded["optimizer"])  # type: ignore[attr-defined]
        self.lr_scheduler.load_state_dict(loaded["scheduler"])  # type: ignore[attr-defined]

    def _load_scaler(self, checkpoint: str | None) -> None:
        loaded = self._restoring(checkpoint)
        if loaded is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None and loaded["scaler"]:
            scaler.load_state_dict(loaded["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        loaded = self._restoring(checkpoint)
        if loaded is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        from tierckpt.integrations.rng import set_rng_states

        set_rng_states(loaded["rng"])


def _sigterm_callback(trainer: TierckptTrainerMixin) -> Any:
    """The ``TrainerCallback`` that turns a received SIGTERM into a save of the step just ended and the
    end of training (after the Trainer's own flow callback has decided the step)."""
    from transformers import TrainerCallback

    class TierckptSigterm(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if trainer.tierckpt_received_sigterm:
                log.warning("SIGTERM: saving step %d before exiting", state.global_step)
                control.should_save = True
                control.should_training_stop = True
            return control

    return TierckptSigterm()


if TYPE_CHECKING:
    from transformers import Trainer

    class TierckptTrainer(TierckptTrainerMixin, Trainer):
        """Built on first use by ``__getattr__`` (importing this module does not import transformers)."""


def __getattr__(name: str) -> Any:
    if name != "TierckptTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return framework_subclass(
        globals(),
        name,
        TierckptTrainerMixin,
        ("transformers", "Trainer"),
        "``transformers.Trainer`` checkpointing to the node's RAM disk (see the module).",
    )
