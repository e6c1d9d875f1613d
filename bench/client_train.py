"""The training-loop mode of ``client_bench.py``: what saving every N steps costs a real training loop.

A GPT-like model (about 0.94 B parameters by default: 18 blocks of width 2048, vocabulary 16,384, fp32
weights, bf16 autocast, fused AdamW) trains on a fixed random batch. Every run uses the same model and
optimizer (one process, one warm GPU), in this order, for each N:

* ``none``: no checkpoint (also last, to see drift); the loop synchronises the GPU at the steps where
  the others save, so every run has the same bubbles;
* ``plain``: ``Checkpointer()``; ``overlap``: ``Checkpointer(overlap=True)``; ``device``:
  ``Checkpointer(device_staging=True)``, the last two with ``register_optimizer``. Each is prepared
  (``prepare()``) and saves once before the timed steps, as a job in its steady state would;
* ``dcp``: DCP ``async_save`` with ``FileSystemWriter`` on the same tmpfs (the previous save's future is
  awaited before the next, as DCP's docs advise), over fewer steps (each save takes many seconds: by
  default only N=10 over 20 steps; its N=100 overhead is its cost per save over 100 steps).

Saves happen after the optimizer step of steps N/2, 3N/2, ... of the timed window, right after a GPU
synchronisation; ``blocking`` is how long ``save`` kept the training thread. The overhead is the
window's wall time against the mean of the ``none`` runs over the same number of steps. Per-step GPU
times come from CUDA events at each step's start: the step that saves, and the step after it (where
overlap mode's optimizer waits for the copy).

Cold start: two more ``plain`` runs in fresh directories report the blocking time of every save, from
the first: without ``prepare()``, and with ``prepare(blocking=False)`` called as training starts.

Check mode (``--check``, after the timed runs): each saver saves twice more; before each save a CPU copy
of every tensor is taken (into pinned memory), and once the optimizer has changed the parameters
again, the committed step's data files are compared with it byte for byte.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import gc
import io
import itertools
import pstats
import shutil
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

GIB = 1 << 30


# ------------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    width: int = 2048
    layers: int = 18
    heads: int = 16
    vocab: int = 16384
    seq: int = 1024
    batch: int = 8


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(spec.vocab, spec.width)
        self.pos = torch.nn.Embedding(spec.seq, spec.width)
        self.blocks = torch.nn.ModuleList(Block(spec.width, spec.heads) for _ in range(spec.layers))
        self.ln = torch.nn.LayerNorm(spec.width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied output head


class Trainer:
    """The model, AdamW and one fixed batch; ``step()`` is one training step."""

    def __init__(self, spec: ModelSpec, device: str) -> None:
        torch.manual_seed(0)
        self.spec, self.device = spec, device
        self.model = GPT(spec).to(device)
        fused = device == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
        g = torch.Generator(device=device).manual_seed(1)
        shape = (spec.batch, spec.seq)
        self.x = torch.randint(0, spec.vocab, shape, device=device, generator=g)
        self.y = torch.randint(0, spec.vocab, shape, device=device, generator=g)
        self.steps = 0

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            logits = self.model(self.x)
        loss = F.cross_entropy(logits.float().view(-1, self.spec.vocab), self.y.view(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.steps}


def state_tensors(state: Any) -> list[torch.Tensor]:
    from tierckpt.snapshot.flatten import flatten

    return list(flatten(state).tensors)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- savers


class Saver:
    """One way of checkpointing: ``save`` returns once training may go on."""

    name = "none"

    def save(self, step: int, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TierckptSaver(Saver):
    def __init__(
        self,
        name: str,
        root: Path,
        trainer: Trainer,
        *,
        prepare: str = "blocking",
        budget: float | int = 0.5,
    ) -> None:
        from tierckpt import Checkpointer

        self.name, self.root = name, root
        root.mkdir(parents=True, exist_ok=True)
        self.ck = Checkpointer(
            root=root,
            job="train",
            rank=0,
            world_size=1,
            keep=2,
            overlap=name == "overlap",
            device_staging=name == "device",
            device_budget=budget,
        )
        if name in ("overlap", "device"):
            self.ck.register_optimizer(trainer.opt)
        self.warm_up = None
        if prepare == "blocking":
            self.ck.prepare(trainer.state())
        elif prepare == "background":
            self.warm_up = self.ck.prepare(trainer.state(), blocking=False)
        self.handles: dict[int, Any] = {}

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.handles[step] = self.ck.save(step, state)

    def close(self) -> None:
        self.ck.close()


class DcpSaver(Saver):
    name = "dcp"

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.pending: Any = None
        self.written: list[Path] = []

    def _settle(self) -> None:
        if self.pending is not None:
            result = getattr(self.pending, "upload_completion", self.pending)
            result.result()
            self.pending = None
        while len(self.written) > 2:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self._settle()
        path = self.root / f"step-{step}"
        self.written.append(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pending = dcp.async_save(state, storage_writer=FileSystemWriter(path))

    def close(self) -> None:
        self._settle()
        shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------------------------------- check


class Checker:
    """Check mode: a CPU copy of the state before each save, compared with the committed step later."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pending: tuple[int, list[tuple[int, int]]] | None = None
        self.verified: list[int] = []

    def before_save(self, step: int, state: dict[str, Any]) -> None:
        tensors = state_tensors(state)
        total = sum(t.numel() * t.element_size() for t in tensors)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        regions, at = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.buffer[at : at + n].view(t.dtype).view(t.shape).copy_(t)
            regions.append((at, n))
            at += n
        self.pending = (step, regions)

    def verify(self, saver: TierckptSaver) -> None:
        """Compare the pending step's data files with its copy, byte for byte (AssertionError if not)."""
        from tierckpt.protocol.format import read_manifest, step_dir
        from tierckpt.snapshot.restore import open_data_files, tensor_views

        if self.pending is None:
            return
        step, regions = self.pending
        self.pending = None
        saver.handles[step].wait()
        path = step_dir(saver.ck.rank_path, step)
        manifest = read_manifest(path)
        files = open_data_files(path, manifest)
        try:
            views = tensor_views(manifest, files)
            assert len(views) == len(regions), (
                f"step {step}: {len(views)} tensors saved, {len(regions)} expected"
            )
            assert self.buffer is not None
            for entry, view, (at, n) in zip(manifest.tensors, views, regions, strict=True):
                saved = view.reshape(-1).view(torch.uint8)
                if not torch.equal(saved, self.buffer[at : at + n]):
                    raise AssertionError(
                        f"step {step}: tensor {entry.key} differs from the copy taken at save"
                    )
            del views
        finally:
            for f in files.values():
                f.close()
        self.verified.append(step)


