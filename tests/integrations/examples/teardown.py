"""The end of a distributed example: leave the process group, then exit without finalizing torch.

A gloo process group can abort or hang a rank that finished cleanly when its last reference goes at
interpreter shutdown (DDP's reducer holds one; ``destroy_process_group`` drops only the registry's):
its destructor joins gloo's worker threads while holding the GIL, and a worker still releasing a
finished collective's tensors needs the GIL, so the rank hangs, or aborts with "terminate called
without an active exception" once finalization has begun (pytorch/pytorch#190489, #179291; seen here
with the Hugging Face Trainer and with plain ``transformers.Trainer``, tierckpt not involved).
Lightning and the Trainer leave the process group to the script. So the examples wait for every rank,
destroy the group, flush, and ``os._exit``: everything they write is written by then (tierckpt's saves
committed when ``train()``/``fit()`` returned).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_distributed() -> NoReturn:
    """Barrier, destroy every process group (the default one and any ``new_group``), exit 0."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
