"""Loading once per replica group and broadcasting: ``Checkpointer.load(..., broadcast=True)``.

Instead of every member reading its own ramdisk copy (a host-to-device copy per rank, and a checksum
pass per rank over what is the same pages when the copies are hard links), the group's lowest rank
loads the step as usual (verified), and its tensors are broadcast over the group's process group
(NCCL between GPUs, gloo between CPU processes) straight into the other members' tensors.

It applies only when every member holds the step with the same content (``protocol.replica.content_key``
of their manifests). A step whose members diverged, or that a member lacks, is loaded by each member
from its own copy, as without the option. Each member still restores its own tree and objects (those
may differ per rank); only tensors travel. Tensors up to 1 MiB go in buckets of 64 MiB; larger ones are
broadcast in place when they are contiguous on the collective's device, else through a buffer.

Every step here that involves another member is a collective that every member enters, whatever
happened locally, so that one member's error never leaves the others waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tierckpt import cuda
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import Manifest
from tierckpt.protocol.replica import content_key
from tierckpt.replica_group import Membership
from tierckpt.snapshot.dtypes import numpy_dtype, torch_dtype
from tierckpt.snapshot.flatten import restore_into
from tierckpt.snapshot.loader import StepLoader
from tierckpt.snapshot.restore import check_structure, read_objects

__all__ = ["load_broadcast"]

log = logging.getLogger(__name__)

_SMALL = 1 << 20
_BUCKET = 64 << 20
_ALIGN = 16


def _content(manifest: Manifest) -> str:
    record = manifest.replica
    if record is not None and record.known:
        return record.content
    return content_key(manifest.files, manifest.tensors)


def _targets(
    dest: dict[Any, Any], manifest: Manifest, objects: list[Any], device: torch.device | None
) -> list[torch.Tensor]:
    """Walk the tree into ``dest`` (restoring what is not a tensor) and return the tensor that receives
    each manifest tensor: the destination's own when it has the same dtype and shape, else a new one."""
    targets: dict[int, torch.Tensor] = {}

    def fill(i: int, existing: Any) -> torch.Tensor:
        entry = manifest.tensors[i]
        dtype, shape = torch_dtype(entry.dtype), tuple(entry.shape)
        if (
            isinstance(existing, torch.Tensor)
            and existing.dtype == dtype
            and tuple(existing.shape) == shape
            and existing.device.type != "meta"
        ):
            target = existing
        else:
            where = (
                existing.device
                if isinstance(existing, torch.Tensor) and existing.device.type != "meta"
                else None
            )
            target = torch.empty(shape, dtype=dtype, device=where or device or "cpu")
        targets[i] = target
        return target

    def fill_array(i: int, existing: Any) -> np.ndarray:
        entry = manifest.tensors[i]
        dtype, shape = numpy_dtype(entry.dtype), tuple(entry.shape)
        fits = (
            type(existing) is np.ndarray
            and existing.shape == shape
            and existing.dtype == dtype
            and existing.flags.writeable
            and existing.flags.c_contiguous
        )
        array = existing if fits else np.empty(shape, dtype=dtype)
        targets[i] = torch.from_numpy(array)
        return array

    restore_into(
        dest,
        manifest.tree,
        fill=fill,
        fill_array=fill_array,
        n_tensors=len(manifest.tensors),
        objects=objects,
    )
    if len(targets) != len(manifest.tensors):
        raise FormatError(
            f"step {manifest.step}: the tree names {len(targets)} of {len(manifest.tensors)} tensors"
        )
    return [targets[i] for i in range(len(manifest.tensors))]


def _broadcast_large(t: torch.Tensor, *, src: int, group: Any, device: torch.device, sending: bool) -> None:
    direct = t.is_contiguous() and t.device == device
    buf = t if direct else torch.empty(t.shape, dtype=t.dtype, device=device)
    if sending and not direct:
        buf.copy_(t)
    dist.broadcast(cuda.flat_bytes(buf), src, group=group)
    if not sending and not direct:
        t.copy_(buf)


