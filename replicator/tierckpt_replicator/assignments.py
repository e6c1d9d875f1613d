"""Peer assignments: ``peers.json`` in each job's state directory (``format.state_dir``, which no pod
can reach: a pod-written ``<job>/control/peers.json`` is never read), newest generation wins.

The operator sends them through ``PUT /v1/jobs/{job}/peers``; in local mode a static file
(``--peers-file``) seeds the job it names. A ``PeerNode.endpoint`` is the node's control API
(``http://host:port``, called through ``tierckpt.protocol.client``, which uses only
``scheme://host:port``); its streaming data endpoint is the same host at ``port + 1`` unless the
endpoint carries an explicit data port as ``http://host:port/?data=PORT`` (local mode).
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse
from pathlib import Path

from tierckpt.protocol.control import PeerAssignment, PeerNode, read_control, write_control
from tierckpt.protocol.errors import ContractError, FormatError
from tierckpt.protocol.format import state_dir

__all__ = ["AssignmentStore", "data_endpoint", "load_static"]

log = logging.getLogger(__name__)


def _parse(endpoint: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ContractError(f"peer endpoint {endpoint!r} is not http(s)://host:port")
    return parts


def data_endpoint(node: PeerNode) -> tuple[str, int]:
    """``(host, port)`` the node's data endpoint listens on."""
    parts = _parse(node.endpoint)
    assert parts.hostname is not None and parts.port is not None  # checked by _parse
    query = urllib.parse.parse_qs(parts.query)
    return parts.hostname, int(query["data"][0]) if "data" in query else parts.port + 1


def load_static(path: Path) -> PeerAssignment:
    try:
        return PeerAssignment.from_bytes(path.read_bytes())
    except (OSError, FormatError) as exc:
        raise ContractError(f"static peers file {path}: {exc}") from exc


class AssignmentStore:
    """Reads and writes each job's ``peers.json``; ``put`` refuses generations not newer than stored."""

    def __init__(self, root: Path, static: PeerAssignment | None = None) -> None:
        self.root, self.static = root, static
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, PeerAssignment]] = {}

    def get(self, job: str) -> PeerAssignment | None:
        path = state_dir(self.root, job) / PeerAssignment.FILE
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return self._seed(job)
        cached = self._cache.get(job)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            got = read_control(self.root, job, PeerAssignment.FILE, PeerAssignment)
        except FormatError as exc:
            log.error("job %s: unreadable %s: %s", job, path, exc)
            return None
        if not isinstance(got, PeerAssignment):
            return self._seed(job)
        self._cache[job] = (stamp, got)
        return got

    def put(self, assignment: PeerAssignment) -> tuple[bool, PeerAssignment]:
        """Store ``assignment`` if its generation is newer; returns (stored, the assignment in force)."""
        with self._lock:
            current = self.get(assignment.job)
            if current is not None and current.generation >= assignment.generation:
                return False, current
            write_control(self.root, assignment.job, PeerAssignment.FILE, assignment)
            self._cache.pop(assignment.job, None)
            log.info("job %s: peer assignment generation %d stored", assignment.job, assignment.generation)
            return True, assignment

    def forget(self, job: str) -> None:
        self._cache.pop(job, None)

    def _seed(self, job: str) -> PeerAssignment | None:
        if self.static is None or self.static.job != job:
            return None
        with self._lock:
            if not (state_dir(self.root, job) / PeerAssignment.FILE).exists():
                write_control(self.root, job, PeerAssignment.FILE, self.static)
                log.info("job %s: seeded peers.json from the static peers file", job)
        return self.static
