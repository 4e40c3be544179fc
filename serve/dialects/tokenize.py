"""`POST /tokenize` and `/detokenize` (and their `/v1/` twins), in llama.cpp's and vLLM's shapes.

Three request forms, told apart by the field that carries the text:

- llama.cpp's `{"content": ..., "add_special", "parse_special", "with_pieces"}` ->
  `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id": .., "piece": ..}]}` (a piece
  is its text, or its bytes as a list when they are not whole UTF-8);
- vLLM's `{"prompt": ..., "add_special_tokens", "return_token_strs"}` and
- vLLM's `{"messages": [...], "add_generation_prompt", "add_special_tokens", "tools",
  "return_token_strs"}` -> `{"count", "max_model_len", "tokens", "token_strs"}`.

Text is tokenized as the completions endpoint tokenizes its prompt (as text: a
special token's text is ordinary text, unless `parse_special` asks for markup);
messages as a chat request with the same fields is rendered and tokenized, the
chat format's structure as markup and what the client wrote as text. So the ids
are the ones the engine would be fed. `/detokenize` takes `{"tokens": [ids]}` and
answers `{"content": text}` (llama.cpp's) with the same text as `prompt` (vLLM's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from serve.core.client_json import Json
from serve.core.errors import invalid
from serve.core.request import ChatRequest
from serve.dialects.openai_request import MAX_TOKEN_ID, parse_chat_request, unknown_fields

# The chat fields that shape a chat request's prompt (the rest only shape its reply).
PROMPT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "reasoning_effort",
                 "parallel_tool_calls")
TOKENIZE_FIELDS = frozenset((
    "model", "content", "add_special", "parse_special", "with_pieces",     # llama.cpp
    "prompt", "add_special_tokens", "return_token_strs", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs",     # vLLM
    *PROMPT_FIELDS))
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))


@dataclass
class TokenizeAsk:
    """What a /tokenize body asks for, in no server's shape."""
    llama: bool                       # llama.cpp's form (content): its reply shape
    param: str                        # the field holding the text, for errors
    text: Optional[str] = None        # content or prompt; None: `chat`
    chat: Optional[ChatRequest] = None
    bos: bool = False                 # the ids add_bos puts first (add_special, add_special_tokens)
    markup: bool = False              # special tokens' texts as their ids (parse_special)
    generation_prompt: bool = True    # a chat's ids end with the reply's opening
    pieces: bool = False              # llama.cpp's with_pieces
    strings: bool = False             # vLLM's return_token_strs
    ignored: tuple[str, ...] = ()     # fields not read, for the log


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be a boolean")
    return value


def parse_tokenize(body: dict) -> TokenizeAsk:
    given = [name for name in ("content", "prompt", "messages") if name in body]
    if len(given) != 1:
        raise invalid(given[1] if given else "content",
                      "send one of content (llama.cpp's form), prompt or messages (vLLM's)")
    (param,) = given
    ignored = tuple(unknown_fields(body, TOKENIZE_FIELDS))
    if param == "messages":
        return _chat(body, ignored)
    text = body[param]
    if not isinstance(text, str):
        raise invalid(param, f"{param} must be a string")
    if param == "content":
        return TokenizeAsk(True, param, text, bos=_flag(body, "add_special", False),
                           markup=_flag(body, "parse_special", False),
                           pieces=_flag(body, "with_pieces", False), ignored=ignored)
    return TokenizeAsk(False, param, text, bos=_flag(body, "add_special_tokens", True),
                       strings=_flag(body, "return_token_strs", False), ignored=ignored)


def _chat(body: dict, ignored: tuple[str, ...]) -> TokenizeAsk:
    if _flag(body, "continue_final_message", False):
        raise invalid("continue_final_message", "continue_final_message is not supported: a "
                      "prompt here always ends with a whole message (a chat request's does too)")
    if body.get("chat_template") is not None:
        raise invalid("chat_template", "chat_template is not supported: a prompt is rendered "
                                       "by the container's own chat format")
    if body.get("chat_template_kwargs") not in (None, {}):
        raise invalid("chat_template_kwargs", "chat_template_kwargs is not supported: the "
                      "prompt's reasoning is chosen by reasoning_effort, as on chat completions")
    request = parse_chat_request({name: body[name] for name in PROMPT_FIELDS if name in body})
    return TokenizeAsk(False, "messages", chat=request,
                       bos=_flag(body, "add_special_tokens", False),
                       generation_prompt=_flag(body, "add_generation_prompt", True),
                       strings=_flag(body, "return_token_strs", False), ignored=ignored)


def tokenize_reply(ask: TokenizeAsk, ids: list[int], pieces: list[bytes], context: int) -> dict:
    """The reply in the form's own shape; `pieces` are each id's bytes (asked for only when
    the reply shows them), `context` the served context (vLLM's max_model_len)."""
    if ask.llama:
        if not ask.pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": token, "piece": _piece(piece)} for token, piece in zip(ids, pieces)]}
    return {"count": len(ids), "max_model_len": context, "tokens": ids,
            "token_strs": [token_string(piece) for piece in pieces] if ask.strings else None}


def wants_pieces(ask: TokenizeAsk) -> bool:
    return ask.pieces or ask.strings


def _piece(piece: bytes) -> str | list[int]:
    """llama.cpp's piece: its text, or its bytes when they are not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _byte_letters() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's, which Hugging Face
    tokenizers name tokens by): printable Latin-1 bytes stand for themselves, the others for
    the characters from U+0100 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    letters = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in letters:
            letters[b] = chr(256 + extra)
            extra += 1
    return letters


_LETTERS = _byte_letters()


def token_string(piece: bytes) -> str:
    """vLLM's token_strs entry (the tokenizer's convert_ids_to_tokens): a byte-level BPE
    token's bytes spelled in byte letters (" world" -> "Ġworld")."""
    return "".join(_LETTERS[b] for b in piece)


def parse_detokenize(body: dict) -> tuple[list[int], tuple[str, ...]]:
    """The ids to detokenize, and the fields not read (for the log)."""
    tokens: Json = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", "tokens must be a list of token ids")
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= MAX_TOKEN_ID:
            raise invalid(f"tokens[{i}]", "a token id must be a non-negative integer")
    return tokens, tuple(unknown_fields(body, DETOKENIZE_FIELDS))


def detokenize_reply(text: str) -> dict:
    return {"content": text, "prompt": text}
