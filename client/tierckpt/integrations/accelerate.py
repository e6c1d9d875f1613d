"""Hugging Face Accelerate: ``save_state``/``load_state`` to the node's RAM disk.

::

    from tierckpt.integrations.accelerate import TierckptAccelerator

    accelerator = TierckptAccelerator()                 # an accelerate.Accelerator
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    start = accelerator.load_state(max_steps=N)        # the newest step every rank holds, or None
    ...
    accelerator.save_state(step=step)                  # this rank's state, a copy into RAM

``TierckptAccelerator`` is ``accelerate.Accelerator`` whose ``save_state``/``load_state`` without a
directory go through tierckpt; with a directory they write and read Accelerate's own files as before.
Each rank saves what Accelerate's ``save_state`` covers: every prepared model, optimizer and LR
scheduler, the AMP ``GradScaler``, the RNG states, Accelerate's step counter and the objects given to
``register_for_checkpointing``; and the prepared data loaders' positions: their epoch, the batches
handed out in it and their generators' states (``integrations.accelerate_data``: the loaders
``prepare`` returns continue, after a load, with the rest of the saved epoch in the same order). Loading
is strict: a model of another architecture raises ``tierckpt.StateMismatchError`` before anything is
copied. ``load_state`` says on rank 0 (a warning, through Accelerate's logger) which step it resumed and
where each rank's copy came from; given ``max_steps``, also that the job is already complete.

Models whose weights are DTensor shards (FSDP2 through Accelerate's FSDP plugin, or ``fully_shard``)
go through PyTorch DCP with ``tierckpt.dcp.RamdiskWriter``/``RamdiskReader`` (states from
``torch.distributed.checkpoint.state_dict``), with each rank's other state under
``accelerate/rank-NNNNN``, on any number of nodes (every node holds the DCP metadata; docs/dcp.md).
DeepSpeed keeps its own checkpoint engine (it needs CUDA and writes its own files) and is refused.

The prepared objects are read from the ``Accelerator`` attributes its own ``save_state`` uses
(``_models``, ``_optimizers``, ``_schedulers``, ``_dataloaders``, ``_custom_objects``); the tests run
them against the pinned Accelerate. Registered ``save_state`` pre-hooks apply to directory saves only.
"""

from __future__ import annotations

import io
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.integrations.accelerate_data import ResumableLoader, own_generator
from tierckpt.integrations.lazy import framework_subclass
from tierckpt.integrations.resume import complete_message, resume_message

__all__ = ["TierckptAccelerator", "TierckptAcceleratorMixin"]

log = logging.getLogger(__name__)

_REMAINDER_PREFIX = "accelerate/rank-"


def _has_dtensor(state: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in state.values())


