"""The ramdisk file protocol of stock Orbax multi-tier checkpointing, and tierckpt's messages for it
(spec: docs/orbax.md).

Orbax (``initialize_multi_tier_checkpointing`` and ``ReplicatorCheckpointManager``, as MaxText uses
them) talks to its node's replicator through files in its local checkpoint directory, the job's
directory in tierckpt (``<root>/<job>``, the pod's CSI mount):

==============================  ==========  ===========================================================
file                            written by  what it is
==============================  ==========  ===========================================================
``jax-init-info.txt``           replicator  the process id, then the JAX coordinator ``host:port``
``replicator.yaml``             Orbax       this process's node rank, the node count, its DP peers, the
                                            backup interval (written as ``.tmp``, renamed); deleting it
                                            releases Orbax
``replicator.errors``           replicator  log lines Orbax reads, logs and deletes
``replicator.failed``           replicator  fatal: Orbax reads and deletes it, and raises
``replicator.prerestore``       replicator  the step about to be handed over (``restore-step: N``, ``{}``)
``<run>-s<S>-n<R>-w0.restore``  replicator  step ``S`` for node rank ``R`` (a directory Orbax renames to
                                            ``<S>``), or, with ``S`` = 0, an empty file: nothing to restore
``<S>/``                        Orbax       a committed step (it appears by rename: Orbax's commit)
==============================  ==========  ===========================================================

Everything Orbax writes is untrusted input to the replicator (the pod writes the directory):
``parse_replicator_yaml`` reads a strict, bounded subset of YAML (the ``key: value`` lines Orbax writes)
and says which line is wrong; names are matched whole in ASCII.

Messages: ``OrbaxSession`` (the operator tells a node's replicator the process id of that node for a
restart attempt, and the coordinator; ``PUT /v1/jobs/{job}/orbax-session``) and ``OrbaxRun`` (the
replicator's own record of the handshake, in the job's state directory where no pod writes).

Pure data and parsing: no file access.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import ClassVar

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.contract import CONTRACT_VERSION
from tierckpt.protocol.control import check_generation, check_node_name
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import Manifest, check_job_id, data_file_name

__all__ = [
    "ERRORS",
    "FAILED",
    "JAX_INIT_INFO",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_YAML_BYTES",
    "PRERESTORE",
    "REPLICATOR_YAML",
    "OrbaxLayout",
    "OrbaxRun",
    "OrbaxSession",
    "ReplicatorConfig",
    "check_coordinator",
    "check_relative_path",
    "is_restore_marker",
    "jax_init_info",
    "parse_replicator_yaml",
    "prerestore",
    "restore_marker",
    "run_name",
    "step_of",
]

JAX_INIT_INFO = "jax-init-info.txt"
REPLICATOR_YAML = "replicator.yaml"
ERRORS = "replicator.errors"
FAILED = "replicator.failed"
PRERESTORE = "replicator.prerestore"
MAX_YAML_BYTES = 64 << 10
"""The largest ``replicator.yaml`` read (Orbax writes about 150 bytes)."""
_MAX_LINES = 64
_MAX_PEERS = 4096
_MAX_PROCESSES = 1 << 31
_MAX_STEPS = (1 << 53) - 1
_MAX_MINUTES = 60 * 24 * 366 * 100
"""A century, as for ``JobPolicy`` intervals."""

_STEP_RE = re.compile(r"0|[1-9][0-9]{0,17}")
_MARKER_RE = re.compile(r"(?P<run>.+)-s(?P<step>[0-9]+)-n(?P<rank>[0-9]+)-w(?P<worker>[0-9]+)\.restore")
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_KEY_RE = re.compile(r"[a-z][a-z0-9-]{0,63}")
_INT_RE = re.compile(r"-?[0-9]{1,19}")
_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


# --------------------------------------------------------------------------------------------- names


def step_of(name: str) -> int | None:
    """The step a committed Orbax step directory's name says (``"42"`` -> 42), else None. Orbax's default
    step names are the decimal step without leading zeros; anything else is not one of its steps."""
    return int(name) if _STEP_RE.fullmatch(name) else None


def run_name(name: str, fallback: str) -> str:
    """``name`` (the ``job-name`` of ``replicator.yaml``) if it is safe in a file name, else ``fallback``
    (Orbax does not check the run name of a restore marker)."""
    return name if _RUN_RE.fullmatch(name) else fallback


def restore_marker(run: str, step: int, rank: int) -> str:
    """The name of the restore marker of ``step`` for node rank ``rank`` (``step`` 0: nothing to restore)."""
    if not _RUN_RE.fullmatch(run) or step < 0 or rank < 0:
        raise FormatError(f"no restore marker for run {run!r}, step {step}, rank {rank}")
    return f"{run}-s{step}-n{rank}-w0.restore"


def is_restore_marker(name: str) -> bool:
    """Whether Orbax would take ``name`` for a restore marker (it lists ``*.restore``)."""
    return name.endswith(".restore")


def jax_init_info(process_id: int, coordinator: str) -> bytes:
    """The content of ``jax-init-info.txt``: the process id, then the coordinator (``host:port``)."""
    return f"{process_id}\n{check_coordinator(coordinator)}\n".encode()


def prerestore(step: int | None) -> bytes:
    """The content of ``replicator.prerestore``: the step about to be handed over, or ``{}`` for none."""
    return b"{}\n" if step is None else f"restore-step: {step}\n".encode()


def check_coordinator(address: str) -> str:
    """A JAX coordinator address: ``host:port`` with a DNS name, an IPv4 address or a bracketed IPv6
    address, and a port 1-65535; nothing else (it is written into a file a process parses)."""
    host, sep, port = address.rpartition(":")
    ok = bool(sep) and re.fullmatch(r"[0-9]{1,5}", port) is not None and 0 < int(port) < 65536
    if ok and host.startswith("[") and host.endswith("]"):
        try:
            ok = ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            ok = False
    elif ok:
        labels = host.rstrip(".").split(".") if 0 < len(host) <= 253 else []
        ok = bool(labels) and all(_HOST_LABEL_RE.fullmatch(label) for label in labels)
    if not ok:
        raise FormatError(f"JAX coordinator {address!r} is not host:port")
    return address


# --------------------------------------------------------------------------------------------- yaml


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
    """What a ``replicator.yaml`` says (``parse_replicator_yaml``)."""

    job_name: str
    framework: str
    node_rank: int
    nodes: int
    peer_ranks: tuple[int, ...] = ()
    data_parallelism: int | None = None
    backup_interval_minutes: int | None = None
    backup_interval_steps: int | None = None


def parse_replicator_yaml(data: bytes) -> ReplicatorConfig:
    """Parse ``replicator.yaml`` as Orbax writes it: ``key: value`` lines (a value is an integer, a
    ``[...]`` list of integers, or a string, bare or quoted), blank lines and ``#`` comments. A
    ``FormatError`` names the line and what is wrong with it; keys it does not know are ignored."""
    if len(data) > MAX_YAML_BYTES:
        raise FormatError(f"{len(data)} bytes, more than the {MAX_YAML_BYTES} a replicator.yaml may have")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = text.splitlines()
    if len(lines) > _MAX_LINES:
        raise FormatError(f"{len(lines)} lines, more than {_MAX_LINES}")
    values: dict[str, tuple[int, str]] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep or not _KEY_RE.fullmatch(key):
            raise FormatError(f"line {number}: expected 'key: value', got {_show(line)}")
        if key in values:
            raise FormatError(f"line {number}: {key!r} is given twice (first on line {values[key][0]})")
        values[key] = (number, value.strip())
    fields = _Fields(values)
    minutes = fields.integer("backup-interval-minutes", 1, _MAX_MINUTES, required=False)
    steps = fields.integer("backup-interval-steps", 1, _MAX_STEPS, required=False)
    if minutes is not None and steps is not None:
        raise FormatError("both backup-interval-minutes and backup-interval-steps are given: name one")
    nodes = fields.integer("nodes", 1, _MAX_PROCESSES)
    assert nodes is not None
    node_rank = fields.integer("node-rank", 0, nodes - 1)
    assert node_rank is not None
    fields.integer("workers-per-node", 1, 1, required=False)  # one Orbax process per node, always
    return ReplicatorConfig(
        job_name=fields.string("job-name"),
        framework=fields.string("framework"),
        node_rank=node_rank,
        nodes=nodes,
        peer_ranks=fields.ranks("peer-ranks", nodes),
        data_parallelism=fields.integer("assume-data-parallelism", 1, _MAX_PROCESSES, required=False),
        backup_interval_minutes=minutes,
        backup_interval_steps=steps,
    )


def _show(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _Fields:
    """Typed reads of the parsed ``key: value`` pairs, each error naming its line."""

    def __init__(self, values: dict[str, tuple[int, str]]) -> None:
        self.values = values

    def _get(self, key: str, required: bool) -> tuple[int, str] | None:
        found = self.values.get(key)
        if found is None and required:
            raise FormatError(f"{key!r} is missing")
        return found

    def string(self, key: str, *, required: bool = True) -> str:
        found = self._get(key, required)
        if found is None:
            return ""
        number, value = found
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if not 0 < len(value) <= 253 or not value.isprintable() or not value.isascii():
            raise FormatError(
                f"line {number}: {key} must be 1-253 printable ASCII characters, got {_show(value)}"
            )
        return value

    def integer(self, key: str, low: int, high: int, *, required: bool = True) -> int | None:
        found = self._get(key, required)
        if found is None:
            return None
        number, value = found
        if not _INT_RE.fullmatch(value) or not low <= int(value) <= high:
            raise FormatError(f"line {number}: {key} must be an integer in {low}..{high}, got {_show(value)}")
        return int(value)

    def ranks(self, key: str, nodes: int) -> tuple[int, ...]:
        found = self._get(key, False)
        if found is None:
            return ()
        number, value = found
        inner = value[1:-1].strip() if value.startswith("[") and value.endswith("]") else None
        items = [] if not inner else [v.strip() for v in inner.split(",")]
        if inner is None or len(items) > _MAX_PEERS or not all(_INT_RE.fullmatch(v) for v in items):
            raise FormatError(
                f"line {number}: {key} must be a list of node ranks like [1, 3], got {_show(value)}"
            )
        ranks = tuple(int(v) for v in items)
        if any(not 0 <= r < nodes for r in ranks) or len(set(ranks)) != len(ranks):
            raise FormatError(
                f"line {number}: {key} must name distinct node ranks below {nodes}, got {_show(value)}"
            )
        return ranks


# --------------------------------------------------------------------------------------------- steps

MAX_ENTRIES = 1 << 16
"""The most files (and, apart, directories) an Orbax step may hold to be adopted (one process's shards:
a few dozen in practice; the data files of a step are numbered in 5 digits)."""
MAX_DEPTH = 32
_MAX_PATH_BYTES = 4096


def check_relative_path(path: str) -> str:
    """A path inside an Orbax step: ``/``-separated names, each printable, not ``.`` or ``..``, at most 255
    bytes; at most ``MAX_DEPTH`` names and 4096 bytes in all. Never absolute, never climbing out."""
    parts = path.split("/") if isinstance(path, str) else []
    ok = 0 < len(parts) <= MAX_DEPTH and len(path.encode("utf-8", "surrogatepass")) <= _MAX_PATH_BYTES
    ok = ok and all(
        p not in ("", ".", "..") and p.isprintable() and len(p.encode("utf-8", "surrogatepass")) <= 255
        for p in parts
    )
    if not ok:
        raise FormatError(f"{path!r} is not a safe path inside an Orbax step")
    return path


@dataclasses.dataclass(frozen=True)
class OrbaxLayout(Record):
    """Where the files of an adopted Orbax step go back: ``extra["orbax"]`` of its manifest.

    The step is stored like any tierckpt step, its files as ``data-00000.bin``, ``data-00001.bin``, ...
    (each with its size and crc32c in the manifest); ``files[i]`` is the path of ``data-<i>.bin`` inside
    the Orbax step directory, ``dirs`` every directory of it (parents before children; empty ones too).
    """

    files: tuple[str, ...]
    dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.files) > MAX_ENTRIES or len(self.dirs) > MAX_ENTRIES:
            raise FormatError(f"an Orbax step of more than {MAX_ENTRIES} files or directories")
        seen: set[str] = set()
        for d in self.dirs:
            parent = check_relative_path(d).rpartition("/")[0]
            if d in seen or (parent and parent not in seen):
                raise FormatError(f"Orbax step directory {d!r} is repeated or listed before its parent")
            seen.add(d)
        names = set()
        for f in self.files:
            parent = check_relative_path(f).rpartition("/")[0]
            if f in seen or f in names or (parent and parent not in seen):
                raise FormatError(
                    f"Orbax step file {f!r} is repeated, a directory, or in no listed directory"
                )
            names.add(f)

    @classmethod
    def of(cls, manifest: Manifest) -> OrbaxLayout:
        """The layout of an adopted step, checked against its manifest (``FormatError`` if it is not an
        Orbax step, or its files are not exactly ``data-00000.bin`` ... in order)."""
        raw = manifest.extra.get("orbax") if manifest.manifest_kind == "orbax" else None
        if not isinstance(raw, dict):
            raise FormatError(f"step {manifest.step} of rank {manifest.rank} is not an adopted Orbax step")
        files, dirs = raw.get("files"), raw.get("dirs", [])
        if not isinstance(files, list) or not isinstance(dirs, list):
            raise FormatError("extra.orbax: files and dirs must be lists")
        if not all(isinstance(x, str) for x in (*files, *dirs)):
            raise FormatError("extra.orbax: files and dirs must be lists of paths")
        layout = cls(tuple(files), tuple(dirs))
        if [f.name for f in manifest.files] != [data_file_name(i) for i in range(len(files))]:
            raise FormatError("an Orbax step's files must be data-00000.bin ... in order, one per path")
        return layout

    def extra(self) -> dict[str, object]:
        """The manifest's ``extra`` for this layout."""
        return {"orbax": {"files": list(self.files), "dirs": list(self.dirs)}}


