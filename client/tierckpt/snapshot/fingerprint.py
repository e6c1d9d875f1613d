"""Content fingerprints of a state's tensors, cheap enough for every save (replica groups compare them).

* CPU tensors: crc32c of their bytes, on the checksum pool (``checksum.region_crcs``).
* CUDA tensors: a digest computed on the device, on the current stream (so after whatever training
  queued that writes them), with nothing copied to the host but the 16-byte result. The bytes are
  viewed as 64-bit words laid out in rows of 4,096; the rows are summed and the columns are summed
  (integer sums wrap and do not depend on the order of reduction, so equal bytes give equal digests on
  any device), and each sum vector is folded with odd position weights into one word. A changed word
  changes its row and its column sum; two swapped words change both unless they are equal. Two passes
  over the bytes at memory bandwidth, no temporary as large as the data. Tensors up to 1 MiB are
  concatenated per device and digested as one buffer, so thousands of small tensors cost a few
  kernels, not thousands.
* The structure (keys, dtypes, shapes) is hashed apart, so that members whose states differ in shape
  are told apart before their bytes are compared tensor by tensor (``tensor_digests``, the slow path
  that names the tensors that differ).

Not a cryptographic hash: it catches replicas that drifted apart (a training bug), not an adversary.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from tierckpt import cuda
from tierckpt.snapshot.checksum import region_crcs

__all__ = ["Fingerprint", "device_digest", "fingerprint", "structure_digest", "tensor_digests"]

_COLS = 4096
_SMALL = 1 << 20
"""Tensors up to this many bytes are digested together (per device)."""


def structure_digest(keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> int:
    """A signed 64-bit hash of the keys, dtypes and shapes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for key, t in zip(keys, tensors, strict=True):
        h.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor (a view when it is contiguous)."""
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _fold(v: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``sum(v[i] * (2 * (start + i) + 1))`` in wrapping int64."""
    weights = torch.arange(start, start + v.numel(), dtype=torch.int64, device=v.device).mul_(2).add_(1)
    return (v * weights).sum()


def device_digest(buf: torch.Tensor) -> torch.Tensor:
    """Two int64 words digesting a 1-D uint8 tensor, computed where it lives (see the module doc)."""
    n = buf.numel()
    n8 = n // 8 * 8
    if buf.data_ptr() % 8:
        buf = buf.clone()  # an int64 view needs 8-byte alignment
    words = buf[:n8].view(torch.int64)
    full = words.numel() // _COLS * _COLS
    length = torch.full((), n, dtype=torch.int64, device=buf.device)  # a fill kernel: no host copy, no sync
    if full:
        rows = words[:full].view(-1, _COLS)
        a = _fold(rows.sum(dim=1))
        b = _fold(rows.sum(dim=0)) + length
    else:
        a, b = torch.zeros((), dtype=torch.int64, device=buf.device), length
    if full < words.numel() or n8 < n:
        tail = torch.cat([words[full:], buf[n8:].to(torch.int64)])
        b = b + _fold(tail, start=_COLS)
    return torch.stack([a, b])


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A state's fingerprint: the host part is known, the device part may still be computing."""

    structure: int
    host: tuple[int, int]
    """The CPU tensors' crc32c, hashed into two signed 64-bit words."""
    device: torch.Tensor | None
    """Two int64 words on a CUDA device (None without CUDA tensors), ready once the stream gets there."""

    def vector(self, device: torch.device, prefix: Sequence[int] = ()) -> torch.Tensor:
        """``[*prefix, structure, host0, host1, device0, device1]`` as int64 on ``device``: one small
        host-to-device copy; the device words are not waited for."""
        head = torch.tensor([*prefix, self.structure, *self.host], dtype=torch.int64).to(device)
        if self.device is None:
            return torch.cat([head, torch.zeros(2, dtype=torch.int64, device=device)])
        return torch.cat([head, self.device.to(device)])


def _signed(data: bytes) -> int:
    return int.from_bytes(data, "little", signed=True)


def _cpu_crcs(tensors: Sequence[torch.Tensor]) -> list[int]:
    flat = [_bytes_of(t) for t in tensors]
    return region_crcs([(b.data_ptr(), b.numel()) for b in flat])


def fingerprint(
    keys: Sequence[str], tensors: Sequence[torch.Tensor], *, structure: int | None = None
) -> Fingerprint:
    """Fingerprint ``tensors`` (named ``keys``); ``structure`` saves hashing the keys again."""
    if structure is None:
        structure = structure_digest(keys, tensors)
    cpu = [t for t in tensors if not cuda.is_cuda(t) and t.numel()]
    h = hashlib.blake2b(digest_size=16)
    if cpu:
        h.update(b"".join(c.to_bytes(4, "little") for c in _cpu_crcs(cpu)))
    host = h.digest()
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for t in tensors:
        if cuda.is_cuda(t) and t.numel():
            small, large = by_device.setdefault(t.device, ([], []))
            (small if t.numel() * t.element_size() <= _SMALL else large).append(t)
    parts: list[torch.Tensor] = []
    for small, large in by_device.values():
        with torch.no_grad(), torch.cuda.device(large[0].device if large else small[0].device):
            if small:
                parts.append(device_digest(torch.cat([_bytes_of(t) for t in small])))
            parts.extend(device_digest(_bytes_of(t)) for t in large)
    digest = None
    if parts:
        first = parts[0].device
        stacked = torch.stack([p.to(first) for p in parts])
        digest = torch.stack([_fold(stacked[:, 0]), _fold(stacked[:, 1])])
    return Fingerprint(structure, (_signed(host[:8]), _signed(host[8:])), digest)


def tensor_digests(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One ``[crc32c, 0]`` (CPU) or device digest (CUDA) row per tensor, as an ``[n, 2]`` int64 tensor on
    ``device``: the slow path that names the tensors two members disagree on."""
    out = torch.zeros((len(tensors), 2), dtype=torch.int64)
    cpu_index = [i for i, t in enumerate(tensors) if not cuda.is_cuda(t)]
    for i, crc in zip(cpu_index, _cpu_crcs([tensors[i] for i in cpu_index]), strict=True):
        out[i, 0] = crc
    out = out.to(device)
    on_device = [i for i, t in enumerate(tensors) if cuda.is_cuda(t) and t.numel()]
    if on_device:
        with torch.no_grad():
            rows = torch.stack([device_digest(_bytes_of(tensors[i])).to(device) for i in on_device])
            out[torch.tensor(on_device, dtype=torch.int64).to(device)] = rows
    return out
