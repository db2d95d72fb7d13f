"""Networking for the RPC and c10d ports: bind them to one interface only, keys under the attempt's secret.

torch's RPC agent and its TCPStore execute or trust what they receive, so they
must listen on the cluster network alone. TensorPipe and gloo pick their
interface from TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME; a TCPStore master
binds to every interface unless it is handed a listening socket, which is what
`bound_store` does. The `gpipe://` rendezvous lets `rpc.init_rpc` use that
store instead of opening its own.

A TCPStore has no authentication, and any client may list its keys. Each
attempt has a random secret (`new_secret`, handed to its members over the
authenticated gRPC channel, never on a command line), and every store of an
attempt process is a PrefixStore under it (`use_secret`): our keys cannot be
guessed, and a stranger's keys are never read as ours. What keeps strangers
out is the network: these ports listen on the cluster address only, live
only for their attempt, and the deployment's NetworkPolicy fences them.

The address helpers need no torch: serve and the worker daemon use them and
never import torch themselves (it costs about a second of CPU at start);
torch.distributed is imported by the first store or RPC call.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import struct
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

_SIOCGIFADDR = 0x8915
_SECRET_RE = re.compile(r"[0-9a-f]{32,128}")
_master_stores: dict[int, dist.Store] = {}
_sockets: dict[int, socket.socket] = {}
_secret: str | None = None  # the attempt's; one attempt per process


def resolve_ip(host: str) -> str:
    """The IPv4 address of `host`."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve host {host!r}: {e}") from None


def interfaces() -> dict[str, str]:
    """This machine's network interfaces that have an IPv4 address: name -> address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                found[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue
    return found


def route_source(peer: str) -> str:
    """This machine's address on the route to `peer` (HOST or HOST:PORT): what the kernel picks for a UDP
    connect to it. No packet is sent."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") == 1 else peer
    ip = resolve_ip(host.strip("[]"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as e:
            raise ValueError(f"no route to {host} ({ip}): {e.strerror}") from None
        return str(s.getsockname()[0])


def is_loopback(host: str) -> bool:
    try:
        return resolve_ip(host).startswith("127.")
    except ValueError:
        return False


def iface_for(host: str) -> str:
    """The name of the network interface that owns `host`'s address."""
    ip = resolve_ip(host)
    if ip.startswith("127."):
        return "lo"
    for name, addr in interfaces().items():
        if addr == ip:
            return name
    raise ValueError(f"no network interface on this machine has address {ip} ({host})")


def bind_to(host: str) -> None:
    """Make this process's TensorPipe and gloo listen on `host`'s interface only."""
    ifname = iface_for(host)
    os.environ["TP_SOCKET_IFNAME"] = ifname
    os.environ["GLOO_SOCKET_IFNAME"] = ifname


def listen(host: str) -> socket.socket:
    """A TCP socket listening on `host` only, on a free port (for bound_store)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((resolve_ip(host), 0))
    sock.listen(512)
    return sock


def new_secret() -> str:
    """A fresh attempt secret: 128 random bits in hex."""
    return secrets.token_hex(16)


def use_secret(secret: str) -> None:
    """Put every store this process opens from now on under `secret` (its attempt's)."""
    global _secret
    if not _SECRET_RE.fullmatch(secret):
        raise ValueError("the attempt secret must be 32 to 128 lowercase hex digits")
    _secret = secret


def _attempt_secret() -> str:
    if _secret is None:
        raise RuntimeError("no attempt secret: call net.use_secret before opening a store")
    return _secret


def _register() -> None:
    """Register the gpipe:// rendezvous with torch.distributed (once)."""
    import torch.distributed as dist

    if not _registered:
        dist.register_rendezvous_handler("gpipe", _rendezvous)  # type: ignore[no-untyped-call]  # unannotated in torch
        _registered.append(True)


_registered: list[bool] = []


def bound_store(host: str, timeout: float, sock: socket.socket | None = None) -> tuple[dist.Store, int]:
    """A TCPStore master listening on `host` only (on `sock`, if given), under the secret; returns it and its port."""
    import torch.distributed as dist

    secret = _attempt_secret()
    sock = sock or listen(host)
    port = sock.getsockname()[1]
    store = dist.PrefixStore(secret, dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno(),
        use_libuv=True, timeout=timedelta(seconds=timeout),
    ))
    _master_stores[port] = store
    _sockets[port] = sock  # the store serves on this fd: keep it open
    return store, port


def master_store(port: int) -> dist.Store | None:
    """The store `bound_store` opened on `port` in this process, if any."""
    return _master_stores.get(port)


REACHED_KEY = "reached/"  # + stage: its worker reached the rendezvous, from this address


def client_store(host: str, port: int, timeout: float) -> dist.Store:
    """A client of the store at host:port, under the secret."""
    import torch.distributed as dist

    secret = _attempt_secret()
    return dist.PrefixStore(secret, dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout)))


def _rendezvous(
    url: str, timeout: timedelta = timedelta(seconds=300), **kwargs: Any
) -> Iterator[tuple[dist.Store, int, int]]:
    """`gpipe://host:port`: rank 0 uses the store `bound_store` made; others connect to it."""
    u = urlparse(url)
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    rank, world_size = int(q["rank"]), int(q["world_size"])
    store: dist.Store | None = _master_stores.get(u.port) if rank == 0 and u.port else None
    if store is None:
        store = client_store(u.hostname or "", u.port or 0, timeout.total_seconds())
    yield store, rank, world_size
    raise RuntimeError("gpipe:// rendezvous cannot re-rendezvous; start a new attempt")



def rpc_options(master: str, timeout: float) -> TensorPipeRpcBackendOptions:
    """RPC options for the gpipe:// rendezvous at `master`.

    TensorPipe's shared-memory transport busy-polls a core per process; on a
    CPU the cores belong to the stages, so RPC goes over plain TCP (uv).
    """
    import torch.distributed.rpc as rpc

    _register()  # rpc.init_rpc resolves gpipe:// through the handler
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"gpipe://{master}", rpc_timeout=timeout, num_worker_threads=8,
        _transports=["uv"], _channels=["basic"],
    )
