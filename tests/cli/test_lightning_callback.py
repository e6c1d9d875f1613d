"""``tierckpt.integrations.lightning.TierckptCallback`` driven through Lightning's hook sequence by
duck-typed trainer objects (Lightning is not a dependency), with a real module, Adam, an LR scheduler,
the real Checkpointer and a real ramdisk directory: save every N steps, "crash", resume bit-exact."""

from __future__ import annotations

import copy
import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt.integrations.lightning import TierckptCallback


class FitLoop:
    """Stands in for Lightning's fit loop: progress counters with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.progress = {"batches": 0, "epoch": 0, "tag": "fit"}

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.progress)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress = copy.deepcopy(state)


class Trainer:
    global_rank, world_size = 0, 1

    def __init__(self, module: torch.nn.Module, seed: int) -> None:
        torch.manual_seed(seed)
        for p in module.parameters():
            torch.nn.init.normal_(p)
        self.optimizers = [torch.optim.Adam(module.parameters(), lr=0.01)]
        self.lr_scheduler_configs = [
            types.SimpleNamespace(
                scheduler=torch.optim.lr_scheduler.StepLR(self.optimizers[0], step_size=2, gamma=0.5)
            )
        ]
        self.fit_loop = FitLoop()

    @property
    def global_step(self) -> int:
        return self.fit_loop.progress["batches"]

    def train_step(self, module: torch.nn.Module) -> None:
        g = torch.Generator().manual_seed(self.global_step)
        loss = module(torch.randn(8, 4, generator=g)).pow(2).mean()
        self.optimizers[0].zero_grad()
        loss.backward()
        self.optimizers[0].step()
        self.lr_scheduler_configs[0].scheduler.step()
        self.fit_loop.progress["batches"] += 1


def _fit(root: Path, steps: int, seed: int) -> tuple[TierckptCallback, Trainer, torch.nn.Module]:
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    trainer = Trainer(module, seed)
    cb = TierckptCallback(every_n_steps=3, root=str(root), job="lightning-job")
    cb.setup(trainer, module, "fit")
    cb.on_fit_start(trainer, module)
    while trainer.global_step < steps:
        trainer.train_step(module)
        cb.on_train_batch_end(trainer, module, None, None, trainer.global_step - 1)
    cb.on_train_end(trainer, module)
    cb.teardown(trainer, module, "fit")
    return cb, trainer, module


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_saves_every_n_steps_and_resumes_bit_exact(tmp_path: Path) -> None:
    first, trainer, module = _fit(tmp_path, steps=7, seed=0)
    assert first.restored_step is None and first.last_saved_step == 7
    rank_dir = tmp_path / "lightning-job" / "rank-00000"
    assert sorted(p.name for p in rank_dir.glob("step-*")) == ["step-000000000006", "step-000000000007"]
    expected = TierckptCallback.training_state(trainer, module)

    # A new process: different initial weights, empty optimizer state, progress at zero.
    module2 = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    trainer2 = Trainer(module2, seed=99)
    cb = TierckptCallback(every_n_steps=3, root=str(tmp_path), job="lightning-job")
    cb.setup(trainer2, module2, "fit")
    cb.on_fit_start(trainer2, module2)
    assert cb.restored_step == 7 and trainer2.global_step == 7
    assert _same(TierckptCallback.training_state(trainer2, module2), expected)
    assert (
        trainer2.lr_scheduler_configs[0].scheduler.get_last_lr()
        == trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    )

    # Training goes on identically to an uninterrupted run.
    trainer.train_step(module)
    trainer2.train_step(module2)
    assert _same(module2.state_dict(), module.state_dict())
    cb.teardown(trainer2, module2, "fit")


def test_other_stages_and_options(tmp_path: Path) -> None:
    module = torch.nn.Linear(4, 2)
    trainer = Trainer(module, seed=1)
    cb = TierckptCallback(
        every_n_steps=5, root=str(tmp_path), job="j", restore=False, save_on_train_end=False
    )
    with pytest.raises(RuntimeError, match="before setup"):
        cb.save(trainer, module)
    cb.setup(trainer, module, "validate")
    assert cb.checkpointer is None  # only fitting checkpoints
    cb.setup(trainer, module, "fit")
    cb.on_fit_start(trainer, module)
    trainer.train_step(module)
    cb.on_train_end(trainer, module)
    cb.teardown(trainer, module, "fit")
    assert not list((tmp_path / "j" / "rank-00000").glob("step-*"))
    with pytest.raises(ValueError):
        TierckptCallback(every_n_steps=0)


@pytest.mark.skipif(
    importlib.util.find_spec("lightning") is not None
    or importlib.util.find_spec("pytorch_lightning") is not None,
    reason="Lightning is installed: the callback derives from its Callback",
)
def test_without_lightning_it_is_a_plain_object() -> None:
    assert TierckptCallback.__mro__[1] is object
