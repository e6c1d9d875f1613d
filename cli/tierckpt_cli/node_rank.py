"""``tierckpt node-rank``: print this pod's node rank for a launch script.

The operator writes the ``tierckpt.io/node-rank`` annotation on the pod once it has placed it; the
kubelet exposes the pod's annotations as a file in a downward-API volume (``$TIERCKPT_PODINFO_DIR``).
A launch script waits for it and hands it to torchrun::

    NODE_RANK=$(tierckpt node-rank --wait)
    exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" train.py

or, with ``--env``, evaluates every assignment at once: ``eval "$(tierckpt node-rank --wait --env)"``.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from pathlib import Path

import typer

from tierckpt.protocol.contract import Annotations, Env, read_podinfo
from tierckpt_cli._common import EXIT_FAILED, EXIT_USAGE, cli_errors, err_console, fail, out_console

__all__ = ["NodeRank", "node_rank_command", "parse_node_rank", "wait_node_rank"]


@dataclasses.dataclass(frozen=True)
class NodeRank:
    rank: int
    num_nodes: int | None
    generation: int | None
    job: str | None
    coordinator: str | None = None
    """The rank-0 pod's address (torchrun ``--master-addr``)."""


def _int_or_none(annotations: dict[str, str], key: str) -> int | None:
    value = annotations.get(key)
    if value is None:
        return None
    try:
        out = int(value)
    except ValueError:
        fail(f"pod annotation {key}={value!r} is not an integer")
    if out < 0:
        fail(f"pod annotation {key}={value!r} is negative")
    return out


def parse_node_rank(annotations: dict[str, str], attempt: int | None = None) -> NodeRank | None:
    """The node rank in a pod's annotations, or None if the operator has not assigned one yet (or,
    with ``attempt``, has not assigned one for that JobSet restart attempt yet)."""
    rank = _int_or_none(annotations, Annotations.NODE_RANK)
    if rank is None:
        return None
    num = _int_or_none(annotations, Annotations.NUM_NODES)
    if num is not None and rank >= num:
        fail(f"pod annotation {Annotations.NODE_RANK}={rank} is not below {Annotations.NUM_NODES}={num}")
    generation = _int_or_none(annotations, Annotations.ASSIGNMENT_GENERATION)
    if attempt is not None and generation != attempt:
        return None
    return NodeRank(
        rank, num, generation, annotations.get(Annotations.JOB_ID), annotations.get(Annotations.COORDINATOR)
    )


def wait_node_rank(
    podinfo_dir: Path, *, timeout: float | None, interval: float = 0.5, attempt: int | None = None
) -> NodeRank | None:
    """Poll the downward-API file until a rank appears (or ``timeout`` seconds pass; None = forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        found = parse_node_rank(read_podinfo(podinfo_dir), attempt)
        if found is not None or (deadline is not None and time.monotonic() >= deadline):
            return found
        time.sleep(interval)


def _render_env(nr: NodeRank) -> str:
    pairs: dict[str, int | str] = {"NODE_RANK": nr.rank}
    if nr.num_nodes is not None:
        pairs["NNODES"] = nr.num_nodes
    if nr.generation is not None:
        pairs["TIERCKPT_ASSIGNMENT_GENERATION"] = nr.generation
    if nr.job is not None:
        pairs[Env.JOB] = nr.job
    if nr.coordinator:
        pairs["MASTER_ADDR"] = nr.coordinator
    return "\n".join(f"export {k}={shlex.quote(str(v))}" for k, v in pairs.items())


def node_rank_command(
    wait: bool = typer.Option(False, "--wait", help="Wait until the operator has assigned a rank."),
    timeout: float = typer.Option(
        0.0, "--timeout", help="With --wait: give up after this many seconds (0 = wait forever).", min=0.0
    ),
    podinfo_dir: Path = typer.Option(
        None,
        "--podinfo-dir",
        envvar=Env.PODINFO_DIR,
        show_envvar=True,
        help="The downward-API volume holding the pod's 'annotations' file.",
    ),
    env: bool = typer.Option(
        False, "--env", help="Print shell 'export' lines (NODE_RANK, NNODES, MASTER_ADDR, ...)."
    ),
    attempt: int = typer.Option(
        None, "--attempt", min=0, help="Only accept a rank assigned for this JobSet restart attempt."
    ),
    interval: float = typer.Option(0.5, "--interval", help="Seconds between polls.", min=0.01, hidden=True),
) -> None:
    """Print this pod's node rank, assigned by the tierckpt operator (for launch scripts)."""
    with cli_errors():
        if podinfo_dir is None:
            fail(f"no podinfo directory: pass --podinfo-dir or set {Env.PODINFO_DIR}", EXIT_USAGE)
        if not podinfo_dir.is_dir():
            fail(f"{podinfo_dir}: not a directory (is the downward-API volume mounted?)", EXIT_USAGE)
        if wait:
            err_console.print(
                f"waiting for {Annotations.NODE_RANK} in {podinfo_dir}/annotations", markup=False
            )
        limit = (timeout or None) if wait else 0.0
        found = wait_node_rank(podinfo_dir, timeout=limit, interval=interval, attempt=attempt)
        if found is None:
            what = f"no {Annotations.NODE_RANK} annotation" + (
                "" if attempt is None else f" for attempt {attempt}"
            )
            why = f" after {timeout:g}s" if wait else " (use --wait to wait for the operator)"
            fail(f"{what} in {podinfo_dir}/annotations{why}", EXIT_FAILED)
        out_console.print(_render_env(found) if env else str(found.rank), markup=False)
