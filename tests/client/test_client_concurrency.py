"""A reader holding a lease never sees a file vanish while retention runs; released steps then go."""

from __future__ import annotations

import threading
import time

import torch

from tierckpt import Checkpointer, MissingCheckpointError
from tierckpt.protocol import leases
from tierckpt.protocol.format import committed_steps, step_dir
from tierckpt.verify import verify_step


def test_leased_steps_survive_retention_and_readers_never_see_files_vanish(root, job):
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"verified": 0, "held_past_keep": 0, "missed": 0}

    with Checkpointer(root=root, job=job, keep=1) as ck:
        rank_path = ck.rank_path

        def reader() -> None:
            while not stop.is_set():
                steps = committed_steps(rank_path)
                if not steps:
                    continue
                step = steps[-1]
                try:
                    held = leases.hold(rank_path, step, "reader", ttl=10)
                except MissingCheckpointError:
                    counts["missed"] += 1  # retired between listing and leasing: never half-read
                    continue
                try:
                    with held:
                        for _ in range(3):
                            verify_step(step_dir(rank_path, step))
                            time.sleep(0.005)
                        if committed_steps(rank_path)[-1] > step:
                            counts["held_past_keep"] += 1  # keep=1 would have retired it without the lease
                            verify_step(step_dir(rank_path, step))
                    counts["verified"] += 1
                except BaseException as exc:
                    errors.append(exc)
                    return

        t = threading.Thread(target=reader)
        t.start()
        state = {"w": torch.randn(1 << 18), "small": [torch.randn(10) for _ in range(20)]}
        for step in range(1, 80):
            ck.save(step, state, blocking=True)
        stop.set()
        t.join(30)
        ck.save(80, state, blocking=True)  # no lease left: retention catches up
        assert ck.committed_steps() == [80]

    assert not errors, f"reader failed: {errors[0]!r}"
    assert counts["verified"] >= 5 and counts["held_past_keep"] >= 1, counts
