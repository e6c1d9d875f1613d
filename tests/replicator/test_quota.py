"""A job's quota on a node (``tierckpt_replicator.quota``): the smallest of its policy's
``quota_bytes``, the node's ``--job-quota`` and the node's ramdisk size, and what a refusal says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.cluster import write_sparse_step
from tierckpt.protocol.control import JobPolicy, write_control
from tierckpt.protocol.format import read_manifest
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.quota import JobQuotas, OverQuotaError
from tierckpt_replicator.stepio import open_files, open_job

JOB = "ns_job_0123abcd"
MiB = 1 << 20


def test_a_jobs_quota_is_the_smallest_limit_set(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    ramdisk = st.f_blocks * st.f_frsize
    policies = PolicyStore(tmp_path)
    assert JobQuotas(tmp_path, policies).of(JOB) == ramdisk  # nothing set: the node's ramdisk
    assert JobQuotas(tmp_path, policies, 64 * MiB).of(JOB) == 64 * MiB  # --job-quota
    write_control(tmp_path, JOB, JobPolicy.FILE, JobPolicy(job=JOB, generation=1, quota_bytes=8 * MiB))
    assert JobQuotas(tmp_path, policies, 64 * MiB).of(JOB) == 8 * MiB  # the job's ramdisk size
    assert JobQuotas(tmp_path, policies, 4 * MiB).of(JOB) == 4 * MiB  # the node's, when smaller
    assert JobQuotas(tmp_path, policies).of("other_job") == ramdisk  # per job
    write_control(tmp_path, JOB, JobPolicy.FILE, JobPolicy(job=JOB, generation=2, quota_bytes=ramdisk * 2))
    assert JobQuotas(tmp_path, policies).of(JOB) == ramdisk  # never more than the ramdisk


def test_a_refusal_says_what_the_step_declares_and_takes(tmp_path: Path) -> None:
    quotas = JobQuotas(tmp_path, PolicyStore(tmp_path), 8 * MiB)
    dense = write_step(tmp_path, JOB, 0, 1, sizes=(9 * MiB,))
    sparse = write_sparse_step(tmp_path, JOB, 1, 1, declared=1 << 30)
    small = write_step(tmp_path, JOB, 2, 1, sizes=(MiB,))
    quotas.check(read_manifest(small))
    for path, says in (
        (dense, f"job {JOB} rank 0 step 1 declares 9.0Mi, over the job's quota of 8.0Mi (its files take 9."),
        (
            sparse,
            f"job {JOB} rank 1 step 1 declares 1.0Gi, over the job's quota of 8.0Mi (its files take 0B",
        ),
    ):
        manifest = read_manifest(path)
        with (
            open_job(tmp_path, JOB) as tree,
            open_files(tree.at(str(path.relative_to(tmp_path / JOB))), manifest) as fds,
            pytest.raises(OverQuotaError) as refused,
        ):
            quotas.check(manifest, fds=fds)
        assert str(refused.value).startswith(says)
        assert str(refused.value).endswith(": sparse)") == (path == sparse)
    over = quotas.committed_over(JOB, 1, 1, declared=1 << 30, limit=MiB)
    assert over is not None and (over.bytes, over.quota, over.allocated) == (1 << 30, 8 * MiB, 0)
    assert quotas.committed_over(JOB, 2, 1, declared=MiB, limit=MiB) is None
