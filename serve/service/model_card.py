"""The served context in a model's entry of /v1/models, under the names other servers use.

An agent that sizes its prompts from the model list reads the field its usual
server writes, so the one number goes out under each name (docs/api.md says
which client reads which): vLLM's `max_model_len` (SGLang's model cards too),
LM Studio's `max_context_length`, and `context_length`, OpenRouter's. Each is
the context the engine was started with (`--ctx`, or `--chores-ctx` for a
chores model), not what the model was trained on: it is what a prompt and its
reply must fit in here.
"""
from __future__ import annotations

CONTEXT_FIELDS = ("max_model_len", "max_context_length", "context_length")


def context_fields(ctx: int) -> dict[str, int]:
    return {name: ctx for name in CONTEXT_FIELDS}
