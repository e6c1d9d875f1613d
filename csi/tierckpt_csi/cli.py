"""``tierckpt-csi``: the ramdisk CSI node plugin (``serve``), the hostPath-mode ramdisk keeper
(``ramdisk``) and an exec probe (``probe``). Every option also reads an environment variable."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tierckpt.protocol.contract import Csi
from tierckpt.protocol.quantity import format_bytes, parse_quantity

if TYPE_CHECKING:
    from tierckpt_csi.ramdisk import Ramdisk

__all__ = ["app", "main"]

log = logging.getLogger("tierckpt_csi")

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

_ENDPOINT = typer.Option(
    "unix:///csi/csi.sock",
    envvar="TIERCKPT_CSI_ENDPOINT",
    help="Unix socket kubelet (through node-driver-registrar) calls.",
)
_RAMDISK = typer.Option(
    Csi.HOST_ROOT,
    envvar="TIERCKPT_RAMDISK_PATH",
    help="Host path of the node ramdisk (mounted with Bidirectional propagation).",
)
_SIZE = typer.Option(..., envvar="TIERCKPT_RAMDISK_SIZE", help="tmpfs size, a quantity such as 64Gi.")
_HUGE = typer.Option(
    "within_size",
    envvar="TIERCKPT_RAMDISK_HUGE",
    help="tmpfs huge= option: never, always, within_size or advise.",
)
_HEALTH = typer.Option(
    ":9808",
    envvar="TIERCKPT_CSI_HEALTH_ADDRESS",
    help="host:port for /healthz, /readyz and /metrics; empty to disable.",
)
_LOG = typer.Option("INFO", envvar="TIERCKPT_LOG_LEVEL")
_PREWARM = typer.Option(
    True,
    envvar="TIERCKPT_RAMDISK_PREWARM",
    help="When the ramdisk is mounted anew (a node that just booted), write its free space once and free "
    "it, so a fresh VM's slow first touch of memory is paid before any trainer needs it.",
)


def _prewarm(disk: Ramdisk, enabled: bool) -> None:
    if enabled and not disk.adopted:
        from tierckpt_csi.prewarm import prewarm

        prewarm(disk.path, disk.usage().free)


def _size(text: str, what: str) -> int:
    try:
        return parse_quantity(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=what) from exc


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@app.command()
def serve(
    node_id: str = typer.Option(..., envvar=["TIERCKPT_NODE_NAME", "NODE_NAME"], help="This node's name."),
    endpoint: str = _ENDPOINT,
    ramdisk: Path = _RAMDISK,
    ramdisk_size: str = _SIZE,
    huge: str = _HUGE,
    pods_dir: Path = typer.Option(
        Path("/var/lib/kubelet/pods"),
        envvar="TIERCKPT_KUBELET_PODS_DIR",
        help="kubelet's pods directory; targets outside it are refused.",
    ),
    default_reservation: str = typer.Option(
        "",
        envvar="TIERCKPT_DEFAULT_RESERVATION",
        help="Per-job reservation when a volume names none (default: the whole ramdisk, one job per node).",
    ),
    memory_headroom: str = typer.Option(
        "1Gi", envvar="TIERCKPT_MEMORY_HEADROOM", help="MemAvailable kept free when admitting a job."
    ),
    require_namespace_match: bool = typer.Option(
        True,
        envvar="TIERCKPT_REQUIRE_NAMESPACE_MATCH",
        help="Refuse job ids of another namespace than the pod's.",
    ),
    health_address: str = _HEALTH,
    log_level: str = _LOG,
    prewarm: bool = _PREWARM,
) -> None:
    """Serve the CSI Identity and Node services for the ramdisk.tierckpt.io driver."""
    from tierckpt_csi.plugin import NodePlugin, PluginSettings
    from tierckpt_csi.ramdisk import ensure_ramdisk
    from tierckpt_csi.server import HealthServer, PluginServer, probe, wait_for_signal

    _setup_logging(log_level)
    disk = ensure_ramdisk(ramdisk, _size(ramdisk_size, "--ramdisk-size"), huge=huge)
    _prewarm(disk, prewarm)  # before serving: no volume is published meanwhile
    settings = PluginSettings(
        node_id=node_id,
        pods_dir=pods_dir,
        default_reservation=(
            _size(default_reservation, "--default-reservation") if default_reservation else None
        ),
        memory_headroom=_size(memory_headroom, "--memory-headroom"),
        require_namespace_match=require_namespace_match,
    )
    server = PluginServer(NodePlugin(disk, settings), endpoint)
    health = None
    if health_address:  # up first: /healthz answers 503 until the CSI socket does
        health = HealthServer(health_address, check=lambda: probe(endpoint), metrics=server.metrics)
        health.start()
        log.info("serving /healthz, /readyz and /metrics on port %d", health.port)
    server.start()
    wait_for_signal()
    log.info("stopping: the ramdisk and published volumes stay mounted")
    if health:
        health.stop()
    server.stop()


@app.command()
def ramdisk(
    ramdisk: Path = _RAMDISK,
    ramdisk_size: str = _SIZE,
    huge: str = _HUGE,
    health_address: str = _HEALTH,
    log_level: str = _LOG,
    prewarm: bool = _PREWARM,
) -> None:
    """hostPath mode: mount (or adopt) the node ramdisk, then keep it healthy-checked until stopped."""
    from tierckpt_csi.ramdisk import ensure_ramdisk
    from tierckpt_csi.server import HealthServer, wait_for_signal

    _setup_logging(log_level)
    disk = ensure_ramdisk(ramdisk, _size(ramdisk_size, "--ramdisk-size"), huge=huge)
    _prewarm(disk, prewarm)
    usage = disk.usage()
    log.info("ramdisk at %s: %s, %s used", disk.path, format_bytes(usage.size), format_bytes(usage.used))
    health = HealthServer(health_address, check=disk.is_mounted, metrics=None) if health_address else None
    if health:
        health.start()
    wait_for_signal()
    if health:
        health.stop()


@app.command("probe")
def probe_cmd(endpoint: str = _ENDPOINT, timeout: float = 3.0) -> None:
    """Exit 0 if the plugin on ENDPOINT answers Probe ready (for exec probes)."""
    from tierckpt_csi.server import probe

    ok = probe(endpoint, timeout)
    typer.echo("ready" if ok else "not ready")
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    os.umask(0o022)
    app(prog_name="tierckpt-csi")
