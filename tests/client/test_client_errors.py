"""Status codes from a real gRPC call become the matching typed errors, message kept.

A tiny in-process gRPC server that aborts with a requested code stands in for the daemon
here only: the point is grpc's real RpcError objects, not the daemon's behaviour (the
end-to-end tests cover that).
"""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from kvtier_client import errors
from kvtier_client.errors import KVTierError, from_rpc_error

METHOD = "/kvtier.test.Abort/Call"


@pytest.fixture(scope="module")
def abort_channel(tmp_path_factory):
    """A channel to a server whose one method aborts with the status code named in the request."""

    def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
        code_name, _, message = request.decode().partition(":")
        context.abort(grpc.StatusCode[code_name], message)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("kvtier.test.Abort", {"Call": grpc.unary_unary_rpc_method_handler(handler)})]
    )
    socket = tmp_path_factory.mktemp("abort") / "abort.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{socket}")
    yield channel.unary_unary(METHOD)
    channel.close()
    server.stop(None)


def _fail(call, code: str, message: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(f"{code}:{message}".encode(), timeout=10)
    return info.value


@pytest.mark.parametrize(
    "code, cls",
    [
        ("INVALID_ARGUMENT", errors.InvalidArgument),
        ("NOT_FOUND", errors.NotFound),
        ("FAILED_PRECONDITION", errors.FailedPrecondition),
        ("RESOURCE_EXHAUSTED", errors.CapacityError),
        ("UNAUTHENTICATED", errors.Unauthenticated),
        ("PERMISSION_DENIED", errors.PermissionDenied),
        ("UNAVAILABLE", errors.Unavailable),
    ],
)
def test_known_codes_map_to_their_class(abort_channel, code, cls):
    exc = _fail(abort_channel, code, f"something about {code.lower()}; do this")
    error = from_rpc_error(exc)
    assert type(error) is cls
    assert error.code == code
    assert str(error) == f"something about {code.lower()}; do this"


@pytest.mark.parametrize("code", ["INTERNAL", "DATA_LOSS", "ABORTED", "UNIMPLEMENTED"])
def test_other_codes_fall_back_to_base_class_with_code(abort_channel, code):
    error = from_rpc_error(_fail(abort_channel, code, "boom"))
    assert type(error) is KVTierError
    assert error.code == code
    assert str(error) == "boom"
    assert KVTierError.code == "UNKNOWN"  # the instance attribute did not leak into the class


def test_deadline_exceeded_from_a_real_timeout(abort_channel, tmp_path):
    # A channel to a socket nobody listens on, with wait_for_ready: the call times out.
    channel = grpc.insecure_channel(f"unix://{tmp_path}/nobody.sock")
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(METHOD)(b"", timeout=0.2, wait_for_ready=True)
    channel.close()
    error = from_rpc_error(info.value)
    assert error.code == "DEADLINE_EXCEEDED"


def test_missing_message_is_filled_in(abort_channel):
    error = from_rpc_error(_fail(abort_channel, "NOT_FOUND", ""))
    assert isinstance(error, errors.NotFound)
    assert "NOT_FOUND" in str(error)
