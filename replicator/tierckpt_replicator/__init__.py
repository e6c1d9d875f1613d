"""tierckpt node replicator: the per-node daemon that copies ramdisk checkpoints to peer nodes and to
GCS, and stages them back for restore. Depends on ``tierckpt`` only (never on the operator).

Start it with ``tierckpt-replicator`` (``__main__``); ``daemon`` is the composition root.

Layers, top down; a module imports only from layers below its own (``lint-imports`` checks this, see
the "replicator layers" contract in pyproject.toml). ``|`` separates independent siblings (neither
imports the other), ``:`` siblings that may import each other:

1. ``__main__``: flags, logging, the event loop.
2. ``daemon``: the composition root; builds every part below and runs their lifecycle.
3. ``probes``: ``/healthz``, ``/readyz`` and ``/metrics`` on a port, thread and event loop of their own.
4. ``app`` : ``api`` : ``controls``: the FastAPI control API (routes from ``tierckpt.protocol.api``;
   ``api.guard``: header/body deadlines and connection limits) and what each call does on this node
   (``NodeControls``, the ``Controls`` the routes are given).
5. ``orbax``: Orbax mode: stock Orbax's ramdisk protocol (``jax-init-info.txt``, ``replicator.yaml``,
   restore markers, error files), its committed steps adopted as primaries and handed back for restore.
6. ``restore``: stage a job's ranks from the best source: the ramdisk, a peer (through the replication
   worker), or the bucket (through ``backup.jobs.BackupPort``).
7. ``replication`` | ``backup``: tier 2 (peer replicas: loop, worker process, data plane) and tier 3
   (GCS backups). Neither knows the other; the daemon tells backup about commits replication saw.
8. ``watch`` | ``access`` | ``identity`` | ``quota``: inotify wake-ups for new commits (other nodes'
   control APIs are reached through ``tierckpt.protocol.client``); who may do what here (the peer
   certificate's identity against the job's members); this node's certificate (obtained from the
   operator, renewed, always this node's own); each job's quota (the most bytes a step may declare to
   be sent, received or uploaded).
9. ``assignments`` | ``inventory`` | ``policies`` | ``orbax_state`` | ``metrics`` | ``settings`` |
   ``connlimits``: peers.json, what this node holds, policy.json, Orbax-mode jobs' session and run,
   Prometheus metrics, the daemon's options, and open connections bounded per source (the data port
   and the HTTP servers).
10. ``stepio``: job trees on the ramdisk, confined (``tierckpt.protocol.safefs.Beneath``: no symlink a
   pod plants is followed), and steps in them (staging, committing, finding). It stands on
   ``tierckpt.protocol``/``tierckpt.planning`` only.

The replicator's own state (peers.json, policy.json, restore.json) lives in
``<ramdisk>/.tierckpt/jobs/<job>/`` (``tierckpt.protocol.format.state_dir``), and its TLS key and
certificate in ``<ramdisk>/.tierckpt/identity/`` (``--identity-dir``), never in the job directory a
pod can write; everything it reads from a job directory is treated as untrusted input.
"""

from tierckpt.protocol import __version__

__all__ = ["__version__"]
