"""What a chaos run does, as data: rounds of training, each with faults to inject (pure, seeded).

A ``Schedule`` is the whole run: the seed it was drawn from and its ``Round``s. A round trains every job
for ``steps`` steps (a multiple of the checkpoint interval) and injects its ``Fault``s while they train;
each fault fires once its job has made ``at`` steps of progress in the round and, if it is transient
(a partition, a full ramdisk, bucket errors...), is cleared ``lasts`` steps later. Targets are named by
job and *node rank* (``slot``), never by node name: node names change as nodes are lost and replaced, and
what a slot resolves to follows from the rounds before, so a schedule replays the same decisions.

``plan_round(seed, index, first)`` draws round ``index`` from the seed alone, so a run of any length is a
prefix of the same sequence, and the fault kinds come from shuffled decks of every kind
(``fault_kind(seed, n)``): every run of ``len(KINDS)`` faults injects each kind once. A schedule is a
typed, versioned JSON file (``Schedule.to_bytes``) that ``tierckpt-chaos --replay`` runs again: the same
faults, in the same order, at the same points of training.
"""

from __future__ import annotations

import dataclasses
import random
import typing
from typing import Literal

from tierckpt.protocol.codec import Message, Record

__all__ = [
    "JOBS",
    "KINDS",
    "Fault",
    "FaultKind",
    "Round",
    "Schedule",
    "fault_kind",
    "plan_round",
    "plan_rounds",
]

FaultKind = Literal[
    "trainer-kill",
    "replicator-kill",
    "node-lost",
    "nodes-lost",
    "partition",
    "netem",
    "full-ramdisk",
    "gcs",
    "slow-peer",
    "purge",
    "replication-factor",
    "resize",
]
KINDS: tuple[FaultKind, ...] = typing.get_args(FaultKind)
JobName = Literal["native", "dcp"]
JOBS: tuple[JobName, ...] = typing.get_args(JobName)
"""``native``: ``Checkpointer`` ranks saving as one replica group; ``dcp``: FSDP2 ranks through DCP (the
only one whose world size changes: it reshards)."""

TRANSIENT: frozenset[str] = frozenset({"partition", "netem", "full-ramdisk", "gcs", "slow-peer"})
"""Kinds that stay in force until cleared (the others happen at one moment)."""

MODES: dict[str, tuple[str, ...]] = {
    "trainer-kill": ("step", "save", "saved", "load"),
    "replicator-kill": ("send", "receive", "backup", "staging"),
    "node-lost": ("same", "new"),
    "nodes-lost": ("peer-group", "any"),
    "partition": ("full", "one-way"),
    "netem": ("loss", "delay", "rate"),
    "full-ramdisk": ("full",),
    "gcs": ("429", "500", "503", "reset-upload", "reset-download", "latency"),
    "slow-peer": ("slow",),
    "purge": ("in-flight",),
    "replication-factor": ("set",),
    "resize": ("grow", "shrink"),
}
"""Each kind's variants (``Fault.mode``)."""


@dataclasses.dataclass(frozen=True)
class Fault(Record):
    """One fault of a round.

    ``mode`` is the kind's variant (``MODES``). ``value`` depends on the kind: the replication factor,
    a rate in kbit/s (``netem`` rate, ``slow-peer``), a loss percentage or a delay in ms (``netem``), how
    many bucket requests fail (``gcs``), how long a killed replicator stays down in ms
    (``replicator-kill``). ``back`` (node losses): the lost node comes back under the ``same`` name or a
    ``new`` one (another node takes its place); ``domain``: in the ``same`` failure domain or an
    ``other`` one. ``graceful`` (``replicator-kill``): SIGTERM (a preemption: the replicator backs up
    first) instead of SIGKILL. ``other``: a second node rank (the sender a ``one-way`` partition drops).
    """

    kind: FaultKind
    mode: str
    job: JobName
    at: int
    """Fires once ``job`` made this many steps of progress in the round (replayed steps count)."""
    lasts: int = 0
    """Transient kinds: cleared this many steps of progress later (0: at the end of the round)."""
    slot: int = 0
    """The node rank of ``job`` it hits (modulo the job's node count)."""
    other: int = 1
    value: int = 0
    back: Literal["same", "new"] = "same"
    domain: Literal["same", "other"] = "same"
    graceful: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES[self.kind]:
            raise ValueError(f"{self.kind}: mode {self.mode!r} is not one of {MODES[self.kind]}")
        if self.at < 0 or self.lasts < 0 or self.slot < 0 or self.other < 0:
            raise ValueError(f"{self.kind}: at, lasts, slot and other must be >= 0")

    def describe(self) -> str:
        """One line, as the history prints it."""
        bits = [f"{self.kind}/{self.mode}", f"{self.job} node rank {self.slot}"]
        if self.kind in ("node-lost", "nodes-lost"):
            bits.append(f"back {self.back}, {self.domain} domain")
        if self.kind == "partition" and self.mode == "one-way":
            bits.append(f"drops new connections from node rank {self.other}")
        if self.value:
            bits.append(f"value {self.value}")
        if self.graceful:
            bits.append("SIGTERM")
        if self.kind in TRANSIENT:
            bits.append(f"lasts {self.lasts or 'the round'} steps")
        return f"{', '.join(bits)} (at step {self.at} of the round)"


