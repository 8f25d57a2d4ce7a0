"""What hostile bytes meet first: every request of every service (KVTier, Health, reflection)
is decoded here, against its method's size limit, before a servicer sees it.

Why not grpc's own decoding: when a request does not decode, grpcio's server answers
INTERNAL ("Exception deserializing request!"), logs a traceback, and then, for a unary
method, tries to send a second status on the finished call; grpc core refuses that batch,
whose tag (holding the call's whole state, ~20 KB) is never freed, and the server's stop
waits for that call forever. Our deserializer never raises: a request that does not decode
or is over its limit becomes a `Refused`, which the wrapped method answers with its status
code, through the same path as any servicer's abort. Nothing is logged and nothing is kept.

Limits (docs/protocol.md, "Message size limits"): gRPC's global `max_receive_message_length`
is the largest legal message of any method, so gRPC itself refuses anything bigger
(RESOURCE_EXHAUSTED) from the message's length prefix, without reading it; below that, each
method has its own limit, checked here before decoding.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

#: Caller strings in error messages and log lines are cut to this many characters.
CALLER_TEXT_CHARS = 64


def cut(text: str, limit: int = CALLER_TEXT_CHARS) -> str:
    """A caller's string, cut to `limit` characters with an ellipsis, for an error message or a
    log line: a namespace or client name of megabytes must not travel back in a status (gRPC
    metadata has a size limit) or fill the log."""
    return text if len(text) <= limit else text[:limit] + "…"


@dataclass(frozen=True)
class Refused:
    """What a request that cannot be served decodes to."""

    code: grpc.StatusCode
    details: str


def _deserializer(decode: Callable[[bytes], Any], method: str, limit: int) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        if len(data) > limit:
            return Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: a request message of {len(data)} bytes is over this method's limit of {limit} bytes; "
                "send fewer keys per call (docs/protocol.md, message size limits)",
            )
        try:
            return decode(data)
        except DecodeError:
            return Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request does not decode as this method's message; use the kvtier client or stubs "
                "generated from the daemon's .proto",
            )

    return deserialize


def _refuse(refused: Refused, context: grpc.ServicerContext) -> None:
    context.abort(refused.code, refused.details)


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Refused):
            _refuse(request, context)
        yield request


def _guard_behavior(behavior: Callable, streaming_requests: bool) -> Callable:
    @functools.wraps(behavior)  # keeps experimental_non_blocking (health's Watch) and its thread pool
    def guarded(request_or_iterator, context, *rest):
        if streaming_requests:
            return behavior(_checked(request_or_iterator, context), context, *rest)
        if isinstance(request_or_iterator, Refused):
            _refuse(request_or_iterator, context)
        return behavior(request_or_iterator, context, *rest)

    return guarded


def _guard(handler: grpc.RpcMethodHandler, method: str, limit: int) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler  # a raw-bytes method: nothing to decode
    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[handler.request_streaming, handler.response_streaming]
    behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
    return kind(
        _guard_behavior(behavior, handler.request_streaming),
        request_deserializer=_deserializer(handler.request_deserializer, method, limit),
        response_serializer=handler.response_serializer,
    )


class WireGuard(grpc.ServerInterceptor):
    """Decodes every request with a size limit and never raises (see the module docstring).
    `limits` maps a method path ("/kvtier.v1.KVTier/WritePages") to its limit in bytes;
    every other method gets `default_limit`."""

    def __init__(self, default_limit: int, limits: Mapping[str, int]) -> None:
        self.default_limit = default_limit
        self.limits = dict(limits)
        # method path -> (grpc's handler, ours); only registered methods get here, so it stays small
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    @property
    def largest_message(self) -> int:
        """The largest request any method takes: gRPC's global receive limit."""
        return max(self.default_limit, *self.limits.values())

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guard(handler, method, self.limits.get(method, self.default_limit))
        self._guarded[method] = (handler, guarded)
        return guarded
