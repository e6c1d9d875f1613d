"""Daemon parts on their own: settings (flags, environment, --help), the commit watcher, the token file,
peer assignments, and the worker process supervised for real."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierckpt.planning.restore_plan import bucket_unknown
from tierckpt.protocol.client import ONE_ATTEMPT, ReplicatorClient, api_base
from tierckpt.protocol.control import (
    PeerAssignment,
    PeerNode,
    RestorePlan,
    RestoreState,
    RestoreStatus,
    Tier,
    write_restore_status,
)
from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.format import discard_step, job_dir, rank_dir, state_dir, step_dir
from tierckpt.protocol.options import option_fields
from tierckpt.protocol.tokens import TokenFile
from tierckpt_demo.ports import free_port
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.assignments import AssignmentStore, data_endpoint
from tierckpt_replicator.backup.jobs import NO_BACKUP, JobBackups
from tierckpt_replicator.commits import CommitFeed, NewSteps, StepCommitted
from tierckpt_replicator.controls import LocalInventory
from tierckpt_replicator.daemon import Daemon, worker_config
from tierckpt_replicator.inventory import Holdings, InventoryScanner
from tierckpt_replicator.replication.ipc import (
    ErasureTask,
    FetchSource,
    FetchTask,
    Outcome,
    SendTask,
    TaskResult,
)
from tierckpt_replicator.replication.manager import ReplicationManager
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.replication.wire import DataReply, DataRequest, ProtocolError, recv_frame, send_frame
from tierckpt_replicator.settings import ENV_PREFIX, Settings, TransferSettings, build_parser, parse_settings
from tierckpt_replicator.stores import NodeStores
from tierckpt_replicator.watch import CommitWatcher


def test_flags_win_over_environment_over_defaults(tmp_path: Path):
    env = {
        f"{ENV_PREFIX}REPLICAS": "3",
        f"{ENV_PREFIX}NODE_NAME": "env-node",
        f"{ENV_PREFIX}RESTORE_ON_START": "no",
        f"{ENV_PREFIX}ROOT": str(tmp_path),
    }
    s = parse_settings(["--node-name", "flag-node", "--advertise-host", "10.1.2.3"], env)
    assert (s.node_name, s.replicas, s.restore_on_start, s.root) == ("flag-node", 3, False, tmp_path)
    assert s.data_port == s.api_port + 1 and s.api_endpoint == "https://10.1.2.3:8470"  # mutual TLS
    assert s.identity_dir == tmp_path / ".tierckpt" / "identity"
    legacy = parse_settings(["--node-name", "n", "--advertise-host", "10.1.2.3", "--auth", "token"], {})
    assert legacy.api_endpoint == "http://10.1.2.3:8470"
    d = parse_settings(["--node-name", "n", "--advertise-host", "h"], {})
    assert (d.replicas, d.transfer.concurrency, d.transfer.replica_keep, d.transfer.bandwidth_limit) == (
        1,
        2,
        2,
        0.0,
    )


def test_grouped_options_keep_their_flags_and_variables(tmp_path: Path):
    """The data plane's options are a group (``Settings.transfer``, which the worker takes whole), read
    from the same flags and variables as before: the chart and the operator set those."""
    env = {
        f"{ENV_PREFIX}JOB_QUOTA": "1000",
        f"{ENV_PREFIX}MAX_INCOMING": "5",
        f"{ENV_PREFIX}WORKER_IDLE": "yes",
    }
    s = parse_settings(["--node-name", "n", "--advertise-host", "h", "--max-incoming", "7"], env)
    assert (s.transfer.max_incoming, s.transfer.job_quota, s.transfer.worker_idle) == (7, 1000, True)
    with pytest.raises(ValueError, match="--max-incoming"):
        parse_settings(["--node-name", "n", "--advertise-host", "h", "--max-incoming", "0"], {})
    assert worker_config(s).transfer is s.transfer


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--replicas", "0"], {}),
        (["--replicas", "two"], {}),
        ([], {f"{ENV_PREFIX}REPLICAS": "x"}),
        ([], {f"{ENV_PREFIX}RESTORE_ON_START": "maybe"}),
        (["--node-name", "../evil"], {}),
    ],
)
def test_bad_settings_are_refused(argv, env):
    with pytest.raises((ValueError, SystemExit, Exception)):
        parse_settings(["--advertise-host", "h", *argv], env)


def test_help_documents_every_option_with_its_environment_variable():
    text = build_parser().format_help()
    for f in option_fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        assert ENV_PREFIX + f.name.upper() in text.replace("\n", "").replace(" ", ""), f.name
    for unit in ("[s]", "[bytes]", "[MB/s]", "[port]"):
        assert unit in text


def test_console_script_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tierckpt_replicator", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--bandwidth-limit" in out.stdout and "TIERCKPT_REPLICATOR_" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tierckpt_replicator", "--advertise-host", "h"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--auth tls needs --tls-ca" in bad.stderr
    legacy = [sys.executable, "-m", "tierckpt_replicator", "--advertise-host", "h", "--auth", "token"]
    bad = subprocess.run(legacy, capture_output=True, text=True)
    assert bad.returncode == 2 and "--auth token needs --token-file" in bad.stderr


def test_token_file_rotation_and_constant_time_check(tmp_path: Path):
    path = tmp_path / "token"
    path.write_text("first\n")
    tokens = TokenFile(path)
    assert tokens.check("first") and not tokens.check("firs") and not tokens.check("")
    time.sleep(0.01)
    path.write_text("second\n")
    assert tokens.check("second") and not tokens.check("first")
    path.unlink()
    assert not tokens.check("second")  # unreadable: refuse everything


def test_peer_endpoints():
    node = PeerNode("n", "http://10.0.0.5:8470")
    assert api_base(node.endpoint) == "http://10.0.0.5:8470" and data_endpoint(node) == ("10.0.0.5", 8471)
    local = PeerNode("n", "http://127.0.0.1:4000/?data=4100")
    assert api_base(local.endpoint) == "http://127.0.0.1:4000" and data_endpoint(local) == ("127.0.0.1", 4100)
    for bad in ("ftp://x", "http://x", "http://:80", "http://x:port"):
        with pytest.raises(ContractError):
            api_base(bad)


def test_assignment_store_keeps_the_newest_generation(tmp_path: Path):
    static = PeerAssignment(job="j1", generation=1, nodes={"a": PeerNode("a", "http://a:1")}, peers={})
    store = AssignmentStore(tmp_path, static)
    assert store.get("j1") == static and (state_dir(tmp_path, "j1") / "peers.json").exists()
    assert store.get("other") is None
    assert store.put(dataclasses.replace(static, generation=1)) == (False, static)
    newer = dataclasses.replace(static, generation=4)
    assert store.put(newer) == (True, newer) and store.get("j1") == newer
    assert AssignmentStore(tmp_path, static).get("j1") == newer  # a restart does not reseed over it


def test_google_cloud_storage_is_loaded_only_once_a_bucket_is_named(tmp_path: Path):
    code = f"""
