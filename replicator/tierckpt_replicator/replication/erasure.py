"""Erasure coding of a committed step: ``k`` data and ``m`` parity fragments, any ``k`` of which
rebuild it, at ``(k + m) / k`` times its size instead of the ``1 + m`` times of ``m`` extra replicas.

**Library**: PyECLib (OpenStack Swift's binding of liberasurecode) with its ISA-L Cauchy Reed-Solomon
backend (``isa_l_rs_cauchy``); both ship inside the wheels (x86-64 and aarch64), the coding is SIMD and
runs without the GIL. Measured on the 2-vCPU dev VM (bench/erasure_bench.py --compare, docs/benchmarks.md),
coding stripes of k x 256 KiB, GB per CPU-second, encode / decode with m data fragments lost: ISA-L
Cauchy 13.1 / 18.2 for (k, m) = (2, 1) and 11.2 / 15.8 for (4, 2); zfec 1.6.0.0 2.7 / 2.8 and
1.4 / 1.4 (and its ``Decoder.decode`` wrote into the immutable ``bytes`` of a parity block passed to
it: a second decode of the same blocks returned garbage); reed-solomon-leopard 12.8 / 1.9 and
9.7 / 2.2 (and it holds the GIL); liberasurecode's own ``liberasurecode_rs_vand`` 7.7 / 9.9 and
1.2 / 0.7. Coding a whole 256 MiB buffer in one call gives 0.4-0.8 for every library (each call faults
in fresh output pages), hence the stripes. Cauchy rather than ``isa_l_rs_vand`` (as fast): ISA-L's
Vandermonde matrix is not invertible for every loss pattern once ``m >= 5`` (measured: 10 of the first
3001 patterns of 5 lost fragments failed to decode with k=10, m=5, 20 with k=8, m=6); Cauchy decoded
them all.

**Layout**: the step's files, concatenated in manifest order, are cut into stripes of
``k * PIECE`` bytes (the last one shorter). Each stripe is encoded into ``k + m`` pieces: a 80-byte
liberasurecode header (the piece's index, the stripe's true length, so the padding, and a checksum of
the header) followed by ``ceil(stripe / k)`` coded bytes. Fragment ``i`` is piece ``i`` of every stripe
in order; every full stripe's piece has the same size, so piece ``j`` starts at ``j * piece_bytes`` in
every fragment, and all fragments have the same size. ``ErasureManifest`` records the layout, the crc32c
of every fragment and every original file; decoding checks both: the fragments it used, and each
rebuilt file against the step's own crc32c. A corrupt fragment is reported and replaced by another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Literal

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.format import FileEntry, check_job_id, fsync_dir, read_manifest, write_atomic
from tierckpt.protocol.integrity import crc32c, crc32c_file

__all__ = [
    "CODEC",
    "ERASURE_MANIFEST_NAME",
    "MAX_FRAGMENTS",
    "PIECE",
    "Decoded",
    "ErasureLayout",
    "ErasureManifest",
    "FragmentEntry",
    "StripeCodec",
    "decode_bytes",
    "decode_step",
    "decode_streams",
    "encode_bytes",
    "encode_step",
    "encode_streams",
    "fragment_name",
    "read_erasure_manifest",
]

log = logging.getLogger(__name__)

Codec = Literal["isa_l_rs_cauchy"]
CODEC: Codec = "isa_l_rs_cauchy"
PIECE = 256 << 10
"""Coded bytes per fragment per stripe. Measured: 256 KiB codes ~10% faster than 1 MiB and ~15x faster
than 4 MiB, where every call faults in fresh output pages."""
MAX_FRAGMENTS = 32
"""k + m at most: liberasurecode allows more, a job's failure domains never need them."""
ERASURE_MANIFEST_NAME = "erasure.json"
_HEADER_BYTES = 80
"""liberasurecode's fragment header (``fragment_header_t``) before every piece."""


def fragment_name(index: int) -> str:
    return f"fragment-{index:03d}.bin"


