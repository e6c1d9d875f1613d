"""``tierckpt status``: a job's checkpointing state, as the operator records it in its CheckpointJob.

The operator keeps one ``CheckpointJob`` (``tierckpt.io/v1alpha1``, same name and namespace as the
JobSet) whose status says which step every rank holds in RAM, on a peer and in the bucket, the
restore plan of the current attempt, the node and peers of each node rank, and conditions. This
command reads it with the kubernetes client (imported here only), from ``--kubeconfig`` /
``$KUBECONFIG`` / ``~/.kube/config``, or the in-cluster service account.
"""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tierckpt_cli._common import EXIT_FAILED, EXIT_USAGE, CliError, cli_errors, fail, out_console, print_json

__all__ = ["CRD_GROUP", "CRD_PLURAL", "CRD_VERSION", "status_command"]

CRD_GROUP = "tierckpt.io"
CRD_VERSION = "v1alpha1"
CRD_PLURAL = "checkpointjobs"
"""The CheckpointJob resource (charts/tierckpt/crds/checkpointjobs.tierckpt.io.yaml; tested to match)."""


def _api(kubeconfig: str | None, context: str | None) -> Any:
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_kube_config(config_file=kubeconfig, context=context)
    except (ConfigException, FileNotFoundError, TypeError) as exc:
        if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            fail(f"no usable kubeconfig ({exc}); pass --kubeconfig or run inside the cluster", EXIT_USAGE)
        config.load_incluster_config()
    return client.CustomObjectsApi()


