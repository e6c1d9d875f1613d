"""``TierckptAccelerator.save_state``/``load_state`` round trip, under torchrun (tests/integrations).

Train a few steps, save, note the state and the next random numbers, train on (changing all of it),
load: everything is back and the random numbers repeat. Every rank writes its checks to
``$RESULT.<rank>``. (The training loop of docs/integration.md is ``accelerate_train.py``.)
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys

import numpy as np
import torch
from teardown import exit_distributed  # this directory is on sys.path
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.integrations.accelerate import TierckptAccelerator


class Counter:
    """An object registered for checkpointing."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def plain(state: object) -> object:
    """Tensors (and DTensors) as full plain tensors, for comparing states."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor().clone()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [plain(v) for v in state]
    return copy.deepcopy(state)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4, shuffle=True)
    counter = Counter()

    accelerator = TierckptAccelerator(cpu=True)  # root, job: $TIERCKPT_ROOT, $TIERCKPT_JOB
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(counter)
    start = accelerator.load_state()  # the newest step every rank holds, or None

    def train(steps: int) -> None:
        batches = iter(loader)
        for _ in range(steps):
            x, y = next(batches)
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            counter.n += 1

    train(3)
    accelerator.save_state(step=3)  # this rank's state, copied into the node's RAM disk

    saved = {
        "model": plain(model.state_dict()),
        "optimizer": plain(optimizer.state_dict()),
        "scheduler": plain(scheduler.state_dict()),
        "counter": counter.n,
        "draws": draws(),
    }
    train(2)
    loaded = accelerator.load_state()
    now = {
        "model": plain(model.state_dict()),
        "optimizer": plain(optimizer.state_dict()),
        "scheduler": plain(scheduler.state_dict()),
        "counter": counter.n,
        "draws": draws(),
    }
    checks = {k: same(saved[k], now[k]) for k in saved}
    result = {"start": start, "loaded": loaded, "checks": checks, "sharded": accelerator._tierckpt_sharded()}
    with open(f"{os.environ['RESULT']}.{accelerator.process_index}", "w") as f:
        json.dump(result, f)
    accelerator.end_training()
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
