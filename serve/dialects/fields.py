"""Every request field of the four dialects, in one of three lists: honoured, refused, ignored.

A field a client sends either does what it asks (honoured), or is a 400 naming it
when the value asks for what serve cannot do (refused: its defaults, which clients
send unasked, are accepted), or cannot change the reply here, and is accepted
(ignored, each with why). docs/api.md carries the same lists, and
tests/api/test_field_lists.py holds the two equal. A field in none of them is not
read, and is named once in the log (serve/http/server.py's note_unread).
Nested fields are named by their path (`text.verbosity`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from serve.core.client_json import Json
from serve.core.errors import invalid

# Refused only where serve cannot decode by itself (no numpy, or an engine whose waste_eval
# gives no logits): serve/service/generation.py's check_decoding.
NEEDS_DECODER = "where serve cannot decode by itself (no numpy, or no logits from waste_eval)"


@dataclass(frozen=True)
class Refusal:
    why: str                       # the 400's message: what is refused, and why
    allowed: tuple[Json, ...] = ()  # values that ask for nothing (besides absent and null)
    checked_here: bool = True      # False: refused where its condition is known (the message says)


@dataclass(frozen=True)
class Fields:
    honoured: tuple[str, ...]
    refused: Mapping[str, Refusal]
    ignored: Mapping[str, str]     # field -> why it cannot change the reply here

    @property
    def read(self) -> frozenset[str]:
        """The top-level fields this endpoint reads or accepts knowingly (the rest are logged)."""
        return frozenset(name.split(".")[0]
                         for name in (*self.honoured, *self.refused, *self.ignored))

    def refuse(self, body: dict) -> None:
        """A 400 naming the first field whose value asks for what serve cannot do."""
        for name, refusal in self.refused.items():
            if not refusal.checked_here:
                continue
            value = _at(body, name)
            if value is not None and not any(_same(value, a) for a in refusal.allowed):
                raise invalid(name, refusal.why)


def _at(body: dict, path: str) -> Json:
    value: Json = body
    for step in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(step)
    return value


def _same(value: Json, allowed: Json) -> bool:
    """JSON equality: true is not 1, nor 1.0 true."""
    return type(value) is type(allowed) and value == allowed


DECODER_REFUSALS = {
    name: Refusal(f"{name} is refused {NEEDS_DECODER}", checked_here=False)
    for name in ("logprobs", "logit_bias", "frequency_penalty", "presence_penalty")}

_USER = "an end user's id, for OpenAI's abuse monitoring: nothing here is monitored"
_CACHE_KEY = "a hint for routing to a warm cache: the prefix cache finds a shared prefix by itself"
_TIER = "a price and latency tier: one server has one"
_VERBOSITY = "other than medium is not supported: the model is not trained to follow it"

CHAT = Fields(
    honoured=("messages", "model", "tools", "tool_choice", "parallel_tool_calls",
              "response_format", "temperature", "top_p", "top_k", "seed", "max_tokens",
              "max_completion_tokens", "stop", "stream", "stream_options", "logprobs",
              "top_logprobs", "reasoning_effort", "logit_bias", "frequency_penalty",
              "presence_penalty", "priority", "cache_salt", "thinking_token_budget"),
    refused={
        "n": Refusal("only n=1 is supported: one reply per request", (1,)),
        "audio": Refusal("audio output is not supported: this server replies in text"),
        "modalities": Refusal("modalities other than [\"text\"] are not supported: the reply is text",
                              (["text"],)),
        "functions": Refusal("functions (the deprecated form of tools) is not supported: "
                             "declare them in tools"),
        "function_call": Refusal("function_call (the deprecated form of tool_choice) is not "
                                 "supported: use tool_choice"),
        "web_search_options": Refusal("web_search_options is not supported: this server runs no "
                                      "search"),
        "verbosity": Refusal(f"verbosity {_VERBOSITY}", ("medium",)),
        **DECODER_REFUSALS,
    },
    ignored={
        "user": _USER,
        "safety_identifier": _USER,
        "metadata": "tags for OpenAI's stored completions, which this server does not keep",
        "store": "keeps the completion in OpenAI's dashboard: there is none here",
        "prompt_cache_key": _CACHE_KEY,
        "prompt_cache_retention": "how long OpenAI keeps a cached prefix: here the prefix "
                                  "cache's own policy decides (docs/snapshots.md)",
        "service_tier": _TIER,
        "prediction": "Predicted Outputs only make a reply faster at OpenAI; the reply is the "
                      "same without it",
    })

COMPLETIONS = Fields(
    honoured=("prompt", "model", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop",
              "stream", "stream_options", "logprobs", "echo", "logit_bias",
              "frequency_penalty", "presence_penalty", "priority", "cache_salt"),
    refused={
        "n": CHAT.refused["n"],
        "best_of": Refusal("only best_of=1 is supported", (1,)),
        "suffix": Refusal("suffix is not supported: this server does not fill in the middle",
                          ("",)),
        "echo": Refusal("echo with logprobs is refused: the engine gives no log-probabilities "
                        "for the prompt's tokens", checked_here=False),
        **DECODER_REFUSALS,
    },
    ignored={"user": _USER})

MESSAGES = Fields(
    honoured=("model", "messages", "system", "max_tokens", "stop_sequences", "stream",
              "temperature", "top_p", "top_k", "tools", "tool_choice", "thinking",
              "output_config", "cache_salt"),
    refused={
        "mcp_servers": Refusal("MCP servers are not supported here: this server connects to "
                               "none (run them in the client, as Claude Code does)", ([],)),
    },
    ignored={
        "metadata": "metadata.user_id is for Anthropic's abuse tracking: nothing here tracks it",
        "service_tier": _TIER,
        "container": "a code execution container, used only by Anthropic's server tools, "
                     "which are left out here (and named in the log)",
        "context_management": "asks Anthropic's server to clear old tool results or thinking "
                              "as the context fills; serve renders the conversation whole (one "
                              "too long for the context is a 400), so the prompt is the one "
                              "the client sent",
    })

# count_tokens takes a Messages body: what shapes the prompt counts; what shapes only the
# reply cannot change the count.
_REPLY_ONLY = "shapes the reply, not the prompt counted"
COUNT_TOKENS = Fields(
    honoured=("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"),
    refused=MESSAGES.refused,
    ignored={**{name: _REPLY_ONLY for name in ("max_tokens", "stop_sequences", "stream",
                                               "temperature", "top_p", "top_k")},
             "cache_salt": "bounds which snapshots a prompt may reuse; a count reuses none",
             **MESSAGES.ignored})

RESPONSES = Fields(
    honoured=("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
              "text", "reasoning", "max_output_tokens", "temperature", "top_p", "store",
              "include", "top_logprobs", "previous_response_id", "stream", "background",
              "cache_salt"),
    refused={
        "conversation": Refusal("conversations are not supported; continue with "
                                "previous_response_id"),
        "prompt": Refusal("stored prompt templates are not supported"),
        "truncation": Refusal("truncation auto is not supported: a conversation too long for "
                              "the context is a 400, never cut", ("disabled",)),
        "text.verbosity": Refusal(f"text.verbosity {_VERBOSITY}", ("medium",)),
        "include": Refusal("include's message.output_text.logprobs (and top_logprobs above 0) "
                           f"is refused {NEEDS_DECODER}", checked_here=False),
    },
    ignored={
        "metadata": "tags the stored response carries back; they do not reach the model",
        "user": _USER,
        "safety_identifier": _USER,
        "prompt_cache_key": _CACHE_KEY,
        "prompt_cache_retention": CHAT.ignored["prompt_cache_retention"],
        "service_tier": _TIER,
        "client_metadata": "Codex's note of itself, for the server's records",
        "max_tool_calls": "bounds calls of OpenAI's hosted tools, which are left out here",
        "reasoning.summary": "the reasoning comes whole, as reasoning_text, never summarized: "
                             "a summary would only be shorter",
        "stream_options": "include_obfuscation pads OpenAI's stream events; these carry none",
    })

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS,
             "/v1/messages": MESSAGES, "/v1/messages/count_tokens": COUNT_TOKENS,
             "/v1/responses": RESPONSES}
