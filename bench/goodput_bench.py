"""What checkpointing costs a training loop, from process start: one fresh process per run, N trainers.

Every run is a new process (or N of them, one per GPU, started together), so the first saves pay what a
restarted job pays. Each trains the GPT-like model of ``client_train.py`` (0.94 B parameters by default,
fp32 weights, bf16 autocast, fused AdamW: 10.5 GiB of state) for ``--steps`` steps and saves every
``--every`` steps from step ``--every`` on, with no warm-up save and no ``prepare()``:

* ``none``: no checkpoints (the baseline; every other run sits between two of these, since a GPU's
  speed drifts over minutes); it synchronises at the steps where the others save;
* ``readme``: exactly the README's snippet: ``tierckpt.Checkpointer()`` configured by the environment,
  ``ckpt.load(state, allow_missing=True)`` (a fresh job) and ``ckpt.save(step, state)`` with
  ``state = {"model": model, "optim": optimizer}``;
* ``fresh``: the same in a brand-new job: the optimizer has no state yet when ``load`` runs (torch
  creates it at the first step), so the slots prepared from ``load`` on are sized for the model alone
  until the first save brings the whole layout;
* ``plain`` (``Checkpointer(device_staging=False)`` with state dicts), ``overlap`` and ``device``
  (``overlap=True`` / ``device_staging=True`` with the optimizer registered): the explicit modes;
* ``dicts``: the default ``Checkpointer()`` given ``model.state_dict()`` and ``optimizer.state_dict()``
  built at every save, as older scripts do.

Saves happen right after a GPU synchronisation (as a loop that logs its loss does); the baseline
synchronises at the same steps. Reported per trainer: the blocking time of every save and the GPU time
of every step that saves (against the baseline's median step), the median of the steps between saves,
and the overhead of the steady window (the second half of the run) against the baseline runs around it.

``--check`` (a separate run per mode, not timed): before two saves a CPU copy of the state is taken, and
once the optimizer has changed the parameters again the committed step is compared with it byte for
byte. ``--trace`` samples every thread's Python frame every 2 ms inside each trainer and reports, for the
slowest steps that do not save (wall clock), where each thread was (and the longest gap between samples:
the training thread holding the GIL). ``--pyspy`` samples trainer 0 of each checkpointing run with
py-spy (``--gil``: only the threads holding the GIL), written as collapsed stacks to ``--out``.
``--events`` adds tierckpt's debug log lines (slots prepared, staging banks) with their time since the
loop started.

A mode may carry settings of the client's tuning constants, for A/B runs in one call:
``readme:BACKGROUND_DUTY=0.5/URGENT_DUTY=1.0`` is the ``readme`` run with ``pool.BACKGROUND_DUTY``
0.5 and ``pool.URGENT_DUTY`` 1.0 (``TUNABLES`` lists what may be set).

Run: ``python bench/goodput_bench.py --root /mnt/ramdisk [--trainers 4] [--modes none,readme,device]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import logging
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TUNABLES = {
    "BACKGROUND_DUTY": "tierckpt.snapshot.pool",
    "URGENT_DUTY": "tierckpt.snapshot.pool",
}
"""Client constants a mode's settings may change (``mode:NAME=value/NAME=value``), and their modules."""


def _tune(mode: str) -> str:
    """Apply the settings a mode carries (see ``TUNABLES``); the plain mode."""
    import importlib

    mode, _, settings = mode.partition(":")
    for item in filter(None, settings.split("/")):
        name, _, value = item.partition("=")
        module = importlib.import_module(TUNABLES[name])
        setattr(module, name, type(getattr(module, name))(float(value)))
    return mode


class _Collections:
    """The garbage collector's passes while attached: each full (generation 2) collection's start
    (seconds since ``start``) and duration, and the total time of the younger ones."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.full: list[tuple[float, float, int]] = []
        self.young_s = 0.0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif info["generation"] == 2:
            self.full.append(
                (round(self._began - self.start, 3), round(now - self._began, 4), info["collected"])
            )
        else:
            self.young_s += now - self._began

    def attach(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def detach(self) -> None:
        gc.callbacks.remove(self)


class _Events(logging.Handler):
    """tierckpt's debug log lines, with seconds since ``start``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.start = time.perf_counter()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 200:
            self.lines.append((round(time.perf_counter() - self.start, 3), record.getMessage()[:300]))

    def attach(self) -> _Events:
        logger = logging.getLogger("tierckpt")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("tierckpt").removeHandler(self)