import sys
from pathlib import Path
from prometheus_client import CollectorRegistry
import tierckpt_replicator.daemon
from tierckpt_replicator.backup.jobs import load_job_backups
from tierckpt_replicator.settings import Settings
print("google.cloud.storage" in sys.modules)
load_job_backups(Settings(node_name="n", root=Path({str(tmp_path)!r})), CollectorRegistry())
print("google.cloud.storage" in sys.modules)
load_job_backups(Settings(node_name="n", root=Path({str(tmp_path)!r}), gcs_bucket="b"), CollectorRegistry())
print("google.cloud.storage" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "True"]


async def test_watcher_wakes_on_a_commit(tmp_path: Path):
    watcher = CommitWatcher(tmp_path, poll_interval=30.0, debounce=0.0)
    watcher.start()
    try:
        assert watcher.uses_inotify
        write_step(tmp_path, "job", 0, 1, sizes=(10,))  # new job, rank and step dirs: each is watched in turn
        watcher.refresh()
        started = time.monotonic()
        step = tmp_path / "job" / "rank-00000" / "step-000000000002"
        step.mkdir()
        await asyncio.wait_for(watcher.wait(), 5)
        watcher.refresh()  # now watching the uncommitted step dir itself
        await asyncio.sleep(0.05)
        watcher._event.clear()
        (step / "COMMIT.tmp").write_text("x")
        (step / "COMMIT.tmp").rename(step / "COMMIT")
        await asyncio.wait_for(watcher.wait(), 5)
        assert time.monotonic() - started < 29  # woken by inotify, not by the poll interval
    finally:
        watcher.close()


async def test_watcher_without_inotify_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def no_inotify(**_: object) -> None:
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr("tierckpt_replicator.watch.INotify", no_inotify)
    watcher = CommitWatcher(tmp_path, poll_interval=0.3, debounce=0.0)
    watcher.start()
    try:
        assert not watcher.uses_inotify
        write_step(tmp_path, "job", 0, 1, sizes=(10,))
        watcher.refresh()  # a no-op without inotify
        started = time.monotonic()
        await asyncio.wait_for(watcher.wait(), 5)  # nothing wakes it: the poll interval does
        assert 0.25 <= time.monotonic() - started < 3
        watcher.kick()
        started = time.monotonic()
        await asyncio.wait_for(watcher.wait(), 5)
        assert time.monotonic() - started < 0.25  # a kick still wakes it at once
    finally:
        watcher.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_watcher_cancelled_in_the_turn_it_wakes_is_cancelled(tmp_path: Path):
    """The replication loop waits in ``wait()``; a shutdown that cancels it just as a change wakes it
    must stop it (Python 3.11's ``asyncio.wait_for`` returned the wake-up and lost the cancellation:
    the loop ran on and the daemon's shutdown waited for it forever)."""
    for turns in range(3):  # the cancellation comes 0, 1 or 2 turns of the loop after the wake-up
        watcher = CommitWatcher(tmp_path, poll_interval=30.0, debounce=0.0)
        watcher.start()
        try:
            waiting = asyncio.create_task(watcher.wait())
            await asyncio.sleep(0.05)  # waiting for a change
            watcher.kick()
            for _ in range(turns):
                await asyncio.sleep(0)
            waiting.cancel()
            done, _ = await asyncio.wait({waiting}, timeout=5)
            assert waiting in done and waiting.cancelled(), f"cancelled {turns} turns after the wake-up"
        finally:
            watcher.close()


