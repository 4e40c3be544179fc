"""OpenAI's response shapes: chat.completion and text_completion bodies, their chunks, usage."""
from __future__ import annotations

from typing import Optional

from serve.core.reply import Usage


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def chat_completion(rid: str, created: int, model: str, message: dict,
                    finish_reason: str, usage: Usage, logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage_body(usage), "waste": usage.waste}


def chat_chunk(rid: str, created: int, model: str, delta: dict,
               finish_reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def text_completion(rid: str, created: int, model: str, text: str,
                    finish_reason: Optional[str], usage: Optional[Usage] = None,
                    logprobs: Optional[dict] = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage_body(usage)
        body["waste"] = usage.waste
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str, usage: Usage) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_body(usage), "waste": usage.waste}