# --------------------------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class OrbaxSession(Message):
    """``orbax-session.json`` (the job's state directory): what GKE's controller would write into
    ``jax-init-info.txt`` on this node for one restart attempt of an Orbax-mode job.

    Sent by the operator to each node's replicator (``PUT /v1/jobs/{job}/orbax-session``) once the
    attempt's node ranks are assigned. ``process_id`` is the node rank of ``node``: ranks stick to the
    nodes that hold their data, so a process id follows its checkpoint across restarts. ``generation``
    is the restart attempt; the newest wins, and the same session again is accepted unchanged.
    """

    KIND = "tierckpt.orbax-session"
    VERSION = CONTRACT_VERSION
    FILE: ClassVar[str] = "orbax-session.json"

    job: str
    node: str
    """The node this session is for (a replicator refuses another node's)."""
    generation: int
    process_id: int
    num_processes: int
    coordinator: str
    """The JAX coordinator, ``host:port``: the address of the pod holding process id 0."""

    def __post_init__(self) -> None:
        check_job_id(self.job)
        check_node_name(self.node)
        check_generation("orbax session", self.generation)
        if not 0 < self.num_processes <= _MAX_PROCESSES or not 0 <= self.process_id < self.num_processes:
            raise FormatError(
                f"orbax session: process id {self.process_id} is not one of {self.num_processes} processes"
            )
        check_coordinator(self.coordinator)


