"""Committed steps written straight in the client format, for the tests and the benchmarks (no torch).

``write_step`` produces exactly what the client commits: tensors at aligned offsets in data files, zero
padding between them, per-tensor and per-file crc32c, a manifest, and COMMIT last. Bytes stream to
disk in blocks, so steps of gigabytes need no more memory than one block.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

from tierckpt.protocol.format import (
    ALIGNMENT,
    FileEntry,
    Manifest,
    TensorEntry,
    align_up,
    commit_step,
    data_file_name,
    rank_dir,
    step_dir,
)
from tierckpt.protocol.integrity import crc32c

__all__ = ["step_files", "tree_bytes", "write_step"]

_BLOCK = 1 << 20


def write_step(
    root: str | os.PathLike[str],
    job: str,
    rank: int,
    step: int,
    *,
    world_size: int = 1,
    sizes: tuple[int, ...] = (1 << 20,),
    files: int = 1,
    seed: int | None = None,
    block: bytes | None = None,
    parent: Path | None = None,
) -> Path:
    """Commit one step of ``rank``: tensors of ``sizes`` bytes, dealt round-robin over ``files`` data files.

    Content: reproducible pseudo-random bytes from ``seed`` (default: from job, rank and step), or
    ``block`` repeated (fast, for large benchmark steps). ``parent``: the rank directory to write into
    (default ``<root>/<job>/rank-<rank>``; a replica directory, say). Returns the step directory.
    """
    path = step_dir(parent if parent is not None else rank_dir(root, job, rank), step)
    path.mkdir(parents=True, exist_ok=False)
    rng = random.Random(seed if seed is not None else hash((job, rank, step)))
    members: list[list[int]] = [[] for _ in range(files)]
    for i in range(len(sizes)):
        members[i % files].append(i)
    tensors: dict[int, TensorEntry] = {}
    entries = []
    for index, group in enumerate(members):
        name = data_file_name(index)
        file_crc, offset = 0, 0
        with open(path / name, "wb") as f:
            for i in group:
                pad = align_up(offset, ALIGNMENT) - offset
                f.write(b"\0" * pad)
                file_crc, offset = crc32c(b"\0" * pad, file_crc), offset + pad
                crc = 0
                for chunk in _content(rng, block, sizes[i]):
                    f.write(chunk)
                    crc, file_crc = crc32c(chunk, crc), crc32c(chunk, file_crc)
                tensors[i] = TensorEntry(f"t{i}", "uint8", (sizes[i],), name, offset, sizes[i], crc)
                offset += sizes[i]
        entries.append(FileEntry(name=name, size=offset, crc32c=file_crc))
    manifest = Manifest(
        job=job,
        rank=rank,
        world_size=world_size,
        step=step,
        created_at=time.time(),
        files=tuple(entries),
        tensors=tuple(tensors[i] for i in range(len(sizes))),
        tree={"t": [{"tensor": i} for i in range(len(sizes))]},
    )
    commit_step(path, manifest)
    return path


def step_files(path: Path) -> dict[str, bytes]:
    """Every file of a step directory, by name (for bit-exact comparisons)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def tree_bytes(path: Path) -> int:
    """Bytes in every file below ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _content(rng: random.Random, block: bytes | None, n: int) -> Iterator[bytes]:
    """``n`` bytes in blocks of at most 1 MiB (``randbytes`` overflows past 256 MiB in one call)."""
    for start in range(0, n, _BLOCK):
        size = min(_BLOCK, n - start)
        yield rng.randbytes(size) if block is None else (block * (size // len(block) + 1))[:size]
