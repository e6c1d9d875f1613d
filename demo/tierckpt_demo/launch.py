"""``run_demo``: the demo the options ask for (native ``Checkpointer`` ranks, or DCP with ``--dcp``)."""

from __future__ import annotations

from rich.console import Console

from tierckpt_demo.dcp_demo import DcpDemo
from tierckpt_demo.report import DemoReport
from tierckpt_demo.run import Demo, DemoOptions

__all__ = ["run_demo"]


def run_demo(options: DemoOptions, console: Console) -> DemoReport:
    """Run the whole demo and return its report; raises ``ValueError`` for unusable options."""
    return (DcpDemo if options.dcp else Demo)(options, console).run()
