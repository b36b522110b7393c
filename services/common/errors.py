"""Domain exceptions. Domain code raises these; one interceptor per service maps them to gRPC
status codes (services.common.server), so servicers stay thin.
"""
from __future__ import annotations

import grpc


class LorafleetError(Exception):
    """Base of every error a client may see; `code` is its gRPC status."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class InvalidArgument(LorafleetError):
    """A bad parameter or malformed adapter; the message names the field or tensor."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class Refusal(InvalidArgument):
    """An adapter or name refused; the message names the field or tensor, `reason` labels
    lorafleet_store_refusals_total (a small fixed set: "r", "shape", "nonfinite", ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class NotFound(LorafleetError):
    """Unknown adapter, or another tenant's (same message for both)."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LorafleetError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LorafleetError):
    """E.g. using an adapter whose state is FAILED."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LorafleetError):
    """Quota exceeded, or no KV / adapter room; carries a retry delay."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(LorafleetError):
    """No worker, or the service is draining."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(LorafleetError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(LorafleetError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(LorafleetError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(LorafleetError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(LorafleetError):
    """A digest mismatch: what arrived is not what was validated."""
    code = grpc.StatusCode.DATA_LOSS


def unknown_adapter(name: str) -> NotFound:
    """The one message for an unknown adapter and for another tenant's adapter."""
    return NotFound(f"adapter {name!r} not found")


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition,
                                      ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled,
                                      Unauthenticated, PermissionDenied, DataLoss)}


def with_prefix(err: LorafleetError, prefix: str) -> LorafleetError:
    """The same error (status, retry delay) with its message prefixed."""
    cls = _BY_CODE.get(err.code, LorafleetError)
    out = cls(prefix + err.message, retry_after=err.retry_after)
    out.code = err.code
    return out


def from_rpc_error(err: grpc.RpcError) -> LorafleetError:
    """Turn a status received from another service back into the domain error (for relaying)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    cls = _BY_CODE.get(code, LorafleetError)
    out = cls(err.details() or str(code))
    if cls is LorafleetError:
        out.code = code
    out.retry_after = retry_after_of(err)
    return out


def retry_after_of(err: grpc.RpcError) -> float | None:
    """The google.rpc.RetryInfo delay carried by an error status, if any."""
    from grpc_status import rpc_status
    from google.rpc import error_details_pb2
    try:
        status = rpc_status.from_call(err)
    except Exception:  # noqa: BLE001 - malformed details are simply absent
        return None
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None

