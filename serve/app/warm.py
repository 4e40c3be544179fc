"""`--warm REQUEST.json`: prefill and checkpoint saved requests' preambles in idle time.

An agent's preamble (tool declarations, system prompt) can take hours to
prefill on an expert-streaming model.  Warming pays for it once, from start-up
(or overnight), into the persistent prefix cache. It is idle-time work: a
request that arrives takes the engine at the warm's next chunk, the warm
checkpoints where it stopped and resumes once the engine is idle again.
Meanwhile /health says how far the warm got (a router sends the host no new
conversations until it is done); requests are served throughout.
"""
from __future__ import annotations

import json
import threading
from typing import Callable, Optional

from serve.dialects import anthropic, responses

from serve.dialects.openai_request import parse_chat_request

from serve.core.errors import ApiError
from serve.core.request import ChatRequest
from serve.engine.types import WasteError
from serve.service.prefill import PrefillCancelled
from serve.service.response_store import ResponseStore
from serve.service.facade import Service
from serve.service.warming import warm

# Keys only an Anthropic Messages body has (a chat completions body has none of them).
ANTHROPIC_KEYS = ("system", "stop_sequences", "thinking", "output_config", "context_management")


class WarmError(Exception):
    """A --warm file that is not a usable request body."""


def dialect_of(body: dict) -> str:
    """Which API a saved body was written for, by the fields only that API has."""
    if "input" in body or "instructions" in body:
        return "responses"
    tools = body.get("tools")
    if any(key in body for key in ANTHROPIC_KEYS) or (
            isinstance(tools, list) and any(isinstance(t, dict) and "input_schema" in t for t in tools)):
        return "anthropic"
    return "chat"


def parse_body(body: dict) -> ChatRequest:
    """Any of the three APIs' request bodies, as the internal chat request."""
    kind = dialect_of(body)
    if kind == "responses":
        # A fresh store: a saved body's previous_response_id cannot refer to this process.
        return responses.parse_request(body, ResponseStore().of("")).request
    if kind == "anthropic":
        return anthropic.parse_request(body).request
    return parse_chat_request(body)


def load_request(path: str) -> ChatRequest:
    """A saved chat completions, Anthropic Messages or Responses body, validated as the
    server would validate it."""
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise WarmError(f"--warm {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(body, dict):
        raise WarmError(f"--warm {path}: not a JSON object")
    try:
        return parse_body(body)
    except ApiError as e:
        raise WarmError(f"--warm {path}: {e.body()['error']['message']}") from None


class Warmer(threading.Thread):
    """Warms each request in turn on the service, reporting on `log` and in service.warming."""

    def __init__(self, service: Service, requests: list[tuple[str, ChatRequest]],
                 log: Callable[[str], None]):
        super().__init__(name="warm", daemon=True)
        self._service = service
        self._requests = requests
        self._log = log
        self._halt = threading.Event()
        self.failed = 0
        service.warming = self._status(0, 0, 0)

    def stop(self) -> None:
        """Stop at the next prefill chunk (shutdown)."""
        self._halt.set()

    def _status(self, done: int, position: int, total: int) -> dict:
        return {"requests_done": done, "requests": len(self._requests),
                "prefilled": position, "prompt_tokens": total}

    def run(self) -> None:
        done = 0
        try:
            for n, (path, req) in enumerate(self._requests):
                if self._halt.is_set() or not self._warm_one(n, path, req):
                    break
                done = n + 1
        finally:
            status, self._service.warming = self._service.warming, None
        warmed = f"{done - self.failed} of {len(self._requests)} warmed"
        if done < len(self._requests):
            at = f"{status['prefilled']}/{status['prompt_tokens']}" if status else "0/0"
            self._log(f"warm     cut short by shutdown: {warmed}; request {done + 1} stopped at "
                      f"{at} positions, checkpointed where that paid")
        else:
            self._log(f"warm     done: {warmed}; serving")

    def _warm_one(self, n: int, path: str, req: ChatRequest) -> bool:
        """Warm one request; False when shutdown cut it short."""
        label = f"warm     {n + 1}/{len(self._requests)} {path}"

        def progress(done: int, total: int) -> None:
            self._service.warming = self._status(n, done, total)
            self._log(f"{label}: {done}/{total} positions")

        try:
            held, restored = warm(self._service, req, progress, self._halt.is_set)
        except PrefillCancelled:
            return False
        except (ApiError, WasteError, OSError) as e:
            self.failed += 1
            message = e.body()["error"]["message"] if isinstance(e, ApiError) else str(e)
            self._log(f"{label}: not warmed: {message}")
            return True
        self._log(f"{label}: {held} positions checkpointed ({restored} were already cached)")
        return True


def warm_requests(paths: Optional[list[str]]) -> list[tuple[str, ChatRequest]]:
    return [(path, load_request(path)) for path in paths or []]
