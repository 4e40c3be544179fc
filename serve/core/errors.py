"""The error every layer raises for a request that ends in an error response.

Its shape is OpenAI's (`{"error": {message, type, param, code}}`); the other
dialects rename its fields and re-shape it on their way out
(serve/dialects/translation.py's `renamed`, serve/dialects/anthropic.py).
"""
from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """A request that ends in an OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}  # extra response headers, e.g. Retry-After

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
