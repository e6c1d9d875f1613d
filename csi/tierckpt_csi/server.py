"""Run the node plugin: the gRPC server on kubelet's unix socket, plus /healthz, /readyz and /metrics.

``serve()`` blocks until SIGTERM/SIGINT and stops gracefully. It never unmounts the ramdisk: the tmpfs
and every bind mount into running pods stay in the host's mount namespace, so a driver restart or
upgrade loses nothing. ``PluginServer`` is the same server as an object, for tests and embedding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierckpt_csi._proto import csi_pb2, csi_pb2_grpc
from tierckpt_csi.plugin import NodePlugin
from tierckpt_csi.service import IdentityService, Metrics, NodeService

__all__ = ["HealthServer", "PluginServer", "probe", "socket_path"]

log = logging.getLogger(__name__)


def socket_path(endpoint: str) -> Path:
    """``unix:///csi/csi.sock`` (or a bare path) -> ``/csi/csi.sock``."""
    path = endpoint.removeprefix("unix://")
    if not path.startswith("/"):
        raise ValueError(f"CSI endpoint {endpoint!r} must be unix:///absolute/path")
    return Path(path)


def probe(endpoint: str, timeout: float = 3.0) -> bool:
    """Call Identity.Probe on ``endpoint``; True if the plugin answers ready."""
    with grpc.insecure_channel(f"unix://{socket_path(endpoint)}") as channel:
        stub = csi_pb2_grpc.IdentityStub(channel)
        try:
            return stub.Probe(csi_pb2.ProbeRequest(), timeout=timeout).ready.value
        except grpc.RpcError as exc:
            log.warning("probe of %s failed: %s", endpoint, exc.details() if hasattr(exc, "details") else exc)
            return False


class PluginServer:
    """The gRPC server of one plugin on one unix socket."""

    def __init__(self, plugin: NodePlugin, endpoint: str, *, workers: int = 8) -> None:
        self.plugin = plugin
        self.endpoint = endpoint
        self.socket = socket_path(endpoint)
        self.metrics = Metrics(plugin)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="csi"))
        csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(plugin, self.metrics), self._server)
        csi_pb2_grpc.add_NodeServicer_to_server(NodeService(plugin, self.metrics), self._server)

    def start(self) -> None:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # left over from a previous run of the driver
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()
        os.chmod(self.socket, 0o600)
        log.info("CSI node plugin listening on %s", self.endpoint)

    def stop(self, grace: float = 5.0) -> None:
        self._server.stop(grace).wait()
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()


class HealthServer:
    """``/healthz`` (Probe over the real socket), ``/readyz`` and ``/metrics`` on a TCP address."""

    def __init__(self, address: str, *, check: Callable[[], bool], metrics: Metrics | None) -> None:
        host, _, port = address.rpartition(":")
        handler = _handler(check, metrics)
        self._httpd = ThreadingHTTPServer((host or "0.0.0.0", int(port)), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="csi-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler(check: Callable[[], bool], metrics: Metrics | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path in ("/healthz", "/readyz"):
                ok = check()
                self._send(200 if ok else 503, b"ok\n" if ok else b"not ready\n", "text/plain")
            elif self.path == "/metrics" and metrics is not None:
                self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            log.debug("health: " + fmt, *args)

    return Handler


def wait_for_signal() -> None:
    """Block the main thread until SIGTERM or SIGINT."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: done.set())
    done.wait()
