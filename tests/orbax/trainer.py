"""A training process that checkpoints with stock Orbax multi-tier checkpointing, as MaxText does.

Run as a script, one per node (``python trainer.py --dir <the pod's ramdisk directory> ...``): it calls
``initialize_multi_tier_checkpointing`` (which reads ``jax-init-info.txt``, starts ``jax.distributed``,
writes ``replicator.yaml`` and waits for the replicator's ``*.restore`` marker), builds a
``ReplicatorCheckpointManager`` on a mesh of ``--slices`` data-parallel copies, restores the newest step
if the replicator handed one over (checking every byte of this process's shards), saves ``--save`` steps
and writes what it saw as JSON to ``--out``. Nothing in Orbax is changed; what the harness must supply
on a CPU box (a cluster environment for the process count, absl flags marked parsed, an absolute
directory) is set up here and by the caller's environment (``SLURM_*``).

The state of step ``s`` is a pure function of ``s`` (``expected``), so any process can check any step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def expected(step: int, rows: int) -> dict[str, Any]:
    """The global arrays of step ``step`` (``rows`` rows, split over a slice's processes)."""
    import numpy as np

    base = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
    return {
        "w": base * np.float32(step + 1) + np.float32(0.25),
        "b": (np.arange(rows, dtype=np.int32) * 7 + step).astype(np.int32),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="the local checkpoint directory (absolute)")
    parser.add_argument("--slices", type=int, default=1)
    parser.add_argument("--run-name", default="orbaxjob")
    parser.add_argument("--save", default="", help="comma-separated steps to save after init")
    parser.add_argument("--backup-interval-steps", type=int, default=0)
    parser.add_argument("--backup-interval-minutes", type=int, default=0)
    parser.add_argument("--init-timeout", type=int, default=120)
    parser.add_argument("--out", required=True, help="where to write what this process saw (JSON)")
    args = parser.parse_args(argv)

    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Orbax reads absl flags during restore; a script under absl.app has them

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
        replicator_checkpoint_manager,
    )

    started = time.monotonic()
    interval: dict[str, int] = (
        {"backup_interval_steps": args.backup_interval_steps}
        if args.backup_interval_steps
        else {"backup_interval_minutes": args.backup_interval_minutes or 30}
    )
    initialization.initialize_multi_tier_checkpointing(
        args.dir,
        num_slices=args.slices,
        run_name=args.run_name,
        jax_initialization_timeout_seconds=args.init_timeout,
        jax_shutdown_timeout_seconds=60,
        **interval,
    )
    init_seconds = time.monotonic() - started
    n = jax.process_count()
    per_slice = n // args.slices
    rows = per_slice * 4
    mesh = Mesh(np.array(jax.devices()).reshape(args.slices, per_slice), ("slice", "shard"))
    sharding = NamedSharding(mesh, PartitionSpec("shard"))  # the slices hold identical copies

    def arrays(step: int) -> dict[str, Any]:
        full = expected(step, rows)
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in full.items()
        }

    manager = replicator_checkpoint_manager.ReplicatorCheckpointManager(
        args.dir,
        replicator_checkpoint_manager.ReplicatorCheckpointManagerOptions(save_interval_steps=1),
        global_mesh=mesh,
    )
    seen: dict[str, Any] = {
        "process_index": jax.process_index(),
        "process_count": n,
        "init_seconds": round(init_seconds, 3),
        "latest": manager.latest_step(),
        "restored": None,
        "bit_exact": None,
    }
    latest = seen["latest"]
    if latest is not None:
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in expected(latest, rows).items()
        }
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        got = manager.restore(
            latest,
            args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)),
        )["state"]
        want = expected(latest, rows)
        exact = True
        for key, array in got.items():
            for shard in array.addressable_shards:
                mine = np.asarray(shard.data)
                exact &= mine.dtype == want[key].dtype and mine.tobytes() == want[key][shard.index].tobytes()
        seen["restored"], seen["bit_exact"] = latest, bool(exact)
    for step in [int(s) for s in args.save.split(",") if s]:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(arrays(step))))
        manager.wait_until_finished()
    manager.close()
    seen["seconds"] = round(time.monotonic() - started, 3)
    with open(args.out, "w") as f:
        json.dump(seen, f)
    jax.distributed.shutdown()  # a barrier: no process leaves while another still needs the coordinator
    return 0


if __name__ == "__main__":
    sys.exit(main())
