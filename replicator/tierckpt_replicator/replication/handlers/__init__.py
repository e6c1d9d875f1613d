"""The data endpoint's operations, one module each, over one receive envelope (``envelope``).

``HANDLERS``: the request's ``op`` -> its handler, ``handle(transfers, conn, req)``, which the data
server (``replication.data_server``) calls once the request is authorized and holds a transfer slot.
``put`` (a replica in), ``get`` (a step out), ``fragment`` (an erasure-coded fragment in), ``getfrag``
(a fragment out), ``corrupt`` (a peer's report of a bad replica here), ``retire`` (surplus replicas).
"""

from __future__ import annotations

from collections.abc import Callable

from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.handlers import corrupt, fragment, get, getfrag, put, retire
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.wire import DataRequest

__all__ = ["HANDLERS", "Handler", "Reject", "Transfers"]

Handler = Callable[[Transfers, DataConnection, DataRequest], None]

HANDLERS: dict[str, Handler] = {
    "put": put.handle,
    "get": get.handle,
    "fragment": fragment.handle,
    "getfrag": getfrag.handle,
    "corrupt": corrupt.handle,
    "retire": retire.handle,
}
