"""``TierckptCallback`` against real Lightning (CPU, gloo): DDP over two processes under torchrun,
killed mid-epoch, then stopped by SIGTERM, then finished: the final weights equal an uninterrupted
run's bit for bit; FSDP2 (``ModelParallelStrategy``) through DCP; and in-process checks of one rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

from tests.integrations.harness import Run, free_port, same_tensors
from tierckpt import Checkpointer, StateMismatchError, TierckptError
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
    assert announced(run.log_text(), "ddp") == ["4"]  # once (rank 0), with Lightning's default logging

    last = Run("lightning_ddp.py", tmp_path, "finished", env=env)
    finished = last.finish()
    assert announced(last.log_text(), "ddp") == ["15"]
    assert "ranks 0-1 from this node's RAM disk" in last.log_text()
    assert finished["restored_step"] == 15 and finished["global_step"] == 30
    assert same_tensors(finished["weights"], lightning_reference["weights"])
    # the module's checkpoint hooks and another callback's state came back too
    assert (finished["steps_seen"], finished["batches"]) == (
        lightning_reference["steps_seen"],
        lightning_reference["batches"],
    )


def announced(log: str, job: str) -> list[str]:
    """The steps of the resume messages in a run's output."""
    head = f"tierckpt: resumed job {job!r} from step "
    return [line.split(head)[1].split()[0] for line in log.splitlines() if head in line]


@pytest.mark.e2e
def test_the_documented_trainer_runs_under_plain_python_and_a_finished_job_trains_nothing(
    module_root: Path, tmp_path: Path
):
    """The snippet's ``Trainer`` under ``python`` (no torchrun environment: one process). Launched again
    once finished, the job resumes its last step, says so and that it is complete (Lightning's
    ``rank_zero_info``, shown by default), and trains nothing."""
    env = {"TIERCKPT_ROOT": str(module_root), "TIERCKPT_JOB": "plain"}
    first = Run("lightning_ddp.py", tmp_path, "first", env=env, torchrun=False).finish()
    assert first["restored_step"] is None and first["global_step"] == 30

    run = Run("lightning_ddp.py", tmp_path, "again", env=env, torchrun=False)
    again = run.finish()
    assert again["restored_step"] == 30 and again["global_step"] == 30
    assert same_tensors(again["weights"], first["weights"]) and again["batches"] == first["batches"]
    assert committed_steps(rank_dir(module_root, "plain", 0)) == [28, 30]
    log = run.log_text()
    assert announced(log, "plain") == ["30"] and "rank 0 from this node's RAM disk" in log
    assert "tierckpt: the job is already complete: step 30 reached max_steps=30, so fit() returns" in log


@pytest.mark.e2e
def test_kill_9_on_torchrun_leaves_workers_that_hold_the_ramdisk_until_ended(
    module_root: Path, tmp_path: Path, lightning_reference: dict
):
    """What docs/quickstart.md says about ``kill -9``: SIGKILL to torchrun's whole process group kills
    torchrun alone (it starts each worker in a session of its own); the workers live on, holding their
    ranks' writer locks, and a new writer is told each holder's pid and command line. Once those are
    ended, the next launch resumes bit-exact."""
    env = {"TIERCKPT_ROOT": str(module_root), "TIERCKPT_JOB": "orphans"}
    run = Run("lightning_ddp.py", tmp_path, "first", env=env, pause_at=6)
    run.wait_paused()
    workers = psutil.Process(run.proc.pid).children()
    assert len(workers) == 2
    os.killpg(run.proc.pid, signal.SIGKILL)  # kill -9 -<pgid>: torchrun leads its process group
    run.proc.wait()
    try:
        for worker in workers:
            assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
            assert os.getsid(worker.pid) == worker.pid  # a session (and process group) of its own
        with pytest.raises(TierckptError) as err:
            Checkpointer(root=module_root, job="orphans", rank=0, world_size=2, writer_lock_timeout=0.5)
        (holder,) = [w for w in workers if f"pid {w.pid} on host " in str(err.value)]
        assert "examples/lightning_ddp.py" in str(err.value) and holder.environ()["RANK"] == "0"
    finally:
        for worker in workers:  # what the docs say to do: kill -KILL <pid>, or pkill -KILL -f <script>
            worker.kill()
        psutil.wait_procs(workers, timeout=10)
    last = Run("lightning_ddp.py", tmp_path, "second", env=env)
    finished = last.finish()
    assert finished["restored_step"] == 4
    assert same_tensors(finished["weights"], lightning_reference["weights"])


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
