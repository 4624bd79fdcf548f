"""A TCP port for a server that this process, or one it starts, opens shortly afterwards."""

from __future__ import annotations

import random
import socket

_LOWEST = 10000


def _ephemeral_low() -> int:
    """The bottom of the kernel's ephemeral port range (``bind(0)`` and outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface, as TCPStore and HTTP servers bind
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port that is free now, chosen below the ephemeral range: a port from ``bind(0)`` can be
    handed out again to any ``bind(0)`` or connection of the gloo groups and stores that start
    before the server opens it, which then fails with EADDRINUSE."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low > _LOWEST else 0):
        port = rng.randrange(_LOWEST, low)
        if _bindable(port):
            return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
