"""The replica-group save strategy: agree with the other members, then write or link this rank's copy.

``Checkpointer.save`` in a replica group (``replica_group.Membership``) hands the step to
``GroupedSave.save``: it plans the save (``save_plan``), takes whether this rank refuses it (busy, or its
copy of the step is leased) and its last failed step to the group's one small exchange
(``Membership.agree``), and then, as the group decided:

* a refusal by any member: every member skips the step (or raises, with ``on_busy="error"``);
* equal fingerprints: the node's writer writes (``SaveWriter.start``), the others link its files
  (``SaveWriter.start_linked``), each with the replica record of its role;
* different fingerprints: every member writes its own copy, and the divergence is logged (and raised
  after the snapshot with ``on_divergence="raise"``).

It owns no files and no thread: the I/O is the ``SaveWriter``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from tierckpt.protocol.errors import ReplicaDivergenceError, SaveInProgressError
from tierckpt.protocol.format import FileEntry, TensorEntry
from tierckpt.protocol.replica import REPLICA_VERSION, ReplicaRecord, content_key
from tierckpt.replica_group import BUSY, FAILED, LEASED, Agreement, Membership
from tierckpt.save_plan import SavePlan, SavePlanner
from tierckpt.save_writer import SaveWriter
from tierckpt.settings import Settings
from tierckpt.snapshot.commit import RecordFor
from tierckpt.snapshot.handle import SaveHandle

__all__ = ["GroupedSave"]

log = logging.getLogger(__name__)


class GroupedSave:
    """Saves of one member of a replica group (every member saves the same steps together)."""

    def __init__(
        self,
        group: Membership,
        settings: Settings,
        planner: SavePlanner,
        writer: SaveWriter,
        protected: Callable[[], frozenset[int]],
    ) -> None:
        self.group, self.settings, self.planner, self.writer = group, settings, planner, writer
        self.protected = protected
        """The storages a registered optimizer's step mutates (empty when saves wait for every copy)."""

    def save(self, step: int, state_dict: dict[Any, Any]) -> tuple[SaveHandle, ReplicaDivergenceError | None]:
        """Agree with the other members, then write (or link) this rank's copy of ``step``.

        An error before the exchange is still taken to it (as a refusal), then raised: the other members
        skip the save instead of waiting in the collective."""
        group = self.group
        error: Exception | None = None
        plan: SavePlan | None = None
        try:
            refusal = self._busy_refusal()
            plan = self.planner.plan(step, state_dict, self.protected())
            if not refusal:
                # Replacing an existing step retires it now, even if another member then refuses the save.
                reason = self.writer.make_room(step)
                if reason is not None:
                    log.warning("step %d: %s", step, reason)
                    refusal = LEASED
        except Exception as exc:
            error, refusal = exc, FAILED
        agreement = group.agree(
            plan.flat.keys if plan is not None else (),
            plan.flat.tensors if plan is not None else (),
            structure=self.planner.structure(plan) if plan is not None else 0,
            refusal=refusal,
            last_failed=self.writer.last_failed,
        )
        if error is not None:
            raise error
        assert plan is not None
        self._settle_link(agreement)
        if agreement.refused:
            reason = f"replica group {group.id} skips step {step}: {agreement.refusal_text()}"
            if self.settings.on_busy == "error":
                raise SaveInProgressError(reason)
            log.info("skipped the save of step %d: %s", step, reason)
            return SaveHandle.skipped_save(step, reason), None
        divergence = self._report_divergence(step, agreement) if agreement.diverged else None
        record = self._record_for(agreement)
        if agreement.source is None:
            handle = self.writer.start(plan, state_dict, record=record)
        else:
            handle = self.writer.start_linked(plan, agreement.source, agreement.fingerprint, record)
        self.writer.last_save.update(
            group=group.id,
            source=self.settings.rank if agreement.source is None else agreement.source,
            diverged=agreement.diverged,
            fingerprint_s=agreement.fingerprint_s,
            exchange_s=agreement.exchange_s,
        )
        return handle, divergence

    def _busy_refusal(self) -> int:
        """``BUSY`` when the previous save still commits and ``on_busy`` does not wait (0 otherwise).

        Decided by the group together: one member skipping alone would leave the others waiting."""
        job = self.writer.inflight
        if job is None or job.handle.done():
            return 0
        if self.settings.on_busy == "wait":
            with contextlib.suppress(Exception):  # its failure belongs to its own handle
                job.handle.wait()
            return 0
        return BUSY

    def _settle_link(self, agreement: Agreement) -> None:
        """Before a new save: finish the previous linked save (abandoned if its source reported its save
        of that step failed; the source, having waited for its own commit, knows by now)."""
        job = self.writer.linking
        if job is None or job.handle.done():
            return
        if agreement.failed.get(job.source) == job.step:
            job.cancelled.set()
        with contextlib.suppress(Exception):
            job.handle.wait()

    def _record_for(self, agreement: Agreement) -> RecordFor:
        group, source, rank = self.group, agreement.source, self.settings.rank

        def record(
            files: tuple[FileEntry, ...], tensors: tuple[TensorEntry, ...], linked: int
        ) -> ReplicaRecord:
            total = sum(f.size for f in files)
            return ReplicaRecord(
                version=REPLICA_VERSION,
                group=group.id,
                members=group.group.members,
                role="writer" if source is None else "linked",
                source=rank if source is None else source,
                node=group.node,
                fingerprint=agreement.fingerprint,
                diverged=agreement.diverged,
                differs=agreement.differs,
                content=content_key(files, tensors),
                written_bytes=total - linked,
                logical_bytes=total,
            )

        return record

    def _report_divergence(self, step: int, agreement: Agreement) -> ReplicaDivergenceError | None:
        classes = " | ".join(str(list(c)) for c in agreement.classes)
        named = "; ".join(
            f"rank {m} differs in {', '.join(keys)}" for m, keys in sorted(agreement.differing_keys.items())
        )
        message = (
            f"replica group {self.group.id}: the members' tensors differ at step {step} (equal fingerprints: "
            f"{classes}){': ' + named if named else ''}; every member keeps its own copy. A replica that "
            "drifted apart is a training bug (a missed gradient all-reduce, a rank-dependent update)"
        )
        log.error("rank %d: %s", self.settings.rank, message)
        if self.settings.on_divergence == "raise":
            return ReplicaDivergenceError(message, step=step, differs=agreement.differs)
        return None
