"""``tierckpt demo``: run the local multi-node demo (tierckpt_demo.run) and print its report.

Exit status: 0 when every check passed, 1 when a check failed or the run stopped early, 2 for
unusable options, 130 on Ctrl-C (after cleaning up everything it started).
"""

from __future__ import annotations

from typing import Annotated

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


# The command's options (typer reads each parameter's ``Annotated`` option; its default is the parameter's).
_Nodes = Annotated[int, typer.Option("--nodes", "-n", min=1, max=64, help="Simulated nodes.")]
_ModelSize = Annotated[
    str,
    typer.Option(
        "--model-size",
        "-m",
        help="tiny|small|medium|large, a parameter count (5M) or a size of the weights (64MB).",
    ),
]
_Steps = Annotated[int, typer.Option("--steps", min=1, help="Training steps in all.")]
_CheckpointEvery = Annotated[
    int, typer.Option("--checkpoint-every", min=2, help="Steps between checkpoints.")
]
_Scenarios = Annotated[
    str | None,
    typer.Option(
        "--scenarios",
        help=f"Comma list of failures to inject, in order ({_SCENARIOS}; with --dcp {_DCP_SCENARIOS}).",
    ),
]
_Dcp = Annotated[
    bool,
    typer.Option(
        "--dcp",
        help="An FSDP2 model checkpointed through PyTorch DCP (several ranks per node), with a 'shrink' "
        "scenario: a node lost for good, the job resumes on fewer ranks, resharded.",
    ),
]
_ReplicaGroup = Annotated[
    bool,
    typer.Option(
        "--replica-group",
        help="Data parallel ranks saved as one replica group: each shard written once per node, "
        "replicated and uploaded once; the report shows the bytes saved.",
    ),
]
_ProcsPerNode = Annotated[
    int | None,
    typer.Option("--procs-per-node", min=1, max=16, help="Training processes per node (1; 2 with --dcp)."),
]
_KeepWorkdir = Annotated[bool, typer.Option("--keep-workdir", help="Keep events and logs (path printed).")]
_Json = Annotated[bool, typer.Option("--json", help="Print one JSON report on stdout (progress on stderr).")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of the model and the data.", hidden=True)]
_Replicas = Annotated[
    int, typer.Option("--replicas", min=1, help="Peers holding each node's replicas.", hidden=True)
]
_Loopback = Annotated[
    bool, typer.Option("--loopback", help="Nodes on loopback ports with plain directories, even as root.")
]
_FlipBit = Annotated[
    bool,
    typer.Option(
        "--flip-restored-bit",
        hidden=True,
        help="Negative control: flip a bit of rank 0's state after the first restore; checks must fail.",
    ),
]
_Timeout = Annotated[
    float, typer.Option("--timeout", min=5.0, help="Longest wait for one phase [s].", hidden=True)
]


def demo_command(
    nodes: _Nodes = 4,
    model_size: _ModelSize = "small",
    steps: _Steps = 40,
    checkpoint_every: _CheckpointEvery = 5,
    scenarios: _Scenarios = None,
    dcp: _Dcp = False,
    replica_group: _ReplicaGroup = False,
    procs_per_node: _ProcsPerNode = None,
    keep_workdir: _KeepWorkdir = False,
    as_json: _Json = False,
    seed: _Seed = 1234,
    replicas: _Replicas = 1,
    loopback: _Loopback = False,
    flip_bit: _FlipBit = False,
    timeout: _Timeout = 300.0,
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
