"""Training with ``TierckptAccelerator``, run under torchrun by tests/integrations/test_accelerate.py.

The region between the ``snippet`` markers is the Accelerate example of docs/integration.md
(tests/integrations/test_docs_snippets.py keeps the two identical): a plain ``DataLoader(shuffle=True)``
and a model with dropout, saved every 4 steps and at the end. ``PAUSE_AT``: hold training after that
step until the process is killed (an optimizer pre-hook, outside the snippet). Rank 0 writes the final
weights and the step ``load_state`` returned to ``$RESULT``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from teardown import exit_distributed  # this directory is on sys.path
from torch.utils.data import DataLoader, TensorDataset

# --8<-- [start:snippet]
from tierckpt.integrations.accelerate import TierckptAccelerator

# --8<-- [end:snippet]


def pause_after(step: int) -> Any:
    """An optimizer pre-hook: once the optimizer has taken ``step`` steps (its restored state counts
    them), write ``$RESULT.paused.0.<rank>`` and wait (to be killed) instead of taking the next."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        taken = int(next(iter(optimizer.state.values()))["step"]) if optimizer.state else 0
        if taken >= step:
            Path(f"{os.environ['RESULT']}.paused.0.{os.environ['RANK']}").touch()
            while True:
                time.sleep(0.05)

    return hook


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))  # 12 batches per rank and epoch
    max_steps = 30
    if os.environ.get("PAUSE_AT"):
        optimizer.register_step_pre_hook(pause_after(int(os.environ["PAUSE_AT"])))

    # --8<-- [start:snippet]
    loader = DataLoader(data, batch_size=2, shuffle=True)  # a plain loader: nothing to add for resuming
    accelerator = TierckptAccelerator(cpu=True)  # root, job: $TIERCKPT_ROOT, $TIERCKPT_JOB
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    start = accelerator.load_state(max_steps=max_steps)  # the newest step every rank holds, or None
    step = start or 0
    while step < max_steps:
        for x, y in loader:  # after load_state: the rest of the saved epoch, in the same order
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 4 == 0 or step == max_steps:  # the last step too: a relaunch has nothing to do
                accelerator.save_state(step=step)  # this rank's state, copied into the node's RAM disk
            if step == max_steps:
                break
    # --8<-- [end:snippet]

    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        torch.save({"weights": weights, "restored_step": start, "step": step}, os.environ["RESULT"])
    accelerator.end_training()
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
