"""crc32c (Castagnoli) over buffers and files, through google-crc32c.

Also ``crc32c_combine``: the crc of a concatenation from the crcs of its parts, so the crc of a whole
data file is derived from its per-tensor crcs without a second pass over the bytes, and
``crc32c_address``: the crc of raw memory (a mapped shard file) with no copy and without the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable, Iterable
from typing import cast

import google_crc32c

__all__ = [
    "crc32c",
    "crc32c_address",
    "crc32c_combine",
    "crc32c_concat",
    "crc32c_file",
    "crc32c_zeros",
]

_POLY_REFLECTED = 0x82F63B78
_READ_CHUNK = 8 << 20


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """crc32c of ``data``, continuing from ``crc`` (0 to start)."""
    # google_crc32c's C extension has no stubs (its functions read as Any); both return the crc as int.
    if crc == 0:
        return cast(int, google_crc32c.value(data))
    return cast(int, google_crc32c.extend(crc, data))


@functools.lru_cache(maxsize=1)
def _native_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, const uint8_t*, size_t)`` of the C library that google-crc32c loads.

    google-crc32c's Python API accepts only ``bytes``, so checksumming a mapped file through it would
    copy every byte. The same wheel ships the library itself; calling it through ctypes reads the
    memory in place, and ctypes releases the GIL for the call.
    """
    if google_crc32c.implementation != "c":
        return None
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = sorted({line.split()[-1] for line in maps if "libcrc32c" in line})
    except OSError:
        pass
    pkg = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    candidates += glob.glob(os.path.join(pkg, "google_crc32c*", "libcrc32c*.so*"))
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


def crc32c_address(address: int, length: int, crc: int = 0) -> int:
    """crc32c of ``length`` bytes of memory at ``address`` (e.g. inside an mmap), continuing from ``crc``.

    The caller keeps the memory alive and unchanged for the duration of the call. No copy is made
    and the GIL is released, so threads can checksum disjoint regions in parallel.
    """
    if length == 0:
        return crc
    native = _native_extend()
    if native is not None:
        return int(native(crc, address, length))
    for start in range(0, length, _READ_CHUNK):  # fallback: copy bounded chunks through the Python API
        crc = crc32c(ctypes.string_at(address + start, min(_READ_CHUNK, length - start)), crc)
    return crc


def crc32c_file(path: str | os.PathLike[str] | int, *, offset: int = 0, length: int | None = None) -> int:
    """crc32c of a file region, read in bounded chunks (``path`` may be an open descriptor: it is read
    from ``offset`` and left open)."""
    crc = 0
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
        f.seek(offset)
        remaining = length
        while remaining is None or remaining > 0:
            want = _READ_CHUNK if remaining is None else min(_READ_CHUNK, remaining)
            chunk = f.read(want)
            if not chunk:
                break
            crc = crc32c(chunk, crc)
            if remaining is not None:
                remaining -= len(chunk)
    return crc


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=1)
def _zero_operators() -> tuple[tuple[int, ...], ...]:
    """Operators that append 2**k zero bytes to a crc register, for k = 0..63."""
    odd = [_POLY_REFLECTED] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    ops = []
    op = _gf2_square(odd)  # eight zero bits = one byte
    for _ in range(64):
        ops.append(tuple(op))
        op = _gf2_square(op)
    return tuple(ops)


def _shift(crc: int, nbytes: int) -> int:
    """Apply ``nbytes`` zero bytes to a raw crc register."""
    k = 0
    while nbytes:
        if nbytes & 1:
            crc = _gf2_times(list(_zero_operators()[k]), crc)
        nbytes >>= 1
        k += 1
    return crc


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) given crc32c(A), crc32c(B) and len(B)."""
    if len2 == 0:
        return crc1
    return _shift(crc1, len2) ^ crc2


def crc32c_zeros(nbytes: int) -> int:
    """crc32c of ``nbytes`` zero bytes, computed in O(log n)."""
    if nbytes == 0:
        return 0
    # crc(zeros) = shift(init, n) ^ xorout where init/xorout are all ones; express via combine.
    return crc32c_combine(0, 0, nbytes) ^ _shift(0xFFFFFFFF, nbytes) ^ 0xFFFFFFFF


def crc32c_concat(parts: Iterable[tuple[int, int]]) -> int:
    """crc32c of a concatenation, from ``(crc, length)`` pairs in order."""
    crc = 0
    for part_crc, length in parts:
        crc = crc32c_combine(crc, part_crc, length)
    return crc
