"""DCP across nodes, end to end, as a user runs it (``tierckpt demo --dcp``): 3 nodes x 2 ranks in network
namespaces, real replicators, fake-gcs-server behind a counting proxy, an FSDP2 model on gloo saved with
``dcp.async_save`` through ``RamdiskWriter`` and restored with ``agreed_step`` + ``dcp.load``.

One run covers, each bit-exact against the state saved (every rank hashes the whole unsharded state):

* a plain restart with no node lost (every node reads only its own ramdisk);
* one node lost and replaced: its ranks come back from the peer holding their replicas, and the bucket
  sees no read of any rank's data;
* a peer group lost: the ranks with no copy left come back from the bucket;
* one node lost for good and the job shrunk to 2 nodes x 2 ranks: DCP reshards, the nodes' replicators
  fetch the steps their ranks lack from peers, again with no read from the bucket.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierckpt_demo.report import DemoReport

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.root]

TIERCKPT = str(Path(sys.executable).parent / "tierckpt")
ARGS = ["--dcp", "--nodes", "3", "--model-size", "tiny", "--steps", "12", "--checkpoint-every", "2"]


def test_dcp_demo_recovers_every_failure_across_nodes() -> None:
    proc = subprocess.run(
        [TIERCKPT, "demo", *ARGS, "--timeout", "120", "--json"], capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = DemoReport.from_bytes(proc.stdout)
    assert report.ok, [(w, c.name, c.detail) for w, c in report.failed_checks] or report.error
    assert (report.config.checkpointing, report.config.network, report.config.world_size) == (
        "dcp",
        "netns",
        6,
    )
    by_name = {s.name: s for s in report.scenarios}
    assert list(by_name) == ["local", "peer", "gcs", "shrink"]
    for s in report.scenarios:
        assert s.restored_step == s.expected_step and s.restored_step is not None
        assert all(r.step == s.restored_step for r in s.ranks)
        assert all(r.state_sha256 and r.state_sha256 == r.reference_sha256 for r in s.ranks), s.name
        assert all(r.tier == r.expected_tier for r in s.ranks), s.name
        assert {c.name for c in s.checks} >= {"step", "tier", "state", "loss", "bucket"}
    local, peer, gcs, shrink = (by_name[n] for n in ("local", "peer", "gcs", "shrink"))
    # same sharding: no rank reads another node's data, nothing from the bucket
    for s in (local, peer):
        assert s.fetched == () and s.bucket_reads == 0 and s.world_size == 6, s.name
    assert {r.tier for r in local.ranks} == {"local"}
    assert len(peer.lost_nodes) == 1 and {r.tier for r in peer.ranks if r.lost} == {"peer"}
    assert {r.tier for r in peer.ranks if not r.lost} == {"local"}
    # a peer group lost: what no surviving node holds comes from the bucket
    assert len(gcs.lost_nodes) == 2 and gcs.bucket_reads > 0 and gcs.fetched == ()
    assert "gcs" in {r.tier for r in gcs.ranks}
    # shrunk to 2 nodes x 2 ranks: resharded from the two nodes left, nothing from the bucket. A new
    # rank reads other ranks' steps: fetched from a peer, or already on its node, because the shrunk plan
    # made the survivors re-replicate at once what they had copied to the lost node (healing)
    assert shrink.world_size == 4 and len(shrink.lost_nodes) == 1
    assert shrink.bucket_reads == 0
    assert shrink.fetched or {r.tier for r in shrink.ranks} == {"local"}
    assert sorted(report.losses) == list(range(1, report.config.steps + 1))
    assert [(c.name, c.ok) for c in report.checks] == [("curve", True), ("in-sync", True)]
    assert "ALL CHECKS PASSED" in proc.stderr and "Traceback" not in proc.stderr
