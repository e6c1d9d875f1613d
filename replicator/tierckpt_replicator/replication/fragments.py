"""Erasure-coded fragments on a node's ramdisk: where they live, how one is committed and read.

A node holds at most one fragment of a rank's step, in ``<job>/fragments/rank-N/step-S/``:

* ``fragment-III.bin``: the fragment's bytes (``III``: its index in the code, ``< k``: data);
* ``erasure.json``: the step's ``ErasureManifest`` (the code, the layout, the step's files, the crc32c
  of every fragment), the typed fragment manifest;
* ``manifest.json`` and ``COMMIT``: the step's own manifest and COMMIT marker, byte for byte, so a step
  rebuilt from fragments is committed exactly as its primary was; COMMIT is written last, so a
  fragment directory exists only once everything in it is complete.

Like replicas, a fragment is received into a hidden ``.incoming-`` directory (``FragmentWriter``),
checked against its crc32c as it arrives, and renamed into place; every access is confined to the job
tree (``safefs.Beneath``): nothing a pod plants is followed. Only the newest ``keep`` fragment steps
of a rank are kept (``retain``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import secrets

from tierckpt.protocol.errors import CorruptShardError, FormatError, UnsafePathError
from tierckpt.protocol.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    committed_steps,
    discard_step,
    ranks_in,
    read_commit,
    read_manifest,
)
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.replication.erasure import ERASURE_MANIFEST_NAME, ErasureManifest, fragment_name
from tierckpt_replicator.stepio import (
    FRAGMENTS,
    INCOMING_PREFIX,
    StepHeader,
    create_preallocated,
    parse_header,
    rank_name,
    read_header,
    step_name,
)

__all__ = [
    "FRAGMENTS",
    "FragmentHeader",
    "FragmentScanner",
    "FragmentWriter",
    "find_fragment",
    "fragment_tree",
    "fragment_trees",
    "held_index",
    "parse_fragment_header",
    "read_fragment_header",
    "retain",
]

log = logging.getLogger(__name__)

_FRAGMENT_RE = re.compile(r"fragment-(\d{3})\.bin")


def fragment_tree(job: Beneath, rank: int) -> Beneath:
    """The view of rank ``rank``'s fragment directory (it may not exist yet)."""
    return job.at(f"{FRAGMENTS}/{rank_name(rank)}")


def fragment_trees(job: Beneath) -> dict[int, Beneath]:
    """Rank -> the view of its fragment directory, for every one that is a real directory."""
    parent = job.at(FRAGMENTS)
    out = {}
    try:
        for rank in ranks_in(parent):
            if parent.is_dir(rank_name(rank)):
                out[rank] = parent.at(rank_name(rank))
    except UnsafePathError as exc:
        log.warning("refusing %s: %s", parent.where, exc)
    return out


@dataclasses.dataclass(frozen=True)
class FragmentHeader:
    """A fragment's step header (the step's COMMIT and manifest), its erasure manifest and its index,
    parsed and cross-checked."""

    step: StepHeader
    erasure_bytes: bytes
    erasure: ErasureManifest
    index: int

    @property
    def size(self) -> int:
        return self.erasure.fragment(self.index).size

    @property
    def crc32c(self) -> int:
        return self.erasure.fragment(self.index).crc32c


def parse_fragment_header(
    commit_bytes: bytes,
    manifest_bytes: bytes,
    erasure_bytes: bytes,
    *,
    job: str,
    rank: int,
    step: int,
    index: int,
) -> FragmentHeader:
    """Decode and cross-check a fragment's header; anything inconsistent raises ``FormatError``."""
    header = parse_header(commit_bytes, manifest_bytes, job=job, rank=rank, step=step)
    em = ErasureManifest.from_bytes(erasure_bytes)
    if (em.job, em.rank, em.step) != (job, rank, step):
        raise FormatError(
            f"erasure manifest of {em.job} rank {em.rank} step {em.step}, not the one requested"
        )
    if tuple(em.files) != tuple(header.manifest.files):
        raise FormatError("the erasure manifest's files are not the step's")
    em.fragment(index)  # FormatError outside 0 .. k+m-1
    return FragmentHeader(header, erasure_bytes, em, index)


def held_index(step: Beneath) -> int | None:
    """The index of the one fragment file in a fragment step directory (None if there is not exactly one)."""
    try:
        found = [int(m.group(1)) for n in step.listdir() if (m := _FRAGMENT_RE.fullmatch(n))]
    except (OSError, UnsafePathError):
        return None
    return found[0] if len(found) == 1 else None


def read_fragment_header(step: Beneath, *, job: str, rank: int, step_no: int, limit: int) -> FragmentHeader:
    """A committed fragment's header, read confined and cross-checked like one received."""
    index = held_index(step)
    if index is None:
        raise FormatError(f"{step.where}: not exactly one fragment file")
    header = read_header(step, job=job, rank=rank, step_no=step_no, limit=limit)
    erasure_bytes = step.read_bytes(ERASURE_MANIFEST_NAME, limit=limit)
    return parse_fragment_header(
        header.commit_bytes,
        header.manifest_bytes,
        erasure_bytes,
        job=job,
        rank=rank,
        step=step_no,
        index=index,
    )