# ------------------------------------------------------------------------------------------- trainer


def _saver(mode: str, root: Path, rank: int, world: int, trainer: Any) -> Any:
    """A callable ``save(step)`` for ``mode`` (None for the baseline), and the checkpointer."""
    import tierckpt

    if mode == "none":
        return None, None
    if mode == "fresh":  # a brand-new job: torch creates the optimizer's state at its first step
        trainer.opt.state.clear()
        mode = "readme"
    if mode == "readme":
        os.environ.update(
            TIERCKPT_ROOT=str(root), TIERCKPT_JOB="bench", RANK=str(rank), WORLD_SIZE=str(world)
        )
        ckpt = tierckpt.Checkpointer()
        state = {"model": trainer.model, "optim": trainer.opt}
        ckpt.load(state, allow_missing=True)  # a fresh job: nothing to load (the slots start preparing)
        return (lambda step: ckpt.save(step, state)), ckpt
    options: dict[str, Any] = {"root": root, "job": "bench", "rank": rank, "world_size": world}
    if mode == "plain":
        options["device_staging"] = False
    elif mode in ("overlap", "device"):
        options["overlap"] = mode == "overlap"
        options["device_staging"] = mode == "device"
    ckpt = tierckpt.Checkpointer(**options)
    if mode in ("overlap", "device"):
        ckpt.register_optimizer(trainer.opt)
    return (lambda step: ckpt.save(step, trainer.state())), ckpt


