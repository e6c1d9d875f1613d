"""The daemon's side of the worker process: start it, feed it tasks, restart it if it dies.

``WorkerSupervisor.run_task(task, on_progress)`` sends a task and awaits its ``TaskResult``. If the
worker dies meanwhile, every pending task fails with ``RetryableError`` (callers retry with backoff)
and a new worker starts after a short, growing delay. ``DataEvent``s go to the ``on_event`` callback.
``fence(job)``/``unfence(job)``: a job being purged, fenced in the worker (``ipc.FenceJob``) and in
every worker started while it is (``WorkerConfig.fenced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import subprocess
import sys
from collections.abc import Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_result, wait_exponential

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt_replicator.replication.ipc import (
    MAX_LINE,
    DataEvent,
    ErasureTask,
    FenceJob,
    FetchTask,
    RebuildTask,
    RetireTask,
    SendTask,
    Shutdown,
    TaskProgress,
    TaskResult,
    WorkerConfig,
    WorkerReady,
    decode_line,
    encode_line,
)

__all__ = ["WorkerSupervisor"]

log = logging.getLogger(__name__)

OnProgress = Callable[[TaskProgress], None]


class WorkerSupervisor:
    def __init__(self, config: WorkerConfig, *, on_event: Callable[[DataEvent], None] | None = None) -> None:
        self.config = config
        self.on_event = on_event or (lambda _e: None)
        self.restarts = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[TaskResult], OnProgress | None]] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ready = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._fenced: set[str] = set()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def next_id(self) -> int:
        return next(self._ids)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="worker-supervisor")
        await asyncio.wait_for(self._ready.wait(), timeout=30)

    async def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._writer is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._writer.write(encode_line(Shutdown()))
                await self._writer.drain()
        proc = self._proc
        if proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
            except asyncio.TimeoutError:
                log.warning("worker did not stop in %.0fs; killing it", timeout)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def fence(self, job: str) -> None:
        """Fence ``job`` in the worker (it is being purged): returns once no transfer or task of it is
        under way there, and none starts until ``unfence``. A worker that is not running has none; the
        next one starts fenced."""
        self._fenced.add(job)
        with contextlib.suppress(RetryableError):
            await self.run_task(FenceJob(id=self.next_id(), job=job))

    async def unfence(self, job: str) -> None:
        """Lift the fence of ``job`` (it was purged)."""
        self._fenced.discard(job)
        with contextlib.suppress(RetryableError):
            await self.run_task(FenceJob(id=self.next_id(), job=job, fenced=False))

    async def run_task(
        self,
        task: SendTask | FetchTask | RetireTask | ErasureTask | RebuildTask | FenceJob,
        on_progress: OnProgress | None = None,
    ) -> TaskResult:
        if not self._ready.is_set():
            raise RetryableError("the replication worker is not running")
        fut: asyncio.Future[TaskResult] = asyncio.get_running_loop().create_future()
        self._pending[task.id] = (fut, on_progress)
        try:
            assert self._writer is not None
            self._writer.write(encode_line(task))
            await self._writer.drain()
            return await fut
        except ConnectionError as exc:
            raise RetryableError(f"the replication worker went away: {exc}") from exc
        finally:
            self._pending.pop(task.id, None)

    # ------------------------------------------------------------------ internals

    async def _supervise(self) -> None:
        """Run the worker until ``stop``: each time it exits, start a new one after 0.5 s, doubling up
        to 30 s (the delay never shrinks again: a worker that keeps dying is not a hot loop)."""
        restarts = AsyncRetrying(
            retry=retry_if_result(lambda _rc: not self._stopping),
            wait=wait_exponential(multiplier=0.5, max=30.0),
            before_sleep=self._restarting,
        )
        await restarts(self._run_worker)

    def _restarting(self, exited: RetryCallState) -> None:
        self.restarts += 1
        rc = exited.outcome.result() if exited.outcome is not None else None
        delay = exited.upcoming_sleep
        log.error("replication worker exited with %s; restarting in %.1fs", rc, delay)

    async def _run_worker(self) -> int | None:
        """One worker's life: start it, serve its channel until it closes; its exit status."""
        rc = await self._run_once()
        self._ready.clear()
        self._fail_pending(f"the replication worker exited with {rc}")
        return rc

    async def _run_once(self) -> int | None:
        parent, child = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tierckpt_replicator.replication.worker", "--fd", str(child.fileno())],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=MAX_LINE)
        self._writer = writer
        writer.write(encode_line(dataclasses.replace(self.config, fenced=tuple(sorted(self._fenced)))))
        await writer.drain()
        try:
            await self._read_loop(reader)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._writer = None
        return await asyncio.to_thread(self._proc.wait)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ConnectionError, ValueError) as exc:
                log.error("worker channel broke: %s", exc)
                return
            if not line:
                return
            try:
                self._dispatch(decode_line(line))
            except FormatError as exc:
                log.error("ignoring a malformed message from the worker: %s", exc)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, TaskResult):
            fut = self._pending.get(msg.id, (None, None))[0]
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, TaskProgress):
            cb = self._pending.get(msg.id, (None, None))[1]
            if cb is not None:
                cb(msg)
        elif isinstance(msg, DataEvent):
            self.on_event(msg)
        elif isinstance(msg, WorkerReady):
            self._ready.set()
            log.info("replication worker %s ready, data endpoint on port %d", self.pid, msg.data_port)

    def _fail_pending(self, why: str) -> None:
        for fut, _ in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(RetryableError(why))
