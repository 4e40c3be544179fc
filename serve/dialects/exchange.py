"""The Exchange protocol: one request in one wire format, from its body to its reply.

Each wire format (OpenAI chat and completions in serve/dialects/openai.py, Anthropic
Messages in serve/dialects/anthropic.py, OpenAI Responses in serve/dialects/responses.py,
Ollama's in serve/dialects/ollama.py) parses its body into the internal request when an
exchange is made, and writes the service's reply back in its own shapes: one JSON
body, or a stream in its framing (server-sent events, or Ollama's NDJSON:
serve/dialects/framing.py). serve/http/sinks.py drives every exchange the same way.
"""
from __future__ import annotations

from typing import Protocol, TypeVar

from serve.core.reply import Delta
from serve.core.errors import ApiError
from serve.core.request import ChatRequest, CompletionRequest
from serve.dialects.framing import Framing
from serve.service.replies import ChatReply, CompletionReply, ReplyStart

Reply = ChatReply | CompletionReply
R = TypeVar("R", ChatReply, CompletionReply, contravariant=True)   # the reply an exchange writes


class Exchange(Protocol[R]):
    left_out: list[str]                        # tools the server cannot run, named for the log
    ignored: list[str]                         # body fields the server does not read, for the log
    model: str                                 # the id replies name: the model that answers
    framing: Framing                           # its stream's: server-sent events or NDJSON

    @property
    def request(self) -> ChatRequest | CompletionRequest:
        """The body, parsed."""

    def error(self, error: ApiError) -> ApiError:
        """The error naming request fields as the client named them."""

    # -- a stream, as bytes in its framing

    def opening(self, start: ReplyStart) -> bytes:
        """The stream's first events, once the prompt's size is known (or once a heartbeat is
        due while the request still waits, whatever comes first); `start` says what is known."""

    def delta(self, delta: Delta) -> bytes:
        """One delta of the service's output, taken into what the exchange accumulates (the
        one accumulation its stream and its blocking body both come from); the stream's bytes
        for it, or b"" for a blocking reply, for which nothing is encoded."""

    def heartbeat(self, start: ReplyStart) -> bytes:
        """A sign of life in a form the format's clients count, sent after the opening when
        the stream has been silent for a while (from the stream's writer thread, under the
        sink's lock)."""

    def closing(self, reply: R) -> bytes:
        """The stream's last events, after the reply is done."""

    def failed(self, error: ApiError) -> bytes:
        """The stream's last events after an error inside it."""

    # -- a blocking reply

    def body(self, reply: R) -> dict:
        """The whole reply as one JSON body."""

    def keep(self, reply: R) -> None:
        """The reply is done and about to reach the client: keep what outlives the request
        (a stored response), before the client can refer to it."""