# ------------------------------------------------------------------------------------------- runs


def saving_steps(steps: int, every: int, *, first: int | None = None) -> set[int]:
    """The steps after which a save happens: ``first`` (default N/2), then every N within the window."""
    first = every // 2 or every if first is None else first
    return set(range(first, steps + 1, every))


def run(
    trainer: Trainer,
    saver: Saver,
    steps: int,
    every: int,
    *,
    checker: Checker | None = None,
    first: int | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """``steps`` timed steps with a save after each step of ``saving_steps`` (``profile``: the first save
    is profiled, its top functions reported)."""
    device = trainer.device
    cuda = device == "cuda"
    saves = saving_steps(steps, every, first=first)
    profiled = ""
    starts: list[torch.cuda.Event] = []
    blocking: list[float] = []
    sync(device)
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        if cuda:
            starts.append(torch.cuda.Event(enable_timing=True))
            starts[-1].record()
        trainer.step()
        if k in saves:
            sync(device)
            if saver.name == "none":
                continue
            state = trainer.state()
            if checker is not None:
                if isinstance(saver, TierckptSaver):
                    checker.verify(saver)
                checker.before_save(trainer.steps, state)
            profiler = cProfile.Profile() if profile and not blocking else None
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            saver.save(trainer.steps, state)
            blocking.append(time.perf_counter() - start)
            if profiler is not None:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                profiled = text.getvalue()
            del state
    if cuda:
        starts.append(torch.cuda.Event(enable_timing=True))
        starts[-1].record()
    sync(device)
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {"mode": saver.name, "steps": steps, "every": every, "wall_s": wall}
    out["saves"] = len(blocking)
    out["blocking_s"] = [round(b, 4) for b in blocking]
    if cuda:
        times = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(starts)]
        plain = [t for k, t in enumerate(times, 1) if k not in saves and k - 1 not in saves]
        out["step_s"] = statistics.median(times)
        out["quiet_step_s"] = statistics.median(plain) if plain else float("nan")
        out["saving_step_s"] = [round(times[k - 1], 4) for k in sorted(saves) if k <= len(times)]
        out["step_after_s"] = [round(times[k], 4) for k in sorted(saves) if k < len(times)]
        out["max_step_s"] = max(times)
    if checker is not None and isinstance(saver, TierckptSaver):
        checker.verify(saver)
    if profiled:
        out["profile"] = profiled
    if isinstance(saver, TierckptSaver) and saver.ck.last_snapshot:
        out["last_snapshot"] = {k: round(v, 4) for k, v in saver.ck.last_snapshot.items()}
        out["device_staging_bytes"] = saver.ck.device_staging_bytes
    return out