async def test_the_daemons_shutdown_stops_a_replication_loop_woken_as_it_is_cancelled(tmp_path: Path):
    """SIGTERM's shutdown (the real worker process, the loops) finishes while changes keep waking the
    replication loop: each cancellation reaches it (it did not: CI seed 21's replicator did not exit)."""
    root = tmp_path / "ramdisk"
    settings = _token_settings(
        tmp_path,
        node_name="node-a",
        root=root,
        api_port=0,  # (the control API is not served here)
        data_port=_free_port(),
        poll_interval=30.0,
        restore_on_start=False,
    )
    daemon = Daemon(settings)
    await daemon.startup()
    stopping = None
    try:
        await asyncio.sleep(0.5)  # the loop's first pass is done: it waits for a change
        daemon.watcher.kick()  # a change comes in the turn the shutdown starts
        stopping = asyncio.create_task(daemon.shutdown())
        done, _ = await asyncio.wait({stopping}, timeout=20)
        assert stopping in done, "the shutdown is still waiting for the replication loop"
        stopping.result()
        assert all(task.done() for task in daemon._loops) and not daemon.supervisor.alive
    finally:
        if stopping is None or not stopping.done():  # stop what the shutdown could not
            for task in daemon._loops:
                task.cancel()
            await daemon.supervisor.stop()


