"""tierckpt Kubernetes operator: turns annotated JobSets into checkpoint-aware jobs.

Layers (imports point down; enforced by the import-linter contracts in ``pyproject.toml``):

* ``__main__``: the composition root: settings, adapters, runtime, leader election, kopf, probes.
* ``registry``: every kopf handler, thin; ``leader``: the leader Lease.
* ``runtime``: settings, adapters, metrics and the per-job controllers, shared by the handlers;
  ``webhooks``: the two admission webhooks' decisions; ``issuer``: the node certificate signing
  endpoint.
* ``reconcile`` (per-job control loop, given a ``JobContext``), ``config_reporter`` (configuration
  status), ``cleanup`` (purge): I/O only through the adapters they are handed.
* ``kube`` (Kubernetes API beyond kopf), ``replicators`` (the replicator API's one
  client, ``tierckpt.protocol.client``, configured), ``events`` (Events
  through kopf): the only adapters; ``metrics``.
* Pure, no I/O: ``clusterview`` (the kopf indices, read-only), ``decisions`` (rank assignment and peer
  plan), ``injection``, ``status_fields``, ``jobsets``, ``pods``, ``resources``, ``issuer_limits``
  (what the signing endpoint may cost: rates, a review cache, slots); and ``settings``;
  under them ``kube_rules`` (what Kubernetes accepts in tolerations, node selectors, quantities).

The pure placement algorithms live in ``tierckpt.planning.placement`` (shared with the demo).
"""

__all__: list[str] = []
