"""Ollama's request bodies (`POST /api/chat`, `/api/generate`) -> the internal request.

A chat's messages become internal chat messages (`images`, base64 with no
data: prefix, as image parts before the text; `thinking` as the assistant's
reasoning; `tool_calls` with their arguments as an object; a tool result's
`tool_name` as its name); `/api/generate` is a chat of its `system` and its
`prompt` (with its `images`), or with `raw: true` a completion of the prompt as
it is. Both go through the chat or completion endpoint's own parser, so
every dialect gets the same checks, and its errors are renamed to the fields
the client sent (`options.temperature`, `format`, `prompt`).

`format` is `response_format`: `"json"` is json_object, a schema json_schema,
each enforced by constrained decoding. `think` is a reasoning effort: true
(thinking on, no level), false (off), or `low`/`medium`/`high`/`max` by
`REASONING_EFFORTS`. `options` are read by OPTIONS below: what is honoured,
what is refused unless neutral, what is accepted and cannot change the reply.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from serve.core.client_json import Json
from serve.core.errors import ApiError, invalid
from serve.core.request import CompletionRequest
from serve.dialects.openai_request import parse_completion_request, parse_reasoning_effort
from serve.dialects.translation import Conversation, Parts, Translation, chat_request, renamed, string_field

ROLES = ("system", "user", "assistant", "tool")
THINK_LEVELS = ("low", "medium", "high", "max")
MAX_TOP_LOGPROBS = 20
# Options serve samples with, under their internal names (the rest is num_predict and num_ctx).
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
            "stop": "stop"}
# Samplers serve does not have: refused unless at the value that leaves sampling as it is.
NEUTRAL = {"min_p": 0.0, "typical_p": 1.0, "tfs_z": 1.0, "repeat_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat": 0}
# Accepted, and cannot change the reply: how the model is loaded and run on the hardware
# (serve's engine is set up at start), num_keep (serve never shifts the context: a reply that
# reaches its end stops, done_reason "length"), and the settings of a refused sampler
# (repeat_last_n and penalize_newline of repeat_penalty, mirostat's tau and eta).
LOAD_TIME = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread",
             "draft_num_predict")
IGNORED_OPTIONS = frozenset((*LOAD_TIME, "num_keep", "repeat_last_n", "penalize_newline",
                             "mirostat_tau", "mirostat_eta"))
OPTIONS = frozenset((*SAMPLING, "num_predict", "num_ctx", *NEUTRAL, *IGNORED_OPTIONS))
FILL_CONTEXT = -2        # num_predict: generate until the context is full
# The fields each endpoint reads (others are named once in the log).
COMMON_FIELDS = ("model", "stream", "format", "options", "keep_alive", "think", "logprobs",
                 "top_logprobs", "truncate", "shift", "_debug_render_only")
CHAT_FIELDS = frozenset((*COMMON_FIELDS, "messages", "tools"))
GENERATE_FIELDS = frozenset((*COMMON_FIELDS, "prompt", "suffix", "system", "template",
                             "context", "raw", "images", "width", "height", "steps"))
# Fields of /api/generate refused when set, and why.
UNSUPPORTED = {
    "suffix": "suffix is not supported: this server does not fill in the middle",
    "template": "template is not supported: the prompt is built by the model's own chat "
                "format (send raw: true with a prompt already formatted)",
    "context": "context is not supported (Ollama deprecates it): send the conversation to "
               "/api/chat as messages",
    "width": "image generation is not supported", "height": "image generation is not supported",
    "steps": "image generation is not supported"}
# Where an internal field comes from (messages and images are mapped as they are built).
TOP_FIELDS = {"messages": "messages", "tools": "tools", "max_tokens": "options.num_predict",
              **{internal: f"options.{name}" for name, internal in SAMPLING.items()},
              "response_format": "format", "response_format.json_schema": "format",
              "response_format.json_schema.schema": "format"}
IMAGE_TYPES = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"),
               (b"GIF89a", "gif"))
# Go's time.ParseDuration: "5m", "1h30m", "-1s", "0".
DURATION = re.compile(r"-?(0|((\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h))+)")


@dataclass
class Completion:
    """A raw /api/generate: the prompt as it is, and how to name its fields as the client did."""
    request: CompletionRequest
    fields: dict[str, str]

    def error(self, error: ApiError) -> ApiError:
        return renamed(error, self.fields)


def model_name(body: dict) -> str:
    """The body's `model`, which Ollama requires."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is required")
    return model


def loads_only(body: dict, key: str) -> bool:
    """A request with nothing to answer (no messages, no prompt): Ollama's way of loading
    the model, answered at once."""
    return body.get(key) in (None, "", [])


