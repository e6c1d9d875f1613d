"""tierckpt Kubernetes operator: turns annotated JobSets into checkpoint-aware jobs.

Layers (imports point down):

* ``__main__``, ``leader``: process lifecycle, leader election, probes.
* ``registry``: every kopf handler, thin; ``admission``: the two webhooks' decisions.
* ``reconcile``, ``cleanup``: per-job control loop and purge (I/O through the adapters).
* ``kube`` (Kubernetes API beyond kopf) and ``replicators`` (the replicator API client,
  ``tierckpt.protocol.client``, configured): the only adapters.
* ``cluster``, ``planning``, ``injection``, ``status``, ``jobsets``, ``pods``, ``resources``: pure.

The pure placement algorithms live in ``tierckpt.planning.placement`` (shared with the demo).
"""

__all__: list[str] = []
