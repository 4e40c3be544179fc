"""Two classes of work: `interactive` (someone waits on it, the default) and `background` (chores).

A request's class is decided at the edge, once its dialect has made it a
neutral request: from what the client said (the `X-Serve-Class` header, vLLM's
`priority` field), from the model it named (--background-model: the model a
client sends its chores to, e.g. Claude Code's ANTHROPIC_SMALL_FAST_MODEL or
Open-WebUI's task model), and from the prompt itself (Open-WebUI's task
templates, serve/core/openwebui.py; the agents' own side prompts,
serve/core/agents.py; --background-match patterns). The first that speaks
decides, in that order.

A chore the server recognised (by its model or its prompt) is held to the
server's bound (--background-max-tokens) whatever max_tokens it asks for: an
agent asks its model's whole output limit of every request (opencode's title:
32,000). One a client declared (header, priority) keeps the max_tokens it set:
that client knows what it asks. The engine queue serves interactive work
first and preempts chores for it (serve/engine/queue.py, docs/chores.md).

vLLM's `priority`: lower is earlier and 0 is its default. Here a positive
priority is background, a negative one interactive (whatever the prompt looks
like), and 0 says nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from serve.core.errors import ApiError
from serve.core.work_classes import BACKGROUND, CLASSES, INTERACTIVE, Hints
from serve.core.agents import agent_chore, message_text
from serve.core.openwebui import task_kind

CLASS_HEADER = "X-Serve-Class"


@dataclass(frozen=True)
class Decision:
    work: str     # INTERACTIVE or BACKGROUND
    why: str      # what decided it, for the log ("" for the default)
    recognised: bool = False   # a chore the server knew (model or prompt), not one declared


class Classifier:
    """The operator's rules (--background-model, --background-match) and the built-in ones."""

    def __init__(self, models: Sequence[str] = (), patterns: Sequence[str] = (),
                 bound: Optional[int] = None):
        self.models = frozenset(models)
        self.patterns = tuple(compile_pattern(p) for p in patterns)
        self.bound = bound   # the most a recognised chore's reply may be (None: no bound)

    def classify(self, request: Any, header: Optional[str]) -> Decision:
        """The class of a neutral request (ChatRequest or CompletionRequest); a recognised
        chore's max_tokens is lowered to the bound (one that sets none gets the server's
        default for chores, later: serve/service/facade.py)."""
        decision = self.decide(request, header)
        limit = request.sampling.max_tokens
        if decision.recognised and self.bound is not None and limit is not None:
            request.sampling.max_tokens = min(limit, self.bound)
        return decision

    def decide(self, request: Any, header: Optional[str]) -> Decision:
        if header is not None:
            value = header.strip().lower()
            if value not in CLASSES:
                raise ApiError(400, f"{CLASS_HEADER} must be one of {', '.join(CLASSES)}, "
                                    f"not {header!r}", code="invalid_value")
            return Decision(value, f"header {CLASS_HEADER}")
        hints: Hints = request.hints
        if hints.priority is not None and hints.priority != 0:
            return Decision(BACKGROUND if hints.priority > 0 else INTERACTIVE,
                            f"priority {hints.priority}")
        if hints.model in self.models:
            return Decision(BACKGROUND, f"model {hints.model} (--background-model)", True)
        text = request_text(request)
        kind = task_kind(text)
        if kind is not None:
            return Decision(BACKGROUND, f"Open-WebUI {kind} task", True)
        messages = getattr(request, "messages", None)   # a completion has none
        chore = agent_chore(messages) if messages is not None else None
        if chore is not None:
            return Decision(BACKGROUND, chore, True)
        for pattern in self.patterns:
            if pattern.search(text):
                return Decision(BACKGROUND, f"--background-match {pattern.pattern}", True)
        return Decision(INTERACTIVE, "")


def compile_pattern(pattern: str) -> "re.Pattern[str]":
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--background-match {pattern!r}: {e}") from None


def request_text(request: Any) -> str:
    """The text a chore shows itself by: a completion's prompt, or a chat's last user message."""
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    for message in reversed(request.messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content"))
    return ""

