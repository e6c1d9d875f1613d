"""SIGKILL at any moment of an asynchronous save: the next restore gets a whole step, never a mix."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from tests.client.client_helpers import filled_state
from tierckpt import Checkpointer
from tierckpt.protocol.format import rank_dir, read_commit, step_dir, step_dirs
from tierckpt.verify import verify_step

ITERATIONS = 30


def save_forever(root, job) -> None:
    """The child: a training loop that saves asynchronously, back to back, until it is killed."""
    try:
        torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork (as in DataLoader workers)
        ck = Checkpointer(root=root, job=job, keep=2)
        step = (ck.latest_step() or 0) + 1
        while True:
            ck.save(step, filled_state(step, numel=1 << 16))
            step += 1
    finally:
        os._exit(1)


def assert_whole(dest: dict, step: int) -> None:
    for t in dest["tensors"]:
        assert bool((t == step).all()), f"step {step}: a tensor holds other steps' bytes"
    assert bool((dest["bf16"] == float(step % 200)).all())
    assert dest["step"] == step and dest["meta"] == {"value": step, "pickled": {step}}


@pytest.mark.slow
def test_sigkill_at_random_moments_never_tears_a_step(root, job):
    rng = random.Random(1234)
    last = 0
    kills_with_progress = kills_mid_save = 0
    for _ in range(ITERATIONS):
        pid = os.fork()
        if pid == 0:
            save_forever(root, job)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills_mid_save += any(read_commit(p) is None for p in step_dirs(rank_dir(root, job, 0)).values())
        with Checkpointer(root=root, job=job, keep=2) as ck:
            for step in ck.committed_steps():
                verify_step(step_dir(ck.rank_path, step))
            dest: dict = {}
            step = ck.load(dest, allow_missing=True)
        if step is None:
            assert last == 0, "a committed step disappeared"
            continue
        assert step >= last, f"restored step {step} after having restored {last}"
        assert_whole(dest, step)
        kills_with_progress += step > last
        last = step
    assert kills_with_progress >= ITERATIONS // 3, "the child rarely got to commit; the test proves little"
    assert kills_mid_save >= ITERATIONS // 4, "the kills rarely hit a save in progress"
