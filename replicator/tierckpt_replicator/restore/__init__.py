"""Restore: gather inventories and choose the step (``gather``), stage this node's ranks (``stage``),
and report progress to the client (``progress``)."""
