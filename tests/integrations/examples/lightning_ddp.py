"""Lightning DDP training with ``TierckptCallback``, run under torchrun by tests/integrations.

The region between the ``snippet`` markers is the Lightning example of docs/integration.md
(tests/integrations/test_docs_snippets.py keeps the two identical). The rest is the test harness: a
tiny model with dropout, a resumable data loader, a stateful callback and checkpoint hooks (to show
they are restored), and ``PAUSE_AT``: stop at that step until SIGKILLed or SIGTERMed. Rank 0 writes
the final weights and counters to ``$RESULT``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from teardown import exit_distributed  # this directory is on sys.path
from torch.utils.data import DataLoader, TensorDataset

# --8<-- [start:snippet]
from tierckpt.integrations.lightning import TierckptCallback

# --8<-- [end:snippet]


def _pause_index() -> int | None:
    steps = os.environ.get("PAUSE_AT", "")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return min(attempt, steps.count(",")) if steps else None


def pause_step() -> int | None:
    """``PAUSE_AT``: the step to pause at, per torchrun attempt (``6,15``: 6 in the first attempt, 15 in
    every later one)."""
    index = _pause_index()
    return None if index is None else int(os.environ["PAUSE_AT"].split(",")[index])


def pause_marker() -> Path:
    """``$RESULT.paused.<index of the pause step>``; each rank adds ``.<rank>`` (the harness waits)."""
    return Path(f"{os.environ['RESULT']}.paused.{_pause_index()}")


class ResumableLoader(DataLoader):
    """Resumes mid-epoch: its state is the number of batches handed out in the current epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out, self._resume_at = 0, 0

    def __iter__(self) -> Any:
        start, self._resume_at = self._resume_at, 0
        self.handed_out = start
        for i, batch in enumerate(super().__iter__()):
            if i >= start:
                self.handed_out = i + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["handed_out"]


class BatchCounter(pl.Callback):
    """A callback with state of its own."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


class PauseAt(pl.Callback):
    """Hold training after step ``PAUSE_AT`` until a signal ends it; the marker file says which step
    this attempt resumed from."""

    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        (tierckpt,) = [c for c in trainer.callbacks if isinstance(c, TierckptCallback)]
        marker = self.marker.with_name(f"{self.marker.name}.{trainer.global_rank}")
        marker.write_text(str(tierckpt.restored_step))  # where this attempt resumed from
        while not trainer.received_sigterm:
            time.sleep(0.05)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.steps_seen = 0  # kept by the checkpoint hooks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_seen += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_callbacks(self) -> list[pl.Callback]:
        extra: list[pl.Callback] = [BatchCounter()]
        if (step := pause_step()) is not None:
            extra.append(PauseAt(step, pause_marker()))
        return extra

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["steps_seen"] = self.steps_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.steps_seen = checkpoint["steps_seen"]


def init_process_group_per_attempt() -> None:
    """Under ``torchrun --max-restarts``, join the process group through a store prefix of this attempt.

    The workers of every attempt share torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``); gloo's
    connection set-up could read the previous attempt's (dead) addresses from it and fail. Lightning
    uses a process group that is already initialised.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"tierckpt-example/attempt-{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def main() -> None:
    init_process_group_per_attempt()
    pl.seed_everything(0, verbose=False)
    model = Model()
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    loader = ResumableLoader(data, batch_size=2, shuffle=True)  # 12 batches per rank and epoch

    # --8<-- [start:snippet]
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's --nproc-per-node; 1 under python
    trainer = Trainer(
        max_steps=30,
        devices=devices,
        num_nodes=int(os.environ.get("WORLD_SIZE", devices)) // devices,
        strategy="ddp",
        callbacks=[TierckptCallback(every_n_steps=4)],  # root, job: $TIERCKPT_ROOT, $TIERCKPT_JOB
        logger=False,
    )
    trainer.fit(model, train_dataloaders=loader)  # resumes from the newest step every rank holds
    # --8<-- [end:snippet]

    if trainer.global_rank == 0:
        (counter,) = [c for c in trainer.callbacks if isinstance(c, BatchCounter)]
        (tierckpt,) = [c for c in trainer.callbacks if isinstance(c, TierckptCallback)]
        torch.save(
            {
                "weights": model.state_dict(),
                "steps_seen": model.steps_seen,
                "batches": counter.batches,
                "global_step": trainer.global_step,
                "restored_step": tierckpt.restored_step,
            },
            os.environ["RESULT"],
        )
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
