"""The CSI Identity and Node gRPC services (csi.v1), over ``NodePlugin``.

Implemented: GetPluginInfo, GetPluginCapabilities, Probe; NodeGetCapabilities, NodeGetInfo,
NodePublishVolume, NodeUnpublishVolume, NodeGetVolumeStats. Everything else answers UNIMPLEMENTED (the
generated base classes do that). ``CsiError`` becomes the RPC's status; any other exception becomes
INTERNAL with its text, and is logged with its traceback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc
from google.protobuf import wrappers_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import tierckpt.protocol
from tierckpt.protocol.contract import Csi
from tierckpt_csi._proto import csi_pb2, csi_pb2_grpc
from tierckpt_csi.errors import CsiError, invalid
from tierckpt_csi.plugin import NodePlugin
from tierckpt_csi.requests import parse_publish

__all__ = ["IdentityService", "Metrics", "NodeService"]

log = logging.getLogger(__name__)

_NodeRPC = csi_pb2.NodeServiceCapability.RPC


class _Service(Protocol):
    metrics: Metrics


S = TypeVar("S", bound=_Service)
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Metrics:
    """Prometheus metrics of one plugin instance (its own registry, so tests can run several)."""

    def __init__(self, plugin: NodePlugin) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "tierckpt_csi_calls",
            "CSI calls by method and gRPC status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "tierckpt_csi_call_seconds", "CSI call latency by method", ["method"], registry=self.registry
        )
        size = Gauge("tierckpt_ramdisk_size_bytes", "Size of the node ramdisk", registry=self.registry)
        used = Gauge("tierckpt_ramdisk_used_bytes", "Bytes used on the node ramdisk", registry=self.registry)
        size.set_function(lambda: plugin.usage().size)
        used.set_function(lambda: plugin.usage().used)
        self.refused = Counter(
            "tierckpt_csi_refused_publishes",
            "Publishes refused for lack of ramdisk or memory",
            registry=self.registry,
        )


def _rpc(
    method: Callable[[S, Req, grpc.ServicerContext], Resp],
) -> Callable[[S, Req, grpc.ServicerContext], Resp]:
    """Run an RPC body, turning ``CsiError`` into its status and counting the outcome."""

    @functools.wraps(method)
    def wrapper(self: S, request: Req, context: grpc.ServicerContext) -> Resp:
        name = method.__name__
        code = grpc.StatusCode.OK
        try:
            with self.metrics.seconds.labels(name).time():
                return method(self, request, context)
        except CsiError as exc:
            code = exc.code
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.metrics.refused.inc()
            log.info("%s -> %s: %s", name, code.name, exc.message)
            context.abort(code, exc.message)
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", name)
            context.abort(code, f"{name} failed: {exc}")
        finally:
            self.metrics.calls.labels(name, code.name).inc()

    return wrapper


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, plugin: NodePlugin, metrics: Metrics) -> None:
        self.plugin = plugin
        self.metrics = metrics

    @_rpc
    def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=Csi.DRIVER, vendor_version=tierckpt.protocol.__version__)

    @_rpc
    def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # A node-only plugin: no CONTROLLER_SERVICE, and volumes are reachable from this node only.
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    @_rpc
    def Probe(self, request: csi_pb2.ProbeRequest, context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=self.plugin.ramdisk.is_mounted()))


def _node_capability(kind: _NodeRPC.Type) -> csi_pb2.NodeServiceCapability:
    return csi_pb2.NodeServiceCapability(rpc=_NodeRPC(type=kind))


class NodeService(csi_pb2_grpc.NodeServicer):
    CAPABILITIES = (_NodeRPC.GET_VOLUME_STATS, _NodeRPC.VOLUME_MOUNT_GROUP)

    def __init__(self, plugin: NodePlugin, metrics: Metrics) -> None:
        self.plugin = plugin
        self.metrics = metrics

    @_rpc
    def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        caps = [_node_capability(c) for c in self.CAPABILITIES]
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=caps)

    @_rpc
    def NodeGetInfo(
        self, request: csi_pb2.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.plugin.settings.node_id)

    @_rpc
    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        settings = self.plugin.settings
        req = parse_publish(
            request, pods_dir=settings.pods_dir, require_namespace=settings.require_namespace_match
        )
        self.plugin.publish(req)
        return csi_pb2.NodePublishVolumeResponse()

    @_rpc
    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        if not request.volume_id:
            raise invalid("volume_id is required")
        self.plugin.unpublish(request.volume_id, request.target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @_rpc
    def NodeGetVolumeStats(
        self, request: csi_pb2.NodeGetVolumeStatsRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeGetVolumeStatsResponse:
        if not request.volume_id or not request.volume_path:
            raise invalid("volume_id and volume_path are required")
        stats = self.plugin.volume_stats(request.volume_path)
        usage = csi_pb2.VolumeUsage
        return csi_pb2.NodeGetVolumeStatsResponse(
            usage=[
                usage(unit=usage.BYTES, used=stats.used, available=stats.available, total=stats.total),
                usage(
                    unit=usage.INODES,
                    used=stats.inodes_used,
                    available=stats.inodes_free,
                    total=stats.inodes_used + stats.inodes_free,
                ),
            ]
        )