def _check_code(k: int, m: int) -> None:
    if not (k >= 1 and m >= 1 and k + m <= MAX_FRAGMENTS):
        raise FormatError(f"erasure code k={k} m={m}: need k >= 1, m >= 1, k + m <= {MAX_FRAGMENTS}")


# --------------------------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class ErasureLayout(Record):
    """How a byte stream of ``total_bytes`` was cut and coded: enough to decode it."""

    codec: Codec
    k: int
    m: int
    stripe_bytes: int
    """Bytes of the stream per full stripe (``k * PIECE``)."""
    total_bytes: int
    piece_bytes: int
    """Bytes of each fragment per full stripe (header included)."""
    last_piece_bytes: int
    """Bytes of each fragment for the last stripe (== ``piece_bytes`` when it is full; 0 when empty)."""

    def __post_init__(self) -> None:
        _check_code(self.k, self.m)
        if self.stripe_bytes < self.k or self.total_bytes < 0:
            raise FormatError("erasure layout sizes out of range")
        if self.total_bytes and not (0 < self.last_piece_bytes <= self.piece_bytes):
            raise FormatError("erasure layout piece sizes out of range")

    @property
    def stripes(self) -> int:
        return -(-self.total_bytes // self.stripe_bytes)

    @property
    def fragment_bytes(self) -> int:
        """The size of every fragment."""
        return 0 if not self.stripes else (self.stripes - 1) * self.piece_bytes + self.last_piece_bytes

    def stripe(self, j: int) -> tuple[int, int, int]:
        """(offset in the stream, its length, offset of its piece in a fragment) of stripe ``j``."""
        start = j * self.stripe_bytes
        return start, min(self.stripe_bytes, self.total_bytes - start), j * self.piece_bytes

    def piece_size(self, j: int) -> int:
        return self.last_piece_bytes if j == self.stripes - 1 else self.piece_bytes


@dataclasses.dataclass(frozen=True)
class FragmentEntry(Record):
    """One fragment: its index in the code (``< k``: data, else parity), its size and its crc32c."""

    index: int
    size: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class ErasureManifest(Message):
    """The erasure-coded form of one committed step: its layout, its original files (in stream order,
    with their crc32c from the step's manifest) and its ``k + m`` fragments (index = position)."""

    KIND = "tierckpt.erasure-manifest"
    VERSION = 1

    job: str
    rank: int
    step: int
    layout: ErasureLayout
    files: tuple[FileEntry, ...]
    fragments: tuple[FragmentEntry, ...]

    def __post_init__(self) -> None:
        check_job_id(self.job)
        lay = self.layout
        if sum(f.size for f in self.files) != lay.total_bytes:
            raise FormatError("erasure manifest: the files do not add up to the coded bytes")
        if len({f.name for f in self.files}) != len(self.files):
            raise FormatError("erasure manifest lists a file twice")
        if [f.index for f in self.fragments] != list(range(lay.k + lay.m)):
            raise FormatError(f"erasure manifest fragments must be 0..{lay.k + lay.m - 1} in order")
        if any(f.size != lay.fragment_bytes for f in self.fragments):
            raise FormatError(f"every fragment must have {lay.fragment_bytes} bytes")

    def fragment(self, index: int) -> FragmentEntry:
        if not 0 <= index < len(self.fragments):
            raise FormatError(f"no fragment {index} in a {self.layout.k}+{self.layout.m} code")
        return self.fragments[index]


def read_erasure_manifest(directory: Path) -> ErasureManifest:
    return ErasureManifest.from_bytes((directory / ERASURE_MANIFEST_NAME).read_bytes())


# --------------------------------------------------------------------------------------------- codec


class StripeCodec:
    """One ``(k, m)`` code over single stripes: ``encode`` gives ``k + m`` pieces, ``decode`` takes any
    ``k`` of them. Not shared between threads (one per encode or decode pass)."""

    def __init__(self, k: int, m: int, codec: Codec = CODEC) -> None:
        from pyeclib.ec_iface import ECDriver  # a C extension: loaded only where coding happens

        _check_code(k, m)
        self.k, self.m, self.codec = k, m, codec
        self._driver = ECDriver(k=k, m=m, ec_type=codec, chksum_type="none")

    def piece_size(self, stripe_len: int) -> int:
        """Bytes of each piece of a stripe of ``stripe_len`` bytes (header included)."""
        return int(self._driver.get_segment_info(stripe_len, stripe_len)["fragment_size"])

    def layout(self, total_bytes: int, piece: int = PIECE) -> ErasureLayout:
        stripe = self.k * piece
        last = total_bytes - (max(0, -(-total_bytes // stripe) - 1) * stripe)
        return ErasureLayout(
            self.codec,
            self.k,
            self.m,
            stripe_bytes=stripe,
            total_bytes=total_bytes,
            piece_bytes=self.piece_size(stripe) if total_bytes else 0,
            last_piece_bytes=self.piece_size(last) if total_bytes else 0,
        )

    def encode(self, stripe: bytes) -> list[bytes]:
        """``k + m`` pieces of one non-empty stripe (``bytes``: the library takes nothing else)."""
        return list(self._driver.encode(stripe))

    def decode(self, pieces: Sequence[bytes], length: int) -> bytes:
        """The stripe of ``length`` bytes from ``k`` (or more) of its pieces, in any order. A piece whose
        header is damaged raises ``CorruptShardError``; damaged coded bytes decode wrongly (callers check
        crc32c)."""
        from pyeclib.ec_iface import ECDriverError

        try:
            out = self._driver.decode(list(pieces))
        except ECDriverError as exc:
            raise CorruptShardError(f"erasure decode failed: {exc}", path="") from exc
        if len(out) != length:
            raise CorruptShardError(f"erasure decode gave {len(out)} bytes, the stripe has {length}", path="")
        return bytes(out)


# --------------------------------------------------------------------------------------------- bytes


def encode_bytes(data: bytes, k: int, m: int, *, piece: int = PIECE) -> tuple[ErasureLayout, list[bytes]]:
    """The ``k + m`` fragments of ``data`` and their layout."""
    sinks = [io.BytesIO() for _ in range(k + m)]
    layout, _ = _encode(StripeCodec(k, m), [io.BytesIO(data)], [len(data)], sinks, piece)
    return layout, [s.getvalue() for s in sinks]


def decode_bytes(layout: ErasureLayout, fragments: Mapping[int, bytes]) -> bytes:
    """The original bytes from at least ``k`` fragments (by index). No crc32c here: ``decode_step``
    checks fragments and files."""
    out = io.BytesIO()
    _decode(
        StripeCodec(layout.k, layout.m, layout.codec),
        layout,
        {i: io.BytesIO(f) for i, f in fragments.items()},
        _StreamOut([out], [layout.total_bytes]),
    )
    return out.getvalue()


# --------------------------------------------------------------------------------------------- step


def encode_step(step: Path, out: Path, k: int, m: int, *, piece: int = PIECE) -> ErasureManifest:
    """Encode the committed step at ``step`` into ``out`` (a new directory): ``k + m`` fragment files and
    ``erasure.json``. Every source byte is checked against the step's manifest on the way: a corrupt
    primary raises ``CorruptShardError`` and leaves no ``out``."""
    manifest = read_manifest(step)
    out.mkdir()
    try:
        with contextlib.ExitStack() as stack:
            sources = [stack.enter_context(open(step / f.name, "rb", buffering=0)) for f in manifest.files]
            for f, src in zip(manifest.files, sources, strict=True):
                size = os.fstat(src.fileno()).st_size
                if size != f.size:
                    raise CorruptShardError(
                        f"{f.name}: {size} bytes on disk, manifest says {f.size}", path=str(step / f.name)
                    )
            sinks = [
                stack.enter_context(open(out / fragment_name(i), "xb", buffering=0)) for i in range(k + m)
            ]
            em = encode_streams(
                sources,
                manifest.files,
                sinks,
                job=manifest.job,
                rank=manifest.rank,
                step=manifest.step,
                k=k,
                m=m,
                piece=piece,
                where=str(step),
            )
            for sink in sinks:
                os.fsync(sink.fileno())
        write_atomic(out / ERASURE_MANIFEST_NAME, em.to_bytes())
        fsync_dir(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return em


def encode_streams(
    sources: Sequence[BinaryIO],
    files: Sequence[FileEntry],
    sinks: Sequence[BinaryIO],
    *,
    job: str,
    rank: int,
    step: int,
    k: int,
    m: int,
    piece: int = PIECE,
    where: str = "",
) -> ErasureManifest:
    """Encode the open ``sources`` (a step's files in manifest order, each exactly its ``files`` size)
    into the ``k + m`` open ``sinks``; every source byte is checked against the file's crc32c on the
    way (a mismatch raises ``CorruptShardError``). For callers that open files confined to a job tree
    (``safefs``); ``encode_step`` is the same on paths."""
    layout, crcs = _encode(StripeCodec(k, m), sources, [f.size for f in files], sinks, piece)
    for f, got in zip(files, crcs.files, strict=True):
        if got != f.crc32c:
            raise CorruptShardError(
                f"{f.name} of step {step}: crc32c {got:08x}, manifest says {f.crc32c:08x}",
                path=f"{where}/{f.name}",
            )
    return ErasureManifest(
        job=job,
        rank=rank,
        step=step,
        layout=layout,
        files=tuple(files),
        fragments=tuple(FragmentEntry(i, layout.fragment_bytes, c) for i, c in enumerate(crcs.fragments)),
    )


def decode_streams(
    em: ErasureManifest, sources: Mapping[int, BinaryIO], sinks: Sequence[BinaryIO]
) -> dict[str, int]:
    """Rebuild the step's files into the open ``sinks`` (one per ``em.files``, in order) from at least
    ``k`` open fragments (index -> file, read from their start), data fragments first. Every fragment
    read is checked against its crc32c and every rebuilt file against the step's (``CorruptShardError``
    naming what failed); returns each file's crc32c. ``decode_step`` also retries around corrupt
    fragments; here the caller verified the fragments when they arrived."""
    lay = em.layout
    chosen = dict(sorted(sources.items())[: lay.k])
    sink = _StreamOut(sinks, [f.size for f in em.files])
    got = _decode(StripeCodec(lay.k, lay.m, lay.codec), lay, chosen, sink)
    bad = sorted(i for i, c in got.items() if c != em.fragment(i).crc32c)
    if bad:
        raise CorruptShardError(
            f"{em.job} rank {em.rank} step {em.step}: fragments {bad} fail their crc32c", path=""
        )
    crcs = dict(zip((f.name for f in em.files), sink.crcs, strict=True))
    wrong = [f.name for f in em.files if crcs[f.name] != f.crc32c]
    if wrong:
        raise CorruptShardError(
            f"{em.job} rank {em.rank} step {em.step}: rebuilt {wrong} fail their crc32c", path=""
        )
    return crcs


@dataclasses.dataclass(frozen=True)
class Decoded:
    """What ``decode_step`` did: the crc32c of every rebuilt file (all matching the manifest), the
    fragments it used, and those it found corrupt (their holders should drop them)."""

    crcs: dict[str, int]
    used: tuple[int, ...]
    corrupt: tuple[int, ...]


def decode_step(em: ErasureManifest, fragments: Mapping[int, Path], out: Path) -> Decoded:
    """Rebuild the step's files into the existing directory ``out`` from the fragment files at hand.

    Data fragments are preferred (their decode is a copy). Each fragment used is checked against its
    crc32c as it is read and each rebuilt file against the step's; when a check fails the fragments
    at fault are set aside and the step is decoded again from others. Fewer than ``k`` intact
    fragments raise ``CorruptShardError`` (``MissingCheckpointError`` if fewer than ``k`` were given).
    """
    lay = em.layout
    if len(fragments) < lay.k:
        raise MissingCheckpointError(
            f"{em.job} rank {em.rank} step {em.step}: {len(fragments)} fragments at hand, {lay.k} needed"
        )
    usable = {}
    for index, path in fragments.items():
        entry = em.fragment(index)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue
        if size != entry.size:
            log.warning(
                "fragment %d of %s step %d has %d bytes, want %d", index, em.job, em.step, size, entry.size
            )
            continue
        usable[index] = path
    corrupt = {i for i in fragments if i not in usable}
    while True:
        chosen = sorted(usable)[: lay.k]
        if len(chosen) < lay.k:
            raise CorruptShardError(
                f"{em.job} rank {em.rank} step {em.step}: {len(usable)} intact fragments of {lay.k + lay.m}, "
                f"{lay.k} needed (corrupt or wrong size: {sorted(corrupt)})",
                path=str(out),
            )
        attempt = _decode_once(em, {i: usable[i] for i in chosen}, out)
        bad = set(attempt.bad_fragments)
        if attempt.files_ok:  # every file matches the step's crc32c: damage only where decoding ignores it
            return Decoded(attempt.crcs, tuple(chosen), tuple(sorted(corrupt | bad)))
        if not bad:  # the fragments match their crc32c, yet the files do not: check the rest too
            bad = {i for i in chosen if crc32c_file(usable[i]) != em.fragment(i).crc32c}
            if not bad:
                raise CorruptShardError(
                    f"{em.job} rank {em.rank} step {em.step}: fragments intact but the rebuilt files fail "
                    "their crc32c (the erasure manifest does not describe these fragments)",
                    path=str(out),
                )
        log.warning(
            "%s rank %d step %d: fragments %s are corrupt; decoding from others",
            em.job,
            em.rank,
            em.step,
            sorted(bad),
        )
        corrupt |= bad
        for i in bad:
            usable.pop(i, None)


@dataclasses.dataclass
class _Attempt:
    crcs: dict[str, int]
    bad_fragments: list[int]
    files_ok: bool


def _decode_once(em: ErasureManifest, chosen: Mapping[int, Path], out: Path) -> _Attempt:
    lay = em.layout
    with contextlib.ExitStack() as stack:
        sources = {i: stack.enter_context(open(p, "rb", buffering=0)) for i, p in chosen.items()}
        sinks = [stack.enter_context(_open_output(out / f.name, f.size)) for f in em.files]
        sink = _StreamOut(sinks, [f.size for f in em.files])
        try:
            frag_crcs = _decode(StripeCodec(lay.k, lay.m, lay.codec), lay, sources, sink)
        except CorruptShardError as exc:  # a damaged piece header: find the fragment by its crc32c
            log.warning("%s rank %d step %d: %s", em.job, em.rank, em.step, exc)
            bad = [i for i, p in chosen.items() if crc32c_file(p) != em.fragment(i).crc32c]
            return _Attempt({}, bad, False)
        for s in sinks:
            os.fsync(s.fileno())
    bad = [i for i, c in frag_crcs.items() if c != em.fragment(i).crc32c]
    crcs = dict(zip((f.name for f in em.files), sink.crcs, strict=True))
    ok = all(crcs[f.name] == f.crc32c for f in em.files)
    return _Attempt(crcs, bad, ok)


# --------------------------------------------------------------------------------------------- core


@dataclasses.dataclass
class _EncodeCrcs:
    files: list[int]
    fragments: list[int]


def _encode(
    codec: StripeCodec,
    sources: Sequence[BinaryIO],
    sizes: Sequence[int],
    sinks: Sequence[BinaryIO],
    piece: int,
) -> tuple[ErasureLayout, _EncodeCrcs]:
    layout = codec.layout(sum(sizes), piece)
    reader = _StreamIn(sources, sizes)
    frag_crcs = [0] * (codec.k + codec.m)
    for j in range(layout.stripes):
        _, length, _ = layout.stripe(j)
        pieces = codec.encode(reader.read(length))
        want = layout.piece_size(j)
        for i, (p, sink) in enumerate(zip(pieces, sinks, strict=True)):
            if len(p) != want:
                raise FormatError(f"erasure codec gave a {len(p)}-byte piece, the layout says {want}")
            frag_crcs[i] = crc32c(p, frag_crcs[i])
            _write_all(sink, p)
    return layout, _EncodeCrcs(reader.crcs(), frag_crcs)


def _decode(
    codec: StripeCodec, layout: ErasureLayout, sources: Mapping[int, BinaryIO], sink: _StreamOut
) -> dict[int, int]:
    """Decode every stripe from the ``sources`` (at least ``k``) into ``sink``; returns the crc32c of
    each source as read."""
    if len(sources) < layout.k:
        raise MissingCheckpointError(f"{len(sources)} fragments given, {layout.k} needed")
    chosen = dict(sorted(sources.items())[: layout.k])
    crcs = dict.fromkeys(chosen, 0)
    for j in range(layout.stripes):
        _, length, _ = layout.stripe(j)
        size = layout.piece_size(j)
        pieces = []
        for i, src in chosen.items():
            p = _read_exact(src, size)
            crcs[i] = crc32c(p, crcs[i])
            pieces.append(p)
        sink.write(codec.decode(pieces, length))
    return crcs


class _StreamIn:
    """Reads the concatenation of ``sources`` (each exactly its size) and the crc32c of each."""

    def __init__(self, sources: Sequence[BinaryIO], sizes: Sequence[int]) -> None:
        self._files = list(zip(sources, sizes, strict=True))
        self._crcs = [0] * len(self._files)
        self._index, self._left = 0, sizes[0] if sizes else 0

    def read(self, n: int) -> bytes:
        parts = []
        while n:
            while self._left == 0:
                self._index += 1
                self._left = self._files[self._index][1]
            src = self._files[self._index][0]
            chunk = _read_exact(src, min(n, self._left))
            self._crcs[self._index] = crc32c(chunk, self._crcs[self._index])
            parts.append(chunk)
            self._left -= len(chunk)
            n -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def crcs(self) -> list[int]:
        return list(self._crcs)


class _StreamOut:
    """Writes a stream across ``sinks`` (each gets exactly its size), with the crc32c of each."""

    def __init__(self, sinks: Sequence[BinaryIO], sizes: Sequence[int]) -> None:
        self._files = list(zip(sinks, sizes, strict=True))
        self.crcs = [0] * len(self._files)
        self._index, self._left = 0, sizes[0] if sizes else 0

    def write(self, data: bytes) -> None:
        start = 0
        while start < len(data):
            while self._left == 0:
                self._index += 1
                self._left = self._files[self._index][1]
            n = min(len(data) - start, self._left)
            part = data if n == len(data) else data[start : start + n]  # google-crc32c takes bytes only
            self.crcs[self._index] = crc32c(part, self.crcs[self._index])
            _write_all(self._files[self._index][0], part)
            self._left -= n
            start += n


def _read_exact(src: BinaryIO, n: int) -> bytes:
    data = src.read(n)
    if data is None or len(data) != n:
        got = 0 if data is None else len(data)
        raise CorruptShardError(
            f"a file ended early ({got} of {n} bytes read)", path=getattr(src, "name", "")
        )
    return data


def _write_all(sink: BinaryIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = sink.write(view)
        if n is None:
            raise OSError("non-blocking sink refused a write")
        view = view[n:]


@contextlib.contextmanager
def _open_output(path: Path, size: int) -> Iterator[BinaryIO]:
    """``path`` opened for writing from its start, keeping what ``create_preallocated`` reserved; exactly
    ``size`` bytes long once closed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    with open(fd, "wb", buffering=0) as f:
        yield f
        os.ftruncate(fd, size)
