"""``tierckpt-chaos`` (``python -m tierckpt_demo.chaos``, ``scripts/chaos.sh``): a seeded chaos run.

    tierckpt-chaos --duration 1h --seed random      # a soak
    tierckpt-chaos --seed 7 --rounds 5              # a short run of a fixed seed
    tierckpt-chaos --replay chaos-runs/seed-7-.../minimal-schedule.json

Prints the seed and every fault, restore and check as it happens, then a summary. When an invariant
breaks, the run stops at the end of that round, writes ``failing-schedule.json``, shrinks it by
replaying smaller schedules (``--shrink-budget``) and writes ``minimal-schedule.json``, which
``--replay`` runs again. Exit status: 0 when every invariant held, 1 when one broke, 2 for bad usage.
Needs root (network namespaces, tmpfs mounts, nftables).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path

from tierckpt_demo.chaos.runner import ChaosOptions, ChaosRun
from tierckpt_demo.chaos.schedule import Schedule
from tierckpt_demo.chaos.shrink import shrink

__all__ = ["main", "parse_duration"]

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smh]?)\s*$")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``1.5h`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90s, 30m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _seed(text: str) -> int:
    if text == "random":
        return secrets.randbelow(1 << 31)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a seed is an integer or 'random'") from None


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use N or LOW-HIGH") from None
    if not 0 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: use N or LOW-HIGH")
    return pair


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierckpt-chaos", description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=_seed, default="random", help="an integer, or 'random' (the default)")
    p.add_argument("--duration", type=parse_duration, help="start no round after this long (90s, 30m, 1h)")
    p.add_argument("--rounds", type=int, help="run this many rounds")
    p.add_argument("--faults", type=int, help="start no round once this many faults were drawn")
    p.add_argument("--faults-per-round", type=_range, default=(2, 5), help="LOW-HIGH (default 2-5)")
    p.add_argument("--replay", type=Path, help="run this schedule (a schedule.json of an earlier run)")
    p.add_argument("--out", type=Path, default=Path("chaos-runs"), help="where each run's files go")
    p.add_argument(
        "--shrink-budget",
        type=parse_duration,
        default=parse_duration("30m"),
        help="time for shrinking a failing schedule (0: do not shrink)",
    )
    p.add_argument("--keep-going", action="store_true", help="go on after a violation")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.geteuid() != 0:
        print("tierckpt-chaos: needs root (network namespaces, tmpfs mounts, nftables)", file=sys.stderr)
        return 2
    replay = Schedule.from_bytes(args.replay.read_bytes()) if args.replay else None
    if replay is None and args.duration is None and args.rounds is None and args.faults is None:
        args.duration = parse_duration("10m")
    seed = replay.seed if replay else args.seed
    out = args.out / f"seed-{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    options = ChaosOptions(
        seed=seed,
        out=out,
        duration=args.duration,
        rounds=args.rounds,
        faults=args.faults,
        replay=replay,
        faults_per_round=args.faults_per_round,
        keep_going=args.keep_going,
    )
    print(f"tierckpt-chaos: seed {seed}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # tear the cluster down as on Ctrl-C
    summary = ChaosRun(options).run()
    if not summary.violations:
        return 0
    first = summary.violations[0]
    failing = _through(Schedule.from_bytes((out / "schedule.json").read_bytes()), first.round)
    (out / "failing-schedule.json").write_bytes(failing.to_bytes())
    print(f"failing schedule ({failing.faults} faults): {out / 'failing-schedule.json'}", flush=True)
    if args.shrink_budget > 0:
        minimal = _shrink(failing, first.invariant, out, args.shrink_budget)
        (out / "minimal-schedule.json").write_bytes(minimal.to_bytes())
        print(
            f"minimal failing schedule ({minimal.faults} faults in {len(minimal.rounds)} rounds): "
            f"{out / 'minimal-schedule.json'}\n"
            f"replay it: scripts/chaos.sh --replay {out / 'minimal-schedule.json'}",
            flush=True,
        )
    return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _through(schedule: Schedule, round_index: int) -> Schedule:
    """The rounds up to the one where the violation was seen (the rest cannot have caused it)."""
    last = len(schedule.rounds) - 1 if round_index < 0 else round_index
    return dataclasses.replace(schedule, rounds=schedule.rounds[: last + 1], note=f"{schedule.note}, failing")


def _shrink(failing: Schedule, invariant: str, out: Path, budget: float) -> Schedule:
    deadline = time.monotonic() + budget
    tries = out / "shrink"
    count = 0
    seen: dict[bytes, bool] = {}

    def fails(candidate: Schedule) -> bool:
        nonlocal count
        key = candidate.to_bytes()
        if key not in seen:
            count += 1
            with open(tries / f"try-{count:03d}.log", "w") as echo:
                options = ChaosOptions(
                    seed=candidate.seed, out=tries / f"try-{count:03d}", replay=candidate, echo=echo
                )
                summary = ChaosRun(options).run()
            seen[key] = any(v.invariant == invariant for v in summary.violations)
            print(
                f"shrink try {count}: {candidate.faults} faults in {len(candidate.rounds)} rounds -> "
                f"{'fails' if seen[key] else 'passes'}",
                flush=True,
            )
        return seen[key]

    tries.mkdir(parents=True, exist_ok=True)
    return shrink(failing, fails, lambda: time.monotonic() > deadline)


if __name__ == "__main__":
    sys.exit(main())