@dataclasses.dataclass(frozen=True)
class Round(Record):
    steps: int
    """Steps every job trains in the round (a multiple of the checkpoint interval)."""
    faults: tuple[Fault, ...] = ()


@dataclasses.dataclass(frozen=True)
class Schedule(Message):
    """A run: its seed and rounds (``tierckpt-chaos --replay`` reads it)."""

    KIND = "tierckpt_demo.chaos-schedule"
    VERSION = 1

    seed: int
    rounds: tuple[Round, ...]
    note: str = ""
    """Where it came from: a seed, a failing run, a shrink."""

    @property
    def faults(self) -> int:
        return sum(len(r.faults) for r in self.rounds)


# ------------------------------------------------------------------------------------- drawing


def fault_kind(seed: int, n: int) -> FaultKind:
    """The kind of the run's ``n``-th fault: decks of every kind, each shuffled by the seed."""
    deck = list(KINDS)
    random.Random(f"{seed}:deck:{n // len(KINDS)}").shuffle(deck)
    return deck[n % len(KINDS)]


def _fault(rng: random.Random, kind: FaultKind, steps: int, every: int) -> Fault:
    mode = rng.choice(MODES[kind])
    job: JobName = "dcp" if kind == "resize" else rng.choice(JOBS)
    at = rng.randrange(1, max(2, steps - 1))
    lasts = rng.choice((0, every, 2 * every)) if kind in TRANSIENT else 0
    value = 0
    if kind == "replication-factor":
        value = rng.choice((1, 2))
    elif kind == "netem":
        value = {"loss": rng.choice((5, 20, 50)), "delay": rng.choice((50, 200)), "rate": 2000}[mode]
    elif kind == "slow-peer":
        value = rng.choice((500, 2000))
    elif kind == "gcs":
        value = rng.choice((1, 3, 8))
    elif kind == "replicator-kill":
        value = rng.choice((0, 500, 2000))
    return Fault(
        kind=kind,
        mode=mode,
        job=job,
        at=at,
        lasts=lasts,
        slot=rng.randrange(4),
        other=rng.randrange(1, 4),
        value=value,
        back=rng.choice(("same", "new")),
        domain=rng.choice(("same", "other")),
        graceful=kind == "replicator-kill" and rng.random() < 0.3,
    )


def plan_round(seed: int, index: int, first: int, *, every: int, faults: tuple[int, int] = (2, 5)) -> Round:
    """Round ``index`` of the run drawn from ``seed``; its faults are the run's ``first``, ``first + 1``...
    (``faults``: how many, at least and at most)."""
    rng = random.Random(f"{seed}:round:{index}")
    steps = every * rng.choice((3, 4, 5))
    count = rng.randint(*faults)
    drawn = [_fault(rng, fault_kind(seed, first + i), steps, every) for i in range(count)]
    return Round(steps=steps, faults=tuple(sorted(drawn, key=lambda f: f.at)))


def plan_rounds(seed: int, count: int, *, every: int, faults: tuple[int, int] = (2, 5)) -> Schedule:
    """The first ``count`` rounds of ``seed``'s run."""
    rounds: list[Round] = []
    first = 0
    for index in range(count):
        rounds.append(plan_round(seed, index, first, every=every, faults=faults))
        first += len(rounds[-1].faults)
    return Schedule(seed=seed, rounds=tuple(rounds), note=f"seed {seed}")
