"""A free TCP port on loopback for a server that a moment later binds it.

The port comes from below the kernel's ephemeral range: a port the kernel hands out for outgoing
connections can be taken by any process's connection (or by the client's own retries, as a TCP
self-connect) between the probe and the server's bind. Below that range only an explicit bind
takes it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # above the well-known and most registered service ports


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing on ``host`` holds now, outside the ephemeral range where there is room."""
    start = ephemeral_start()
    candidates = random.sample(range(LOWEST, start), min(64, start - LOWEST)) if start > LOWEST else []
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # no room below the range: let the kernel choose
        probe.bind((host, 0))
        return probe.getsockname()[1]
