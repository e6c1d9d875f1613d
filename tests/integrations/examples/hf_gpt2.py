"""A tiny GPT-2 (config built here, nothing downloaded) trained by ``TierckptTrainer``, under torchrun.

Run by tests/integrations/test_hf.py. The region between the ``snippet`` markers is the Hugging Face
example of docs/integration.md (kept identical by tests/integrations/test_docs_snippets.py).
``PAUSE_AT``: hold training after that step until the process is killed or sent SIGTERM. Rank 0
writes the final weights to ``$RESULT``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from teardown import exit_distributed  # this directory is on sys.path
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

# --8<-- [start:snippet]
from tierckpt.integrations.hf import TierckptTrainer

# --8<-- [end:snippet]


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences (a fixed seed): language modelling on noise, enough to move the weights."""

    def __init__(self, n: int = 48, length: int = 16) -> None:
        self.tokens = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class PauseAt(TrainerCallback):
    """Hold training after step ``step`` until the process is killed or receives SIGTERM."""

    def __init__(self, step: int, marker: Path, sigterm: Callable[[], bool]) -> None:
        self.step, self.marker, self.sigterm = step, marker, sigterm

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.marker.with_name(f"{self.marker.name}.{args.process_index}").touch()
            while not self.sigterm():
                time.sleep(0.05)


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    dataset = TokenDataset()
    callbacks = []
    if os.environ.get("PAUSE_AT"):
        sigterm = lambda: trainer.tierckpt_received_sigterm  # noqa: E731 (trainer is assigned below)
        marker = Path(os.environ["RESULT"] + ".paused.0")
        callbacks.append(PauseAt(int(os.environ["PAUSE_AT"]), marker, sigterm))

    # --8<-- [start:snippet]
    args = TrainingArguments(
        output_dir="out",
        max_steps=16,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=4,  # each save goes to the ramdisk: $TIERCKPT_ROOT/$TIERCKPT_JOB
        use_cpu=True,
        report_to="none",
    )
    trainer = TierckptTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.train()  # resumes from the newest step every rank holds; on SIGTERM saves, then exits
    # --8<-- [end:snippet]

    if trainer.args.process_index == 0:
        torch.save(
            {"weights": model.state_dict(), "restored_step": trainer.tierckpt_restored_step},
            os.environ["RESULT"],
        )
    exit_distributed()


if __name__ == "__main__":
    sys.exit(main())
