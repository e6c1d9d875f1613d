"""Shared pieces of the ``tierckpt`` commands: consoles, clean error reporting, sizes and ages.

Every command runs its body inside ``cli_errors()``: an expected failure (a missing path, a corrupt
file, an unreachable bucket or cluster) becomes one red line on stderr and a non-zero exit code,
never a traceback. Only a genuine bug still shows one (and ``TIERCKPT_DEBUG=1`` shows them all).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from tierckpt.protocol.errors import TierckptError

__all__ = [
    "EXIT_FAILED",
    "EXIT_USAGE",
    "CliError",
    "cli_errors",
    "err_console",
    "fail",
    "format_age",
    "format_bytes",
    "out_console",
    "print_json",
    "progress_bar",
]

EXIT_FAILED = 1
"""The command ran and found a problem (corrupt data, failed check, unreachable service)."""
EXIT_USAGE = 2
"""The input was unusable (missing path, malformed argument); same code as click's usage errors."""

out_console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

log = logging.getLogger(__name__)


class CliError(Exception):
    """An error already phrased for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    raise CliError(message, code)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn expected exceptions into one clear line on stderr and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except CliError as exc:
        _report(str(exc), exc.code)
    except TierckptError as exc:
        _report(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    except FileNotFoundError as exc:
        _report(f"not found: {exc.filename or exc}", EXIT_USAGE)
    except PermissionError as exc:
        _report(f"permission denied: {exc.filename or exc}", EXIT_USAGE)
    except OSError as exc:
        _report(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", EXIT_FAILED)
    except KeyboardInterrupt:
        _report("interrupted", 130)
    except ImportError as exc:
        _report(_missing_dependency(exc), EXIT_USAGE)


_EXTRAS = {
    "google": "replicator",
    "kubernetes": "operator",
    "fake_gcs_server": "demo",
    "fastapi": "replicator",
}


def _missing_dependency(exc: ImportError) -> str:
    top = (exc.name or "").split(".")[0]
    extra = _EXTRAS.get(top)
    hint = f"pip install 'tierckpt[{extra}]'" if extra else "pip install 'tierckpt[all]'"
    return f"this command needs {exc.name or 'a package that is not installed'} ({hint})"


def _report(message: str, code: int) -> NoReturn:
    if os.environ.get("TIERCKPT_DEBUG"):
        log.exception("command failed")
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    """Machine-readable output: one JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def format_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_age(timestamp: float | None, now: float | None = None) -> str:
    if timestamp is None:
        return "-"
    seconds = max(0.0, (time.time() if now is None else now) - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def progress_bar(*, transient: bool = True, bytes_mode: bool = True) -> Progress:
    """A rich progress bar on stderr, so stdout stays clean for ``--json``."""
    columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
    columns.append(DownloadColumn() if bytes_mode else TextColumn("{task.completed}/{task.total}"))
    columns.append(TimeRemainingColumn())
    return Progress(*columns, console=err_console, transient=transient, disable=not err_console.is_terminal)
