"""The demo's training job: one rank of a small, bit-reproducible PyTorch model, checkpointed by tierckpt.

Run as ``python -m tierckpt_demo.training`` (one process per rank, started by ``tierckpt_demo.run``
inside its node's network namespace, with ``TIERCKPT_ROOT`` set to that node's ramdisk).

Why the loss curve is reproducible bit for bit across kills and restores:

* every input batch is generated from a seed derived from ``(seed, step, rank)``, so no data-loader
  or RNG state has to be saved;
* gradients are averaged with one ``all_reduce`` over a flat buffer in a fixed order (no DDP
  buckets, whose layout can change between runs and with it the order of floating-point sums);
* one intra-op thread per process; deterministic algorithms on;
* Adam's state is created eagerly, so ``Checkpointer.load`` restores it in place like the weights.

The rank reports what it does as ``TrainerEvent`` lines (JSON) in ``--events``; the orchestrator
reads them to drive the scenarios and check the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import itertools
import logging
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError
from tierckpt.snapshot.restore_wait import restored_from

__all__ = [
    "MODEL_PRESETS",
    "ModelShape",
    "TrainerEvent",
    "build_state",
    "describe_restore",
    "main",
    "pace",
    "parse_model_size",
    "read_events",
    "shape_for_params",
    "state_sha256",
    "train_step",
]

log = logging.getLogger(__name__)

D_IN, D_OUT, DEPTH, BATCH = 32, 8, 3, 64
LR = 3e-3
WARMUP = 10
"""Steps of linear learning-rate warm-up (Adam on wide layers overshoots without it)."""

MODEL_PRESETS = {"tiny": 20_000, "small": 1_000_000, "medium": 10_000_000, "large": 100_000_000}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


# ------------------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    depth: int = DEPTH

    @property
    def params(self) -> int:
        first = D_IN * self.hidden + self.hidden
        middle = (self.depth - 1) * (self.hidden * self.hidden + self.hidden)
        return first + middle + self.hidden * D_OUT + D_OUT

    @property
    def state_bytes(self) -> int:
        """fp32 weights + Adam's two moments + the per-rank statistics tensor, as saved."""
        return 3 * 4 * self.params + 4 * 2 + 4 * 3


def shape_for_params(target: int) -> ModelShape:
    """The MLP whose parameter count is closest to ``target`` (at least a 4-wide hidden layer)."""
    a, b, c = DEPTH - 1, D_IN + 1 + DEPTH - 1 + D_OUT, D_OUT - target
    hidden = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return ModelShape(max(4, round(hidden)))


def parse_model_size(text: str) -> ModelShape:
    """``tiny|small|medium|large``, a parameter count (``250k``, ``5M``, ``1e6``) or a size of the
    fp32 weights in bytes (``64MB``, ``1GiB``)."""
    key = text.strip().lower()
    if key in MODEL_PRESETS:
        return shape_for_params(MODEL_PRESETS[key])
    m = _SIZE_RE.match(key)
    if not m:
        raise ValueError(
            f"model size {text!r}: use {'|'.join(MODEL_PRESETS)}, a parameter count (5M) "
            "or a byte size (64MB)"
        )
    number, prefix, byte_unit = float(m.group(1)), m.group(2).lower(), (m.group(3) or "").lower()
    base = 1024 if byte_unit == "ib" else 1000
    value = number * base ** " kmgt".index(prefix or " ")
    params = int(value / 4) if byte_unit else int(value)
    if params < 100:
        raise ValueError(f"model size {text!r} is too small (at least 100 parameters)")
    return shape_for_params(params)


