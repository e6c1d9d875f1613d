"""Peer replication: the streaming data plane (worker process, data endpoint, transfers) and the pure
planning of what to send where and which replicas to keep.

Layers, top down: ``worker`` (process main) > ``server``/``transfer`` (protocol roles) > ``replicas``,
``stream`` (bytes on disk and on the wire; steps are staged and committed by ``tierckpt_replicator.stepio``)
> ``wire``, ``ipc`` (typed messages).
``plan`` and ``retention`` are pure: no file, socket or process access.
"""
