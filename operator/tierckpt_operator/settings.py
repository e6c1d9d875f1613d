"""Every operator option, in one place: flag, environment fallback, unit and default.

``parse_settings(argv, environ)``: a flag wins, then ``TIERCKPT_OPERATOR_<NAME>``, then the default.
``tierckpt-operator --help`` lists them all. (Named apart from ``kopf.OperatorSettings``, which the
composition root fills from these.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tierckpt.protocol.contract import Csi
from tierckpt.protocol.options import env_name, field_type, merge_settings

__all__ = ["ENV_PREFIX", "Settings", "build_parser", "parse_settings"]

ENV_PREFIX = "TIERCKPT_OPERATOR_"


def _opt(help: str, unit: str = "") -> dict[str, Any]:
    return {"help": help, "unit": unit}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The operator's configuration. Field docs are the ``--help`` texts."""

    # --- cluster access and scope
    server: str = dataclasses.field(
        default="",
        metadata=_opt(
            "Kubernetes API URL (no auth, for emulators and tests). Default: in-cluster, else kubeconfig."
        ),
    )
    kubeconfig: str = dataclasses.field(default="", metadata=_opt("Kubeconfig file (default: $KUBECONFIG)."))
    watch_namespaces: str = dataclasses.field(
        default="", metadata=_opt("Comma-separated namespaces to serve; empty = the whole cluster.")
    )
    namespace: str = dataclasses.field(
        default="default", metadata=_opt("The operator's own namespace (holds the leader Lease).")
    )
    pod_name: str = dataclasses.field(
        default="", metadata=_opt("This operator pod's name (the Lease identity).")
    )
    leader_election: bool = dataclasses.field(
        default=False,
        metadata=_opt("Elect one active replica through a Lease; the others only serve the webhook."),
    )
    lease_name: str = dataclasses.field(
        default="tierckpt-operator", metadata=_opt("Name of the leader Lease.")
    )
    lease_duration: float = dataclasses.field(
        default=15.0, metadata=_opt("A leader that stops renewing loses the Lease after this long.", "s")
    )
    default_config: str = dataclasses.field(
        default="default",
        metadata=_opt("CheckpointConfiguration used by JobSets that opt in without tierckpt.io/config."),
    )
    pod_selector: str = dataclasses.field(
        default="",
        metadata=_opt(
            "Server-side label selector for the pod watch (must match training AND replicator pods); "
            "empty = watch all pods and filter here."
        ),
    )
    # --- replicators
    replicator_selector: str = dataclasses.field(
        default="app.kubernetes.io/name=tierckpt,app.kubernetes.io/component=replicator",
        metadata=_opt("Label selector of the replicator pods (equality terms)."),
    )
    replicator_api_port: int = dataclasses.field(
        default=8470,
        metadata=_opt("Replicator control API port (pods may override with an annotation).", "port"),
    )
    replicator_data_port: int = dataclasses.field(
        default=8471, metadata=_opt("Replicator data port.", "port")
    )
    jax_coordinator_port: int = dataclasses.field(
        default=8476,
        metadata=_opt(
            "Orbax mode: the JAX coordinator's port on the pod of process 0 (jax-init-info.txt; GKE's "
            "is 8476).",
            "port",
        ),
    )
    # --- identity (docs/security.md)
    auth: str = dataclasses.field(
        default="tls",
        metadata=_opt(
            "How the operator and the replicators prove who they are: 'tls' (the tierckpt CA: the operator "
            "signs each node's certificate and its own; the default) or 'token' (legacy: one shared "
            "bearer token, --token-file)."
        ),
    )
    ca_cert_file: str = dataclasses.field(
        default="", metadata=_opt("--auth tls: the tierckpt CA certificate (the CA Secret's tls.crt).")
    )
    ca_key_file: str = dataclasses.field(
        default="",
        metadata=_opt(
            "--auth tls: the CA's private key (the CA Secret's tls.key; only the operator reads it)."
        ),
    )
    ca_bundle_file: str = dataclasses.field(
        default="",
        metadata=_opt(
            "CA certificates replicators are verified against (default: --ca-cert-file; during a CA "
            "rotation, the old and the new CA)."
        ),
    )
    ca_configmap: str = dataclasses.field(
        default="",
        metadata=_opt(
            "Publish the CA certificate into this ConfigMap of the operator's namespace (key ca.crt), "
            "where replicators read it: for CAs the chart does not render (cert-manager). Empty: off."
        ),
    )
    issuer_port: int = dataclasses.field(
        default=8443,
        metadata=_opt("HTTPS port of the node certificate signing endpoint (0 = off).", "port"),
    )
    issuer_addr: str = dataclasses.field(
        default="0.0.0.0", metadata=_opt("Listen address of the signing endpoint.")
    )
    issuer_names: str = dataclasses.field(
        default="",
        metadata=_opt(
            "Comma-separated DNS names and IP addresses of the signing endpoint's certificate (its "
            "Service's names, as replicators reach it)."
        ),
    )
    replicator_service_account: str = dataclasses.field(
        default="tierckpt-replicator",
        metadata=_opt(
            "The replicators' ServiceAccount (in --namespace): only its pods' tokens get node certificates."
        ),
    )
    token_audience: str = dataclasses.field(
        default="tierckpt",
        metadata=_opt("The audience of the replicators' projected ServiceAccount tokens."),
    )
    cert_hours: float = dataclasses.field(
        default=24.0,
        metadata=_opt("Lifetime of node and operator certificates (renewed at two thirds).", "h"),
    )
    issuer_rate: float = dataclasses.field(
        default=0.2,
        metadata=_opt(
            "Signing requests one source address may make per second, sustained (each may cost a "
            "TokenReview); more get 429. Raise it if a proxy hides the replicators' addresses.",
            "1/s",
        ),
    )
    issuer_burst: int = dataclasses.field(
        default=10, metadata=_opt("Signing requests one source address may make at once, beyond the rate.")
    )
    issuer_api_calls: int = dataclasses.field(
        default=8,
        metadata=_opt(
            "Signing requests checking with the API server at once (a TokenReview, the pod); more get 503."
        ),
    )
    review_cache_seconds: float = dataclasses.field(
        default=10.0,
        metadata=_opt(
            "How long a TokenReview's answer is reused for the same token (kept by its SHA-256).", "s"
        ),
    )
    token_file: str = dataclasses.field(
        default="", metadata=_opt("--auth token: the file with the shared bearer token (a mounted Secret).")
    )
    http_timeout: float = dataclasses.field(
        default=5.0, metadata=_opt("Timeout of one replicator call.", "s")
    )
    http_retries: int = dataclasses.field(default=3, metadata=_opt("Attempts per replicator call."))
    http_concurrency: int = dataclasses.field(
        default=64, metadata=_opt("Replicator calls in flight at once (all jobs together).")
    )
    http_keepalive: float = dataclasses.field(
        default=90.0,
        metadata=_opt(
            "Keep a replicator's idle TLS connection this long for the next call: longer than "
            "--refresh-interval and --resync-interval, shorter than the replicators' --api-keepalive "
            "(else every round pays a TLS handshake per node).",
            "s",
        ),
    )
    peers_full_view_max: int = dataclasses.field(
        default=128,
        metadata=_opt(
            "Jobs up to this many nodes send every replicator the whole peer map (113 bytes a node); "
            "larger jobs send each node only its neighbourhood (its peers, the nodes that send to it "
            "and theirs, its replica groups' nodes)."
        ),
    )
    # --- pods
    ramdisk_mode: str = dataclasses.field(
        default="csi", metadata=_opt("How pods get the ramdisk: csi (inline CSI volume) or hostPath.")
    )
    ramdisk_host_path: str = dataclasses.field(
        default=Csi.HOST_ROOT, metadata=_opt("hostPath mode: the node ramdisk holding <job id>/ directories.")
    )
    podinfo_dir: str = dataclasses.field(
        default="/etc/tierckpt/podinfo", metadata=_opt("Where pods see their annotations (downward API).")
    )
    api_concurrency: int = dataclasses.field(
        default=16, metadata=_opt("Kubernetes API writes in flight at once (pod annotations).")
    )
    # --- timing
    debounce: float = dataclasses.field(
        default=0.5, metadata=_opt("Events for one job within this window are handled together.", "s")
    )
    resync_interval: float = dataclasses.field(
        default=60.0, metadata=_opt("Each job is reconciled at least this often.", "s")
    )
    refresh_interval: float = dataclasses.field(
        default=30.0, metadata=_opt("How often tier progress is gathered from the replicators.", "s")
    )
    restore_grace: float = dataclasses.field(
        default=30.0,
        metadata=_opt(
            "After ranks are assigned, wait at most this long for every node's replicator "
            "before choosing the restore step without the missing ones.",
            "s",
        ),
    )
    config_status_interval: float = dataclasses.field(
        default=30.0, metadata=_opt("How often CheckpointConfiguration status is refreshed.", "s")
    )
    # --- webhook and probes
    webhook_port: int = dataclasses.field(
        default=9443, metadata=_opt("Admission webhook HTTPS port.", "port")
    )
    webhook_addr: str = dataclasses.field(
        default="0.0.0.0", metadata=_opt("Admission webhook listen address.")
    )
    webhook_cert_dir: str = dataclasses.field(
        default="", metadata=_opt("Directory with tls.crt and tls.key for the webhook (a TLS Secret).")
    )
    webhook_insecure: bool = dataclasses.field(
        default=False, metadata=_opt("Serve the webhook over plain HTTP (development only).")
    )
    webhook_enabled: bool = dataclasses.field(default=True, metadata=_opt("Serve the admission webhook."))
    metrics_port: int = dataclasses.field(
        default=8080, metadata=_opt("Port of /healthz, /readyz and /metrics (0 = off).", "port")
    )
    log_level: str = dataclasses.field(default="INFO", metadata=_opt("Logging level."))

    def __post_init__(self) -> None:
        if self.ramdisk_mode not in ("csi", "hostPath"):
            raise ValueError(f"--ramdisk-mode must be csi or hostPath, not {self.ramdisk_mode!r}")
        for name in (
            "http_retries",
            "http_concurrency",
            "api_concurrency",
            "issuer_burst",
            "issuer_api_calls",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.auth not in ("tls", "token"):
            raise ValueError(f"--auth must be tls or token, not {self.auth!r}")
        if not self.http_keepalive > 0:
            raise ValueError("--http-keepalive must be positive")
        if not 0 < self.cert_hours <= 24 * 366:
            raise ValueError("--cert-hours must be in (0, 8784]")
        if not (self.issuer_rate > 0 and 0 <= self.review_cache_seconds <= 300):
            raise ValueError("--issuer-rate must be positive and --review-cache-seconds within [0, 300]")

    def check_credentials(self) -> None:
        """``ValueError`` unless the options of the chosen ``--auth`` are given."""
        if self.auth == "token":
            if not self.token_file:
                raise ValueError("--auth token needs --token-file")
            return
        if not self.ca_cert_file or not self.ca_key_file:
            raise ValueError("--auth tls needs --ca-cert-file and --ca-key-file (the tierckpt CA)")
        if self.issuer_port and not self.issuer_names.strip():
            raise ValueError("--issuer-port needs --issuer-names (the names replicators reach it by)")

    @property
    def replicator_scheme(self) -> str:
        """How replicator endpoints are reached: https (mutual TLS) or, with --auth token, http."""
        return "https" if self.auth == "tls" else "http"

    @property
    def replicator_user(self) -> str:
        """The username of the replicators' ServiceAccount tokens."""
        return f"system:serviceaccount:{self.namespace}:{self.replicator_service_account}"

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(ns.strip() for ns in self.watch_namespaces.split(",") if ns.strip())

    @property
    def replicator_labels(self) -> dict[str, str]:
        """The replicator selector as a kopf ``labels=`` filter (equality terms only)."""
        out = {}
        for term in self.replicator_selector.split(","):
            if term.strip():
                key, sep, value = term.partition("=")
                if not sep or key.rstrip().endswith("!"):
                    raise ValueError(f"--replicator-selector term {term!r} is not key=value")
                out[key.strip()] = value.lstrip("=").strip()
        return out


def _env(name: str) -> str:
    return env_name(ENV_PREFIX, name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt-operator",
        description="tierckpt Kubernetes operator: turns annotated JobSets into checkpoint-aware jobs. "
        f"Every option may also be set as {ENV_PREFIX}<OPTION> (upper case, underscores); a flag wins.",
    )
    for f in dataclasses.fields(Settings):
        kind, meta = field_type(f), f.metadata
        unit = f" [{meta['unit']}]" if meta["unit"] else ""
        text = f"{meta['help']}{unit} (env {_env(f.name)}; default: {f.default!r})"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper(), help=text)
    return p


def parse_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags, then ``TIERCKPT_OPERATOR_*`` environment variables, then defaults."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    return merge_settings(Settings, args, environ, prefix=ENV_PREFIX)