class Net(torch.nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        dims = [D_IN] + [shape.hidden] * shape.depth + [D_OUT]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.layers[-1](x)
        return out


def batch_for(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) batch of ``rank`` at ``step``: a fixed nonlinear teacher on seeded noise."""
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(D_IN, D_OUT, generator=teacher) / math.sqrt(D_IN)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, torch.sin(2.0 * (x @ w))


def _prime_adam(opt: torch.optim.Adam) -> None:
    """Create Adam's state now (it is lazy), exactly as its first step would, so it loads in place."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def build_state(shape: ModelShape, seed: int) -> tuple[Net, torch.optim.Adam, dict[str, Any]]:
    """The model, its optimizer, and the state dict that is checkpointed (views of both, in place)."""
    torch.manual_seed(seed)
    net = Net(shape)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    _prime_adam(opt)
    rank_stats = torch.zeros(3, dtype=torch.float32)  # [steps seen, sum of local loss, last local loss]
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "rank_stats": rank_stats}
    return net, opt, state


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [kv for k in sorted(obj, key=str) for kv in _tensors(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}/{i}")]
    return []


def state_sha256(state: dict[str, Any]) -> str:
    """sha256 over every tensor of ``state`` (key, dtype, shape and bytes), in a stable key order."""
    h = hashlib.sha256()
    for key, t in _tensors(state):
        t = t.detach().contiguous().cpu()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    assert p.grad is not None, "backward() fills every parameter's gradient"
    return p.grad


def train_step(net: Net, opt: torch.optim.Adam, stats: torch.Tensor, *, seed: int, step: int) -> float:
    """One deterministic data-parallel step; returns the mean loss over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch_for(seed, step, rank)
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(net(x), y)
    loss.backward()
    params = [p for p in net.parameters()]
    grads = [_grad(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = p.numel()
        g.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    for group in opt.param_groups:  # a pure function of the step: nothing to restore
        group["lr"] = LR * min(1.0, step / WARMUP)
    opt.step()
    local = loss.detach()
    stats[0] += 1
    stats[1] += local
    stats[2] = local
    return float(flat[-1])


def pace(began: float, seconds: float) -> None:
    """Sleep until ``seconds`` after ``began`` (``time.monotonic``): compute time, on a tiny model."""
    left = began + seconds - time.monotonic()
    if left > 0:
        time.sleep(left)


# ------------------------------------------------------------------------------------- events


EventName = Literal["start", "restored", "step", "saving", "saved", "held", "done", "error"]
"""``saving`` (step, sha256 of the state being saved) comes before the save starts, ``saved`` once it
returned: a step that commits always has its ``saving`` event, whenever the process is killed."""


@dataclasses.dataclass(frozen=True)
class TrainerEvent(Message):
    """One line of a rank's event file."""

    KIND = "tierckpt_demo-trainer-event"
    VERSION = 1

    event: EventName
    rank: int
    time: float
    step: int | None = None
    loss: float | None = None
    sha256: str = ""
    tier: str = ""
    bytes: int = 0
    seconds: float = 0.0
    staged_at: float = 0.0
    """``restored``: when the replicator reported the step staged (0: nothing was staged)."""
    message: str = ""
    fetched: tuple[int, ...] = ()
    """``restored`` (DCP): ranks whose step the load had the replicator fetch to this node."""
    fetched_bytes: int = 0
    """``restored`` (DCP): bytes the replicator moved for those fetches."""
    fetch_s: float = 0.0
    """``restored`` (DCP): time the load waited for them."""
    written_bytes: int = 0
    """``saved`` (replica group): bytes this rank wrote; 0 for a member that linked the writer's files."""
    logical_bytes: int = 0
    """``saved`` (replica group): bytes it would have written without deduplication."""


class EventLog:
    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def emit(self, event: EventName, **fields: Any) -> None:
        msg = TrainerEvent(event=event, rank=self.rank, time=time.time(), **fields)
        self._f.write(msg.to_bytes().decode() + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())


def read_events(path: Path) -> list[TrainerEvent]:
    """Every complete event line in ``path``: what follows the last newline is a line still being
    written (or torn by a kill), and a line that does not decode is skipped."""
    try:
        lines = path.read_bytes().split(b"\n")[:-1]
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(TrainerEvent.from_bytes(line))
        except (ValueError, FormatError):
            continue
    return out


# ------------------------------------------------------------------------------------- the run


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tierckpt_demo.training", description=__doc__.split("\n")[0])
    p.add_argument("--events", type=Path, required=True, help="append TrainerEvent lines here")
    p.add_argument("--model-size", default="small")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--until", type=int, required=True, help="train up to and including this step")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument(
        "--hold",
        action="store_true",
        help="after --until, wait for the last save to be durable and sleep until killed",
    )
    p.add_argument("--init-timeout", type=float, default=120.0)
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="each step takes at least this long (the rest of it asleep): compute time, on a tiny model",
    )
    p.add_argument(
        "--replica-group",
        action="store_true",
        help="every rank holds the same model and optimizer (data parallel): one replica group, saved "
        "once per node and replicated and uploaded once per distinct shard",
    )
    p.add_argument(
        "--flip-restored-bit",
        action="store_true",
        help="flip one bit of the restored weights (a negative control: the demo's checks must fail)",
    )
    return p.parse_args(argv)