def _token_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings of node ``n`` on loopback, token auth (the token written under ``tmp_path``), its
    worker at normal priority; ``overrides`` on top."""
    token = tmp_path / "token"
    token.write_text("tok\n")
    base: dict[str, Any] = {
        "node_name": "n",
        "root": tmp_path,
        "auth": "token",
        "token_file": token,
        "advertise_host": "127.0.0.1",
        "listen_host": "127.0.0.1",
        "transfer": TransferSettings(worker_nice=0),
    }
    return Settings(**(base | overrides))


def _local_supervisor(tmp_path: Path) -> WorkerSupervisor:
    """A worker supervisor of node ``n`` on loopback ports, token auth, at normal priority."""
    settings = _token_settings(tmp_path, api_port=0, data_port=0)
    return WorkerSupervisor(dataclasses.replace(worker_config(settings), data_port=0))


async def test_supervisor_restarts_a_dead_worker(tmp_path: Path):
    sup = _local_supervisor(tmp_path)
    await sup.start()
    try:
        first = sup.pid
        result = await sup.run_task(
            FetchTask(
                id=sup.next_id(), job="j", rank=0, step=1, sources=(FetchSource(kind="replica", node="n"),)
            )
        )
        assert not result.ok and result.outcomes[0].status == "missing"
        assert first is not None
        sup._proc.kill()  # type: ignore[union-attr]
        for _ in range(200):
            if sup.alive and sup.pid != first:
                break
            await asyncio.sleep(0.05)
        assert sup.alive and sup.pid != first and sup.restarts == 1
        result = await sup.run_task(SendTask(id=sup.next_id(), job="j", rank=0, step=1, candidates=()))
        assert not result.ok
    finally:
        await sup.stop()
    assert not sup.alive


async def test_a_job_fenced_for_its_purge_starts_nothing_in_the_worker_nor_in_its_restart(tmp_path: Path):
    sup = _local_supervisor(tmp_path)

    async def fetch(job: str) -> TaskResult:
        source = FetchSource(kind="replica", node="n")
        return await sup.run_task(FetchTask(id=sup.next_id(), job=job, rank=0, step=1, sources=(source,)))

    await sup.start()
    try:
        await sup.fence("j")
        assert "being purged" in (await fetch("j")).message
        assert (await fetch("k")).outcomes[0].status == "missing"  # another job: served
        first = sup.pid
        sup._proc.kill()  # type: ignore[union-attr]
        for _ in range(200):
            if sup.alive and sup.pid != first:
                break
            await asyncio.sleep(0.05)
        assert sup.alive and sup.pid != first
        assert "being purged" in (await fetch("j")).message  # the new worker starts fenced
        await sup.unfence("j")
        assert (await fetch("j")).outcomes[0].status == "missing"
    finally:
        await sup.stop()


async def test_a_purge_through_the_api_aborts_a_replica_still_arriving(tmp_path: Path):
    """The whole daemon (its worker process, the data port, the control API in-process): a peer's put
    admitted before the purge, whose header comes after it, is aborted; nothing re-creates the job."""
    root = tmp_path / "ramdisk"
    settings = _token_settings(tmp_path, root=root, api_port=0, data_port=free_port())
    job = "team_purge_1234abcd"
    src = write_step(tmp_path / "sender", job, 0, 3, sizes=(4 << 20,))
    commit, manifest = (src / "COMMIT").read_bytes(), (src / "manifest.json").read_bytes()
    req = DataRequest(
        op="put", token="tok", job=job, rank=0, step=3, commit_size=len(commit), manifest_size=len(manifest)
    )
    daemon = Daemon(settings)
    await daemon.startup()
    try:
        with socket.create_connection(("127.0.0.1", settings.data_port), timeout=5) as s:
            send_frame(s, req)  # admitted and authorized; the receiver waits for the step's header
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=daemon.app), base_url="http://replicator"
            ) as api:
                resp = await api.delete(f"/v1/jobs/{job}", headers={"Authorization": "Bearer tok"})
            assert resp.status_code == 200

            def go_on() -> None:  # the sender goes on, as a real one would
                with contextlib.suppress(OSError, ProtocolError):
                    s.sendall(commit + manifest + (src / "data-00000.bin").read_bytes())
                    recv_frame(s, DataReply)

            await asyncio.to_thread(go_on)
        assert not job_dir(root, job).exists()
    finally:
        await daemon.shutdown()


def test_docs_describe_every_option():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "replicator.md").read_text()
    for f in option_fields(Settings):
        assert f"`--{f.name.replace('_', '-')}" in doc, f.name


async def test_worker_runs_at_lower_priority(tmp_path: Path):
    settings = _token_settings(tmp_path, transfer=TransferSettings(worker_nice=7, worker_idle=True))
    sup = WorkerSupervisor(dataclasses.replace(worker_config(settings), data_port=0))
    await sup.start()
    try:
        assert sup.pid is not None
        assert os.getpriority(os.PRIO_PROCESS, sup.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 7
        assert os.sched_getscheduler(sup.pid) == os.SCHED_IDLE
    finally:
        await sup.stop()


async def test_restore_plan_asks_again_before_believing_nothing_is_restorable(tmp_path: Path):
    import httpx

    from tierckpt.protocol.control import NodeInventory, RankHoldings
    from tierckpt_replicator.restore.gather import compute_plan

    token = tmp_path / "token"
    token.write_text("tok\n")
    assignment = PeerAssignment(
        job="j",
        generation=1,
        peers={},
        nodes={"a": PeerNode("a", "http://a:1"), "b": PeerNode("b", "http://b:1")},
    )
    held = NodeInventory(
        job="j",
        node="b",
        endpoint="http://b:1",
        updated_at=0.0,
        ranks={0: RankHoldings(local=(5,)), 1: RankHoldings(replica=(5,))},
        world_sizes={5: 2},
    )
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:  # b is slow to come back
            return httpx.Response(503)
        return httpx.Response(200, content=held.to_bytes())

    peers = ReplicatorClient(
        token=TokenFile(token), timeout=1.0, retry=ONE_ATTEMPT, transport=httpx.MockTransport(answer)
    )

    async def own() -> NodeInventory:
        return NodeInventory(job="j", node="a", endpoint="http://a:1", updated_at=0.0, ranks={})

    try:
        plan = await compute_plan("j", own, assignment, peers, attempts=5, backoff=0.01)
        assert plan.step == 5 and len(calls) == 3  # asked again instead of starting the job afresh
        calls.clear()
        never = ReplicatorClient(
            token=TokenFile(token),
            timeout=1.0,
            retry=ONE_ATTEMPT,
            transport=httpx.MockTransport(lambda r: httpx.Response(503)),
        )
        plan = await compute_plan("j", own, assignment, never, attempts=3, backoff=0.01)
        assert plan.step is None  # after the attempts, what is known is all there is
        await never.aclose()
    finally:
        await peers.aclose()


async def test_reconcile_asks_every_peer_at_once_and_never_holds_up_a_pass(tmp_path: Path):
    """A peer that does not answer costs a reconcile one timeout, not one per job, and the sends of
    the replication pass that started it go on meanwhile."""
    import httpx

    from tierckpt.protocol.control import NodeInventory
    from tierckpt_replicator.inventory import InventoryScanner
    from tierckpt_replicator.metrics import Metrics
    from tierckpt_replicator.replication.manager import ReplicationManager

    token = tmp_path / "token"
    token.write_text("tok\n")
    root = tmp_path / "root"
    store = AssignmentStore(root)
    jobs = [f"j{i}" for i in range(3)]
    for job in jobs:
        nodes = {n: PeerNode(n, f"http://{n}:1") for n in ("a", "b")}
        store.put(PeerAssignment(job=job, generation=1, nodes=nodes, peers={"a": ("b",)}))
        write_step(root, job, 0, 5)  # a's rank 0, replicated to b (as far as a knows)
    asked: list[str] = []
    all_asked, release = asyncio.Event(), asyncio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        job = request.url.path.split("/")[3]
        asked.append(job)
        if len(asked) == len(jobs):
            all_asked.set()
        await release.wait()  # b hangs until every job's question is in flight
        empty = NodeInventory(job=job, node="b", endpoint="http://b:1", updated_at=0.0, ranks={})
        return httpx.Response(200, content=empty.to_bytes())

    peers = ReplicatorClient(
        token=TokenFile(token), timeout=30.0, retry=ONE_ATTEMPT, transport=httpx.MockTransport(answer)
    )
    mgr = ReplicationManager(
        node="a",
        k=1,
        scanner=InventoryScanner(root, node="a", endpoint="http://a:1"),
        assignments=store,
        supervisor=None,
        peers=peers,
        metrics=Metrics(),
        reconcile_interval=0.0,  # type: ignore[arg-type]
    )
    mgr.confirmed = {(job, 0, 5): {"b"} for job in jobs}
    try:
        await asyncio.wait_for(mgr.run_pass(), 10)  # returns while b has not answered
        await asyncio.wait_for(all_asked.wait(), 10)  # every job asked at once
        assert sorted(asked) == jobs and mgr.confirmed == {(job, 0, 5): {"b"} for job in jobs}
        await asyncio.wait_for(mgr.run_pass(), 10)  # a pass while the reconcile still waits
        assert len(asked) == len(jobs)  # ... starts no second reconcile
        release.set()
        await asyncio.wait_for(mgr._reconciling, 10)  # type: ignore[arg-type]
        assert all(not nodes for nodes in mgr.confirmed.values())  # b lost them all: send again
    finally:
        release.set()
        await mgr.close()
        await peers.aclose()


def _offline_manager(root: Path) -> Any:
    """Node ``a``'s replication manager, factor 1, with no worker and no peers (planning only)."""
    from tierckpt_replicator.inventory import InventoryScanner
    from tierckpt_replicator.metrics import Metrics
    from tierckpt_replicator.replication.manager import ReplicationManager

    return ReplicationManager(
        node="a",
        k=1,
        scanner=InventoryScanner(root, node="a", endpoint="http://a:1"),
        assignments=AssignmentStore(root),
        supervisor=None,
        peers=None,  # type: ignore[arg-type]
        metrics=Metrics(),
    )


