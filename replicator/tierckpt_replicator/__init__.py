"""tierckpt node replicator: the per-node daemon that copies ramdisk checkpoints to peer nodes and to
GCS, and stages them back for restore. Depends on ``tierckpt`` only (never on the operator).

Start it with ``tierckpt-replicator`` (``__main__``); ``daemon`` is the composition root.
"""

from tierckpt.protocol import __version__

__all__ = ["__version__"]
