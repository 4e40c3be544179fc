"""Reading a request's body: its declared length checked, read in place, within the request's deadline."""
from __future__ import annotations

import io
import socket
import time
from email.message import Message
from typing import Any, Callable

from serve.core.errors import ApiError
from serve.http.json_body import MAX_BODY_BYTES


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each bounded by what is left of the request's deadline.

    A per-read timeout lets a client that trickles a byte at a time hold its
    thread forever (slowloris); this bounds the whole request instead.
    """

    def __init__(self, connection: socket.socket, deadline: Callable[[], float]):
        super().__init__()
        self._connection = connection
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline() - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took longer than its deadline")
        self._connection.settimeout(left)
        return self._connection.recv_into(buffer)


def has_body(headers: Message) -> bool:
    return headers.get("Content-Length") is not None or bool(headers.get("Transfer-Encoding"))


def declared_length(headers: Message) -> int:
    """The body's length as its headers declare it, or the ApiError that refuses them."""
    if headers.get("Transfer-Encoding"):
        raise ApiError(411, "chunked request bodies are not accepted; send Content-Length",
                       code="length_required")
    declared = headers.get_all("Content-Length") or []
    if not declared:
        raise ApiError(411, "a request body needs a Content-Length", code="length_required")
    # Digits only, and one value: int() would also take "+5" or "1_0", and a
    # proxy that reads such a header differently would see another request boundary.
    if len(declared) > 1 or not (declared[0].isascii() and declared[0].isdigit()):
        raise ApiError(400, "Content-Length is not a valid length", code="invalid_body")
    length = int(declared[0])
    if length > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MB",
                       code="request_too_large")
    return length


def read_exactly(rfile: io.BufferedIOBase, length: int, request_timeout: float) -> bytearray:
    """`length` bytes, read in place (no second copy of a large body), or the ApiError of a
    body that ended early or missed the request's deadline."""
    body, got = bytearray(length), 0
    with memoryview(body) as view:
        try:
            while got < length:
                n = rfile.readinto(view[got:got + (1 << 20)])
                if not n:
                    break
                got += n
        except TimeoutError:
            raise ApiError(408, f"the request was not received within {request_timeout:g} seconds",
                           code="request_timeout") from None
        except OSError:
            pass
    if got < length:
        raise ApiError(400, f"request body ended after {got} of {length} declared bytes",
                       code="incomplete_body")
    return body
