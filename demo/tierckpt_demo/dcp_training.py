"""The DCP demo's training job: one rank of an FSDP2-sharded model, checkpointed through PyTorch DCP.

Run by a node's launcher (``tierckpt_demo.launcher --module tierckpt_demo.dcp_training``) inside its
network namespace, with ``TIERCKPT_ROOT`` = the node's ramdisk. Every rank:

* builds the demo's MLP (``tierckpt_demo.training.Net``) and shards every layer with FSDP2 over the
  whole world (gloo on the CPU), with Adam;
* asks ``tierckpt.dcp.agreed_step()`` which step to restore (the operator's plan, or what every rank's
  node holds), and loads it with ``dcp.load`` through ``RamdiskReader`` (resharding if the world size
  changed: chunks of ranks no node of this job holds any more are fetched from peers or the bucket);
* trains, and saves every ``--checkpoint-every`` steps with ``dcp.async_save`` through one
  ``RamdiskWriter``, on a process group of its own (the save's collectives run beside training's).

The data is a global batch of ``GLOBAL_BATCH`` rows per step, split evenly over the ranks, and FSDP2
averages the gradients over the world: every world size that divides the batch computes the same
function (only the order of floating-point sums changes). The state's fingerprint (``full_state_sha256``)
is taken over the whole unsharded state, so it is comparable across world sizes.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tierckpt.dcp import RamdiskReader, RamdiskWriter, agreed_step
from tierckpt.protocol.control import RestoreState, RestoreStatus, read_restore_status
from tierckpt.protocol.errors import FormatError
from tierckpt.settings import resolve
from tierckpt_demo.training import D_IN, D_OUT, LR, WARMUP, EventLog, Net, pace, parse_model_size

__all__ = ["GLOBAL_BATCH", "full_state_sha256", "main"]

log = logging.getLogger(__name__)

GLOBAL_BATCH = 48
"""Rows per step, all ranks together (divisible by every world size the demo uses)."""


def global_batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(D_IN, D_OUT, generator=teacher) / math.sqrt(D_IN)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    return x, torch.sin(2.0 * (x @ w))


def build(model_size: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net(parse_model_size(model_size))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=LR)


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [kv for k in sorted(obj, key=str) for kv in _tensors(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, list):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}/{i}")]
    return []


def full_state_sha256(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of the whole unsharded model and optimizer state (a collective: every rank gets the same)."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()
    for key, t in _tensors(_full({"model": msd, "optim": osd})):
        t = t.detach().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, seed: int, step: int) -> float:
    """One step on this rank's rows of the global batch; returns the mean loss over the world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(seed, step)
    rows = GLOBAL_BATCH // world
    x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for group in opt.param_groups:
        group["lr"] = LR * min(1.0, step / WARMUP)
    opt.step()
    opt.zero_grad()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return float(total / world)


def _own_tier(step: int) -> tuple[str, float]:
    """Where this rank's own step came from (its restore status), and when it was staged."""
    s = resolve()
    try:
        status = read_restore_status(s.root, s.job, s.rank)
    except FormatError:
        status = None
    if isinstance(status, RestoreStatus) and status.step == step and status.state is RestoreState.READY:
        return (status.source.value if status.source else "local"), status.updated_at
    return "local", 0.0


def _restore(model: torch.nn.Module, opt: torch.optim.Optimizer, events: EventLog) -> int:
    began = time.time()
    step = agreed_step()
    fetched: tuple[int, ...] = ()
    nbytes, fetched_bytes, fetch_s = 0, 0, 0.0
    if step is not None:
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "extra": {"step": -1}}
        reader = RamdiskReader()
        load(state, checkpoint_id=str(step), storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if state["extra"]["step"] != step:
            raise RuntimeError(f"step {step} restored a state saved at step {state['extra']['step']}")
        fetched, nbytes = reader.fetched, reader.bytes_read
        fetched_bytes, fetch_s = reader.fetched_bytes, reader.fetch_seconds
    tier, staged_at = _own_tier(step) if step is not None else ("none", 0.0)
    seconds = time.time() - max(began, staged_at)
    sha = full_state_sha256(model, opt)
    events.emit(
        "restored",
        step=step,
        tier=tier,
        bytes=nbytes,
        seconds=seconds,
        sha256=sha,
        staged_at=staged_at,
        fetched=fetched,
        fetched_bytes=fetched_bytes,
        fetch_s=fetch_s,
    )
    return 0 if step is None else step


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.init_timeout))
    saves = dist.new_group(backend="gloo")  # async saves' collectives, beside training's
    rank = dist.get_rank()
    events = EventLog(args.events, rank)
    events.emit("start", message=f"pid {os.getpid()}, world {dist.get_world_size()}")
    model, opt = build(args.model_size, args.seed)
    get_state_dict(model, opt)  # creates Adam's state, as a restore needs it (every run does the same)
    start = _restore(model, opt, events)
    writer = RamdiskWriter()
    pending: Any = None
    for step in range(start + 1, args.until + 1):
        began = time.monotonic()
        loss = train_step(model, opt, seed=args.seed, step=step)
        events.emit("step", step=step, loss=loss)
        if step % args.checkpoint_every == 0:
            if pending is not None:
                pending.result()  # the previous save is durable before the next starts
            msd, osd = get_state_dict(model, opt)
            sha = full_state_sha256(model, opt)
            events.emit("saving", step=step, sha256=sha)
            t0 = time.perf_counter()
            response = async_save(
                {"model": msd, "optim": osd, "extra": {"step": step}},
                checkpoint_id=str(step),
                storage_writer=writer,
                process_group=saves,
            )
            pending = getattr(response, "upload_completion", response)
            events.emit("saved", step=step, seconds=time.perf_counter() - t0, sha256=sha)
        pace(began, args.step_seconds)
    if pending is not None:
        pending.result()
    writer.close()
    if args.hold:
        dist.barrier()
        events.emit("held", step=args.until)
        signal.pause()  # the orchestrator kills us: a crash at a known point
    dist.barrier()
    events.emit("done", step=args.until, sha256=full_state_sha256(model, opt))
    dist.destroy_process_group()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tierckpt_demo.dcp_training", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=Path, required=True, help="append TrainerEvent lines here")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--until", type=int, required=True, help="train up to and including this step")
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--hold", action="store_true", help="after --until, sleep until killed")
    p.add_argument("--init-timeout", type=float, default=120.0)
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="each step takes at least this long (the rest of it asleep): compute time, on a tiny model",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
    )
    try:
        run(args)
    except Exception as exc:
        rank = int(os.environ.get("RANK", "0"))
        EventLog(args.events, rank).emit("error", message=f"{type(exc).__name__}: {exc}")
        log.exception("training failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
