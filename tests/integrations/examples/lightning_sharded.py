"""Lightning ``ModelParallelStrategy`` (FSDP2) with ``TierckptCallback``: the shards go through DCP.

Run under torchrun by tests/integrations/test_lightning.py. Every rank writes its own shard of the
final weights (full tensors gathered) to ``$RESULT`` (rank 0) for comparison; ``PAUSE_AT`` holds
training at a step until the process is killed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_ddp import ResumableLoader, pause_marker, pause_step  # this directory is on sys.path
from teardown import exit_distributed  # this directory is on sys.path
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from tierckpt.integrations.lightning import TierckptCallback


class PauseAt(pl.Callback):
    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.marker.with_name(f"{self.marker.name}.{trainer.global_rank}").touch()
            while True:
                time.sleep(0.05)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self.net, mesh=self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def configure_callbacks(self) -> list[pl.Callback]:
        step = pause_step()
        return [] if step is None else [PauseAt(step, pause_marker())]


def main() -> None:
    pl.seed_everything(0, verbose=False)
    model = Model()
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    trainer = Trainer(
        max_steps=12,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=ModelParallelStrategy(
            data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1
        ),
        callbacks=[TierckptCallback(every_n_steps=4)],
        logger=False,
    )
    # 8 batches per rank and epoch: steps 4 and 8 are saved, 12 is the end; the epoch boundary is 8
    trainer.fit(model, train_dataloaders=ResumableLoader(data, batch_size=2, shuffle=True))
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        (tierckpt,) = [c for c in trainer.callbacks if isinstance(c, TierckptCallback)]
        torch.save({"weights": weights, "restored_step": tierckpt.restored_step}, os.environ["RESULT"])
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
