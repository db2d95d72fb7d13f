"""Hosts for multi-host tests: each one a network namespace, linked by veth pairs to a bridge.

The bridge lives in a namespace of its own, so nothing of the machine's own
network changes; traffic goes only between those namespaces' addresses. A
host's link can be cut (its bridge port set down) and mended. Processes run
in a host with `ip netns exec`, each in its own process group, and are killed
by group when the block ends; the namespaces (and their veths) are deleted.

Needs root and iproute2; `skip_reason()` says why not, for a test to skip
with.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

# `ip netns` mounts /run/netns on first use; if it was not there before these tests, it goes after them.
_RUN_NETNS = Path("/run/netns")
_MOUNTED_BEFORE = os.path.ismount(_RUN_NETNS)


def skip_reason(prefix: str = "gp") -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{prefix}probe-{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    if not _MOUNTED_BEFORE and os.path.ismount(_RUN_NETNS) and not any(_RUN_NETNS.iterdir()):
        subprocess.run(["umount", str(_RUN_NETNS)], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no route of this machine covers."""
    used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    nets = [ipaddress.ip_network(w, strict=False) for line in used.splitlines()
            for w in line.split()[:1] if "/" in w]
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{random.randrange(100, 250)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(n) for n in nets):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the test hosts")


class Hosts:
    """`n` hosts: host i has address `addr(i)`; `spawn(i, argv, env, log)` runs a process there."""

    def __init__(self, n: int, prefix: str = "gp"):
        """`prefix` (2-4 characters) starts the names of the namespaces and links made."""
        self.n, self.tag = n, prefix + uuid.uuid4().hex[:6]
        self.subnet = _free_subnet()
        self.bridge_ns = f"{self.tag}-br"
        self.ns = [f"{self.tag}-{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.made: list[str] = []

    def addr(self, i: int) -> str:
        return str(self.subnet.network_address + i + 1)

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.bridge_ns)
            self.made.append(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                self.made.append(ns)
                host, port = f"{self.tag}h{i}", f"{self.tag}p{i}"  # <= 15 characters
                _ip("link", "add", host, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", host)
                _ip("-n", ns, "link", "set", host, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cut(self, i: int) -> None:
        """Host i loses its link (as a pulled cable): nothing gets in or out until `mend`."""
        _ip("-n", self.bridge_ns, "link", "set", f"{self.tag}p{i}", "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.bridge_ns, "link", "set", f"{self.tag}p{i}", "up")

    def block(self, i: int, j: int) -> None:
        """Hosts i and j no longer reach each other (a blackhole route each way); both reach the rest."""
        _ip("-n", self.ns[i], "route", "add", "blackhole", f"{self.addr(j)}/32")
        _ip("-n", self.ns[j], "route", "add", "blackhole", f"{self.addr(i)}/32")

    def unblock(self, i: int, j: int) -> None:
        _ip("-n", self.ns[i], "route", "del", "blackhole", f"{self.addr(j)}/32")
        _ip("-n", self.ns[j], "route", "del", "blackhole", f"{self.addr(i)}/32")

    def spawn(self, i: int, argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None
              ) -> subprocess.Popen[bytes]:
        with log.open("ab") as f:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[i], *argv], env=env, stdout=f, stderr=f,
                                 cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        self.procs.clear()
        time.sleep(0.1)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.made.clear()
        if not _MOUNTED_BEFORE and os.path.ismount(_RUN_NETNS) and not any(_RUN_NETNS.iterdir()):
            subprocess.run(["umount", str(_RUN_NETNS)], capture_output=True, check=False)