def _call(what: str, fn: Any, **kwargs: Any) -> Any:
    """One API call; its failures become one clear line."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(CRD_GROUP, CRD_VERSION, plural=CRD_PLURAL, _request_timeout=15, **kwargs)
    except ApiException as exc:
        if exc.status == 404:
            raise CliError(
                f"{what}: not found (is the JobSet opted in with tierckpt.io/enabled=true, "
                "and the tierckpt CRDs installed?)",
                EXIT_FAILED,
            ) from None
        if exc.status in (401, 403):
            raise CliError(f"{what}: access denied ({exc.status} {exc.reason})", EXIT_FAILED) from None
        raise CliError(f"{what}: the API server answered {exc.status} {exc.reason}", EXIT_FAILED) from None
    except HTTPError as exc:
        raise CliError(f"{what}: cannot reach the API server ({exc})", EXIT_FAILED) from None


def _step(value: Any) -> str:
    return "-" if value is None else str(value)


def _list_table(items: list[dict[str, Any]]) -> Table:
    table = Table(title="CheckpointJobs", title_justify="left", header_style="bold")
    for col in (
        "namespace",
        "name",
        "phase",
        "nodes",
        "attempt",
        "local",
        "replicated",
        "backed up",
        "restore",
    ):
        table.add_column(col, justify="left" if col in ("namespace", "name", "phase") else "right")
    for obj in items:
        meta, spec, st = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status", {})
        restore = (st.get("restore") or {}).get("step")
        steps = [st.get(k) for k in ("latestLocalStep", "latestReplicatedStep", "latestBackedUpStep")]
        table.add_row(
            meta.get("namespace", ""),
            meta.get("name", ""),
            st.get("phase", "?"),
            _step(spec.get("numNodes")),
            _step(st.get("assignmentGeneration")),
            *map(_step, steps),
            _step(restore),
        )
    return table


def _print_summary(meta: dict[str, Any], spec: dict[str, Any], st: dict[str, Any]) -> None:
    name = escape(f"{meta.get('namespace')}/{meta.get('name')}")
    attempt = _step(st.get("assignmentGeneration"))
    phase, job_id = escape(str(st.get("phase", "?"))), escape(str(spec.get("jobId", "?")))
    out_console.print(f"[bold]{name}[/]  job id {job_id}  phase [bold]{phase}[/]  attempt {attempt}")
    local, replicated, backed = (
        _step(st.get(k)) for k in ("latestLocalStep", "latestReplicatedStep", "latestBackedUpStep")
    )
    seen = f"{st.get('inventoryNodes', '?')} replicators at {st.get('inventoryTime', '?')}"
    out_console.print(
        f"steps: local {local}, replicated {replicated}, backed up {backed}  (from {seen})", markup=False
    )
    if st.get("redundancy"):
        out_console.print(f"redundancy: {st['redundancy']}", markup=False)
    if st.get("overQuota"):
        out_console.print(f"over quota (not replicated, not backed up): {st['overQuota']}", markup=False)
    restore = st.get("restore") or {}
    if restore:
        sources = ", ".join(
            f"{tier}: ranks {ranks}" for tier, ranks in (restore.get("sources") or {}).items()
        )
        what = "fresh start" if restore.get("freshStart") else f"step {_step(restore.get('step'))}"
        out_console.print(f"restore: {what}" + (f" ({sources})" if sources else ""), markup=False)
    groups = st.get("replicaGroups") or {}
    if groups:
        out_console.print(replica_groups_line(groups), markup=False)


def _bytes(n: object) -> str:
    if not isinstance(n, int):
        return "?"
    if abs(n) < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


def replica_groups_line(groups: dict[str, Any]) -> str:
    """``status.replicaGroups`` in one line: the groups, the ranks that differ, and for each of written,
    replicated and uploaded the bytes of the newest accounted step against those without dedup."""
    parts = [f"replica groups: {groups.get('groups', '?')}"]
    if groups.get("divergedRanks"):
        parts.append(f"ranks {groups['divergedRanks']} DIFFER from their group (not deduplicated)")
    b = groups.get("bytes") or {}
    if b:
        shown = []
        for what in ("written", "replicated", "uploaded"):
            now, without = b.get(what), b.get(f"{what}WithoutDedup")
            if without:
                shown.append(f"{what} {_bytes(now)} of {_bytes(without)}")
        if shown:
            parts.append(f"step {groups.get('step', '?')}: " + ", ".join(shown) + " without dedup")
    return "; ".join(parts)


def _print_job(obj: dict[str, Any]) -> None:
    meta, spec, st = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status", {})
    _print_summary(meta, spec, st)
    nodes, domains, peers = st.get("nodes") or [], st.get("domains") or [], st.get("peers") or []
    if nodes:
        table = Table(title="node ranks", title_justify="left", header_style="bold")
        for col in ("rank", "node", "domain", "peers"):
            table.add_column(col)
        for i, node in enumerate(nodes):
            domain = domains[i] if i < len(domains) else ""
            table.add_row(str(i), node, domain, " ".join(map(str, peers[i])) if i < len(peers) else "")
        out_console.print(table)
    conditions = st.get("conditions") or []
    if conditions:
        table = Table(title="conditions", title_justify="left", header_style="bold")
        for col in ("type", "status", "reason", "message"):
            table.add_column(col)
        for c in conditions:
            style = {"True": "green", "False": "red"}.get(c.get("status", ""), "yellow")
            status = f"[{style}]{c.get('status', '')}[/]"
            table.add_row(
                Text(c.get("type", "")), status, Text(c.get("reason", "")), Text(c.get("message", ""))
            )
        out_console.print(table)


def status_command(
    jobset: str | None = typer.Argument(None, help="The JobSet's name (omit to list every CheckpointJob)."),
    namespace: str = typer.Option(None, "--namespace", "-n", help="Namespace (default: the context's)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="List across namespaces."),
    kubeconfig: str = typer.Option(None, "--kubeconfig", envvar="KUBECONFIG", help="Path to a kubeconfig."),
    context: str = typer.Option(None, "--context", help="The kubeconfig context to use."),
    as_json: bool = typer.Option(False, "--json", help="Print the CheckpointJob(s) as JSON."),
) -> None:
    """Show a job's checkpointing state from its CheckpointJob (tiers, restore plan, ranks)."""
    with cli_errors():
        api = _api(kubeconfig, context)
        ns = namespace or _default_namespace(kubeconfig, context) or "default"
        if jobset is None:
            if all_namespaces:
                found = _call("CheckpointJobs", api.list_cluster_custom_object)
            else:
                found = _call(f"CheckpointJobs in {ns}", api.list_namespaced_custom_object, namespace=ns)
            items = found.get("items", [])
            if as_json:
                print_json(items)
            elif items:
                out_console.print(_list_table(items))
            else:
                out_console.print("no CheckpointJobs" + ("" if all_namespaces else f" in namespace {ns}"))
            return
        obj = _call(
            f"CheckpointJob {ns}/{jobset}", api.get_namespaced_custom_object, namespace=ns, name=jobset
        )
        if as_json:
            print_json(obj)
        else:
            _print_job(obj)


def _default_namespace(kubeconfig: str | None, context: str | None) -> str | None:
    """The namespace of the kubeconfig context in use, else the service account's (in a pod)."""
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError, TypeError):
        contexts, active = [], None
    if context:
        active = next((c for c in contexts if c.get("name") == context), active)
    if active:
        return (active.get("context") or {}).get("namespace")
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None
