"""The shared bearer token: read from a file (a mounted Secret), re-read when it changes, compared in
constant time. Used by the control API and the data endpoint alike."""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

__all__ = ["TokenFile"]

log = logging.getLogger(__name__)


class TokenFile:
    """``check(presented)`` is True only for the file's current token. Rotation needs no restart."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._token = b""
        self.current()  # fail fast on a missing or empty file

    def current(self) -> bytes:
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_ino)
        with self._lock:
            if stamp != self._stamp:
                token = self.path.read_bytes().strip()
                if not token:
                    raise ValueError(f"token file {self.path} is empty")
                if self._stamp is not None:
                    log.info("token file %s changed; using the new token", self.path)
                self._token, self._stamp = token, stamp
            return self._token

    def check(self, presented: str | bytes) -> bool:
        if isinstance(presented, str):
            presented = presented.encode()
        try:
            expected = self.current()
        except (OSError, ValueError) as exc:
            log.error("cannot read token file %s: %s; refusing every request", self.path, exc)
            return False
        return hmac.compare_digest(presented, expected)

    def text(self) -> str:
        return self.current().decode()
