"""The chaos harness: real training on the local cluster while a seeded scheduler injects random,
overlapping faults, with every invariant checked after every fault and at every restore.

``schedule`` draws the faults from a seed (pure), ``rig`` holds the machines (``LocalCluster``, launchers,
network effects), ``jobs`` the training jobs and their launches, ``operator`` does the operator's part
through the control API, ``inject`` does each fault, ``tiers`` looks at what the ramdisks and the bucket
hold, ``oracle`` and ``reference`` are the invariants (pure), ``runner`` runs the rounds and ``shrink``
cuts a failing schedule down. ``tierckpt-chaos`` (``__main__``) is the command; docs/reliability.md
describes the invariants and the soak.
"""
