"""The ids a text or a chat request would be fed as, and ids back to bytes: /tokenize's and
/detokenize's answers (serve/dialects/tokenize.py has their shapes).

Each goes through the same prompt builder a generation does (serve/service/prompt.py),
so the ids are the engine's for the same request: a completion's prompt by its
tokenizer (BOS first when asked, as add_bos puts it), a chat's messages rendered and
tokenized, remembered replies laid over as the model produced them. Without the engine
when serve's own tokenizer is in use; else as one errand between the engine's calls.
"""
from __future__ import annotations

from typing import Sequence

from serve.core.errors import invalid
from serve.core.request import ChatRequest
from serve.engine.types import UnencodableText
from serve.service.facade import Service
from serve.service.images import StagedImages
from serve.service.prompt import check_fits


def text_ids(service: Service, text: str, *, param: str, bos: bool, markup: bool) -> list[int]:
    """`text` as the completions endpoint tokenizes its prompt, or (`markup`) with special
    tokens' texts read as their ids; after the BOS ids when `bos`."""
    prompts = service.prompts
    check_fits(service.engine, len(text), param, service.options.context_beyond)
    tokenize = prompts.tokenizer.tokenize_markup if markup else prompts.tokenizer.tokenize
    try:
        ids = prompts.tokenizing(lambda: tokenize(text))
    except UnencodableText as e:
        raise invalid(param, f"{param} cannot be tokenized: {e}") from None
    return (prompts.bos if bos else []) + ids


def chat_ids(service: Service, req: ChatRequest, *, generation_prompt: bool, bos: bool
             ) -> list[int]:
    """The ids a chat request's prompt would be fed as: the conversation, then (when
    `generation_prompt`) the opening of the reply. Images are refused: their positions are
    the engine's to expand, from the picture."""
    check = service.prompts.check(req)
    if check.images:
        param, _ = check.images[0]
        raise invalid(param, "an image cannot be tokenized here: the engine expands it into "
                             "its positions when it encodes it; /v1/messages/count_tokens "
                             "counts a conversation with images")
    with StagedImages(service.options.allow_local_images) as staged:
        prompt = service.prompts.of_chat(req, check, staged, fit=False)
    ids = prompt.ids if generation_prompt else prompt.history
    return (service.prompts.bos if bos else []) + ids


def pieces(service: Service, ids: Sequence[int]) -> list[bytes]:
    """Each id's bytes; a 400 naming `tokens[i]`, the first id no token has."""
    return service.prompts.pieces(ids, "tokens")