def find_fragment(job: Beneath, rank: int, step: int) -> Beneath | None:
    """The view of this node's committed fragment of the rank's step, if it holds one."""
    path = fragment_tree(job, rank).at(step_name(step))
    try:
        return path if read_commit(path) is not None else None
    except (FormatError, UnsafePathError):
        return None


class FragmentWriter:
    """Stage one fragment under ``parent`` (``fragment_tree``); ``commit()`` makes it exist,
    ``abort()`` removes it."""

    def __init__(self, parent: Beneath, header: FragmentHeader) -> None:
        self.parent, self.header = parent, header
        self.final = step_name(header.erasure.step)
        self.file = fragment_name(header.index)
        parent.makedirs()
        self.name = f"{INCOMING_PREFIX}{header.erasure.step:012d}-{secrets.token_hex(4)}"
        parent.mkdir(self.name)
        self.dir = parent.at(self.name)
        self._crc: int | None = None

    def prepare(self) -> None:
        """Create the fragment file at its full size now (``RamdiskFullError`` before any byte moves)."""
        create_preallocated(self.dir, self.file, self.header.size)

    def open(self) -> int:
        """A write descriptor of the staged fragment file (the caller closes it)."""
        return self.dir.open_fd(self.file, os.O_WRONLY)

    @property
    def where(self) -> str:
        return f"{self.dir.where}/{self.file}"

    def record(self, crc: int) -> None:
        """The crc32c computed while the fragment was written; a mismatch raises ``CorruptShardError``."""
        if crc != self.header.crc32c:
            em = self.header.erasure
            raise CorruptShardError(
                f"fragment {self.header.index} of {em.job} rank {em.rank} step {em.step}: crc32c {crc:08x}, "
                f"its erasure manifest says {self.header.crc32c:08x}",
                path=self.where,
            )
        self._crc = crc

    def commit(self) -> Beneath:
        """Write the erasure manifest, the step's manifest, then its COMMIT; rename into place."""
        if self._crc is None:
            raise FormatError("cannot commit a fragment that was not received")
        self.dir.write_atomic(ERASURE_MANIFEST_NAME, self.header.erasure_bytes)
        self.dir.write_atomic(MANIFEST_NAME, self.header.step.manifest_bytes)
        self.dir.write_atomic(COMMIT_NAME, self.header.step.commit_bytes)
        final = self.parent.at(self.final)
        if self.parent.exists(self.final):
            with contextlib.suppress(FormatError):
                if read_commit(final) is not None:
                    self.abort()
                    return final
            discard_step(final)
        self.parent.rename(self.name, self.final)
        return final

    def abort(self) -> None:
        with contextlib.suppress(OSError, UnsafePathError):
            self.parent.remove_tree(self.name)

    def __enter__(self) -> FragmentWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def retain(parent: Beneath, keep: int) -> list[int]:
    """Drop all but the newest ``keep`` committed fragment steps of a rank; returns the dropped steps."""
    steps = committed_steps(parent)
    dropped = steps[: max(0, len(steps) - keep)]
    for s in dropped:
        discard_step(parent.at(step_name(s)))
    return dropped


class FragmentScanner:
    """``scanner(job_tree)``: rank -> step -> ((index, k), world size) of every committed fragment held
    (the inventory's ``fragments``); each step's erasure manifest and manifest are read once, cached by
    the crc32c its COMMIT records."""

    def __init__(self, max_manifest_bytes: int) -> None:
        self.limit = max_manifest_bytes
        self._cache: dict[tuple[str, int], tuple[int, int]] = {}

    def __call__(self, job: Beneath) -> dict[int, dict[int, tuple[tuple[int, int], int]]]:
        out: dict[int, dict[int, tuple[tuple[int, int], int]]] = {}
        for rank, parent in fragment_trees(job).items():
            for step in committed_steps(parent):
                info = self._info(parent.at(step_name(step)))
                if info is not None:
                    out.setdefault(rank, {})[step] = info
        return out

    def _info(self, step: Beneath) -> tuple[tuple[int, int], int] | None:
        try:
            marker = read_commit(step)
            index = held_index(step)
            if marker is None or index is None:
                return None
            key = (step.where, marker.manifest_crc32c)
            cached = self._cache.get(key)
            if cached is None:
                em = ErasureManifest.from_bytes(step.read_bytes(ERASURE_MANIFEST_NAME, limit=self.limit))
                cached = self._cache[key] = (em.layout.k, read_manifest(step, limit=self.limit).world_size)
            return (index, cached[0]), cached[1]
        except (FormatError, OSError) as exc:
            log.warning("skipping unreadable fragment %s: %s", step.where, exc)
            return None
