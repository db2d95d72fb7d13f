"""Ports for the services a test starts."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

_PICK = random.SystemRandom()  # not the `random` that the test runner seeds alike in every worker


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port nothing is bound to, for a process to listen on. Taken from below the kernel's ephemeral range
    where there is room: a port from that range may, between this check and the child's bind, become the local
    end of any connection on the machine (the suite makes thousands), and the child's bind then fails."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PICK.randrange(max(1024, low - 10000), low) if low >= 4096 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")


def free_port_in(ports: range, taken: Collection[int] = ()) -> int:
    """A free port of `ports`, none of `taken` (handed out already, not bound yet): for a test whose servers
    must listen in a range of its own (a NetworkPolicy's, a firewall's)."""
    left = [p for p in ports if p not in taken]
    for port in _PICK.sample(left, min(len(left), 200)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1}")