async def test_only_a_fault_of_the_peer_itself_moves_every_jobs_replicas_off_it(tmp_path: Path):
    """A peer that refuses one job (its plan of that job is behind: ``unauthorized``) or holds a corrupt
    copy stays first among every job's candidates; one that is unreachable, busy or full goes last."""
    import time

    from tierckpt_replicator.replication.ipc import Outcome

    root = tmp_path / "root"
    mgr = _offline_manager(root)
    try:
        for status in ("unauthorized", "corrupt", "missing", "ok", "already"):
            mgr._record(("j", 0, 5), [Outcome(node="b", status=status)])
        assert mgr._node_backoff.blocked(time.monotonic()) == set()
        for i, status in enumerate(("unreachable", "busy", "full", "failed")):
            mgr._record(("j", 0, 5), [Outcome(node=f"n{i}", status=status)])
        assert mgr._node_backoff.blocked(time.monotonic()) == {"n0", "n1", "n2", "n3"}
    finally:
        await mgr.close()


async def test_a_copy_back_on_the_assigned_peer_is_kept_and_the_fallbacks_linked_copy_retired(tmp_path: Path):
    """The copy a fallback linked while the assigned peer was in backoff is the surplus once the copy
    went back to the assigned peer, linked or not: retiring the assigned peer's copy instead would send
    it back again at the next pass, round after round."""

    root = tmp_path / "root"
    nodes = {n: PeerNode(n, f"http://{n}:1") for n in ("a", "b", "c")}
    assignment = PeerAssignment(job="j", generation=1, nodes=nodes, peers={"a": ("b",)})
    mgr = _offline_manager(root)
    retired: list[tuple[object, tuple[str, ...]]] = []

    async def retire(key: object, holders: tuple[str, ...], _: PeerAssignment) -> None:
        retired.append((key, holders))

    mgr._retire = retire  # type: ignore[method-assign]
    try:
        mgr.confirmed = {("j", 0, 5): {"b", "c"}}
        mgr.linked = {("j", 0, 5): {"c"}}
        mgr._retire_surplus("j", assignment, {0: 5}, 1, 0.0)
        await asyncio.sleep(0)
        assert retired == [(("j", 0, 5), ("c",))]
    finally:
        await mgr.close()


class _HeldSends:
    """The worker's side of the manager's sends: each send (of a whole step, or of its fragments: index 0)
    waits for ``release``, then tells ``ok`` for ``node``; ``started`` is set once one is in flight."""

    def __init__(self, node: str) -> None:
        self.node, self.sent = node, 0
        self.started, self.release = asyncio.Event(), asyncio.Event()

    def next_id(self) -> int:
        return self.sent + 1

    async def run_task(self, task: SendTask | ErasureTask) -> TaskResult:
        self.sent += 1
        self.started.set()
        await self.release.wait()
        index = 0 if isinstance(task, ErasureTask) else -1
        return TaskResult(id=task.id, ok=True, outcomes=(Outcome(node=self.node, status="ok", index=index),))