class _Sampler:
    """Every thread's innermost frame (and innermost tierckpt frame) every ``period`` seconds."""

    def __init__(self, period: float = 0.002) -> None:
        import threading

        self.period = period
        self.samples: list[tuple[float, dict[str, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def _where(frame: Any) -> str:
        inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
        f = frame
        while f is not None and "tierckpt" not in f.f_code.co_filename:
            f = f.f_back
        if f is None:
            return inner
        return f"{inner} < {Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno}"

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.period):
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            now = time.perf_counter()
            self.samples.append(
                (now, {names.get(i, str(i)): self._where(f) for i, f in frames.items() if i != me})
            )

    def report(self, start: float, end: float) -> dict[str, Any]:
        import collections

        self._stop.set()
        inside = [(t, s) for t, s in self.samples if start <= t <= end]
        times = [start, *(t for t, _ in inside), end]
        by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for _, sample in inside:
            for name, where in sample.items():
                by_thread[name][where] += 1
        return {
            "samples": len(inside),
            "longest_gap_s": round(max(b - a for a, b in itertools.pairwise(times)), 4),
            "threads": {name: c.most_common(3) for name, c in by_thread.items()},
        }


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer process: build, warm the kernels, wait for the others, train and save; JSON out."""
    import torch

    sys.path.insert(0, str(HERE))
    from client_train import Checker, ModelSpec, Trainer

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES names this trainer's GPU
    spec = ModelSpec(layers=args.layers, width=args.width, seq=args.seq, vocab=args.vocab, batch=args.batch)
    trainer = Trainer(spec, args.device)
    clock = _Clock(cuda)
    for _ in range(3):  # kernels chosen, optimizer state allocated: as any job before its first save
        trainer.step()
    clock.sync()
    run_dir = Path(args.run_dir)
    (run_dir / f"ready-{args.rank}").touch()
    while not (run_dir / "go").exists():
        time.sleep(0.005)
    events = _Events().attach() if args.events else None
    started = time.perf_counter()
    collections = _Collections(started).attach()
    save, ckpt = _saver(_tune(args.mode), Path(args.root), args.rank, args.trainers, trainer)
    checker = Checker() if args.check else None
    saved = types.SimpleNamespace(handles={}, ck=ckpt)  # what Checker.verify reads
    profiler = cProfile.Profile() if (args.profile or args.profile_first) and save is not None else None
    every, steps = args.every, args.steps
    blocking: dict[int, float] = {}
    window: list[float] = []
    sampler = _Sampler() if args.trace and save is not None else None
    walls: list[float] = []
    for k in range(1, steps + 1):
        walls.append(time.perf_counter())
        clock.mark()
        trainer.step()
        if k % every:
            continue
        clock.sync()
        if k == steps // 2 or k == steps:
            window.append(time.perf_counter())
        if save is None:
            continue
        if checker is not None:
            if k > every:
                checker.verify(saved)
            checker.before_save(k, trainer.state())
        profiling = profiler is not None and (k <= 2 * every if args.profile_first else k > steps // 2)
        if profiling:
            profiler.enable()
        t0 = time.perf_counter()
        handle = save(k)
        blocking[k] = time.perf_counter() - t0
        if profiling:
            profiler.disable()
        saved.handles[k] = handle
    walls.append(time.perf_counter())
    clock.mark()
    clock.sync()
    if checker is not None:
        checker.verify(saved)
    step_s = clock.intervals()
    stalls = []
    if sampler is not None:  # the slowest steps that neither save nor follow a save, by wall clock
        quiet_walls = [(b - a, k) for k, (a, b) in enumerate(itertools.pairwise(walls), 1) if k % every]
        for wall, k in sorted(quiet_walls, reverse=True)[:4]:
            stalls.append({"step": k, "wall_s": round(wall, 4), **sampler.report(walls[k - 1], walls[k])})
    saving = [k for k in range(every, steps + 1, every)]
    quiet = [t for k, t in enumerate(step_s, 1) if k % every and (k - 1) % every]
    out: dict[str, Any] = {
        "mode": args.mode,
        "rank": args.rank,
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "state_bytes": sum(t.numel() * t.element_size() for t in _tensors(trainer)),
        "blocking_s": {k: round(v, 4) for k, v in blocking.items()},
        "saving_step_s": {k: round(step_s[k - 1], 4) for k in saving},
        "quiet_step_s": statistics.median(quiet),
        "step_s": [round(t, 5) for t in step_s],
        "window_s": window[1] - window[0] if len(window) == 2 else None,
        "window_steps": steps - steps // 2,
        "run_s": time.perf_counter() - started,
    }
    collections.detach()
    out["full_gc"] = collections.full  # [seconds since start, duration, objects collected]
    out["young_gc_s"] = round(collections.young_s, 4)
    out["step_starts"] = [round(w - started, 3) for w in walls[:-1]]
    if stalls:
        out["stalls"] = stalls
    if events is not None:
        events.detach()
        out["events"] = events.lines
    if ckpt is not None:
        out["last_snapshot"] = ckpt.last_snapshot
        out["device_staging_bytes"] = ckpt.device_staging_bytes
        ckpt.close()
    if checker is not None:
        out["verified_steps"] = checker.verified
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        which = "first" if args.profile_first else "steady"
        (Path(args.out) / f"profile-{which}-{args.rank}.txt").write_text(text.getvalue())
    return out


class _Clock:
    """Step starts: CUDA timing events on the GPU's timeline, or wall-clock times on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        import torch

        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def intervals(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


def _tensors(trainer: Any) -> list[Any]:
    from tierckpt.snapshot.flatten import flatten

    return list(flatten(trainer.state()).tensors)


# ------------------------------------------------------------------------------------------- parent


def launch(args: argparse.Namespace, mode: str, index: int, *, check: bool = False) -> list[dict[str, Any]]:
    """Start ``--trainers`` processes of ``mode`` together; their results."""
    run_dir = Path(args.root) / f"run-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    procs = []
    for rank in range(args.trainers):
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--rank", str(rank)]
        cmd += ["--trainers", str(args.trainers), "--root", str(run_dir), "--run-dir", str(run_dir)]
        cmd += ["--every", str(args.every), "--steps", str(args.steps), "--device", args.device]
        cmd += [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "seq", "vocab", "batch")]
        cmd += ["--check"] if check else []
        cmd += ["--trace"] if args.trace and not check else []
        cmd += ["--events"] if args.events and not check else []
        cmd += (
            ["--profile-first", "--out", args.out]
            if args.profile_first and not check and mode != "none"
            else []
        )
        cmd += ["--profile", "--out", args.out] if args.profile and check else []
        if args.pyspy and rank == 0 and mode != "none" and not check:
            trace = Path(args.out) / f"pyspy-{index}-{mode}.txt"
            gil = ["--gil"] if args.pyspy == "gil" else []
            cmd = [
                "py-spy",
                "record",
                "-r",
                "400",
                "--nonblocking",
                "--threads",
                *gil,
                "-f",
                "raw",
                "-o",
                str(trace),
                "--",
                *cmd,
            ]
        env = dict(
            os.environ,
            CUDA_VISIBLE_DEVICES=str(rank % max(1, args.gpus)),
            LOCAL_WORLD_SIZE=str(args.trainers),
        )
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 300
    while not all((run_dir / f"ready-{r}").exists() for r in range(args.trainers)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (run_dir / "go").touch()
    results = []
    for p in procs:
        text, _ = p.communicate(timeout=600)
        lines = [line for line in text.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": p.returncode})
    shutil.rmtree(run_dir, ignore_errors=True)
    return results


def summarize(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Each checkpointing run against the baseline runs just before and after it."""
    rows = []
    for i, (mode, results) in enumerate(runs):
        if mode == "none" or any("error" in r for r in results):
            continue
        near = [runs[j][1] for j in (i - 1, i + 1) if 0 <= j < len(runs) and runs[j][0] == "none"]
        for r in results:
            base = [b[r["rank"]] for b in near if "error" not in b[r["rank"]]]
            if not base:
                continue
            window = statistics.mean(b["window_s"] for b in base)
            step = statistics.mean(b["quiet_step_s"] for b in base)
            blocking = list(r["blocking_s"].values())
            steady = blocking[len(blocking) // 2 :]
            rows.append(
                {
                    "mode": mode,
                    "rank": r["rank"],
                    "overhead": round(r["window_s"] / window - 1, 4),
                    "quiet_steps": round(r["quiet_step_s"] / step - 1, 4),
                    "first_blocking_s": blocking[:4],
                    "steady_blocking_s": round(statistics.median(steady), 4),
                    "worst_vs_steady": round(max(blocking) / statistics.median(steady), 2),
                    "saving_steps_x": [round(t / step, 2) for t in r["saving_step_s"].values()],
                    "base_step_s": round(step, 5),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/dev/shm/tierckpt-goodput", help="ramdisk directory")
    p.add_argument("--modes", default="readme,device", help="checkpointing runs (comma-separated)")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes started together")
    p.add_argument("--gpus", type=int, default=0, help="GPUs to spread trainers over (0: all)")
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--steps", type=int, default=120, help="steps per run (the second half is timed)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a check of the script")
    p.add_argument("--layers", type=int, default=18, help="transformer blocks (18: 0.94 B parameters)")
    p.add_argument("--width", type=int, default=2048, help="model width")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary")
    p.add_argument("--batch", type=int, default=8, help="batch size")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the modes, interleaved with baselines")
    p.add_argument("--check", action="store_true", help="also verify two saves of each mode bit-exact")
    p.add_argument("--pyspy", choices=["", "all", "gil"], default="", help="sample trainer 0 with py-spy")
    p.add_argument("--trace", action="store_true", help="where each thread was during the slowest steps")
    p.add_argument("--events", action="store_true", help="tierckpt's debug log lines, timed")
    p.add_argument("--out", default=".", help="where py-spy and --profile write")
    p.add_argument("--profile", action="store_true", help="cProfile the check runs' steady saves")
    p.add_argument(
        "--profile-first", action="store_true", help="cProfile the first two saves of the timed runs"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(train(args)), flush=True)
        return
    if not args.gpus and args.device == "cuda":
        import torch

        args.gpus = torch.cuda.device_count()
    modes = [m for m in args.modes.split(",") if m and m != "none"]
    runs: list[tuple[str, list[dict[str, Any]]]] = [("none", launch(args, "none", 0))]
    for _ in range(args.rounds):
        for mode in modes:
            runs.append((mode, launch(args, mode, len(runs))))
            runs.append(("none", launch(args, "none", len(runs))))
            print(f"{mode}: {json.dumps(runs[-2][1])}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"trainers": args.trainers, "every": args.every, "steps": args.steps}
    report["runs"] = runs
    report["summary"] = summarize(runs)
    if args.check:
        report["check"] = {m: launch(args, m, len(runs) + i, check=True) for i, m in enumerate(modes)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
