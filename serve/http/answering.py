"""What an endpoint may use of the request it answers: the handler's face toward endpoints.py.

The route table (routes.py) and the endpoints (endpoints.py) take the request
as an `Answering`, so they need not import the handler (server.py) that calls
them: the handler meets this Protocol, and mypy checks that it does.
"""
from __future__ import annotations

import time
from email.message import Message
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from serve.core.errors import ApiError
from serve.core.hangup import Hangup
from serve.http.auth import ANYONE, Principal
from serve.service.facade import Service
from serve.service.models import Models
from serve.dialects.sse import EventWriter
from serve.http.background import Keepers


@dataclass
class Ongoing:
    """One request's record, from its request line to its log line (Handler.current)."""
    request_id: str
    started: float = field(default_factory=time.monotonic)
    path: str = "-"              # as routed and logged: the origin form, without its query
    endpoint: str = "other"      # what /metrics counts it under
    shape: Callable[[ApiError], dict] = ApiError.body   # its errors, as its API writes them
    status: int = 0              # what was sent (a stream's 200), or 499 for a client that left
    tokens: int = 0              # generated
    timing: str = ""             # a generation's: where its time went (sinks.py's Answer)
    streaming: bool = False      # an event stream's headers have gone out
    reply_headers: dict[str, str] = field(default_factory=dict)   # what a generation's reply carries
    body_read: bool = False      # an endpoint read the body (else it is discarded before replying)
    body_bytes: int = 0
    counted: bool = False        # in /metrics already
    named_model: Optional[str] = None   # the body's `model`, which picks the model that answers
    answered_by: str = ""        # with several models: the one that answered, for the log line
    principal: Principal = ANYONE   # who sent it (serve/http/auth.py), once its key is checked

    @property
    def who(self) -> str:
        """The log line's word on its sender: the name, never the key."""
        return f" person={self.principal.name}" if self.principal.name else ""


class ServerFace(Protocol):
    """What an endpoint reads of the server: its models, the main model's service, its
    background responses, its log (and body fields it does not read, named there once)."""

    @property
    def models(self) -> Models: ...

    @property
    def background(self) -> Keepers: ...

    @property
    def service(self) -> Service: ...

    def log_once(self, key: str, line: str) -> None: ...

    def log_line(self, line: str) -> None: ...

    def note_unread(self, endpoint: str, fields: list[str]) -> None: ...


class Answering(Protocol):
    """One request as an endpoint sees it: read its body, answer it once."""

    @property
    def path(self) -> str: ...

    @property
    def server(self) -> ServerFace: ...

    @property
    def headers(self) -> Message: ...

    @property
    def current(self) -> Ongoing: ...

    @property
    def request_id(self) -> str: ...

    def read_json(self) -> dict:
        """The body as a JSON object (a 400 otherwise), read once."""
        ...

    @property
    def client_left(self) -> Hangup:
        """Asks whether the client has closed its end."""
        ...

    @property
    def owner(self) -> str:
        """Who sent it: a digest of its credentials ("" for none)."""
        ...

    def open_stream(self, content_type: str, on_silence: Callable[[], None],
                    on_failed: Callable[[], None]) -> EventWriter:
        """Send an event stream's headers; its bytes then go through the returned writer."""
        ...

    def public_error(self, error: Exception) -> ApiError:
        """What the client may be told of an error (the details of a server's own go to its log)."""
        ...

    def send_json(self, status: int, payload: Any, headers: Optional[dict[str, str]] = None) -> None:
        ...

    def send(self, status: int, content_type: str, body: bytes,
             headers: Optional[dict[str, str]] = None) -> None:
        ...
