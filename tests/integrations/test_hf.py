"""``TierckptTrainer`` against the real ``transformers.Trainer`` (CPU, gloo, a tiny GPT-2 built from a
config): killed mid-epoch under torchrun and restarted, or stopped by SIGTERM (saving the step it
reached), the final weights equal an uninterrupted run's bit for bit (model, optimizer, scheduler,
RNG, TrainerState and the data position all resumed), and the resume is announced once with default
logging; a finished job launched again trains nothing and says so; a model of another architecture is
refused with the strict-mode error."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tests.integrations.harness import EXAMPLES, Run, same_tensors
from tierckpt import StateMismatchError
from tierckpt.protocol.format import committed_steps, rank_dir

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict[str, str], Path]]:
    """An uninterrupted run: its result, its environment (job ``ref``, finished at step 16 on its
    ramdisk) and its work directory."""
    work = tmp_path_factory.mktemp("hf")
    with fresh_ramdisk_dir(work, "hf") as root:
        env = {"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "ref"}
        result = Run("hf_gpt2.py", work, "ref", env=env).finish()
        assert result["restored_step"] is None
        yield result, env, work


def announced(log: str, job: str) -> list[str]:
    """The steps of the resume messages in a run's output."""
    head = f"tierckpt: resumed job {job!r} from step "
    return [line.split(head)[1].split()[0] for line in log.splitlines() if head in line]


@pytest.mark.e2e
def test_killed_mid_epoch_resumes_bit_exact(reference, root: Path, tmp_path: Path):
    reference, _, _ = reference
    env = {"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "gpt2"}
    killed = Run("hf_gpt2.py", tmp_path, "killed", env=env, pause_at=6)  # an epoch is 6 steps per rank
    killed.wait_paused()
    killed.kill()
    assert [committed_steps(rank_dir(root, "gpt2", r)) for r in range(2)] == [[4], [4]]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("checkpoint-*"))

    last = Run("hf_gpt2.py", tmp_path, "finished", env=env)
    finished = last.finish()
    assert finished["restored_step"] == 4
    assert same_tensors(finished["weights"], reference["weights"])
    assert announced(last.log_text(), "gpt2") == ["4"]  # once (rank 0), with default logging
    assert "ranks 0-1 from this node's RAM disk" in last.log_text()


@pytest.mark.e2e
def test_a_finished_job_launched_again_trains_nothing_and_says_so(reference):
    """``max_steps`` reached: ``train()`` returns at once, as if finished (no step 17 is trained, as
    plain ``transformers.Trainer`` resumed from its final checkpoint would)."""
    expected, env, work = reference
    root = Path(env["TIERCKPT_ROOT"])
    run = Run("hf_gpt2.py", work, "again", env=env)
    again = run.finish()
    assert again["restored_step"] == 16
    assert same_tensors(again["weights"], expected["weights"])
    assert [committed_steps(rank_dir(root, "ref", r)) for r in range(2)] == [[12, 16], [12, 16]]
    assert announced(run.log_text(), "ref") == ["16"]
    message = "tierckpt: the job is already complete: step 16 reached max_steps=16, so train() returns"
    assert run.log_text().count(message) == 1, run.log_text()


@pytest.mark.e2e
def test_sigterm_saves_the_step_reached_then_exits_and_the_next_launch_resumes_bit_exact(
    reference, root: Path, tmp_path: Path
):
    """SIGTERM to torchrun (the pod deleted) mid-epoch at step 5, between periodic saves: both ranks save
    step 5 and the processes end; the next launch resumes from 5 and ends with the uninterrupted run's
    weights, bit for bit."""
    reference, _, _ = reference
    env = {"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "term"}
    stopped = Run("hf_gpt2.py", tmp_path, "stopped", env=env, pause_at=5)
    stopped.wait_paused()
    stopped.terminate()
    assert [committed_steps(rank_dir(root, "term", r)) for r in range(2)] == [[4, 5], [4, 5]], (
        stopped.log_text()
    )
    assert "SIGTERM: saving step 5" in stopped.log_text()
    assert not stopped.result.exists()  # the code after train() did not run

    finished = Run("hf_gpt2.py", tmp_path, "finished", env=env).finish()
    assert finished["restored_step"] == 5
    assert same_tensors(finished["weights"], reference["weights"])


def _trainer(root: Path, n_embd: int, tmp_path: Path, max_steps: int = 4, epochs: float = 3.0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from tierckpt.integrations.hf import TierckptTrainer

    sys.path.insert(0, str(EXAMPLES))
    try:
        from hf_gpt2 import TokenDataset
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=max_steps,
        num_train_epochs=epochs,
        per_device_train_batch_size=4,
        save_steps=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    return TierckptTrainer(
        model=model, args=args, train_dataset=TokenDataset(), tierckpt={"root": str(root), "job": "strict"}
    )


def test_another_architecture_is_refused_with_the_strict_error(root: Path, tmp_path: Path):
    _trainer(root, 32, tmp_path).train()
    assert committed_steps(rank_dir(root, "strict", 0)) == [2, 4]
    wider = _trainer(root, 48, tmp_path)
    with pytest.raises(StateMismatchError) as err:
        wider.train()
    assert "model/transformer.wte.weight: checkpoint float32 (64, 32), destination float32 (64, 48)" in (
        err.value.mismatches
    )
    resumed = _trainer(root, 32, tmp_path, max_steps=6)
    resumed.train()  # the same architecture resumes
    assert resumed.tierckpt_restored_step == 4 and resumed.state.global_step == 6


def test_a_job_that_trained_its_epochs_trains_nothing_when_launched_again(root: Path, tmp_path: Path):
    """Without ``max_steps`` the end is ``num_train_epochs`` (12 steps of 4 samples: 48 samples, one
    epoch): launched again, ``train()`` returns the finished run's state without training."""
    first = _trainer(root, 32, tmp_path, max_steps=-1, epochs=1)
    assert first.train().global_step == 12
    assert committed_steps(rank_dir(root, "strict", 0)) == [10, 12]
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}

    again = _trainer(root, 32, tmp_path, max_steps=-1, epochs=1)
    output = again.train()
    assert again.tierckpt_restored_step == 12 and output.global_step == 12 and again.state.global_step == 12
    assert again.state.epoch == 1.0 and again.optimizer is None  # nothing was set up to train
    assert same_tensors(again.model.state_dict(), weights)
    assert committed_steps(rank_dir(root, "strict", 0)) == [10, 12]