async def _settled(mgr: ReplicationManager) -> None:
    """Until every send, retirement and heal the manager started has ended."""
    while mgr._tasks:
        await asyncio.wait(set(mgr._tasks))


@pytest.mark.parametrize("erasure", [None, (1, 1)], ids=["replicas", "fragments"])
async def test_a_send_that_a_save_of_its_step_overtook_counts_no_copy_of_the_new_save(
    tmp_path: Path, erasure: tuple[int, int] | None
):
    """tests/replicator/test_resaved_e2e.py, 2 runs in 7 under load: a replicator that had just started
    sent rank 0's step 10 of the run the job left (its peer had dropped that copy for the restore) while
    the job saved step 10 again. A pass during the send saw the new save and forgot the copies of the
    earlier one; then the send's "ok" counted the peer's copy of the earlier save as one of the new save,
    which was never sent, and the peer kept the earlier save. The copy counts only while the step the
    send was for is still the rank's newest save: the new save goes out at the next pass. The same for
    an erasure-coded job's fragments."""
    from tierckpt_replicator.metrics import Metrics

    root = tmp_path / "root"
    store = AssignmentStore(root)
    nodes = {n: PeerNode(n, f"http://{n}:1") for n in ("a", "b")}
    store.put(PeerAssignment(job="j", generation=1, nodes=nodes, peers={"a": ("b",)}))
    write_step(root, "j", 0, 10, seed=1, sizes=(1000,))
    worker = _HeldSends("b")
    mgr = ReplicationManager(
        node="a",
        k=1,
        scanner=InventoryScanner(root, node="a", endpoint="http://a:1"),
        assignments=store,
        supervisor=worker,  # type: ignore[arg-type]
        peers=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        reconcile_interval=3600.0,
        erasure=lambda job: erasure,
    )
    key = ("j", 0, 10)

    def holders() -> set[str]:
        return set(mgr.confirmed.get(key, ()) if erasure is None else mgr.placed.get(key, {}))

    try:
        await mgr.run_pass()
        await asyncio.wait_for(worker.started.wait(), 10)  # the earlier save is on its way to b
        discard_step(step_dir(rank_dir(root, "j", 0), 10))
        await asyncio.sleep(0.01)  # the new save's commit time differs from the earlier one's
        write_step(root, "j", 0, 10, seed=2, sizes=(1000,))
        await mgr.run_pass()  # sees the new save; step 10 is in flight, so nothing is sent yet
        assert worker.sent == 1
        worker.release.set()
        await asyncio.wait_for(_settled(mgr), 10)
        assert holders() == set(), "b's copy of the earlier save counted for the new one"
        await mgr.run_pass()
        await asyncio.wait_for(_settled(mgr), 10)
        assert worker.sent == 2 and holders() == {"b"}
    finally:
        worker.release.set()
        await mgr.close()


class _SentSteps(_HeldSends):
    """Sends that succeed at once, recording the (rank, step) of each."""

    def __init__(self, node: str) -> None:
        super().__init__(node)
        self.steps: list[tuple[int, int]] = []
        self.release.set()

    async def run_task(self, task: SendTask | ErasureTask) -> TaskResult:
        self.steps.append((task.rank, task.step))
        return await super().run_task(task)


async def test_a_step_the_run_a_job_left_saved_is_not_sent_while_the_job_saves_it_again(tmp_path: Path):
    """Soak run 6 (seed 613830794, rounds 29 and 31): a DCP job went back to step 27 (the operator's
    plan) while node-0 still held rank 2's primary step 30 of the run it left. Staging dropped the
    peers' replicas above 27; node-0's reconcile saw its copy gone and sent step 30 again, and again,
    each send holding a lease on that primary, so the trainer's save of step 30 failed, attempt after
    attempt ("leased (being read or copied): not overwriting"). A step above the plan's committed before
    the plan was decided is not the rank's newest: it is held (reported, until the client's first commit
    retires it) but neither counted nor sent; the new save of its step is."""
    root = tmp_path / "ramdisk"
    settings = _token_settings(
        tmp_path, node_name="a", root=root, api_port=0, data_port=_free_port(), restore_on_start=False
    )
    daemon = Daemon(settings)  # not started: its scanner and stager, as the daemon wires them
    job = "went-back"
    nodes = {n: PeerNode(n, f"http://{n}:1") for n in ("a", "b")}
    daemon.assignments.put(PeerAssignment(job=job, generation=1, nodes=nodes, peers={"a": ("b",)}))
    for step in (27, 30):  # the run the job left
        write_step(root, job, 2, step, seed=step, world_size=3, sizes=(1000,))
    await asyncio.sleep(0.01)
    plan = RestorePlan(job=job, step=27, world_size=2, sources={0: Tier.LOCAL}, decided_at=time.time())
    daemon.stager.plans[job] = plan  # this node staged it: the job went back to 27
    worker = _SentSteps("b")
    mgr = ReplicationManager(
        node="a",
        k=1,
        scanner=daemon.scanner,
        assignments=daemon.assignments,
        supervisor=worker,  # type: ignore[arg-type]
        peers=None,  # type: ignore[arg-type]
        metrics=daemon.metrics,
        reconcile_interval=3600.0,
    )
    try:
        holdings = daemon.scanner.holdings(job)
        assert holdings.ranks[2].local == (27, 30)  # still held (the inventory says so)
        assert holdings.newest_local() == {2: 27}
        await mgr.run_pass()
        await asyncio.wait_for(_settled(mgr), 10)
        mgr._uncount("b", [(job, 2, 30)])  # a reconcile: b dropped its copy for the restore
        await mgr.run_pass()
        await asyncio.wait_for(_settled(mgr), 10)
        assert worker.steps == [(2, 27)], "a step of the run the job left was sent while it saves it again"
        discard_step(step_dir(rank_dir(root, job, 2), 30))  # the job saves step 30 again
        write_step(root, job, 2, 30, seed=300, world_size=3, sizes=(1000,))
        await mgr.run_pass()
        await asyncio.wait_for(_settled(mgr), 10)
        assert worker.steps == [(2, 27), (2, 30)] and mgr.confirmed == {(job, 2, 30): {"b"}}
    finally:
        await mgr.close()


