"""The cluster's fallback without namespaces (loopback ports, plain directories) also replicates and
restores: what a non-root developer gets from ``LocalCluster``."""

from __future__ import annotations

import pytest

from tests.fixtures.cluster import (
    TEST_REPLICATOR_ARGS,
    commit_everywhere,
    committed,
    replica_path,
    wait_restored,
)
from tierckpt.protocol.control import RestoreState, Tier
from tierckpt.protocol.format import rank_dir, step_dir
from tierckpt_demo.cluster import LocalCluster
from tierckpt_demo.step_writer import step_files

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_loopback_cluster_replicates_and_restores():
    with LocalCluster(nodes=2, job="loop_job", netns=False, replicator_args=TEST_REPLICATOR_ARGS) as cluster:
        a, b = cluster.nodes
        assert a.ip == b.ip == "127.0.0.1" and a.data_port != a.api_port + 1  # ports from the OS
        sources = commit_everywhere(cluster, "loop_job", 5)
        rep = replica_path(b, "loop_job", 0, 5)
        cluster.wait_for(lambda: committed(rep), what="replica on b")
        assert step_files(rep) == step_files(sources[0])
        a.kill_replicator()
        a.wipe_ramdisk()
        a.start_replicator()  # the static peers file names the job: staged on start
        st = wait_restored(a, "loop_job", 0)
        assert (st.state, st.source) == (RestoreState.READY, Tier.PEER)
        assert step_files(step_dir(rank_dir(a.root, "loop_job", 0), 5)) == step_files(sources[0])
        with pytest.raises(RuntimeError, match="namespaces"):
            a.cut_link()
