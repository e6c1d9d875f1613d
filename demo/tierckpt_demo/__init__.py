"""Local demos and test rigs: a multi-node cluster on one machine (``cluster``), a GCS emulator
(``fakegcs``), and the ``tierckpt demo`` training scenarios built on them.

Nothing here is imported by the library itself; the replicator is only ever started as a process
through its console script.
"""
