"""The node ramdisk as a CSI driver (``ramdisk.tierckpt.io``): a Python CSI node plugin over gRPC.

kubelet asks it, through a unix socket registered by node-driver-registrar, to publish an inline
ephemeral volume into each opted-in training pod. It bind-mounts that pod's job directory of the node
ramdisk (one tmpfs on a host path, mounted once, surviving restarts of the pods and of the driver) at
the pod's target path, after checking that the job belongs to the pod's namespace and that the job's
reservation fits the ramdisk and node memory (RESOURCE_EXHAUSTED otherwise).

Modules: ``ramdisk`` (mount or adopt the tmpfs), ``requests`` (request validation), ``admission`` (pure
capacity rules), ``volumes`` (published-volume records), ``plugin`` (the operations), ``service`` (the
gRPC services), ``server`` (socket, health and metrics), ``cli`` (``tierckpt-csi``).
"""

__all__: list[str] = []
