"""``tierckpt demo``: run the local multi-node demo (tierckpt_demo.run) and print its report.

Exit status: 0 when every check passed, 1 when a check failed or the run stopped early, 2 for
unusable options, 130 on Ctrl-C (after cleaning up everything it started).
"""

from __future__ import annotations

import typer

from tierckpt_cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    cli_errors,
    err_console,
    fail,
    out_console,
    print_json,
)

__all__ = ["demo_command"]

_SCENARIOS = "local,peer,gcs"
_DCP_SCENARIOS = "local,peer,gcs,shrink"


def _scenarios(text: str) -> tuple[str, ...]:
    from tierckpt_demo.scenarios import SCENARIOS

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        fail(f"--scenarios: unknown {unknown or 'empty list'}; choose from {','.join(SCENARIOS)}", EXIT_USAGE)
    return names


def demo_command(
    nodes: int = typer.Option(4, "--nodes", "-n", min=1, max=64, help="Simulated nodes."),
    model_size: str = typer.Option(
        "small",
        "--model-size",
        "-m",
        help="tiny|small|medium|large, a parameter count (5M) or a size of the weights (64MB).",
    ),
    steps: int = typer.Option(40, "--steps", min=1, help="Training steps in all."),
    checkpoint_every: int = typer.Option(5, "--checkpoint-every", min=2, help="Steps between checkpoints."),
    scenarios: str | None = typer.Option(
        None,
        "--scenarios",
        help=f"Comma list of failures to inject, in order ({_SCENARIOS}; with --dcp {_DCP_SCENARIOS}).",
    ),
    dcp: bool = typer.Option(
        False,
        "--dcp",
        help="An FSDP2 model checkpointed through PyTorch DCP (several ranks per node), with a 'shrink' "
        "scenario: a node lost for good, the job resumes on fewer ranks, resharded.",
    ),
    replica_group: bool = typer.Option(
        False,
        "--replica-group",
        help="Data parallel ranks saved as one replica group: each shard written once per node, "
        "replicated and uploaded once; the report shows the bytes saved.",
    ),
    procs_per_node: int | None = typer.Option(
        None,
        "--procs-per-node",
        min=1,
        max=16,
        help="Training processes per node (1; 2 with --dcp).",
    ),
    keep_workdir: bool = typer.Option(False, "--keep-workdir", help="Keep events and logs (path printed)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON report on stdout (progress on stderr)."
    ),
    seed: int = typer.Option(1234, "--seed", help="Seed of the model and the data.", hidden=True),
    replicas: int = typer.Option(
        1, "--replicas", min=1, help="Peers holding each node's replicas.", hidden=True
    ),
    loopback: bool = typer.Option(
        False, "--loopback", help="Nodes on loopback ports with plain directories, even as root."
    ),
    flip_bit: bool = typer.Option(
        False,
        "--flip-restored-bit",
        hidden=True,
        help="Negative control: flip a bit of rank 0's state after the first restore; checks must fail.",
    ),
    timeout: float = typer.Option(
        300.0, "--timeout", min=5.0, help="Longest wait for one phase [s].", hidden=True
    ),
) -> None:
    """Run a local cluster, train a small model, break it three ways, and check every recovery.

    With --dcp the model is sharded with FSDP2 and checkpointed through PyTorch DCP, and a fourth failure
    shrinks the job: it resumes on fewer nodes, resharding the checkpoint from the peers."""
    with cli_errors():
        from tierckpt_demo.launch import run_demo
        from tierckpt_demo.report import render_report
        from tierckpt_demo.run import DemoOptions

        options = DemoOptions(
            nodes=nodes,
            model_size=model_size,
            steps=steps,
            checkpoint_every=checkpoint_every,
            scenarios=_scenarios(scenarios or (_DCP_SCENARIOS if dcp else _SCENARIOS)),
            keep_workdir=keep_workdir,
            seed=seed,
            replicas=replicas,
            netns=False if loopback else None,
            timeout=timeout,
            flip_bit=flip_bit,
            dcp=dcp,
            replica_group=replica_group,
            procs_per_node=procs_per_node or (2 if dcp else 1),
        )
        try:
            options.validate()
        except ValueError as exc:
            fail(str(exc), EXIT_USAGE)
        console = err_console if as_json else out_console
        report = run_demo(options, console)
        if as_json:
            print_json(report.to_dict())
        render_report(report, err_console if as_json else out_console)
        if not report.ok:
            raise typer.Exit(EXIT_FAILED)
