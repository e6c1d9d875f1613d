"""Free TCP ports for the rigs: picked below the kernel's ephemeral range, so an outgoing connection
(whose source port comes from that range) cannot take one between the pick and the server's bind."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000


def _candidates() -> range:
    try:
        low = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return range(_LOWEST, max(low, _LOWEST + 1_000))


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now; all are held open until all are chosen."""
    pool = _candidates()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(200 * count):
            if len(ports) == count:
                return ports
            port = random.choice(pool)
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"found only {len(ports)} of {count} free ports on {host} in {pool}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` right now (see ``free_ports``)."""
    return free_ports(1, host)[0]
