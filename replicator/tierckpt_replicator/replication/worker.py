"""The replication worker process: the data endpoint plus a bounded pool of outgoing transfers.

Started by the daemon (``python -m tierckpt_replicator.replication.worker --fd N``) with one end of a
socketpair; it lowers its own CPU and I/O priority first, so replication never competes with the
training step. It exits when the daemon says ``Shutdown`` or its end of the socketpair closes. A job
the daemon fences (``FenceJob``: it is being purged) has no transfer or task under way here once the
worker answers, and none starts until the fence is lifted (``replication.fences``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.data_server import DataServer
from tierckpt_replicator.replication.fences import JobPurging
from tierckpt_replicator.replication.fragment_transfer import rebuild_step, remove_scratch, send_fragments
from tierckpt_replicator.replication.ipc import (
    Channel,
    ErasureTask,
    FenceJob,
    FetchTask,
    Outcome,
    RebuildTask,
    RetireTask,
    SendTask,
    Shutdown,
    TaskProgress,
    TaskResult,
    WorkerConfig,
    WorkerReady,
)
from tierckpt_replicator.replication.transfer import fetch_step, log_outcome, push_step, retire_copy
from tierckpt_replicator.stepio import remove_stale_incoming

__all__ = ["lower_priority", "main", "run_fetch", "run_send"]

log = logging.getLogger("tierckpt_replicator.worker")

_IOPRIO_CLASS_BE, _IOPRIO_CLASS_SHIFT, _IOPRIO_WHO_PROCESS = 2, 13, 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
_PROGRESS_EVERY = 0.25


def lower_priority(nice: int, idle_class: bool = False) -> None:
    """nice(``nice``), best-effort I/O class at its lowest level (ionice -c2 -n7), and optionally the
    SCHED_IDLE CPU class. Called before any other thread starts: every thread inherits it."""
    if nice > 0:
        os.nice(nice)
    if idle_class and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # pragma: no cover - refused by a seccomp profile, say
            log.warning("cannot switch to SCHED_IDLE: %s", exc)
    nr = _SYS_IOPRIO_SET.get(os.uname().machine)
    if nr is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(nr, _IOPRIO_WHO_PROCESS, 0, (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7)
    except OSError:  # pragma: no cover - best effort
        pass


def run_send(ctx: DataContext, task: SendTask) -> TaskResult:
    """Push to the candidates in order until ``want`` hold the step (or the primary is gone, or this
    node cannot send it at all: ``missing``, ``local``)."""
    outcomes: list[Outcome] = []
    have = 0
    for peer in task.candidates:
        out = push_step(ctx, task.job, task.rank, task.step, peer, base_rank=task.bases.get(peer.node, -1))
        outcomes.append(out)
        log_outcome(log, "send", task, f"-> {peer.node}", out)
        if out.status in ("ok", "already"):
            have += 1
        if out.status in ("missing", "local") or have >= task.want:
            break
    return TaskResult(id=task.id, ok=have >= task.want, outcomes=tuple(outcomes))


def _progress(ctx: DataContext, task_id: int) -> Callable[[int, int], None]:
    """A progress callback that reports ``TaskProgress`` at most every ``_PROGRESS_EVERY`` seconds (and
    at the end)."""
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= _PROGRESS_EVERY or done >= total:
            last = now
            ctx.emit(TaskProgress(id=task_id, bytes_done=done, bytes_total=total))

    return progress


def run_fetch(ctx: DataContext, task: FetchTask) -> TaskResult:
    """Stage from the first source that delivers a verified copy."""
    outcomes: list[Outcome] = []
    progress = _progress(ctx, task.id)
    for source in task.sources:
        out = fetch_step(
            ctx, task.job, task.rank, task.step, source, progress, into=task.into, save_id=task.save_id
        )
        outcomes.append(out)
        log_outcome(log, "fetch", task, f"<- {source.node} ({source.kind})", out)
        if out.status in ("ok", "already"):
            return TaskResult(id=task.id, ok=True, outcomes=tuple(outcomes))
    return TaskResult(
        id=task.id, ok=False, outcomes=tuple(outcomes), message="no source delivered a good copy"
    )


def run_rebuild(ctx: DataContext, task: RebuildTask) -> TaskResult:
    """Rebuild a primary from erasure-coded fragments, reporting progress like a fetch."""
    return rebuild_step(ctx, task, _progress(ctx, task.id))


def run_retire(ctx: DataContext, task: RetireTask) -> TaskResult:
    """Ask every holder to drop its surplus replica."""
    outcomes = tuple(retire_copy(ctx, task.job, task.rank, task.step, peer) for peer in task.holders)
    for out in outcomes:
        log.info(
            "retire %s rank %d step %d on %s: %s %s",
            task.job,
            task.rank,
            task.step,
            out.node,
            out.status,
            out.message,
        )
    return TaskResult(id=task.id, ok=all(o.status == "ok" for o in outcomes), outcomes=outcomes)


def _serve_tasks(chan: Channel, ctx: DataContext, pool: ThreadPoolExecutor) -> None:
    Task = SendTask | FetchTask | RetireTask | ErasureTask | RebuildTask

    def run(fn: Callable[[DataContext, Any], TaskResult], task: Task) -> None:
        try:
            with ctx.fences.working(task.job):  # a purge of the job waits for it
                result = fn(ctx, task)
        except JobPurging as exc:
            result = TaskResult(id=task.id, ok=False, message=str(exc))
        except Exception as exc:  # a bug: report it, keep the worker alive
            log.exception("task %d failed unexpectedly", task.id)
            result = TaskResult(id=task.id, ok=False, message=f"worker error: {exc!r}")
        chan.send(result)

    while True:
        try:
            msg = chan.recv()
        except FormatError as exc:
            log.error("ignoring a malformed message from the daemon: %s", exc)
            continue
        if msg is None or isinstance(msg, Shutdown):
            return
        if isinstance(msg, SendTask):
            pool.submit(run, run_send, msg)
        elif isinstance(msg, FetchTask):
            pool.submit(run, run_fetch, msg)
        elif isinstance(msg, RetireTask):
            pool.submit(run, run_retire, msg)
        elif isinstance(msg, ErasureTask):
            pool.submit(run, send_fragments, msg)
        elif isinstance(msg, RebuildTask):
            pool.submit(run, run_rebuild, msg)
        elif isinstance(msg, FenceJob):  # not behind the pool's queue: it waits for what the pool runs
            threading.Thread(target=_fence, args=(chan, ctx, msg), name="fence", daemon=True).start()
        else:
            log.error("unexpected message from the daemon: %s", type(msg).__name__)


def _fence(chan: Channel, ctx: DataContext, msg: FenceJob) -> None:
    """Fence (or unfence) ``msg.job``; answer once nothing of it is under way here."""
    if msg.fenced:
        ctx.fences.fence(msg.job)
        log.info("job %s: fenced (being purged): nothing of it is under way in the worker", msg.job)
    else:
        ctx.fences.lift(msg.job)
    chan.send(TaskResult(id=msg.id, ok=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierckpt-replicator-worker")
    parser.add_argument("--fd", type=int, required=True, help="socketpair end connected to the daemon")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    chan = Channel(sock)
    config = chan.recv()
    if not isinstance(config, WorkerConfig):
        print("worker: first message must be a WorkerConfig", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s [worker] %(name)s: %(message)s",
    )
    lower_priority(config.transfer.worker_nice, config.transfer.worker_idle)
    ctx = DataContext.from_config(config, emit=chan.send)
    removed = remove_stale_incoming(Path(config.root)) + remove_scratch(Path(config.root))
    if removed:
        log.info("removed %d torn transfers left by an earlier run", removed)
    server = DataServer(ctx)
    server.start()
    chan.send(WorkerReady(data_port=server.port))
    pool = ThreadPoolExecutor(max_workers=config.transfer.concurrency, thread_name_prefix="transfer")
    try:
        _serve_tasks(chan, ctx, pool)
    finally:
        server.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        log.info("worker stopping; unfinished transfers leave staging dirs that the next start removes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
