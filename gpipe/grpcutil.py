"""What every gRPC client of ours shares: the channel, its token, and one-line errors."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc

from gpipe.errors import SpecError


def read_token(path: str | None) -> str | None:
    """The shared token: from --auth-token-file, else env GPIPE_TOKEN, else none."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise SpecError(f"--auth-token-file: cannot read {path}: {e.strerror}") from None
        if not token:
            raise SpecError(f"--auth-token-file: {path} is empty")
        return token
    return os.environ.get("GPIPE_TOKEN") or None


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
        return grpc.aio.secure_channel(address, creds)
    interceptors = [_UnaryToken(token), _StreamToken(token)] if token else None
    return grpc.aio.insecure_channel(address, interceptors=interceptors)


def _with_token(d: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    md = [*(d.metadata or ()), ("authorization", f"Bearer {token}")]
    # grpc takes any sequence of (key, value) pairs as the metadata, not only its Metadata class.
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, cast(grpc.aio.Metadata, md), d.credentials, d.wait_for_ready)


# Two classes: grpc's aio channel files an interceptor under the first kind it is an instance of.
class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` (call credentials are only sent over TLS)."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryUnaryCall[Any, Any]]],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall[Any, Any]:
        return await continuation(_with_token(details, self.token), request)


class _StreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryStreamCall[Any, Any]]],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryStreamCall[Any, Any]:
        return await continuation(_with_token(details, self.token), request)


def describe(e: grpc.RpcError, address: str) -> str:
    """One line for a failed call."""
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the coordinator at {address}: {e.details()}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the coordinator at {address} refused the call: {e.details()}"
    return e.details() or code.name
