"""``TierckptAccelerator`` against real Accelerate (CPU, gloo): a ``save_state``/``load_state`` round
trip under two torchrun processes restores model, optimizer, scheduler, registered objects and RNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.harness import Run
from tierckpt.protocol.format import committed_steps, rank_dir

pytest.importorskip("accelerate")


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
