"""What our gRPC servers and clients share: ports, bounds, tokens, the channel and one-line errors."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc

from gpipe.errors import SpecError

NO_SHARED_PORT = ("grpc.so_reuseport", 0)  # a server option: bind fails when the port is taken
# HTTP/2 keepalive, both sides: a connection whose peer is gone (a cut link, a dead host) is closed within
# about 15 s even while no call is under way, so a worker's command stream ends and it registers again.
CLIENT_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
SERVER_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
                    ("grpc.http2.min_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 0)]
MAX_RANK = 4095  # ranks a worker may register: 0 ... MAX_RANK
# A SIGTERM's grace (serve's and gpipe-worker's --grace-s, Leave's grace_s): under Kubernetes' default 30 s.
DEFAULT_GRACE_S, MIN_GRACE_S, MAX_GRACE_S = 25.0, 1.0, 3600.0
Context = grpc.aio.ServicerContext[Any, Any]  # a call's, on a server: its request and response types vary by method


def check_grace(seconds: float, flag: str = "--grace-s") -> float:
    """`seconds` if it is a grace in range; else SpecError naming `flag` and the range (nan too)."""
    if not MIN_GRACE_S <= seconds <= MAX_GRACE_S:
        raise SpecError(f"{flag}: {seconds} is outside {MIN_GRACE_S:g}..{MAX_GRACE_S:g} seconds")
    return seconds
CLIENT_TOKEN_ENV, WORKER_TOKEN_ENV = "GPIPE_TOKEN", "GPIPE_WORKER_TOKEN"


def read_token(path: str | None, flag: str = "--auth-token-file", env: str = CLIENT_TOKEN_ENV) -> str | None:
    """A token: from the file `flag` names, else env `env`, else none."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise SpecError(f"{flag}: cannot read {path}: {e.strerror}") from None
        if not token:
            raise SpecError(f"{flag}: {path} is empty")
        return token
    return os.environ.get(env) or None


def forget_tokens() -> None:
    """Take the tokens out of this process's environment, so that no child (user code) inherits them."""
    for k in (CLIENT_TOKEN_ENV, WORKER_TOKEN_ENV):
        os.environ.pop(k, None)


def listen(server: grpc.aio.Server, address: str, flag: str, creds: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` to `address` and return its port, or SpecError naming the address.

    The server must be made with NO_SHARED_PORT: gRPC's default, SO_REUSEPORT,
    lets a second server bind a port in use, and the two answer at random.
    """
    host, _, port_text = address.rpartition(":")
    why = "the address is not this machine's"
    try:  # first on a socket of ours, for the reason in one line (gRPC logs its own, at length)
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host.strip("[]") or None, int(port_text),
                                                                   type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(sockaddr)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        port = 0
    else:
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError:  # grpc raises where older versions returned 0
            port = 0
    if not port:
        raise SpecError(f"{flag}: cannot listen on {address}: {why}")
    return port


def read_file(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SpecError(f"{flag}: cannot read {path}: {e.strerror}") from None


def channel(address: str, token: str | None, tls_ca: str | None) -> grpc.aio.Channel:
    """An aio channel to `address`, with TLS when a CA is given and the token on every call."""
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=read_file("--tls-ca", tls_ca))
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token))
        return grpc.aio.secure_channel(address, creds, options=CLIENT_KEEPALIVE)
    interceptors: list[grpc.aio.ClientInterceptor] | None = \
        [_UnaryToken(token), _StreamToken(token), _UploadToken(token)] if token else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors, options=CLIENT_KEEPALIVE)


def _with_token(d: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    md = [*(d.metadata or ()), ("authorization", f"Bearer {token}")]
    # grpc takes any sequence of (key, value) pairs as the metadata, not only its Metadata class.
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, cast(grpc.aio.Metadata, md), d.credentials, d.wait_for_ready)


# A class per kind of call: grpc's aio channel files an interceptor under the first kind it is an instance of.
class _Token:
    """Adds `authorization: Bearer <token>` (call credentials are only sent over TLS)."""

    def __init__(self, token: str):
        self.token = token


class _UnaryToken(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryUnaryCall[Any, Any]]],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall[Any, Any]:
        return await continuation(_with_token(details, self.token), request)


class _StreamToken(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryStreamCall[Any, Any]]],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryStreamCall[Any, Any]:
        return await continuation(_with_token(details, self.token), request)


class _UploadToken(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.StreamUnaryCall[Any, Any]]],
        details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> grpc.aio.StreamUnaryCall[Any, Any]:
        return await continuation(_with_token(details, self.token), request_iterator)


def describe(e: grpc.RpcError, address: str) -> str:
    """One line for a failed call."""
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the coordinator at {address}: {e.details()}"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return f"the coordinator at {address} refused the call: {e.details()}"
    return e.details() or code.name