def _broadcast_bucket(
    bucket: Sequence[torch.Tensor], *, src: int, group: Any, device: torch.device, sending: bool
) -> None:
    """One broadcast for tensors of one device: laid out at aligned offsets in a buffer."""
    offsets, total = [], 0
    for t in bucket:
        offsets.append(total)
        total += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    home = bucket[0].device
    local = torch.empty(total, dtype=torch.uint8, device=home)
    slots = [
        local[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for o, t in zip(offsets, bucket, strict=True)
    ]
    if sending:
        cuda.gather(slots, bucket)
    wire = local if home == device else local.to(device)
    dist.broadcast(wire, src, group=group)
    if not sending:
        if wire is not local:
            local.copy_(wire)
        cuda.gather(bucket, slots)


def _broadcast(
    targets: Sequence[torch.Tensor], *, src: int, group: Any, device: torch.device, sending: bool
) -> None:
    small: dict[torch.device, list[torch.Tensor]] = {}
    for t in targets:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        if nbytes > _SMALL:
            _broadcast_large(t, src=src, group=group, device=device, sending=sending)
        else:
            small.setdefault(t.device, []).append(t)
    for tensors in small.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= _BUCKET:
                _broadcast_bucket(bucket, src=src, group=group, device=device, sending=sending)
                bucket, size = [], 0
        if bucket:
            _broadcast_bucket(bucket, src=src, group=group, device=device, sending=sending)


def load_broadcast(
    loader: StepLoader,
    membership: Membership,
    dest: dict[Any, Any],
    step: int,
    path: Path,
    *,
    verify: bool,
    device: torch.device | str | None,
    strict: bool = True,
) -> None:
    """Fill ``dest`` with ``step``: loaded by the group's lowest rank, broadcast to the others (see the
    module doc). Raises this rank's own error (``FormatError``, ``StateMismatchError``...) like
    ``StepLoader.load``; ``strict`` as there (every member checks its own destination)."""
    start = time.perf_counter()
    manifest: Manifest | None = None
    error: BaseException | None = None
    try:
        manifest = loader.manifests.read(path, step)
        loader.check_identity(path, step, manifest, strict=strict)
    except Exception as exc:  # reported after the exchange: the other members must not wait for us
        error = exc
    contents = membership.all_gather_object(None if manifest is None else _content(manifest))
    if len(set(contents.values())) != 1 or None in contents.values():
        if error is not None:
            raise error
        log.info(
            "replica group %s: step %d differs between members (or one lacks it): each loads its own",
            membership.id,
            step,
        )
        loader.load(dest, step, path, verify=verify, device=device, strict=strict)
        return
    assert manifest is not None
    src = membership.group.members[0]
    sending = membership.rank == src
    targets: list[torch.Tensor] = []
    where = None if device is None else torch.device(device)
    try:
        objects = read_objects(path, manifest)
        if sending:
            loader.load(dest, step, path, verify=verify, device=device, strict=strict)
        elif strict:
            check_structure(dest, path, manifest, objects)
        targets = _targets(dest, manifest, objects, where)
    except Exception as exc:
        error = exc
    ready = membership.all_gather_object(error is None)
    if not all(ready.values()):
        if error is not None:
            raise error
        log.warning(
            "replica group %s: step %d: the loading member failed; nothing was broadcast", membership.id, step
        )
        return  # the job-wide agreement after the load reports the failed member on every rank
    local = time.perf_counter()
    comm = membership.exchange_device()
    with torch.no_grad():
        _broadcast(targets, src=src, group=membership.process_group, device=comm, sending=sending)
    timings = loader.last_timings if sending else {}
    timings["broadcast_s"] = time.perf_counter() - local
    timings["total_s"] = time.perf_counter() - start
    timings["broadcast_source"] = float(src)
    loader.last_timings = timings
