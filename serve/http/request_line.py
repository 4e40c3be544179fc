"""A request line as this server reads it: its method, its target as a path, and its refusals.

The standard library parses the request line and headers, and refuses what it
cannot parse with an HTML page; here each refusal becomes an ApiError, so it
is answered, logged and counted like every other error. A target is one of
RFC 9112's forms: the origin form (/path?query), the absolute form
(http://host/path?query, routed by its path: the host is this server
whatever it says) or the asterisk form (*, only for OPTIONS, which asks
about the server as a whole). The authority form is CONNECT's, which this
server does not do.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Optional
from urllib.parse import urlsplit

from serve.core.errors import ApiError

# Methods the routes answer (404 or 405 as they say); any other is a 501 (RFC 9110 15.6.2).
ROUTED_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
# What some route takes, for `OPTIONS *` and a 501 (HEAD: a GET's headers; OPTIONS: `*`).
SERVER_METHODS = ("GET", "HEAD", "POST", "DELETE", "OPTIONS")
ASTERISK = "*"
MAX_LINE = 65536   # bytes in a request line, as the standard library reads it

# The standard library's refusals (its send_error), by status: an error code each.
_CODES = {400: "invalid_request_line", 414: "request_line_too_long",
          431: "request_header_fields_too_large", 505: "http_version_not_supported"}


def refusal(status: int, message: Optional[str]) -> ApiError:
    """The standard library's refusal of a request line or its headers, as an ApiError."""
    if status == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:
        message = f"{message}: this server speaks HTTP/1.0 and HTTP/1.1"
    return ApiError(status, message or HTTPStatus(status).phrase, code=_CODES.get(status),
                    kind="invalid_request_error" if status < 500 else "server_error")


def unsupported(method: str) -> ApiError:
    return ApiError(501, f"the method {method} is not supported: this server answers "
                         f"{', '.join(SERVER_METHODS)}", code="method_not_supported",
                    kind="server_error")


def origin_form(target: str) -> str:
    """The path and query a request target names ("*" stays itself); a 400 for any other form."""
    if target.startswith("/") or target == ASTERISK:
        return target
    parts = urlsplit(target)
    if parts.scheme.lower() in ("http", "https") and parts.netloc:
        return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    raise ApiError(400, f"the request target {target[:200]!r} is not a path, an http URL or *",
                   code="invalid_request_line")
