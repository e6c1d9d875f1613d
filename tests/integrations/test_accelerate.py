"""``TierckptAccelerator`` against real Accelerate (CPU, gloo, two torchrun processes): the documented
training loop (a plain ``DataLoader(shuffle=True)``, dropout) killed mid-epoch and resumed ends with the
uninterrupted run's weights, bit for bit; the resume is announced once, on rank 0, with default logging;
a finished job launched again trains nothing and says so; and a ``save_state``/``load_state`` round
trip restores model, optimizer, scheduler, registered objects and RNG."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.ramdisk import fresh_ramdisk_dir
from tests.integrations.harness import Run, same_tensors
from tierckpt.protocol.format import committed_steps, rank_dir

pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict[str, str], Path]]:
    """An uninterrupted run of the documented loop: its result, its environment (job ``ref``, finished
    at step 30 on its ramdisk) and its work directory."""
    work = tmp_path_factory.mktemp("accelerate")
    with fresh_ramdisk_dir(work, "accelerate") as root:
        env = {"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "ref"}
        result = Run("accelerate_train.py", work, "ref", env=env).finish()
        assert result["restored_step"] is None and result["step"] == 30
        yield result, env, work


@pytest.mark.e2e
def test_documented_loop_killed_mid_epoch_twice_resumes_bit_exact(reference, tmp_path: Path):
    """Killed at step 6 (epoch 0, 4 saved), then at step 18 (epoch 1, 16 saved), then finished: the
    resumed passes continue the saved epochs with the same batches and dropout masks.
    Each resume is announced once, on rank 0, in the captured output (default logging)."""
    expected, env, _ = reference
    env = {**env, "TIERCKPT_JOB": "acc"}
    root = Path(env["TIERCKPT_ROOT"])
    logs = []
    for pause in (6, 18):
        run = Run("accelerate_train.py", tmp_path, f"to-{pause}", env=env, pause_at=pause)
        run.wait_paused()
        run.kill()
        saved = (pause // 4) * 4
        assert [committed_steps(rank_dir(root, "acc", r))[-1] for r in range(2)] == [saved, saved]
        logs.append(run.log_text())
    finished = Run("accelerate_train.py", tmp_path, "finished", env=env).finish()
    assert finished["restored_step"] == 16 and finished["step"] == 30
    assert same_tensors(finished["weights"], expected["weights"])
    logs.append((tmp_path / "finished.log").read_text())
    assert [announced(log) for log in logs] == [[], ["from step 4 "], ["from step 16 "]], logs
    assert "ranks 0-1 from this node's RAM disk" in logs[-1]


def announced(log: str) -> list[str]:
    """The resume messages in a run's output: ``from step N `` for each."""
    return [
        line.split("resumed job 'acc' ")[1].split("(")[0]
        for line in log.splitlines()
        if "tierckpt: resumed job 'acc' " in line
    ]


@pytest.mark.e2e
def test_a_finished_job_launched_again_trains_nothing_and_says_so(reference):
    expected, env, work = reference
    root = Path(env["TIERCKPT_ROOT"])
    again = Run("accelerate_train.py", work, "again", env=env).finish()
    assert again["restored_step"] == 30 and again["step"] == 30
    assert same_tensors(again["weights"], expected["weights"])
    assert [committed_steps(rank_dir(root, "ref", r))[-1] for r in range(2)] == [30, 30]
    log = (work / "again.log").read_text()
    assert log.count("tierckpt: the job is already complete: step 30 reached max_steps=30") == 1, log


@pytest.mark.e2e
def test_save_state_load_state_round_trip_on_two_ranks(root: Path, tmp_path: Path):
    run = Run(
        "accelerate_roundtrip.py", tmp_path, "acc", env={"TIERCKPT_ROOT": str(root), "TIERCKPT_JOB": "acc"}
    )
    assert run.wait() == 0, run.log_text()
    for rank in range(2):
        result = json.loads(Path(f"{run.result}.{rank}").read_text())
        assert result["start"] is None and result["loaded"] == 3, result
        assert result["checks"] == dict.fromkeys(
            ("model", "optimizer", "scheduler", "counter", "draws"), True
        )
        assert committed_steps(rank_dir(root, "acc", rank)) == [3]