def describe_restore(ckpt: Any, step: int | None) -> tuple[str, int, float]:
    """(tier, bytes, staged_at) of the step ``ckpt.load`` just restored (``restore_wait.restored_from``:
    the tier the node's replicator staged it from, ``local`` when it did not stage it)."""
    if step is None:
        return "none", 0, 0.0
    s = ckpt.settings
    restored = restored_from(s.root, s.job, s.rank, step)
    return restored.tier.value, restored.total_bytes, restored.staged_at


def _flip_one_bit(state: dict[str, Any]) -> None:
    weight = next(t for _, t in _tensors(state["model"]) if t.is_floating_point() and t.numel())
    weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    log.warning("flipped the lowest bit of one restored weight (--flip-restored-bit)")


def _checkpointed(state: dict[str, Any], group: bool) -> dict[str, Any]:
    """What is saved: ``state``, or in a replica group the shared tensors with this rank's own
    statistics as plain numbers (a tensor that differs per rank would make every save diverge)."""
    if not group:
        return state
    return {"model": state["model"], "optim": state["optim"], "rank_stats": state["rank_stats"].tolist()}


def _restore(
    ckpt: Any, state: dict[str, Any], events: EventLog, *, flip: bool = False, group: bool = False
) -> int:
    began = time.time()
    view = _checkpointed(state, group)
    step = ckpt.load(view, allow_missing=True)
    if group and step is not None:
        state["rank_stats"].copy_(torch.tensor(view["rank_stats"], dtype=torch.float32))
    if flip and step is not None:
        _flip_one_bit(state)
    tier, nbytes, staged_at = describe_restore(ckpt, step)
    # Time in load() once the replicator had staged the step: the load itself (verify + copy).
    load_s = time.time() - max(began, staged_at)
    events.emit(
        "restored",
        step=step,
        tier=tier,
        bytes=nbytes,
        seconds=load_s,
        sha256=state_sha256(state),
        staged_at=staged_at,
    )
    return 0 if step is None else step


def run(args: argparse.Namespace) -> None:
    import tierckpt

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    log.info(
        "joining the process group at %s:%s", os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    )
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.init_timeout))
    rank = dist.get_rank()
    log.info("rank %d of %d joined", rank, dist.get_world_size())
    events = EventLog(args.events, rank)
    events.emit("start", message=f"pid {os.getpid()}")
    net, opt, state = build_state(parse_model_size(args.model_size), args.seed)
    world = dist.get_world_size()
    ckpt = tierckpt.Checkpointer(replica_group=list(range(world)) if args.replica_group else None)
    start = _restore(ckpt, state, events, flip=args.flip_restored_bit, group=args.replica_group)
    for step in range(start + 1, args.until + 1):
        began = time.monotonic()
        loss = train_step(net, opt, state["rank_stats"], seed=args.seed, step=step)
        events.emit("step", step=step, loss=loss)
        if step % args.checkpoint_every == 0:
            sha = state_sha256(state)
            events.emit("saving", step=step, sha256=sha)
            t0 = time.perf_counter()
            ckpt.save(step, _checkpointed(state, args.replica_group))
            blocking = time.perf_counter() - t0
            accounting = ckpt.last_save if args.replica_group else {}
            events.emit(
                "saved",
                step=step,
                seconds=blocking,
                sha256=sha,
                written_bytes=int(accounting.get("written_bytes", 0)),
                logical_bytes=int(accounting.get("logical_bytes", 0)),
            )
        pace(began, args.step_seconds)
    ckpt.wait()
    if args.hold:
        dist.barrier()
        events.emit("held", step=args.until)
        signal.pause()  # the orchestrator kills us: a crash at a known point
    ckpt.close()
    dist.barrier()
    events.emit("done", step=args.until, sha256=state_sha256(state["model"]))
    dist.destroy_process_group()


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
