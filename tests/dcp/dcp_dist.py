"""Run a function on N real processes joined by a gloo process group (CPU, 127.0.0.1 / file rendezvous).

Children come from a forkserver that has torch preloaded, so each rank starts in well under a second
without inheriting the test process's threads. A child's exception fails the test with its traceback.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as tmp

_PRELOAD = [
    "torch",
    "torch._dynamo",  # FSDP2 imports it lazily on first use: seconds per process otherwise
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "tierckpt.dcp",
    "tests.dcp.dcp_scenarios",
    "tests.dcp.dcp_nodes",
]


def _entry(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; raise if any of them fails."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    init_file = os.path.join(tempfile.gettempdir(), f"tierckpt-dcp-pg-{uuid.uuid4().hex}")
    try:
        tmp.start_processes(
            _entry,
            args=(world_size, init_file, fn, args),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
