"""The end of a distributed example: destroy the process groups before the interpreter exits.

Without it, gloo's worker threads can still be alive during interpreter finalization and abort a rank
that finished cleanly ("terminate called without an active exception", pytorch/pytorch#190489);
Lightning and the Hugging Face Trainer leave the process group to the script. PyTorch documents
``destroy_process_group()`` as the last call of every distributed program.
"""

from __future__ import annotations

import torch.distributed as dist


def end_process_groups() -> None:
    """Destroy every process group (the default one and any ``new_group``), if one was started."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
