"""Which node a training process runs on, as every process of that node sees it.

The ranks of one node share its ramdisk, so a DCP save keeps the global metadata and the replicated items
once per node (``tierckpt.dcp.copies``), and a load reads them from its own node. The identity is
``$TIERCKPT_NODE_NAME`` when the operator injects it; otherwise the kernel's boot id (one per machine)
and the device of the ramdisk (one per tmpfs), which also tells apart the nodes of a local test rig
that share one kernel. Two nodes never get the same identity; at worst one node gets two, which costs
only an extra copy.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from tierckpt.protocol.contract import Env

__all__ = ["node_identity"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def _machine() -> str:
    try:
        return _BOOT_ID.read_text().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def node_identity(ramdisk_dir: Path) -> str:
    """This process's node: ``name:<node>`` from the environment, else ``dev:<boot id>:<st_dev>`` of
    ``ramdisk_dir``, a directory on the ramdisk that exists (the writer creates its rank directory first)."""
    name = os.environ.get(Env.NODE_NAME, "").strip()
    if name:
        return f"name:{name}"
    return f"dev:{_machine()}:{os.stat(ramdisk_dir).st_dev}"