def test_the_backups_read_the_restore_plans_the_daemons_stager_keeps(tmp_path: Path):
    """The daemon's backups (``JobBackups``, built before the daemon over the same ``NodeStores``) see
    the plan the stager staged: after the job went back to step 5, its newest step for a backup is 5,
    not 8, the run it left saved (the backup once uploaded and leased that one while the trainer saved
    step 8 again)."""
    root = tmp_path / "ramdisk"
    settings = _token_settings(
        tmp_path,
        root=root,
        api_port=0,
        data_port=_free_port(),
        restore_on_start=False,
        gcs_bucket="b",
        gcs_endpoint="http://127.0.0.1:1",
    )
    stores = NodeStores.open(settings)
    backups = JobBackups(settings, stores=stores)
    daemon = Daemon(settings, stores=stores, backup=backups)  # not started: the parts as wired
    job = "went-back"
    for step in (5, 8):  # the run the job left
        write_step(root, job, 0, step, seed=step, sizes=(100,))
    time.sleep(0.01)
    svc = backups.service(job)
    assert svc is not None and svc._newest_local(job) == 8  # no restore staged here
    plan = RestorePlan(job=job, step=5, world_size=1, sources={0: Tier.LOCAL}, decided_at=time.time())
    daemon.stager.plans[job] = plan  # this node staged it: the job went back to 5
    assert svc._newest_local(job) == 5 and daemon.scanner.holdings(job).newest_common() == 5


class _StuckBucket:
    """A bucket that takes ``seconds`` to list a job's complete steps (unreachable: connects time out)."""

    def __init__(self, seconds: float, steps: dict[int, int]) -> None:
        self.seconds, self.steps, self.listings = seconds, steps, 0

    async def complete_world_sizes(self, job: str) -> dict[int, int]:
        self.listings += 1
        await asyncio.sleep(self.seconds)
        return self.steps


async def test_an_unreachable_bucket_does_not_hold_up_the_inventory(tmp_path: Path):
    """Found by the chaos harness: a node cut off from the bucket answered every inventory only once its
    listing of the bucket gave up (10 s and more), so its peers (--inventory-timeout) counted none of the
    replicas it held, and the operator planned restores without its holdings. The inventory now waits a
    moment for the bucket and answers with what it knew; the listing goes on in the background, once per
    job, and its answer is used from then on."""
    job = "slow-bucket"
    write_step(tmp_path, job, 0, 7, seed=1, sizes=(1000,))
    scanner = InventoryScanner(tmp_path, node="n0", endpoint="https://n0:8470")
    bucket = _StuckBucket(3.0, {5: 1})
    inventory = LocalInventory(scanner, bucket)  # type: ignore[arg-type]
    started = time.monotonic()
    first, second = await asyncio.gather(inventory(job), inventory(job))
    assert time.monotonic() - started < 2.0, "the inventory waited for the bucket"
    assert first.ranks[0].local == (7,) and first.gcs == () and second.gcs == ()
    assert bucket.listings == 1, "one listing at a time per job"
    assert first.gcs_pending and second.gcs_pending, "a bucket not listed yet is unknown, not empty"
    await asyncio.sleep(3.5)  # the listing answered meanwhile
    third = await inventory(job)
    assert third.gcs == (5,) and not third.gcs_pending
    assert bucket.listings == 1


