"""The kernel's protocol half: everything the training library, the daemons and the tools agree on.

What lives here, one module per concept:

* ``errors``: the exception hierarchy;
* ``codec``: typed, versioned JSON for every file and wire message (no pickle);
* ``integrity``: crc32c over buffers, memory and files;
* ``format``: the on-ramdisk format (paths, manifest, commit marker) and its small-file I/O;
* ``leases``: readers' claims on committed steps;
* ``contract``: environment, annotations, labels and the CSI volume that connect pods to the system;
* ``control``: the control files and control-API messages (peers, plans, policies, inventories);
* ``orbax``: the ramdisk file protocol of stock Orbax multi-tier checkpointing, and its messages;
* ``api``: the control API's endpoints, and ``client``: the one client of it;
* ``tokens``: the bearer token read from a mounted file;
* ``bucket_layout``: every object key of a GCS backup;
* ``options``: how the daemons read their settings (flags, then environment, then defaults).

Rules, enforced by import-linter: nothing here imports torch or any other part of ``tierckpt``, so the
daemons (replicator, operator, CSI plugin) depend on this package and ``tierckpt.planning`` only.
"""

__version__ = "0.1.0"
"""The software version of every tierckpt program (reported by the replicator, the CSI plugin, the CLI)."""

__all__ = ["__version__"]
