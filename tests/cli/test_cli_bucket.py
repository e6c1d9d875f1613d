"""``tierckpt ls gs://...`` against the real fake-gcs-server, with backups made by the real backup service.

The replicator's ``BackupService`` uploads client-format steps from a "node" ramdisk; the command
lists them through ``tierckpt.protocol.bucket_layout`` and google-cloud-storage (``STORAGE_EMULATOR_HOST``).
Covers: complete and partial steps, a local job id and a Kubernetes one, the default prefix, the
job filter, and clean errors for a missing bucket and an unreachable endpoint.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.cli.cli_helpers import assert_clean_error, cli
from tierckpt.protocol.bucket_layout import SUMMARY_METADATA_KEY, BucketLayout, RankSummary
from tierckpt.protocol.format import read_commit
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.service import BackupService
from tierckpt_replicator.backup.settings import BackupSettings

pytestmark = pytest.mark.e2e

LOCAL_JOB = "local-run"
K8S_JOB = "team-a_train_0123abcd"
KiB = 1 << 10


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        server.create_bucket("ckpts")
        yield server


def _backup(url: str, root: Path, job: str) -> None:
    async def run() -> None:
        service = BackupService(
            BackupSettings(interval_steps=1, interval_seconds=0, keep_last=5, parallelism=4, slice_size=0),
            node="node-0",
            root=root,
            store=GcsStore(GcsSettings(bucket="ckpts", endpoint=url)),
            metrics=BackupMetrics(CollectorRegistry()),
        )
        try:
            await service.backup_now(job, all_local=True)
        finally:
            await service.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def backups(gcs: FakeGcsServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Local job: step 10 complete (2 ranks), step 20 partial (rank 0 only). K8s job: step 5 complete."""
    root, other = tmp_path_factory.mktemp("node"), tmp_path_factory.mktemp("node")
    sizes = (64 * KiB, 3 * KiB)
    for rank in (0, 1):
        write_step(root, LOCAL_JOB, rank, 10, world_size=2, sizes=sizes, seed=rank)
    _backup(gcs.url, root, LOCAL_JOB)
    write_step(other, LOCAL_JOB, 0, 20, world_size=2, sizes=sizes, seed=7)  # rank 1's node never uploads
    _backup(gcs.url, other, LOCAL_JOB)
    write_step(root, K8S_JOB, 0, 5, world_size=1, sizes=sizes, seed=9)
    _backup(gcs.url, root, K8S_JOB)
    step10 = [root / LOCAL_JOB / f"rank-{r:05d}" / "step-000000000010" for r in (0, 1)]
    return {"step10_bytes": sum(read_commit(p).total_bytes for p in step10)}


def test_lists_complete_and_partial_steps_of_every_job(gcs: FakeGcsServer, backups: dict[str, int]) -> None:
    result = cli("ls", "gs://ckpts/tierckpt", "--json", env={"STORAGE_EMULATOR_HOST": gcs.url})
    assert result.code == 0, result.output
    steps = {(s["job"], s["step"]): s for s in result.json()["steps"]}
    assert set(steps) == {(LOCAL_JOB, 10), (LOCAL_JOB, 20), (K8S_JOB, 5)}
    done, partial, k8s = steps[LOCAL_JOB, 10], steps[LOCAL_JOB, 20], steps[K8S_JOB, 5]
    assert (done["state"], done["ranks"], done["world_size"]) == ("complete", 2, 2)
    assert done["bytes"] == backups["step10_bytes"]
    assert (partial["state"], partial["ranks"], partial["world_size"]) == ("partial", 1, 2)
    assert "1/2 ranks uploaded" in partial["detail"]
    assert (k8s["state"], k8s["world_size"]) == ("complete", 1)
    assert k8s["url"].startswith("gs://ckpts/tierckpt/jobs/team-a/train/0123abcd/steps/")


def test_bucket_url_alone_finds_the_default_prefix_and_filters(
    gcs: FakeGcsServer, backups: dict[str, int]
) -> None:
    env = {"STORAGE_EMULATOR_HOST": gcs.url, "COLUMNS": "200"}
    only = cli("ls", "gs://ckpts", "--job", K8S_JOB, "--json", env=env).json()["steps"]
    assert [(s["job"], s["step"], s["state"]) for s in only] == [(K8S_JOB, 5, "complete")]
    table = cli("ls", "gs://ckpts", env=env)
    assert table.code == 0 and "partial" in table.stdout and "complete" in table.stdout
    assert "2 job(s), 3 step(s) listed (2 complete)" in table.stdout


def test_missing_bucket_and_unreachable_endpoint_are_clean_errors(gcs: FakeGcsServer) -> None:
    result = cli("ls", "gs://no-such-bucket/tierckpt", env={"STORAGE_EMULATOR_HOST": gcs.url})
    assert_clean_error(result, 1, "no such bucket")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    assert_clean_error(
        cli("ls", "gs://ckpts/tierckpt", "--timeout", "1", env=dead), 1, "cannot list the bucket"
    )
    assert_clean_error(cli("ls", "gs://Bad_Bucket!"), 1, "invalid bucket name")


def test_a_partial_step_of_a_large_world_is_summarised_from_one_listing(gcs: FakeGcsServer) -> None:
    """80 of 4,096 ranks uploaded: the step is summarised (how many, the first missing ranges and how
    many more) from the rank commits' metadata alone: their bodies here are unreadable, and never read."""
    job, step, world = "big-world", 7, 4096
    layout = BucketLayout(BackupSettings().prefix)
    store = GcsStore(GcsSettings(bucket="ckpts", endpoint=gcs.url))
    summary = RankSummary(world_size=world, manifest_crc32c=1, total_bytes=KiB).to_bytes().decode()
    uploaded = [r for start in range(0, 800, 100) for r in range(start, start + 10)]
    for rank in uploaded:
        store.put_bytes(
            layout.rank_commit_key(job, step, rank), b"not json", metadata={SUMMARY_METADATA_KEY: summary}
        )
    result = cli("ls", "gs://ckpts", "--job", job, "--json", env={"STORAGE_EMULATOR_HOST": gcs.url})
    assert result.code == 0, result.output
    [partial] = result.json()["steps"]
    assert (partial["state"], partial["ranks"], partial["world_size"]) == ("partial", 80, world)
    assert partial["bytes"] == 80 * KiB
    assert partial["detail"] == (
        "80/4096 ranks uploaded; missing 10-99, 110-199, 210-299, 310-399, 410-499, 510-599, "
        "... (2 more ranges)"
    )
