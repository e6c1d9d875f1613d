"""The kernel's planning half: pure decisions shared by the client, the daemons and the demo.

* ``placement``: sticky node ranks and peers across failure domains (the operator, the demo);
* ``retention``: which steps of a rank directory may go (the client, the replicator, the CLI);
* ``restore_plan``: which step a whole job restores and from which tier each rank reads it;
* ``common_step``: the newest step every rank holds;
* ``goodput``: the checkpoint and backup intervals and the replication factor that ``tierckpt plan``
  recommends, and the goodput they give.

Pure functions over plain values: no files, sockets, clocks or torch. They import only
``tierckpt.protocol``.
"""
