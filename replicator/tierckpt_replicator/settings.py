"""Every replicator option, in one place: flag, environment fallback, unit and default.

Each option is a field of ``Settings`` with a help text. ``parse_settings(argv, environ)`` builds the
argument parser from those fields: a flag given on the command line wins, then the environment
variable ``TIERCKPT_REPLICATOR_<NAME>``, then the default. ``tierckpt-replicator --help`` lists them all.

Options are grouped by concern: the data plane's (transfers, their limits, the worker process) are
``TransferSettings``, ``Settings.transfer``, which the worker's ``WorkerConfig`` takes whole. A group's
fields are options like the others (``tierckpt.protocol.options.option_fields``): each one's name is
still its flag and its environment variable, the contract the chart and the operator's pod injection
keep (``tests/chart``, ``tests/operator``). The other options stay flat fields on purpose: each is
read where it is used, and none is copied field by field into another process's config, which is what
made the data plane's a group (issue 22).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tierckpt.protocol.codec import Record
from tierckpt.protocol.format import STATE_DIR_NAME, check_holder
from tierckpt.protocol.options import env_name, field_type, merge_settings, option_fields

__all__ = ["ENV_PREFIX", "Settings", "TransferSettings", "build_parser", "parse_settings"]

ENV_PREFIX = "TIERCKPT_REPLICATOR_"
MiB = 1 << 20


def _opt(help: str, *, unit: str = "", env: bool = True, short: str | None = None) -> dict[str, Any]:
    return {"help": help, "unit": unit, "env": env, "short": short}


@dataclasses.dataclass(frozen=True)
class TransferSettings(Record):
    """The data plane: transfers between nodes, their limits, and the worker process that runs them. A
    group of ``Settings`` (``Settings.transfer``): its fields are options like the others (the same
    flags and ``TIERCKPT_REPLICATOR_<NAME>`` variables); the worker's ``WorkerConfig`` takes it whole."""

    concurrency: int = dataclasses.field(
        default=2, metadata=_opt("Outgoing transfers (sends and restore fetches) running at once.")
    )
    max_incoming: int = dataclasses.field(
        default=4, metadata=_opt("Incoming transfers accepted at once; more are refused as busy.")
    )
    bandwidth_limit: float = dataclasses.field(
        default=0.0, metadata=_opt("Cap on outgoing replication bandwidth; 0 = unlimited.", unit="MB/s")
    )
    replica_keep: int = dataclasses.field(
        default=2,
        metadata=_opt("Committed replica steps kept per rank (the newest complete copy is always kept)."),
    )
    reserve_bytes: int = dataclasses.field(
        default=64 * MiB,
        metadata=_opt(
            "Free ramdisk space never given to replicas, on top of room for the client's next save.",
            unit="bytes",
        ),
    )
    job_quota: int = dataclasses.field(
        default=0,
        metadata=_opt(
            "The most bytes one rank's step of any job may declare to be sent, received or uploaded "
            "(a job's policy may set less: its ramdisk size; this node's ramdisk size always applies); "
            "0: no node-wide limit.",
            unit="bytes",
        ),
    )
    transfer_timeout: float = dataclasses.field(
        default=30.0,
        metadata=_opt("A transfer with no progress for this long is abandoned and retried.", unit="s"),
    )
    connect_timeout: float = dataclasses.field(default=5.0, metadata=_opt("TCP connect timeout.", unit="s"))
    handshake_timeout: float = dataclasses.field(
        default=5.0,
        metadata=_opt(
            "A data connection must complete its handshake (TLS, then the request) within this "
            "long, in total; then it is closed. No transfer slot is taken before that.",
            unit="s",
        ),
    )
    min_transfer_rate: float = dataclasses.field(
        default=0.064,
        metadata=_opt(
            "An incoming transfer slower than this over any --transfer-timeout window is dropped "
            "(keep it below the senders' --bandwidth-limit); 0 = no floor.",
            unit="MB/s",
        ),
    )
    data_connections_per_source: int = dataclasses.field(
        default=8,
        metadata=_opt(
            "Open data connections one source address may have; more are closed at once (in total: "
            "4 x --max-incoming + 8; when they are all open, a new one takes the place of the oldest "
            "unauthenticated one of the source with the most)."
        ),
    )
    send_method: Literal["mmap", "sendfile"] = dataclasses.field(
        default="sendfile",
        metadata=_opt(
            "How the worker streams a file out of the ramdisk: 'sendfile' (the kernel sends the page "
            "cache's pages; measured fastest, and less sender CPU, on veth) or 'mmap' (a read-only "
            "mapping handed to sendall)."
        ),
    )
    worker_nice: int = dataclasses.field(
        default=10,
        metadata=_opt("Niceness of the replication worker process (it never competes with training)."),
    )
    worker_idle: bool = dataclasses.field(
        default=False,
        metadata=_opt(
            "Run the worker under SCHED_IDLE: it only gets CPU nobody else wants (strictest "
            "deference to training; replication may stall while every core is busy)."
        ),
    )
    max_manifest_bytes: int = dataclasses.field(
        default=64 * MiB,
        metadata=_opt("Largest manifest (or commit marker) accepted on the data endpoint.", unit="bytes"),
    )

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_incoming", "data_connections_per_source"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.send_method not in ("mmap", "sendfile"):
            raise ValueError("--send-method must be 'mmap' or 'sendfile'")
        if self.replica_keep < 1:
            raise ValueError("--replica-keep must be at least 1")
        if self.job_quota < 0:
            raise ValueError("--job-quota must be 0 (none) or more")
        if not self.handshake_timeout > 0:
            raise ValueError("--handshake-timeout must be positive")
        if not self.min_transfer_rate >= 0:
            raise ValueError("--min-transfer-rate must be 0 or more")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The replicator's configuration. Field docs are the ``--help`` texts."""

    # --- identity and storage
    node_name: str = dataclasses.field(
        default="",
        metadata=_opt("This node's name, as the operator and peers.json know it (default: hostname)."),
    )
    root: Path = dataclasses.field(
        default=Path("/run/tierckpt"),
        metadata=_opt("The node ramdisk (tmpfs) root holding <job>/ directories."),
    )
    # --- identity (docs/security.md)
    auth: str = dataclasses.field(
        default="tls",
        metadata=_opt(
            "How peers and the operator prove who they are: 'tls' (mutual TLS, each node with its own "
            "certificate from the tierckpt CA; the default) or 'token' (legacy: one bearer token shared "
            "by every node and the operator, so the whole cluster is one trust domain)."
        ),
    )
    tls_ca: Path | None = dataclasses.field(
        default=None,
        metadata=_opt(
            "--auth tls: the tierckpt CA bundle (PEM) every peer and the operator are verified against."
        ),
    )
    tls_cert: Path | None = dataclasses.field(
        default=None,
        metadata=_opt(
            "--auth tls: this node's certificate chain (PEM; may hold the key too), issued by the CA for "
            "this node. Without it the certificate comes from --issuer-url."
        ),
    )
    tls_key: Path | None = dataclasses.field(
        default=None, metadata=_opt("--auth tls: the private key of --tls-cert (unless that file holds it).")
    )
    issuer_url: str = dataclasses.field(
        default="",
        metadata=_opt(
            "--auth tls without --tls-cert: the operator's signing endpoint (https://host:port); the node "
            "makes its own key, asks there for its certificate with --issuer-token-file, and renews it "
            "at two thirds of its life."
        ),
    )
    issuer_token_file: Path = dataclasses.field(
        default=Path("/var/run/secrets/tierckpt/identity/token"),
        metadata=_opt(
            "The projected ServiceAccount token (audience 'tierckpt') that proves to the operator which "
            "pod, and so which node, this replicator is."
        ),
    )
    identity_dir: Path | None = dataclasses.field(
        default=None,
        metadata=_opt(
            "Where the key and certificate obtained from the operator are kept (0700, never visible to "
            "pods; default <root>/.tierckpt/identity)."
        ),
    )
    tls_reload_interval: float = dataclasses.field(
        default=60.0,
        metadata=_opt(
            "--tls-cert: how often its files are looked at for a replacement (reloaded if they hold this "
            "node's identity, else refused with an error and the identity in use kept).",
            unit="seconds",
        ),
    )
    token_file: Path | None = dataclasses.field(
        default=None,
        metadata=_opt("--auth token: the file holding the shared bearer token (a mounted Secret)."),
    )
    domain: str = dataclasses.field(
        default="", metadata=_opt("This node's failure domain (reported in inventories).")
    )
    # --- network
    listen_host: str = dataclasses.field(
        default="0.0.0.0", metadata=_opt("Address the control API and the data endpoint listen on.")
    )
    api_port: int = dataclasses.field(
        default=8470, metadata=_opt("TCP port of the control API (FastAPI).", unit="port")
    )
    probe_port: int = dataclasses.field(
        default=0,
        metadata=_opt(
            "TCP port of /healthz, /readyz and /metrics, served by a server of their own; 0 means "
            "api-port + 2.",
            unit="port",
        ),
    )
    data_port: int = dataclasses.field(
        default=0,
        metadata=_opt(
            "TCP port of the streaming data endpoint; 0 means api-port + 1, the port peers assume.",
            unit="port",
        ),
    )
    advertise_host: str = dataclasses.field(
        default="",
        metadata=_opt("Host or IP peers reach this node at (default: $POD_IP, else this host's address)."),
    )
    # --- replication
    replicas: int = dataclasses.field(
        default=1, metadata=_opt("K: number of peer nodes each rank's newest step is copied to.", short="-k")
    )
    transfer: TransferSettings = dataclasses.field(
        default_factory=TransferSettings,
        metadata={"group": "the data plane: transfers, their limits and the worker process"},
    )
    """The data plane's options (``TransferSettings``), which the worker process takes whole."""
    peers_file: Path | None = dataclasses.field(
        default=None,
        metadata=_opt(
            "Static peer assignment (a peers.json PeerAssignment) for local mode, used until the "
            "operator sends a newer generation."
        ),
    )
    orbax_keep: int = dataclasses.field(
        default=2,
        metadata=_opt(
            "Orbax-mode jobs: committed steps kept per process on its node (Orbax leaves retention to the "
            "replicator; leased steps and the restore plan's are kept too)."
        ),
    )
    retry_max: float = dataclasses.field(
        default=60.0, metadata=_opt("Longest backoff between retries of a failed transfer.", unit="s")
    )
    poll_interval: float = dataclasses.field(
        default=5.0, metadata=_opt("Full rescan of the ramdisk, as a safety net under inotify.", unit="s")
    )
    reconcile_interval: float = dataclasses.field(
        default=30.0,
        metadata=_opt("How often peers are asked whether they still hold our replicas.", unit="s"),
    )
    # --- restore
    restore_on_start: bool = dataclasses.field(
        default=True, metadata=_opt("Stage this node's ranks for restore when the daemon starts.")
    )
    inventory_timeout: float = dataclasses.field(
        default=3.0,
        metadata=_opt("Deadline for a peer's inventory while computing a restore plan.", unit="s"),
    )
    restore_attempts: int = dataclasses.field(
        default=5,
        metadata=_opt(
            "Rounds over all sources before a rank's restore, or a fetch a DCP load asked for, is marked "
            "failed."
        ),
    )
    # --- GCS backup (tierckpt_replicator.backup)
    gcs_bucket: str = dataclasses.field(
        default="", metadata=_opt("GCS bucket for backups; empty disables them.")
    )
    gcs_prefix: str = dataclasses.field(default="tierckpt", metadata=_opt("Object prefix inside the bucket."))
    gcs_endpoint: str = dataclasses.field(
        default="",
        metadata=_opt(
            "GCS API endpoint override (an emulator), e.g. http://10.0.0.1:4443 "
            "(default: $STORAGE_EMULATOR_HOST, else the real service)."
        ),
    )
    gcs_project: str = dataclasses.field(
        default="", metadata=_opt("GCS billing project (default: from the credentials).")
    )
    backup_interval: float = dataclasses.field(
        default=1800.0,
        metadata=_opt(
            "Back up a newly committed step once this long has passed since the newest complete "
            "backup; 0 disables the time schedule.",
            unit="s",
        ),
    )
    backup_interval_steps: int = dataclasses.field(
        default=0,
        metadata=_opt(
            "Back up a newly committed step once this many steps have passed since the newest "
            "complete backup; 0 disables the step schedule.",
            unit="steps",
        ),
    )
    backup_keep_last: int = dataclasses.field(
        default=3, metadata=_opt("Newest complete backups kept in the bucket.")
    )
    backup_keep_every: int = dataclasses.field(
        default=0,
        metadata=_opt(
            "Also keep the oldest complete backup of every window of this many steps; 0: off.", unit="steps"
        ),
    )
    backup_parallelism: int = dataclasses.field(
        default=8, metadata=_opt("Object uploads/downloads in flight at once on this node.")
    )
    backup_takeover_after: float = dataclasses.field(
        default=120.0,
        metadata=_opt(
            "Seconds after a backup began before this node also uploads ranks assigned to another "
            "holder that are still missing (that holder may be gone, or hold no copy).",
            unit="s",
        ),
    )
    restore_fanout_wait: float = dataclasses.field(
        default=300.0,
        metadata=_opt(
            "Seconds a restore from the bucket waits, while the node restoring its replica group's data "
            "rank reports progress, to fetch those data files from it instead of the bucket (0: off).",
            unit="s",
        ),
    )
    backup_chunks: bool = dataclasses.field(
        default=True,
        metadata=_opt(
            "Upload backups as content-addressed chunks (bucket layout 3: what the bucket holds from the "
            "rank's previous step is not sent again). --no-backup-chunks: whole objects (layout 2), while "
            "a node of the job still runs a replicator that cannot read layout 3 (an upgrade from one: "
            "docs/bucket-layout.md, 'Layout versions')."
        ),
    )
    backup_compression: str = dataclasses.field(
        default="off",
        metadata=_opt(
            "How backed-up chunks are stored in the bucket: 'off' (raw; the default: no codec measured "
            "outruns the upload on a 2-vCPU node), 'zstd', or 'grouped' (bytes grouped by element size, "
            "then zstd). docs/benchmarks.md, 'Bucket codecs'."
        ),
    )
    backup_group_wait: float = dataclasses.field(
        default=60.0,
        metadata=_opt(
            "Seconds a replica group member's upload waits for the member that uploads the group's "
            "data files, before uploading its own copy of them.",
            unit="s",
        ),
    )
    backup_poll_interval: float = dataclasses.field(
        default=30.0,
        metadata=_opt(
            "How often the bucket is checked to join backups other nodes started, take over "
            "ranks of dead nodes and apply retention.",
            unit="s",
        ),
    )
    preemption_timeout: float = dataclasses.field(
        default=25.0,
        metadata=_opt("On SIGTERM, time allowed to back up the newest step before exiting.", unit="s"),
    )
    # --- limits and logging
    max_request_bytes: int = dataclasses.field(
        default=1 * MiB, metadata=_opt("Largest control API request body accepted.", unit="bytes")
    )
    api_keepalive: float = dataclasses.field(
        default=120.0,
        metadata=_opt(
            "Close a control API connection idle this long. Longer than the operator's "
            "--http-keepalive, so its rounds (every 30 to 60 s) reuse one TLS connection per node.",
            unit="s",
        ),
    )
    api_header_timeout: float = dataclasses.field(
        default=10.0,
        metadata=_opt(
            "An HTTP request (control API or probes) must send its request line and headers within "
            "this long of the connection or the request starting; else the connection is closed.",
            unit="s",
        ),
    )
    api_body_timeout: float = dataclasses.field(
        default=30.0,
        metadata=_opt("An HTTP request body must arrive within this long of its headers.", unit="s"),
    )
    api_max_connections: int = dataclasses.field(
        default=128,
        metadata=_opt(
            "Open control API connections in all; when they are, a new one takes the place of the "
            "oldest unauthenticated one of the source with the most (never of an authenticated one)."
        ),
    )
    api_connections_per_source: int = dataclasses.field(
        default=16,
        metadata=_opt("Open control API connections one source address may have; more are closed at once."),
    )
    log_level: str = dataclasses.field(default="INFO", metadata=_opt("Logging level."))

    def __post_init__(self) -> None:
        if not self.node_name:
            object.__setattr__(self, "node_name", socket.gethostname())
        check_holder(self.node_name)
        if not self.data_port:
            object.__setattr__(self, "data_port", self.api_port + 1)
        if not self.probe_port:
            object.__setattr__(self, "probe_port", self.api_port + 2)
        if not self.advertise_host:
            object.__setattr__(self, "advertise_host", os.environ.get("POD_IP") or _own_address())
        for name in ("replicas", "restore_attempts", "api_max_connections", "api_connections_per_source"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.orbax_keep < 1:
            raise ValueError("--orbax-keep must be at least 1")
        for name in ("api_keepalive", "api_header_timeout", "api_body_timeout", "tls_reload_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.backup_compression not in ("off", "zstd", "grouped"):
            raise ValueError(
                f"--backup-compression must be off, zstd or grouped, not {self.backup_compression!r}"
            )
        if self.auth not in ("tls", "token"):
            raise ValueError("--auth must be 'tls' or 'token'")
        if self.identity_dir is None:
            object.__setattr__(self, "identity_dir", self.root / STATE_DIR_NAME / "identity")

    def check_credentials(self) -> None:
        """``ValueError`` unless the options of the chosen ``--auth`` are given (the daemon needs them;
        other tools reading these settings do not)."""
        if self.auth == "token":
            if self.token_file is None:
                raise ValueError("--auth token needs --token-file")
            return
        if self.tls_ca is None:
            raise ValueError("--auth tls needs --tls-ca (the tierckpt CA bundle)")
        if self.tls_cert is None and not self.issuer_url:
            raise ValueError("--auth tls needs --tls-cert (local mode) or --issuer-url (the operator)")
        if self.issuer_url and not self.issuer_url.startswith("https://"):
            raise ValueError("--issuer-url must be https://")

    @property
    def scheme(self) -> str:
        return "https" if self.auth == "tls" else "http"

    @property
    def api_endpoint(self) -> str:
        """This node's control API as peers reach it."""
        return f"{self.scheme}://{_host_for_url(self.advertise_host)}:{self.api_port}"

    @property
    def holder(self) -> str:
        """The lease holder name of this replicator."""
        return f"replicator-{self.node_name}"[:128]


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ------------------------------------------------------------------------------------ parsing


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return env_name(ENV_PREFIX, name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt-replicator",
        description="tierckpt node replicator: copies ramdisk checkpoints to peer nodes and GCS, and stages "
        "them back for restore. Every option may also be set as " + ENV_PREFIX + "<OPTION> (upper case, "
        "underscores); a flag wins over the environment.",
    )
    for f in option_fields(Settings):
        meta, kind = f.metadata, field_type(f)
        unit = f" [{meta['unit']}]" if meta["unit"] else ""
        help_text = f"{meta['help']}{unit} (env {_env(f.name)})"
        names = [_flag(f.name)] + ([meta["short"]] if meta["short"] else [])
        if kind is bool:
            p.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text + f" default: {f.default}",
            )
        else:
            p.add_argument(
                *names,
                dest=f.name,
                type=kind,
                default=None,
                metavar=f.name.upper(),
                help=help_text + f" default: {_shown(f.default)}",
            )
    return p


def _shown(default: Any) -> str:
    if default is None:
        return "none"
    return "(empty)" if default == "" else str(default)


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags, then ``TIERCKPT_REPLICATOR_*`` environment variables, then defaults."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    return merge_settings(Settings, args, environ, prefix=ENV_PREFIX)
