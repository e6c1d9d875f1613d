"""``SaveHandle``: what ``Checkpointer.save`` returns. Two signals, as in DCP's ``AsyncSaveResponse``:

* *snapshot done*: the state's bytes are in the ramdisk (or on their way there in a way training
  cannot disturb); training may mutate the parameters again;
* *committed*: checksums, sync, manifest and COMMIT are done; the step exists.

A save skipped by the ``on_busy="skip"`` policy is a handle that is already done, with ``skipped``
set and result None.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from tierckpt.protocol.format import CommitMarker

__all__ = ["SaveHandle"]


class SaveHandle:
    """Progress and result of one ``save``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.skip_reason: str | None = None
        self._snapshot: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commit: concurrent.futures.Future[CommitMarker | None] = concurrent.futures.Future()
        for f in (self._snapshot, self._commit):
            f.set_running_or_notify_cancel()

    @classmethod
    def skipped_save(cls, step: int, reason: str) -> SaveHandle:
        handle = cls(step)
        handle.skip_reason = reason
        handle._snapshot.set_result(None)
        handle._commit.set_result(None)
        return handle

    # ------------------------------------------------------------------------------------ queries

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    def snapshot_done(self) -> bool:
        """True once training may mutate the saved tensors again."""
        return self._snapshot.done()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the snapshot is taken; raises the save's error if it failed before that."""
        self._snapshot.result(timeout)

    def done(self) -> bool:
        """True once the save is committed, failed or skipped."""
        return self._commit.done()

    def wait(self, timeout: float | None = None) -> CommitMarker | None:
        """Block until committed and return the ``CommitMarker`` (None if skipped); raises its error."""
        return self._commit.result(timeout)

    result = wait

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._commit.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        self._commit.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        if self.skipped:
            state = f"skipped: {self.skip_reason}"
        elif not self.done():
            state = "snapshot done, committing" if self.snapshot_done() else "copying"
        else:
            state = "failed" if self._commit.exception() else "committed"
        return f"<SaveHandle step={self.step} {state}>"

    # ------------------------------------------------------------------------------------ producer

    def _set_snapshot(self) -> None:
        if not self._snapshot.done():
            self._snapshot.set_result(None)

    def _set_committed(self, marker: CommitMarker) -> None:
        self._set_snapshot()
        self._commit.set_result(marker)

    def _set_failed(self, exc: BaseException) -> None:
        if not self._snapshot.done():
            self._snapshot.set_exception(exc)
        self._commit.set_exception(exc)
