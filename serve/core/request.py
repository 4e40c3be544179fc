"""The internal request every dialect converts into: a chat (OpenAI-shaped messages, tools and
choices, as the chat formats read them) or a completion, and how to sample its reply.

Nothing here knows a wire format: serve/dialects/ validate their bodies into these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from serve.core.work_classes import INTERACTIVE, Hints
from serve.core.client_json import Json

# Every reasoning effort a client may name -> the K3 release encoder's nearest level (low,
# high, max), or None for thinking off. OpenAI's values (none, minimal, low, medium, high,
# xhigh) and K3's own (max, and serve's `off`). `medium` lies halfway between low and high
# on the scale K3's own effort text draws (low, medium, high, max) and is taken up to
# high; xhigh is K3's max. Checked against the release's vectors in tests/prompt/test_effort.py.
REASONING_EFFORTS: dict[str, Optional[str]] = {
    "none": None, "minimal": None, "off": None,
    "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
IMAGE_PARTS = ("image_url", "image")  # OpenAI's part, and the K3 release's own


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None        # None: a fresh seed per request
    max_tokens: Optional[int] = None  # None: the server's default
    stop: list[str] = field(default_factory=list)
    # Serve's own decoder applies these to the logits (the engine's sampler has no such knobs):
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    frequency_penalty: float = 0.0    # times a token's count in the reply, taken off its logit
    presence_penalty: float = 0.0     # taken off the logit of a token the reply already holds

    @property
    def adjusted(self) -> Optional[str]:
        """The field that needs serve's decoder to change the logits, or None."""
        return next((name for name, on in (("logit_bias", bool(self.logit_bias)),
                                           ("frequency_penalty", self.frequency_penalty != 0),
                                           ("presence_penalty", self.presence_penalty != 0))
                     if on), None)


@dataclass
class ChatRequest:
    messages: list[dict]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    tools: Optional[list[dict]] = None
    tool_choice: Optional[str | dict] = None   # "none", "auto", "required", or {"type": "function", ...}
    response_format: Optional[dict] = None
    thinking: Optional[bool] = None   # None: the server's default
    thinking_effort: Optional[str] = None   # K3's level (REASONING_EFFORTS), when thinking
    thinking_token_budget: Optional[int] = None   # think-channel tokens; None: the server's; 0: off
    parallel_tool_calls: bool = True  # False: at most one call per reply
    logprobs: Optional[int] = None    # None: off; else how many top_logprobs per token
    request_id: str = ""              # the HTTP request's id, for log lines
    hints: Hints = field(default_factory=Hints)   # what the body says about its class
    work: str = INTERACTIVE           # its class, decided at the edge (serve/core/work.py)
    owner: str = ""                   # its sender's namespace, decided at the edge (http/auth.py)
    cache_salt: Optional[str] = None  # vLLM's: reuse only the cache of requests with this salt


@dataclass
class CompletionRequest:
    prompt: str
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None    # None: off; else how many top_logprobs per token
    request_id: str = ""
    hints: Hints = field(default_factory=Hints)
    work: str = INTERACTIVE
    owner: str = ""
    cache_salt: Optional[str] = None
    echo: bool = False                # the reply's text begins with the prompt's


def image_url(part: dict) -> Json:
    """The URL of an image part: `image_url` and `image` each hold it as a string or as {"url": ...}."""
    value = part.get(part.get("type"))
    return value.get("url") if isinstance(value, dict) else value