@dataclasses.dataclass(frozen=True)
class OrbaxRun(Message):
    """``orbax-run.json`` (the job's state directory): the replicator's record of the newest handshake.

    ``generation``: the session whose ``replicator.yaml`` it consumed (-1: none yet); ``delivered``:
    whether that handshake is answered (a restore marker, the nothing-to-restore marker, or a fatal
    error). The backup interval the job asked for there (``backup_interval_*``, 0: not given) overrides
    the schedule of the job's policy; ``restored``: the step handed over for restore (Orbax renames it to
    ``<step>/``, which is then not a new save).
    """

    KIND = "tierckpt.orbax-run"
    VERSION = CONTRACT_VERSION
    FILE: ClassVar[str] = "orbax-run.json"

    job: str
    generation: int = -1
    run: str = ""
    """The run name used in restore markers."""
    backup_interval_steps: int = 0
    backup_interval_minutes: int = 0
    delivered: bool = False
    restored: int | None = None

    def __post_init__(self) -> None:
        check_job_id(self.job)
        if not -1 <= self.generation <= _MAX_STEPS:
            raise FormatError("orbax run: generation must be in -1..2**53-1")
        if self.run and not _RUN_RE.fullmatch(self.run):
            raise FormatError(f"orbax run: invalid run name {self.run!r}")
        if (
            not 0 <= self.backup_interval_steps <= _MAX_STEPS
            or not 0 <= self.backup_interval_minutes <= _MAX_MINUTES
        ):
            raise FormatError("orbax run: backup intervals out of range")
        if self.restored is not None and not 0 <= self.restored <= _MAX_STEPS:
            raise FormatError("orbax run: restored step out of range")

    @property
    def schedule(self) -> tuple[int, float] | None:
        """``(interval_steps, interval_seconds)`` the job asked for, or None if it named none."""
        if self.backup_interval_steps:
            return self.backup_interval_steps, 0.0
        if self.backup_interval_minutes:
            return 0, self.backup_interval_minutes * 60.0
        return None
