"""PyTorch Distributed Checkpoint (DCP) on the tierckpt ramdisk.

``RamdiskWriter`` and ``RamdiskReader`` are DCP storage plugins: ``dcp.save``, ``dcp.async_save`` and
``dcp.load`` write and read the same on-ramdisk format as ``Checkpointer`` (one committed step
directory per rank, ``manifest_kind="dcp"``), so the replicator replicates and backs up DCP checkpoints
like native ones, and FSDP2/DTensor state dicts reshard on load under another world size::

    import torch.distributed.checkpoint as dcp
    from tierckpt.dcp import RamdiskReader, RamdiskWriter

    dcp.save(state_dict, checkpoint_id=step, storage_writer=RamdiskWriter())
    dcp.load(state_dict, checkpoint_id=step, storage_reader=RamdiskReader())

Without a ``checkpoint_id``, the ranks agree on the newest step every node holds whole and undamaged,
falling back together past a damaged one (``tierckpt.dcp.choice``). With sharded state on several nodes,
every rank asks ``agreed_step()`` which step to load (the same answer everywhere)::

    step = agreed_step()
    if step is not None:
        dcp.load(state_dict, checkpoint_id=step, storage_reader=RamdiskReader())

``full_state_dict(root, job, step)`` reads a whole checkpoint, unsharded, into one process. See docs/dcp.md.
"""

from tierckpt.dcp.agree import agreed_step
from tierckpt.dcp.export import full_state_dict
from tierckpt.dcp.reader import RamdiskReader, dcp_steps
from tierckpt.dcp.writer import RamdiskWriter

__all__ = ["RamdiskReader", "RamdiskWriter", "agreed_step", "dcp_steps", "full_state_dict"]
