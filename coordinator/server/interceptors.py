"""serve's interceptors: a token per service (TokenAuth), and INVALID_ARGUMENT for an undecodable request."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gpipe.service.grpcutil import Context

Handler = Any  # a method's handler, or None: grpc's stubs type its behaviours as sync, not the coroutines aio holds
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]
JOBS, WORKERS = "/gpipe.v1.JobService/", "/gpipe.v1.WorkerService/"
DIRECTORY = "/gpipe.v1.WorkerDirectory/"  # a client's, as JOBS: it takes the client token


class TokenAuth(grpc.aio.ServerInterceptor):
    """Each service its own token: the client token for JobService and WorkerDirectory, the worker token for
    WorkerService.

    Calls carry `authorization: Bearer <token>`; health probes need none. With
    one token set and not the other, the service without one refuses every
    call (PERMISSION_DENIED): a half-configured serve opens no door.
    """

    def __init__(self, client: str | None, worker: str | None):
        self.tokens = {JOBS: _bearer(client), WORKERS: _bearer(worker)}

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        if details.method.startswith("/grpc.health.v1.") or handler is None:
            return handler
        service = JOBS if details.method.startswith((JOBS, DIRECTORY)) else WORKERS
        other = WORKERS if service == JOBS else JOBS
        what, flag = (("client", "--auth-token-file") if service == JOBS else ("worker", "--worker-token-file"))
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        expected = self.tokens[service]
        if expected is not None and hmac.compare_digest(got, expected):
            return handler
        if expected is None:
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"the {service.strip('/').split('.')[-1]} is closed: serve was started without a "
                         f"{what} token ({flag})")
        other_token = self.tokens[other]
        if other_token is not None and hmac.compare_digest(got, other_token):
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"a {'worker' if what == 'client' else 'client'} token cannot call this: the "
                         f"{what} token is needed ({flag})")
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, f"a valid {what} token is required ({flag})")


def _bearer(token: str | None) -> bytes | None:
    return None if token is None else f"Bearer {token}".encode()


def _deny(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler like `handler` that refuses the call."""

    async def deny(request: Any, context: Context) -> None:
        await context.abort(code, message)

    make: Callable[..., Any] = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                                else grpc.stream_unary_rpc_method_handler if handler.stream_unary
                                else grpc.unary_unary_rpc_method_handler)
    return make(deny, handler.request_deserializer, handler.response_serializer)


class _Undecodable:
    def __init__(self, why: str):
        self.why = why


class StrictDecoding(grpc.aio.ServerInterceptor):
    """A request that is not a valid message (bad UTF-8 in a string, a cut field) is INVALID_ARGUMENT.

    gRPC's own answer is UNKNOWN, with the decoder's exception in it.
    """

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/gpipe.v1."):
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as e:
                return _Undecodable(str(e).rpartition(": ")[2] or "cannot be decoded")

        async def check(request: Any, context: Context) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid {details.method.rpartition('/')[2]} request: "
                                    f"{request.why}")

        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                await check(request, context)
                async for m in inner_stream(request, context):
                    yield m

            return grpc.unary_stream_rpc_method_handler(stream, lenient, handler.response_serializer)
        if handler.stream_unary:
            inner_upload = handler.stream_unary

            async def upload(requests: AsyncIterator[Any], context: Context) -> Any:
                async def checked() -> AsyncIterator[Any]:
                    async for r in requests:
                        await check(r, context)
                        yield r

                return await inner_upload(checked(), context)

            return grpc.stream_unary_rpc_method_handler(upload, lenient, handler.response_serializer)
        inner = handler.unary_unary

        async def unary(request: Any, context: Context) -> Any:
            await check(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)