async def test_a_bucket_that_cannot_be_listed_leaves_its_steps_unknown_not_empty(tmp_path: Path):
    """A listing that fails (no earlier one cached) says the bucket's steps are unknown (``gcs_pending``):
    found by the chaos soak (seed 2127330875, round 2), where both nodes of a job moved to new nodes
    answered "nothing in the bucket" while every bucket request was delayed, and the plan started the
    job afresh over its complete step 39."""

    class Failing:
        async def complete_world_sizes(self, job: str) -> dict[int, int]:
            raise TimeoutError("the bucket did not answer")

    scanner = InventoryScanner(tmp_path, node="n0", endpoint="https://n0:8470")
    inv = await LocalInventory(scanner, Failing())("j")  # type: ignore[arg-type]
    assert inv.gcs == () and inv.gcs_pending
    assert bucket_unknown([inv]) and not bucket_unknown([inv, dataclasses.replace(inv, gcs_pending=False)])
    assert not bucket_unknown([])


async def test_the_commit_feed_tells_the_backup_once_per_step_every_local_rank_committed(tmp_path: Path):
    """One scan per pass for every subscriber (replication and backup): the backup hears of a step once,
    when every local rank has committed it, and again after a purge (``forget``)."""
    job = "feed"
    scanner = InventoryScanner(tmp_path, node="n0", endpoint="https://n0:8470")
    feed = CommitFeed(scanner)
    told: list[StepCommitted] = []
    scans: list[tuple[str, tuple[int, ...]]] = []

    async def on_step(committed: StepCommitted) -> None:
        told.append(committed)

    async def replication(job: str, holdings: Holdings) -> None:
        scans.append((job, tuple(sorted(holdings.ranks))))

    uploads = NewSteps(on_step)
    feed.subscribe("replication", replication)
    feed.subscribe("backup", uploads)
    write_step(tmp_path, job, 0, 3, world_size=2, sizes=(100,))
    write_step(tmp_path, job, 1, 3, world_size=2, sizes=(100,))
    write_step(tmp_path, job, 0, 4, world_size=2, sizes=(100,))  # rank 1 has not committed 4 yet
    for _ in range(2):
        await feed.run_pass()
        await asyncio.sleep(0)
    assert told == [StepCommitted(job, 3, (0, 1))]
    assert scans == [(job, (0, 1))] * 2, "every pass hands replication the job's holdings"
    write_step(tmp_path, job, 1, 4, world_size=2, sizes=(100,))
    await feed.run_pass()
    await asyncio.sleep(0)
    assert told[1:] == [StepCommitted(job, 4, (0, 1))]
    uploads.forget(job)  # purged, and saved again from the start
    await feed.run_pass()
    await asyncio.sleep(0)
    assert told[2:] == [StepCommitted(job, 4, (0, 1))]
    await uploads.close()


def test_backups_spread_uploads_by_the_daemons_assignment_store(tmp_path: Path):
    """The backup service reads the peer plan from the store it is given (the daemon's, the one reader
    of peers.json), not from the file: a plan only the store holds (a static peers file's, not yet
    written to disk) decides who holds which rank."""
    from tierckpt_replicator.backup.service import BackupService
    from tierckpt_replicator.backup.settings import BackupSettings

    nodes = {n: PeerNode(n, f"http://{n}:1") for n in ("a", "b")}
    plan = PeerAssignment("spread", 1, nodes, {"a": ("b",), "b": ("a",)}, {"a": 0, "b": 1}, procs_per_node=1)
    store = AssignmentStore(tmp_path, plan)
    svc = BackupService(BackupSettings(), node="a", root=tmp_path, store=None, assignments=store)  # type: ignore[arg-type]
    assert svc._holders_of("spread", 2) == {0: ("a", "b"), 1: ("b", "a")}


async def test_a_node_without_backups_has_the_null_backup(tmp_path: Path):
    """No tier 3: the parts see a backup that holds nothing and refuses an on-demand backup as
    unconfigured; nothing checks for its absence."""
    assert await NO_BACKUP.complete_world_sizes("j") == {} and await NO_BACKUP.data_source("j", 1, 0) is None
    with pytest.raises(LookupError, match="not configured"):
        await NO_BACKUP.backup_now("j")
    scanner = InventoryScanner(tmp_path, node="n0", endpoint="https://n0:8470")
    write_step(tmp_path, "j", 0, 7, sizes=(100,))
    inventory = await LocalInventory(scanner)("j")
    assert inventory.ranks[0].local == (7,) and inventory.gcs == ()


def test_a_ranks_newest_step_is_its_newest_commit_whatever_a_later_restore_status_says(tmp_path: Path):
    """A staging run while the job trains (a replicator restarted, a node given a new node rank) writes
    a restore status naming an older step, newer than the rank's commits that the job still builds on.
    The rank's newest step stays its newest commit: while a status like that stood for a restore
    (found by the chaos harness), the newest step was neither sent nor counted until the next save, and
    held trainers never saved again."""
    job = "status-after-commits"
    for step in (3, 6):
        write_step(tmp_path, job, 0, step, seed=step, sizes=(1000,))
    write_restore_status(
        job_dir(tmp_path, job),
        RestoreStatus(job, 0, RestoreState.READY, 3, Tier.LOCAL, 0, 0, updated_at=time.time() + 1),
    )
    holdings = InventoryScanner(tmp_path, node="n0", endpoint="https://n0:8470").holdings(job)
    assert holdings.newest_local() == {0: 6}
