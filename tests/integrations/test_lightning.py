"""``TierckptCallback`` against real Lightning (CPU, gloo): DDP over two processes under torchrun,
killed mid-epoch, then stopped by SIGTERM, then finished: the final weights equal an uninterrupted
run's bit for bit; FSDP2 (``ModelParallelStrategy``) through DCP; and in-process checks of one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations.harness import Run, free_port, same_tensors
from tierckpt import StateMismatchError
from tierckpt.protocol.format import committed_steps, rank_dir

pytest.importorskip("lightning")


@pytest.mark.e2e
def test_ddp_rank_killed_restarted_by_torchrun_then_terminated_resumes_bit_exact(
    module_root: Path, tmp_path: Path, lightning_reference: dict
):
    """torchrun --max-restarts: a rank SIGKILLed mid-epoch, torchrun restarts the workers, they resume
    from the last common step; then SIGTERM (the pod deleted) saves the step where training stopped; a
    new launch resumes from it. The final weights equal the uninterrupted run's, bit for bit."""
    env = {"TIERCKPT_ROOT": str(module_root), "TIERCKPT_JOB": "ddp"}
    ranks = [rank_dir(module_root, "ddp", r) for r in range(2)]
    elastic = ("--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")

    run = Run("lightning_ddp.py", tmp_path, "elastic", env=env, pause_at="6,15", torchrun_args=elastic)
    assert run.wait_paused(index=0) == ["None", "None"]  # step 6: mid-epoch (12 batches), 4 saved
    run.kill_worker(local_rank=1)
    assert run.wait_paused(index=1) == ["4", "4"]  # restarted by torchrun, resumed, now at step 15
    run.terminate()
    assert [committed_steps(d)[-1] for d in ranks] == [15, 15], run.log_text()  # saved on SIGTERM
    assert "SIGTERM: saving step 15" in run.log_text()

    finished = Run("lightning_ddp.py", tmp_path, "finished", env=env).finish()
    assert finished["restored_step"] == 15 and finished["global_step"] == 30
    assert same_tensors(finished["weights"], lightning_reference["weights"])
    # the module's checkpoint hooks and another callback's state came back too
    assert (finished["steps_seen"], finished["batches"]) == (
        lightning_reference["steps_seen"],
        lightning_reference["batches"],
    )


@pytest.mark.e2e
def test_fsdp2_shards_go_through_dcp_and_resume_bit_exact(module_root: Path, tmp_path: Path):
    reference = Run(
        "lightning_sharded.py",
        tmp_path,
        "ref",
        env={"TIERCKPT_ROOT": str(module_root), "TIERCKPT_JOB": "fsdp-ref"},
    ).finish()
    env = {"TIERCKPT_ROOT": str(module_root), "TIERCKPT_JOB": "fsdp"}
    killed = Run("lightning_sharded.py", tmp_path, "killed", env=env, pause_at=6)
    killed.wait_paused()
    killed.kill()
    from tierckpt.protocol.format import read_manifest, step_dir

    manifest = read_manifest(step_dir(rank_dir(module_root, "fsdp", 1), 4))
    assert manifest.manifest_kind == "dcp"  # each rank's shard, in the DCP layout
    finished = Run("lightning_sharded.py", tmp_path, "finished", env=env).finish()
    assert finished["restored_step"] == 4
    assert same_tensors(finished["weights"], reference["weights"])


# ------------------------------------------------------------------------------------------ one rank


def _fit(root: Path, max_steps: int, hidden: int = 16):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tierckpt.integrations.lightning import TierckptCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
            )

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    pl.seed_everything(1, verbose=False)
    module = Module()
    callback = TierckptCallback(every_n_steps=2, root=str(root), job="one")
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer.fit(module, train_dataloaders=loader)
    return trainer, callback


@pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable")
def test_one_rank_resumes_and_refuses_another_architecture(root: Path):
    trainer, callback = _fit(root, max_steps=5)
    assert callback.restored_step is None and committed_steps(rank_dir(root, "one", 0)) == [4, 5]
    assert not [c for c in trainer.callbacks if type(c).__name__ == "ModelCheckpoint"]  # none added

    trainer2, callback2 = _fit(root, max_steps=7)
    assert callback2.restored_step == 5 and trainer2.global_step == 7

    with pytest.raises(StateMismatchError) as err:
        _fit(root, max_steps=9, hidden=8)
    assert (
        "state_dict/net.0.weight: checkpoint float32 (16, 4), destination float32 (8, 4)"
        in err.value.mismatches
    )


def test_arguments_and_unsupported_strategies():
    from lightning.pytorch.strategies import FSDPStrategy

    from tierckpt.integrations.lightning import TierckptCallback, _sharded

    with pytest.raises(ValueError, match="at least 1"):
        TierckptCallback(every_n_steps=0)
    with pytest.raises(RuntimeError, match="before setup"):
        TierckptCallback().save(object())
    with pytest.raises(ValueError, match="state_dict_type='sharded'"):
        _sharded(FSDPStrategy(state_dict_type="full"))
    assert _sharded(FSDPStrategy(state_dict_type="sharded"))
