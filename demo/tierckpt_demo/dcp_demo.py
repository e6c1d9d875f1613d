"""``tierckpt demo --dcp``: the demo's timeline with an FSDP2 model checkpointed through PyTorch DCP.

The same cluster, operator stand-in and failures as the native demo (``tierckpt_demo.run``), with several
training processes per node (``tierckpt_demo.dcp_training``: FSDP2 over gloo, ``dcp.async_save`` through
``RamdiskWriter``, ``agreed_step`` + ``dcp.load`` through ``RamdiskReader``), and one more failure:

* ``shrink``: a node is lost and not replaced; the job resumes on the others with fewer ranks, and DCP
  reshards the checkpoint. The chunks the lost node's ranks wrote are fetched from the peers holding
  their replicas (the nodes' replicators serve the ranks' fetch requests), not from the bucket.

Besides step, tier, state and loss, every recovery checks where the bytes came from:

* ``fetch``: with the same sharding no rank reads another node's data (each node holds the metadata
  and its copy of every replicated item);
* ``bucket``: nothing of any rank's step is read from the bucket, except when a whole peer group was
  lost (after ``shrink``, what a node lacks for the reshard comes from its peers).

The state check compares the whole unsharded state (every rank hashes the same), so it holds across
world sizes; after a reshard the replayed losses are compared within a relative 1e-5 (the same
computation, summed in another order).
"""

from __future__ import annotations

from tierckpt.protocol.text import rank_ranges
from tierckpt_demo import scenarios as sc
from tierckpt_demo.report import Check, RankResult
from tierckpt_demo.run import Demo

__all__ = ["RESHARD_LOSS_TOLERANCE", "DcpDemo", "dcp_checks"]

RESHARD_LOSS_TOLERANCE = 1e-5


def dcp_checks(scenario: str, ranks: list[RankResult], bucket_reads: int) -> list[Check]:
    """Where a DCP recovery's bytes came from (pure; see the module doc)."""
    fetched = sorted({f for r in ranks for f in r.fetched})
    checks = []
    if scenario != "shrink":
        checks.append(
            Check(
                "fetch",
                not fetched,
                "no rank read another node's data (each node holds its ranks' metadata and copies)"
                if not fetched
                else f"ranks {fetched} were fetched from other nodes for a load with the same sharding",
            )
        )
    want_bucket = scenario == "gcs"
    ok = (bucket_reads > 0) == want_bucket
    detail = (
        f"{bucket_reads} object(s) of ranks' steps read from the bucket"
        if bucket_reads
        else "nothing read from the bucket"
    )
    if scenario == "shrink" and fetched:
        moved = sum(r.fetched_bytes for r in ranks) / (1 << 20)
        waited = max(r.fetch_s for r in ranks)
        detail += (
            f" (the reshard fetched the steps of ranks {rank_ranges(fetched)} from peers: "
            f"{moved:.1f} MiB, {waited:.2f} s)"
        )
    checks.append(Check("bucket", ok, detail))
    return checks


class DcpDemo(Demo):
    """The demo with DCP checkpoints of an FSDP2 model (see the module doc)."""

    trainer_module = "tierckpt_demo.dcp_training"
    checkpointing = "dcp"
    reshards = True

    def _loss_tolerance(self, previous: sc.Segment) -> float:
        return RESHARD_LOSS_TOLERANCE if previous.scenario == "shrink" else 0.0

    def _recovery_checks(self, scenario: str, ranks: list[RankResult], bucket_reads: int) -> list[Check]:
        return dcp_checks(scenario, ranks, bucket_reads)