@contextlib.contextmanager
def closing(saver: Saver) -> Iterator[Saver]:
    try:
        yield saver
    finally:
        saver.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def d2h_floor(trainer: Trainer, root: Path) -> dict[str, float]:
    """One device-to-host copy of the state's bytes into a pre-faulted, registered tmpfs mapping: the floor
    for a save (and the pre-fault and registration it needs once)."""
    from tierckpt.snapshot.shardfile import MappedFile

    nbytes = sum(t.numel() * t.element_size() for t in state_tensors(trainer.state()))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    f = MappedFile.create(root / "floor.bin", nbytes)
    fault = time.perf_counter() - start
    start = time.perf_counter()
    registered = f.register(torch.cuda.current_device())
    register = time.perf_counter() - start
    out = {"bytes": nbytes, "fault_s": fault, "register_s": register, "registered": registered}
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copies = []
    for _ in range(3):
        sync("cuda")
        start = time.perf_counter()
        f.buffer.copy_(src, non_blocking=True)
        sync("cuda")
        copies.append(time.perf_counter() - start)
    out["d2h_s"] = statistics.median(copies)
    del src
    f.close(unlink=True)
    torch.cuda.empty_cache()
    return out


def bench_training(
    root: Path,
    spec: ModelSpec,
    device: str,
    *,
    everies: tuple[int, ...] = (10, 100),
    steps: dict[int, int] | None = None,
    dcp_steps: dict[int, int] | None = None,
    modes: tuple[str, ...] = ("plain", "overlap", "device", "dcp"),
    budget: float | int = 0.5,
    check: bool = False,
    freeze_gc: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    steps = steps or {10: 60, 100: 100}
    dcp_steps = {10: 20} if dcp_steps is None else dcp_steps
    trainer = Trainer(spec, device)
    r: dict[str, Any] = {"parameters": trainer.parameters, "spec": dataclasses.asdict(spec)}
    for _ in range(3):  # warm-up: kernels chosen, optimizer state allocated
        trainer.step()
    sync(device)
    if freeze_gc:  # as a long-running trainer would: the setup's objects leave the collector's generations
        gc.collect()
        gc.freeze()
    r["freeze_gc"] = freeze_gc
    state = trainer.state()
    r["state_bytes"] = sum(t.numel() * t.element_size() for t in state_tensors(state))
    r["state_tensors"] = len(state_tensors(state))
    del state
    log(f"model: {trainer.parameters / 1e9:.3f} B parameters, state {r['state_bytes'] / GIB:.2f} GiB")
    if device == "cuda":
        r["floor"] = d2h_floor(trainer, root / "floor")
        log(f"floor: {r['floor']}")

    def tier(name: str, directory: str, prepare: str = "blocking") -> TierckptSaver:
        return TierckptSaver(name, root / directory, trainer, prepare=prepare, budget=budget)

    def log_run(out: dict[str, Any]) -> None:
        r["runs"].append(out)
        wall, blocking = f"{out['wall_s']:.3f} s / {out['steps']} steps", out["blocking_s"]
        log(f"N={out['every']} {out['mode']}: {wall}, blocking {blocking}")

    r["runs"] = []
    r["errors"] = {}

    def timed_runs(name: str, every: int, count: int) -> None:
        """One saver's run at N=``every``, in the shared ramdisk directory (each Checkpointer adopts the
        last one's slots); the device-staged one profiles its first save."""
        try:
            saver: Saver = DcpSaver(root / "dcp") if name == "dcp" else tier(name, "steady")
            with closing(saver):
                if name != "dcp":
                    run(trainer, saver, 10, 10)  # one untimed save: the steady state begins
                log_run(run(trainer, saver, count, every, profile=name == "device" and every == everies[0]))
        except Exception as exc:  # report it and go on with the other savers
            r["errors"][f"{name}, N={every}"] = repr(exc)
            log(f"{name} N={every} failed: {exc!r}")

    first, *others = everies
    log_run(run(trainer, Saver(), steps[first], first))
    for name in modes:  # every saver between two baselines: the GPU's speed drifts over minutes
        count = dcp_steps.get(first, 0) if name == "dcp" else steps[first]
        if count:
            timed_runs(name, first, count)
            log_run(run(trainer, Saver(), steps[first], first))
    for every in others:
        log_run(run(trainer, Saver(), steps[every], every))
        for name in modes:
            count = dcp_steps.get(every, 0) if name == "dcp" else steps[every]
            if count:
                timed_runs(name, every, count)
        log_run(run(trainer, Saver(), steps[every], every))
    shutil.rmtree(root / "steady", ignore_errors=True)
    for prepare in ("none", "background"):  # a job's first saves: every N steps from step N
        try:
            with closing(tier("plain", f"cold-{prepare}", prepare=prepare)) as saver:
                out = run(trainer, saver, steps[first], first, first=first)
            out["mode"] = f"plain, cold, prepare={prepare}"
            log_run(out)
        except Exception as exc:
            r["errors"][f"cold-{prepare}"] = repr(exc)
            log(f"cold start, prepare={prepare} failed: {exc!r}")
        shutil.rmtree(root / f"cold-{prepare}", ignore_errors=True)
    r["summary"] = summarize(r)
    if check:
        r["check"] = {}
        for name in [m for m in modes if m != "dcp"]:
            checker = Checker()
            try:
                with closing(tier(name, "check")) as saver:
                    out = run(trainer, saver, 2 * everies[0], everies[0], checker=checker)
                r["check"][name] = {"verified_steps": checker.verified, "blocking_s": out["blocking_s"]}
                log(f"check {name}: steps {checker.verified} bit-exact")
            except Exception as exc:
                r["check"][name] = {"verified_steps": checker.verified, "error": repr(exc)}
                log(f"check {name} FAILED: {exc!r}")
        shutil.rmtree(root / "check", ignore_errors=True)
    return r


def summarize(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Overhead of each run against the ``none`` runs of the same N just before and after it (all of
    them when it has none on a side), per step. A saver run at the first N only (DCP) gets a derived row
    for the others: its overhead per save over N steps."""
    rows = []
    runs = r["runs"]
    floor = r.get("floor", {}).get("d2h_s")
    base: dict[int, list[float]] = {}
    for run_ in runs:
        if run_["mode"] == "none":
            base.setdefault(run_["every"], []).append(run_["wall_s"] / run_["steps"])
    for n, run_ in enumerate(runs):
        same = [(m, x) for m, x in enumerate(runs) if x["mode"] == "none" and x["every"] == run_["every"]]
        before = [x for m, x in same if m < n][-1:]
        after = [x for m, x in same if m > n][:1]
        near = before + after if before and after else [x for _, x in same]
        per_step = statistics.mean(x["wall_s"] / x["steps"] for x in near) if near else float("nan")
        expected = per_step * run_["steps"]
        overhead = (run_["wall_s"] - expected) / expected
        row = {
            "mode": run_["mode"],
            "every": run_["every"],
            "steps": run_["steps"],
            "wall_s": round(run_["wall_s"], 3),
            "baseline_step_s": round(per_step, 5),
            "overhead": round(overhead, 4),
            "blocking_s": run_["blocking_s"],
        }
        if run_["saves"]:
            row["overhead_per_save_s"] = round((run_["wall_s"] - expected) / run_["saves"], 4)
            if floor:
                row["per_save_vs_floor"] = round(row["overhead_per_save_s"] / floor, 3)
        for key in ("saving_step_s", "step_after_s", "step_s", "max_step_s", "last_snapshot"):
            if key in run_:
                row[key] = run_[key]
        rows.append(row)
    measured = {(row["mode"], row["every"]) for row in rows}
    for row in list(rows):
        if "overhead_per_save_s" not in row or "cold" in row["mode"]:
            continue
        for every in base:
            if (row["mode"], every) not in measured:
                derived = row["overhead_per_save_s"] / (every * statistics.mean(base[every]))
                rows.append(
                    {"mode": row["mode"], "every": every, "overhead": round(derived, 4), "derived": True}
                )
                measured.add((row["mode"], every))
    return rows
