"""Streams at a scaled K3 clock: one streamed request per dialect, and what its clients count.

The reference engine sleeps WASTE_DELAY_MS per evaluated token, so a 512-token
prefill chunk lasts seconds, as one lasts 17 minutes on K3. What counts as a
sign of life differs by client: the openai clients' read timeouts are reset
by any byte (comments too); Codex's idle timer only by an event with a data
line; Claude Code's watchdog only by an event other than `ping`.
"""
from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from scripted import block_data

DELAY_MS = 9          # per evaluated token: a 512-token chunk lasts about 4.6 s
CHUNK = 512


@dataclass(frozen=True)
class Dialect:
    path: str
    body: Callable[[str], dict]      # the prompt's text -> a streamed request
    counts: Callable[[str], bool]    # an SSE block this dialect's clients count as a sign of life
    token: Callable[[str], bool]     # a block carrying a piece of the reply


def _any_block(block: str) -> bool:
    return True


def _data(block: str) -> bool:
    return block_data(block) is not None


def _not_ping(block: str) -> bool:
    return _data(block) and block_data(block).get("type") != "ping"


# "Token" below: a block carrying a piece of the reply, or its end. A random-weight model
# may spend its few tokens on markup that shows nothing (a stray header, say); the reply's
# end then marks when generation was done, which is all the silence before it needs.

def _chat_token(block: str) -> bool:
    data = block_data(block)
    choice = data["choices"][0] if data and data.get("choices") else {}
    delta = choice.get("delta", {})
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or choice.get("finish_reason"))


def _completion_token(block: str) -> bool:
    data = block_data(block)
    choice = data["choices"][0] if data and data.get("choices") else {}
    return bool(choice.get("text") or choice.get("finish_reason"))


def _responses_token(block: str) -> bool:
    data = block_data(block) or {}
    kind = data.get("type")
    return (kind in ("response.output_text.delta", "response.reasoning_text.delta",
                     "response.function_call_arguments.delta") and bool(data["delta"])) \
        or kind in ("response.completed", "response.incomplete")


def _messages_token(block: str) -> bool:
    data = block_data(block) or {}
    delta = data.get("delta", {}) if data.get("type") == "content_block_delta" else {}
    return bool(delta.get("text") or delta.get("thinking") or delta.get("partial_json")) \
        or data.get("type") == "message_delta"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


DIALECTS = {
    "chat": Dialect("/v1/chat/completions",
                    lambda text: {"messages": _user(text), "max_tokens": 4, "stream": True},
                    _any_block, _chat_token),
    "completions": Dialect("/v1/completions",
                           lambda text: {"prompt": text, "max_tokens": 4, "stream": True},
                           _any_block, _completion_token),
    "responses": Dialect("/v1/responses",
                         lambda text: {"model": "m", "input": text, "max_output_tokens": 4,
                                       "stream": True},
                         _data, _responses_token),
    "messages": Dialect("/v1/messages",
                        lambda text: {"model": "m", "messages": _user(text), "max_tokens": 4,
                                      "stream": True},
                        _not_ping, _messages_token),
}
COUNTED_BY = {"chat": "any byte (openai clients)", "completions": "any byte (openai clients)",
              "responses": "data events (Codex)", "messages": "events but ping (Claude Code)"}


def prompt_text(items: int, salt: str = "") -> str:
    """Text of about 13 tokens per item on the reference containers; `salt` makes it differ."""
    return " ".join(f"{salt}item{i} costs {i * 7 % 100} pounds;" for i in range(items))


class Streamed:
    """A streamed request, read on a thread: when its stream opened, and when it ended."""

    def __init__(self, port: int, path: str, body: dict, headers: tuple[str, ...] = ()):
        data = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=300)
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n".encode()
                          + b"Content-Type: application/json\r\n"
                          + "".join(f"{line}\r\n" for line in headers).encode()
                          + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        self.raw = b""
        self.holding = threading.Event()   # its stream opened: it holds the engine
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.raw += chunk
                if self.raw.startswith(b"HTTP/1.1 200"):
                    self.holding.set()
                if b"[DONE]" in self.raw:
                    break
        except OSError:
            pass
        self.ended.set()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


class LongPrefill(Streamed):
    """A streamed chat request whose prompt takes the engine a long time."""

    def __init__(self, port: int, items: int, headers: tuple[str, ...] = ()):
        super().__init__(port, "/v1/chat/completions",
                         {"messages": _user(prompt_text(items, "busy")), "max_tokens": 2}, headers)