def parse_chat(body: dict, context: int) -> Translation:
    model_name(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages", "messages must be a list")
    conversation = Conversation()
    for i, message in enumerate(messages):
        _message(conversation, message, f"messages[{i}]")
    tools = body.get("tools")
    return _chat(body, context, conversation, {"tools": tools or None})


def parse_generate(body: dict, context: int) -> Translation | Completion:
    model_name(body)
    for name, reason in UNSUPPORTED.items():
        if body.get(name) not in (None, "", []):
            raise invalid(name, reason)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "prompt must be a string")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise invalid("raw", "raw must be a boolean")
    if raw:
        return _raw(body, prompt, context)
    conversation = Conversation()
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise invalid("system", "system must be a string")
    if system:
        conversation.add({"role": "system", "content": system}, "system")
    parts = _images(body.get("images"), "images")
    if parts:
        parts.text(prompt, "prompt")
        conversation.add({"role": "user", "content": parts.content()}, "prompt", parts)
    else:
        conversation.add({"role": "user", "content": prompt}, "prompt")
    return _chat(body, context, conversation, {})


def _raw(body: dict, prompt: str, context: int) -> Completion:
    """The prompt as it is: no chat format, so nothing that needs one."""
    for name in ("system", "images", "format"):
        if body.get(name) not in (None, "", []):
            raise invalid(name, f"{name} needs the chat format, and raw: true sends the prompt "
                                "as it is")
    if body.get("think") not in (None, False):
        raise invalid("think", "think needs the chat format, and raw: true sends the prompt as "
                               "it is")
    completion = {"prompt": prompt, **_common(body, context)}
    on = completion.pop("logprobs", False)
    top = completion.pop("top_logprobs", 0)
    completion["logprobs"] = top if on else None
    fields = {**TOP_FIELDS, "prompt": "prompt", "logprobs": "top_logprobs"}
    try:
        return Completion(parse_completion_request(completion), fields)
    except ApiError as e:
        raise renamed(e, fields) from None


def _chat(body: dict, context: int, conversation: Conversation, extra: dict) -> Translation:
    chat = {"messages": conversation.messages, **extra, **_common(body, context),
            "response_format": _format(body.get("format"))}
    translation = chat_request(chat, {**TOP_FIELDS, **conversation.fields}, [])
    translation.request.thinking, translation.request.thinking_effort = _think(body.get("think"))
    return translation


