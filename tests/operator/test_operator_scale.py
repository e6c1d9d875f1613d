"""The real operator at a size CI affords, through ``bench/operator_scale_bench.py`` (the API emulator,
the operator process with production settings, one mutual-TLS fake replicator per node): 192 nodes, past
``peers_full_view_max`` (128), so each node is sent its own neighbourhood of the peer plan.

What must hold at any size: every node gets its peers, in a message that does not grow with the job,
with the policy and the restore plan in one call;
each node's calls share kept-alive connections; one node replaced re-sends peers only to the nodes whose
view changed (a delta, not the whole job). Times are bounded loosely (this machine may be shared: at a
load average of 30 on 2 vCPUs peers took 30 s and a replacement 0.98 s, on 2 s of operator CPU); the
targets (peers under 10 s at 4,096 nodes, a replacement under 1 s) are the benchmark's:
docs/benchmarks.md (the same script, a longer run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.shared_data import require_jobset_crd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NODES = 192
WHOLE_MAP_BYTES_A_NODE = 113
"""What each node adds to a message holding the whole peer map."""


def test_192_nodes_get_their_own_peers_over_kept_connections_and_a_replaced_node_replans_few(
    tmp_path: Path,
) -> None:
    require_jobset_crd()  # skipped here without it, as every operator e2e test (the bench would fail)
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "operator_scale_bench.py"),
            "--nodes",
            str(NODES),
            "--settle",
            "2",
            "--timeout",
            "120",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    # every node holds its peers, policy and restore plan, for little of the operator's CPU
    assert fig["deliver_operator_cpu_s"] < 15.0 and fig["deliver_peers_s"] < 120.0, fig
    # a node's message is its neighbourhood: a fraction of the whole map (which grows with the job)
    assert fig["deliver_peers_bytes_max"] < WHOLE_MAP_BYTES_A_NODE * NODES / 3, fig
    # peers, policy and restore plan (and the inventory asked for) over one kept-alive connection a node
    assert fig["deliver_connections_max"] <= 2, fig
    assert fig["deliver_connections"] <= NODES + NODES // 8, fig
    # one call a node for the policy, its peers and the restore plan together (NodePlan), besides the
    # inventory the restore plan is chosen from (and at most one refresh round of inventories)
    assert fig["deliver_requests"] <= 3 * NODES, fig
    # one node replaced: new peers only where the view changed (the newcomer, its senders, their
    # senders), no new handshake but the newcomer's
    assert 1 <= fig["replace_nodes_sent_new_peers"] <= 24, fig
    assert fig["replace_all_plans_s"] < 5.0, fig
    assert fig["replace_connections"] <= 4, fig
