"""The ``tierckpt`` typer application (console script ``tierckpt = tierckpt_cli.app:main``)."""

from __future__ import annotations

import logging
import os

import typer

from tierckpt.protocol import __version__
from tierckpt_cli.demo import demo_command
from tierckpt_cli.gc import gc_command
from tierckpt_cli.ls import ls_command
from tierckpt_cli.node_rank import node_rank_command
from tierckpt_cli.plan import plan_command
from tierckpt_cli.status import status_command
from tierckpt_cli.verify import verify_command

__all__ = ["app", "main"]

app = typer.Typer(
    name="tierckpt",
    help="Multi-tier checkpointing for PyTorch: inspect ramdisks and buckets, and run the local demo.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tierckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log what happens (to stderr)."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    level = (
        logging.DEBUG if os.environ.get("TIERCKPT_DEBUG") else logging.INFO if verbose else logging.WARNING
    )
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


app.command("ls")(ls_command)
app.command("verify")(verify_command)
app.command("gc")(gc_command)
app.command("status")(status_command)
app.command("node-rank")(node_rank_command)
app.command("plan")(plan_command)
app.command("demo")(demo_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
