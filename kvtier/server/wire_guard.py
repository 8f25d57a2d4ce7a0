"""What hostile bytes meet first: every request of every service (KVTier, Health, reflection)
is decoded here, before a servicer sees it.

Why not grpc's own decoding: when a request does not decode, grpcio's server answers
INTERNAL ("Exception deserializing request!"), logs a traceback, and then, for a unary
method, tries to send a second status on the finished call; grpc core refuses that batch,
whose tag (holding the call's whole state, ~20 KB) is never freed, and the server's stop
waits for that call forever. Our deserializer never raises: a request that does not decode
becomes a `Refused`, which the wrapped method answers with its status code, through the
same path as any servicer's abort. Nothing is logged and nothing is kept.

Size (docs/protocol.md, "Message size limits"): gRPC's global `max_receive_message_length`
is the largest legitimate request of any method (4 MiB: a page travels in pieces of 1 MiB),
and gRPC refuses anything bigger (RESOURCE_EXHAUSTED) from the message's length prefix,
before reading it. A limit per method would not save memory: gRPC has read a message whole
before any Python code sees it. Each call is told to `called` (the heap trimmer).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from kvtier_client.errors import InvalidArgument
from kvtier_client.layout import PageLayout
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.wire import layout_from_proto

#: Caller strings in error messages and log lines are cut to this many characters.
CALLER_TEXT_CHARS = 64


def cut(text: str, limit: int = CALLER_TEXT_CHARS) -> str:
    """A caller's string, cut to `limit` characters with an ellipsis, for an error message or a
    log line: a namespace or client name of megabytes must not travel back in a status (gRPC
    metadata has a size limit) or fill the log."""
    return text if len(text) <= limit else text[:limit] + "…"


def layout_of(message: pb.PageLayout) -> PageLayout:
    """A caller's page layout (Register, LookupGroups); INVALID_ARGUMENT when malformed.
    Its message quotes a bad dtype or order cut (a cut string, ending in an ellipsis, is
    never a valid name, so cutting changes no verdict)."""
    layout = pb.PageLayout()
    layout.CopyFrom(message)
    layout.dtype, layout.order = cut(layout.dtype), cut(layout.order)
    try:
        return layout_from_proto(layout)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


@dataclass(frozen=True)
class Refused:
    """What a request that cannot be served decodes to."""

    code: grpc.StatusCode
    details: str


def _deserializer(decode: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
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


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
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
        request_deserializer=_deserializer(handler.request_deserializer, method),
        response_serializer=handler.response_serializer,
    )


class WireGuard(grpc.ServerInterceptor):
    """Decodes every request and never raises (see the module docstring). `limit`: the
    largest request, gRPC's receive limit; `called()` is told of every call as it starts."""

    def __init__(self, limit: int, called: Callable[[], None] = lambda: None) -> None:
        self.limit = limit
        self._called = called
        # method path -> (grpc's handler, ours); only registered methods get here, so it stays small
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, handler_call_details):
        self._called()
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guard(handler, method)
        self._guarded[method] = (handler, guarded)
        return guarded