def _common(body: dict, context: int) -> dict:
    """What chat and generate share, as chat completions fields: sampling, stream, logprobs."""
    _keep_alive(body.get("keep_alive"))
    for name in ("truncate", "shift", "logprobs", "_debug_render_only"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(name, f"{name} must be a boolean")
    if body.get("_debug_render_only"):
        raise invalid("_debug_render_only", "_debug_render_only is not supported: the prompt "
                                            "serve builds is in its log, not in a reply")
    fields = _options(body.get("options"), context)
    stream = body.get("stream")
    fields["stream"] = True if stream is None else stream   # Ollama streams unless told not to
    top = body.get("top_logprobs")
    if top is not None and (not _integral(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if body.get("logprobs"):   # top_logprobs alone is ignored, as Ollama ignores it
        fields.update(logprobs=True, top_logprobs=int(top or 0))
    return fields


def _options(options: Json, context: int) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid("options", "options must be an object")
    fields: dict[str, Any] = {}
    for name, internal in SAMPLING.items():
        value = options.get(name)
        if value is not None:
            fields[internal] = int(value) if name in ("top_k", "seed") and _integral(value) else value
    if isinstance(fields.get("seed"), int) and fields["seed"] < 0:
        del fields["seed"]   # Ollama's -1: a fresh seed for each request
    predict = options.get("num_predict")
    if predict is not None:
        if not _integral(predict) or predict < FILL_CONTEXT:
            raise invalid("options.num_predict", "num_predict must be an integer: the most "
                                                 "tokens to generate, -1 for no limit of its own, "
                                                 "-2 to fill the context")
        if predict > 0:
            fields["max_tokens"] = int(predict)
        elif predict == FILL_CONTEXT:
            fields["max_tokens"] = context   # cut to the room the prompt leaves
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not _integral(num_ctx) or num_ctx < 1):
        raise invalid("options.num_ctx", "num_ctx must be a positive integer")
    if num_ctx is not None and num_ctx > context:
        raise invalid("options.num_ctx", f"num_ctx {int(num_ctx)} is above the context this "
                                         f"model is served with ({context} tokens)")
    for name, neutral in NEUTRAL.items():
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or value != neutral):
            raise invalid(f"options.{name}", f"{name} is not supported: serve samples with "
                                             "temperature, top_p, top_k and seed only (send "
                                             f"{neutral}, or leave it out)")
    return fields


def unread_options(body: dict) -> list[str]:
    """The options Ollama does not know either, for the log (Ollama logs them too)."""
    options = body.get("options")
    return sorted(f"options.{key}" for key in options if key not in OPTIONS) \
        if isinstance(options, dict) else []


def _integral(value: Json) -> bool:
    """An integer, or a float that is one (JSON numbers are floats to Go, which Ollama is)."""
    return not isinstance(value, bool) and (
        isinstance(value, int) or isinstance(value, float) and value.is_integer())


def _keep_alive(value: Json) -> None:
    """Accepted and checked: serve keeps its models loaded for as long as it runs."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return
    if not isinstance(value, str) or not DURATION.fullmatch(value):
        raise invalid("keep_alive", "keep_alive must be a duration such as \"5m\" or a number "
                                    "of seconds")


def _format(value: Json) -> Optional[dict]:
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}
    raise invalid("format", 'format must be "json" or a JSON schema object')


def _think(value: Json) -> tuple[Optional[bool], Optional[str]]:
    if value is None or isinstance(value, bool):
        return value, None
    if value not in THINK_LEVELS:
        raise invalid("think", 'think must be true, false, "low", "medium", "high" or "max"')
    return parse_reasoning_effort(value, "think")


# ---- messages ---------------------------------------------------------------


def _message(conversation: Conversation, message: Json, where: str) -> None:
    if not isinstance(message, dict):
        raise invalid(where, "each message must be an object")
    role = message.get("role")
    role = role.lower() if isinstance(role, str) else role   # as Ollama reads it
    if role not in ROLES:
        raise invalid(f"{where}.role", f"role must be one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise invalid(f"{where}.content", "content must be a string")
    internal: dict[str, Any] = {"role": role, "content": content or ""}
    parts = _images(message.get("images"), f"{where}.images")
    if parts:
        if content:
            parts.text(content, f"{where}.content")
        internal["content"] = parts.content()
    if role == "assistant":
        if message.get("thinking"):
            internal["reasoning_content"] = string_field(message, "thinking", where)
        if message.get("tool_calls"):
            internal["tool_calls"] = _calls(message["tool_calls"], f"{where}.tool_calls")
    elif role == "tool":
        for name, key in (("tool_name", "name"), ("tool_call_id", "tool_call_id")):
            if message.get(name) is not None:
                internal[key] = string_field(message, name, where)
    conversation.add(internal, where, parts or None)


def _calls(calls: Json, where: str) -> list[dict]:
    """An assistant's calls in internal shape: arguments as JSON text, an id only if it had one
    (a result then finds its call by id, else by its place)."""
    if not isinstance(calls, list):
        raise invalid(where, "tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise invalid(f"{where}[{j}]", "a tool call needs a function object")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict):
            raise invalid(f"{where}[{j}].function.arguments", "arguments must be an object")
        internal: dict[str, Any] = {"type": "function", "function": {
            "name": string_field(function, "name", f"{where}[{j}].function"),
            "arguments": json.dumps(arguments, ensure_ascii=False)}}
        if isinstance(call.get("id"), str) and call["id"]:
            internal["id"] = call["id"]
        out.append(internal)
    return out


def _images(images: Json, where: str) -> Optional[Parts]:
    """Base64 images as image parts (data URLs, their type read from their first bytes)."""
    if images is None or images == []:
        return None
    if not isinstance(images, list):
        raise invalid(where, "images must be a list of base64-encoded images")
    parts = Parts()
    for j, image in enumerate(images):
        parts.image(data_url(image, f"{where}[{j}]"), f"{where}[{j}]")
    return parts


def data_url(image: Json, where: str) -> str:
    if not isinstance(image, str):
        raise invalid(where, "an image must be a base64-encoded string")
    if image.startswith("data:"):
        return image   # a data URL already (Ollama wants none, but its meaning is plain)
    head = image[:32]   # whole base64 quanta: 24 bytes, enough for every signature
    try:
        start = base64.b64decode(head + "=" * (-len(head) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(where, "an image must be base64-encoded (with no data: prefix)") from None
    kind = next((name for magic, name in IMAGE_TYPES if start.startswith(magic)),
                "webp" if start[:4] == b"RIFF" and start[8:12] == b"WEBP" else None)
    if kind is None:
        raise invalid(where, "the image is not a PNG, JPEG, GIF or WebP")
    return f"data:image/{kind};base64,{image}"
