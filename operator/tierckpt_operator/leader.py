"""Leader election through a ``coordination.k8s.io`` Lease (one active replica reconciles).

Every replica serves the admission webhook; only the Lease holder runs the control loops. The holder
renews every third of the Lease duration; a replica that cannot renew within the duration gives up
leadership (and the process exits, to come back as a standby), so two leaders never overlap for
longer than one Lease duration. The Lease calls themselves (read, create, patch with the
``resourceVersion`` read, release) are ``Kube.try_lease`` and ``Kube.release_lease``.

Why not ``kubernetes.leaderelection`` (client 37), which ships a ``LeaseLock``:

* ``LeaseLock`` builds its ``CoordinationV1Api()`` on the process-wide default configuration; it takes
  no ``ApiClient``. The operator's client comes from ``settings.server`` or the kubeconfig
  (``kube.api_client``), and the emulator-based tests run several operators with their own settings in
  one process (``tests/operator/test_operator_leader.py``).
* ``LeaderElection.run`` blocks: it sleeps in ``time.sleep`` loops and runs the leader's callback in a
  thread. The operator is one asyncio loop (kopf's); it would need a thread per elector and a bridge
  back into the loop for "became leader" and "lost the lease".
* It cannot give the Lease up: a clean stop leaves it held until it expires (client-go's
  ``ReleaseOnCancel`` has no counterpart), so every rolling update would leave the job controllers
  without a leader for a whole Lease duration. ``release`` here hands over at once (the leader test
  checks the standby takes over after a clean stop).

Why not kopf's peering: it is not mutual exclusion. Operators of the same priority both keep running
(kopf logs "possibly conflicting operators" and goes on); only a higher priority pauses a lower one.
It also needs kopf's own ``KopfPeering`` resources, which the chart would have to install.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tierckpt_operator.kube import Kube

__all__ = ["LeaseElector"]

log = logging.getLogger(__name__)


class LeaseElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, duration: float = 15.0) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.identity, self.duration = identity, duration

    async def _try(self) -> bool:
        try:
            return await self.kube.try_lease(self.namespace, self.name, self.identity, self.duration)
        except Exception as exc:  # API unreachable: not leader this round
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    async def acquire(self) -> None:
        """Return once this replica holds the Lease."""
        while not await self._try():
            await asyncio.sleep(self.duration / 3)
        log.info("became leader (lease %s/%s as %s)", self.namespace, self.name, self.identity)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew until a renewal has not succeeded for a whole Lease duration, then set ``lost``."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.duration / 3)
            if await self._try():
                last = time.monotonic()
            elif time.monotonic() - last > self.duration * 2 / 3:
                log.error("lost the lease %s/%s", self.namespace, self.name)
                lost.set()
                return

    async def run(self, acquired: asyncio.Event, lost: asyncio.Event) -> None:
        """Acquire, set ``acquired``, renew from then on without a gap; set ``lost`` if renewal fails."""
        await self.acquire()
        acquired.set()
        await self.hold(lost)

    async def release(self) -> None:
        await self.kube.release_lease(self.namespace, self.name, self.identity)
