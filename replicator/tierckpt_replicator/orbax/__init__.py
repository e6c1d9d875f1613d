"""Orbax mode: stock Orbax multi-tier checkpointing (``initialize_multi_tier_checkpointing``,
``ReplicatorCheckpointManager``, as MaxText uses them) on tierckpt's replicator, through the ramdisk
file protocol of GKE's replicator (``tierckpt.protocol.orbax``; docs/orbax.md).

* ``jobs``: ``OrbaxJobs``, every Orbax-mode job of the node: the operator's session, the handshake
  (``jax-init-info.txt``, ``replicator.yaml``, the error files), Orbax's steps adopted, the restore
  hand-over (``*.restore``, ``replicator.prerestore``);
* ``steps``: an Orbax step directory to a committed tierckpt step and back (hard links, crc32c, a
  manifest of kind ``orbax``), and retention of the adopted steps;
* ``files``: the protocol's files in a job directory, read and written confined.

It sits above ``restore`` (the hand-over follows restore staging) and below the control API. The data
path, the bucket layout and the security model are tierckpt's: an adopted step is an ordinary step.
"""

from tierckpt_replicator.orbax.jobs import OrbaxJobs

__all__ = ["OrbaxJobs"]