class TierckptAcceleratorMixin:
    """The tierckpt ``save_state``/``load_state`` of ``TierckptAccelerator``.

    ``tierckpt={"root": ..., "job": ..., "keep": 2}`` overrides the ``$TIERCKPT_ROOT``/``$TIERCKPT_JOB``
    defaults; other keys go to ``tierckpt.Checkpointer``.
    """

    def __init__(self, *args: Any, tierckpt: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tierckpt_options = {"keep": 2, **(tierckpt or {})}
        self._tierckpt: Any = None
        self._tierckpt_loaders: list[ResumableLoader] = []

    # ------------------------------------------------------------------------------- data loaders

    def prepare_data_loader(self, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        """Accelerate's ``prepare_data_loader``, given a generator of its own first and returning a
        ``ResumableLoader``: its position is saved with each step and resumed by its next pass."""
        if isinstance(data_loader, ResumableLoader):
            return data_loader
        own_generator(data_loader)
        prepared = super().prepare_data_loader(data_loader, *args, **kwargs)  # type: ignore[misc]
        return self._tierckpt_loader(prepared)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Accelerate's ``skip_first_batches`` of the loader ``prepare`` returned. After ``load_state`` the
        loader resumes its position by itself; skipping instead replaces that (logged)."""
        if isinstance(dataloader, ResumableLoader):
            if dataloader.skip_pending_resume():
                log.warning(
                    "skip_first_batches after load_state: the loader would have resumed the saved position "
                    "by itself; it now starts its next pass at the beginning of epoch %d",
                    dataloader.epoch,
                )
            dataloader = dataloader.loader
        return super().skip_first_batches(dataloader, num_batches)  # type: ignore[misc]

    def _tierckpt_loader(self, prepared: Any) -> ResumableLoader:
        """The ``ResumableLoader`` of a loader Accelerate prepared (made on first use)."""
        for loader in self._tierckpt_loaders:
            if loader.loader is prepared:
                return loader
        loader = ResumableLoader(prepared)
        self._tierckpt_loaders.append(loader)
        return loader

    # ------------------------------------------------------------------------------- plumbing

    def _tierckpt_sharded(self) -> bool:
        from accelerate.utils import DistributedType

        kind = self.distributed_type  # type: ignore[attr-defined]
        if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            raise NotImplementedError(
                f"TierckptAccelerator does not save {kind} runs (their engines write their own files); "
                "pass a directory to save_state/load_state"
            )
        models = self._models  # type: ignore[attr-defined]
        return kind == DistributedType.FSDP or any(_has_dtensor(m.state_dict()) for m in models)

    def _tierckpt_checkpointer(self) -> Any:
        if self._tierckpt is None:
            from tierckpt.checkpointer import Checkpointer

            self._tierckpt = Checkpointer(
                rank=self.process_index,  # type: ignore[attr-defined]
                world_size=self.num_processes,  # type: ignore[attr-defined]
                **self.tierckpt_options,
            )
        return self._tierckpt

    def _tierckpt_writer(self) -> Any:
        if self._tierckpt is None:
            from tierckpt.dcp import RamdiskWriter

            options = {k: v for k, v in self.tierckpt_options.items() if k in ("root", "job", "keep")}
            self._tierckpt = RamdiskWriter(
                rank=self.process_index,  # type: ignore[attr-defined]
                world_size=self.num_processes,  # type: ignore[attr-defined]
                **options,
            )
        return self._tierckpt

    def _tierckpt_rest(self) -> dict[str, Any]:
        """Everything but the models and optimizers: schedulers, loaders, scaler, RNG, step, objects."""
        from tierckpt.integrations.rng import collect_rng_states

        loaders = [self._tierckpt_loader(d).state_dict() for d in self._dataloaders]  # type: ignore[attr-defined]
        scaler = self.scaler  # type: ignore[attr-defined]
        return {
            "schedulers": [s.state_dict() for s in self._schedulers],  # type: ignore[attr-defined]
            "dataloaders": loaders,
            "scaler": None if scaler is None else scaler.state_dict(),
            "rng": collect_rng_states(),
            "step": self.step,
            "custom": [obj.state_dict() for obj in self._custom_objects],  # type: ignore[attr-defined]
        }

    def _tierckpt_apply_rest(self, rest: dict[str, Any]) -> None:
        from tierckpt.integrations.rng import set_rng_states

        for scheduler, saved in zip(self._schedulers, rest["schedulers"], strict=True):  # type: ignore[attr-defined]
            scheduler.load_state_dict(saved)
        for loader, saved in zip(self._dataloaders, rest["dataloaders"], strict=True):  # type: ignore[attr-defined]
            self._tierckpt_loader(loader).load_state_dict(saved)
        if self.scaler is not None and rest["scaler"]:  # type: ignore[attr-defined]
            self.scaler.load_state_dict(rest["scaler"])  # type: ignore[attr-defined]
        for obj, saved in zip(self._custom_objects, rest["custom"], strict=True):  # type: ignore[attr-defined]
            obj.load_state_dict(saved)
        self.step = rest["step"]
        set_rng_states(rest["rng"])

    # ------------------------------------------------------------------------------- save

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        *args: Any,
        step: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Without ``output_dir``: save this rank's state as ``step`` (default: the save iteration) to the
        ramdisk and return the step. With it: Accelerate's own ``save_state``."""
        if output_dir is not None or self.project_configuration.automatic_checkpoint_naming:  # type: ignore[attr-defined]
            return super().save_state(output_dir, *args, **kwargs)  # type: ignore[misc]
        step = self.save_iteration if step is None else step  # type: ignore[attr-defined]
        models, optimizers = self._models, self._optimizers  # type: ignore[attr-defined]
        if self._tierckpt_sharded():
            self._tierckpt_save_sharded(step)
        else:
            state = {
                "models": [self.unwrap_model(m).state_dict() for m in models],  # type: ignore[attr-defined]
                "optimizers": [opt.state_dict() for opt in optimizers],
                **self._tierckpt_rest(),
            }
            self._tierckpt_checkpointer().save(step, state)
        self.project_configuration.iteration = step + 1  # type: ignore[attr-defined]
        log.info("rank %d saved step %d to the ramdisk", self.process_index, step)  # type: ignore[attr-defined]
        return step

    def _tierckpt_save_sharded(self, step: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        state = self._tierckpt_sharded_state(get_model_state_dict, get_optimizer_state_dict)
        rest = io.BytesIO()
        torch.save(self._tierckpt_rest(), rest)
        state[self._tierckpt_rest_key()] = rest.getvalue()
        dcp_save(state, checkpoint_id=step, storage_writer=self._tierckpt_writer())

    def _tierckpt_sharded_state(self, get_model: Any, get_optimizer: Any) -> dict[str, Any]:
        models, optimizers = self._models, self._optimizers  # type: ignore[attr-defined]
        if len(optimizers) > len(models):
            raise ValueError("sharded states pair optimizer i with model i: prepare a model per optimizer")
        state: dict[str, Any] = {f"model_{i}": get_model(m) for i, m in enumerate(models)}
        for i, opt in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer(models[i], opt.optimizer)
        return state

    def _tierckpt_rest_key(self) -> str:
        return f"{_REMAINDER_PREFIX}{self.process_index:05d}"  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------- load

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        *args: Any,
        max_steps: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Without ``input_dir``: load the newest step every rank holds from the ramdisk and return it
        (None when there is none); say on rank 0 which step and from where, and, when the step reached
        ``max_steps``, that the job is already complete. With it: Accelerate's own ``load_state``."""
        if input_dir is not None or self.project_configuration.automatic_checkpoint_naming:  # type: ignore[attr-defined]
            return super().load_state(input_dir, *args, **kwargs)  # type: ignore[misc]
        models, optimizers = self._models, self._optimizers  # type: ignore[attr-defined]
        if self._tierckpt_sharded():
            step = self._tierckpt_load_sharded()
        else:
            state: dict[str, Any] = {
                "models": [self.unwrap_model(m).state_dict() for m in models],  # type: ignore[attr-defined]
                "optimizers": [opt.state_dict() for opt in optimizers],
            }
            step = self._tierckpt_checkpointer().load(state, allow_missing=True)
            if step is not None:
                for opt, saved in zip(optimizers, state["optimizers"], strict=True):
                    opt.load_state_dict(saved)
                self._tierckpt_apply_rest(state)
        if step is not None:
            self.project_configuration.iteration = step + 1  # type: ignore[attr-defined]
            log.info("rank %d resumed from step %d", self.process_index, step)  # type: ignore[attr-defined]
            where = getattr(self._tierckpt, "settings", self._tierckpt)  # a Checkpointer's, or the writer
            self._tierckpt_warn(resume_message(where.root, where.job, self.process_index, step))  # type: ignore[attr-defined]
            if max_steps is not None and step >= max_steps:
                self._tierckpt_warn(
                    complete_message(step, f"max_steps={max_steps}", "nothing is left to train")
                )
        return step

    def _tierckpt_warn(self, message: str) -> None:
        """A warning on the main process, through Accelerate's logger (shown with default settings)."""
        from accelerate.logging import get_logger

        get_logger(__name__).warning(message, main_process_only=True)

    def _tierckpt_load_sharded(self) -> int | None:
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

        writer = self._tierckpt_writer()
        step = newest_common_step(agree.all_gather(dcp_steps(writer.root, writer.job)))
        if step is None:
            return None
        state = self._tierckpt_sharded_state(get_model_state_dict, get_optimizer_state_dict)
        key = self._tierckpt_rest_key()
        state[key] = b""
        dcp_load(state, checkpoint_id=step, storage_reader=RamdiskReader(writer.root, writer.job))
        models, optimizers = self._models, self._optimizers  # type: ignore[attr-defined]
        for i, model in enumerate(models):
            set_model_state_dict(model, state[f"model_{i}"])
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(models[i], opt.optimizer, state[f"optimizer_{i}"])
        self._tierckpt_apply_rest(torch.load(io.BytesIO(state[key]), weights_only=False))  # this rank's own
        return step

    def end_training(self) -> None:
        if self._tierckpt is not None:
            close = getattr(self._tierckpt, "close", None)
            if close is not None:
                close()
            self._tierckpt = None
        super().end_training()  # type: ignore[misc]


if TYPE_CHECKING:
    from accelerate import Accelerator

    class TierckptAccelerator(TierckptAcceleratorMixin, Accelerator):  # type: ignore[misc]
        """Built on first use by ``__getattr__`` (importing this module does not import accelerate)."""


def __getattr__(name: str) -> Any:
    if name != "TierckptAccelerator":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return framework_subclass(
        globals(),
        name,
        TierckptAcceleratorMixin,
        ("accelerate", "Accelerator"),
        "``accelerate.Accelerator`` saving its state to the node's RAM disk.",
    )
