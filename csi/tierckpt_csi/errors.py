"""The one error type the node plugin raises on purpose: a gRPC status code and a message for kubelet."""

from __future__ import annotations

import grpc

__all__ = ["CsiError", "already_exists", "failed_precondition", "invalid", "not_found", "resource_exhausted"]


class CsiError(Exception):
    """Aborts an RPC with ``code`` and ``message``; kubelet shows the message in the pod's events."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.NOT_FOUND, message)


def already_exists(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.ALREADY_EXISTS, message)


def failed_precondition(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.FAILED_PRECONDITION, message)


def resource_exhausted(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
