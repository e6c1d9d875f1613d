"""The replicator's two metric views (``tierckpt_replicator.metrics``): per job for the control API,
over the node's jobs (naming none) for the open probe port."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.metrics import Metrics

NS = "tierckpt_replicator"


def samples(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
    }


def test_the_probe_page_shows_the_jobs_series_over_the_node_and_names_none():
    m = Metrics()
    backup = BackupMetrics(m.registry)
    for job, lag, copies, local, degraded, success in (
        ("team-a_x_1", 3, 2, 4, 0, 100.0),
        ("team-b_y_2", 7, 1, 1, 1, 50.0),
    ):
        m.replication_lag.labels(job).set(lag)
        m.replication_copies.labels(job).set(copies)
        m.replication_degraded.labels(job).set(degraded)
        m.steps.labels(job, "local").set(local)
        m.redundancy_changes.labels(job, "degraded").inc()
        backup.last_success.labels(job=job).set(success)
        backup.last_step.labels(job=job).set(local * 100)
    m.transfers.labels("in", "ok").inc(5)
    page = m.render()
    assert b"team-" not in page and b'job="' not in page
    got = samples(page)
    assert got[(f"{NS}_replication_lag_seconds", ())] == 7  # the largest
    assert got[(f"{NS}_replication_copies", ())] == 1  # the fewest
    assert got[(f"{NS}_replication_degraded", ())] == 1  # how many jobs
    assert got[(f"{NS}_steps", (("kind", "local"),))] == 5  # summed
    assert got[(f"{NS}_redundancy_changes_total", (("change", "degraded"),))] == 2
    assert got[("tierckpt_backup_last_success_timestamp_seconds", ())] == 50.0  # the oldest
    assert not any(name.startswith("tierckpt_backup_last_complete_step") for name, _ in got)
    assert got[(f"{NS}_transfers_total", (("direction", "in"), ("result", "ok")))] == 5  # as it is
    per_job = samples(m.render_jobs())
    assert per_job[(f"{NS}_replication_lag_seconds", (("job", "team-a_x_1"),))] == 3
    assert per_job[("tierckpt_backup_last_complete_step", (("job", "team-b_y_2"),))] == 100
