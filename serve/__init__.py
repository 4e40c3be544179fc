"""serve: an OpenAI- and Anthropic-compatible server for mixture-of-experts models that
stream their experts off an SSD (libwaste).

`python -m serve` (or the `serve` command) runs it. This module is the public face:
what bench/, tools/ and the tests may import without reaching into a package.
Everything else moves freely; docs/architecture.md says where each thing lives.
"""
from serve.core.errors import ApiError
from serve.core.reply import Delta, Reply, Usage
from serve.core.request import ChatRequest, CompletionRequest, Sampling
from serve.core.segment import Segment
from serve.dialects.anthropic import MessagesExchange, parse_request as parse_anthropic_request
from serve.dialects.openai import ChatExchange, CompletionExchange
from serve.dialects.openai_request import parse_chat_request, parse_completion_request
from serve.dialects.responses import ResponsesExchange
from serve.engine.api import EngineApi
from serve.engine.binding import Engine, load_library
from serve.engine.decode import Decoder
from serve.engine.types import EngineConfig, GenParams, WasteError
from serve.formats.base import ChatFormat
from serve.formats.format_choice import resolve_chat_format
from serve.formats.grammar import compile_grammar, Vocabulary
from serve.formats.xtml.grammar import Markup, xtml_grammar
from serve.formats.xtml.render import build_chat_segments
from serve.service.facade import Service, ServiceOptions
from serve.service.image_check import check_pixels, Undecodable
from serve.service.journal import Event, Emitted, Listener
from serve.service.replies import ChatReply, CompletionReply
from serve.service.response_store import ResponseStore
from serve.snapshots.cache import PrefixCache
from serve.snapshots.policy import Costs, SnapshotPolicy
from serve.snapshots.reply_memory import ReplyMemory
from serve.tokenizer.encoder import BpeTokenizer
from serve.tokenizer.vocabulary import load as load_vocabulary

__all__ = [
    # the request, the reply, errors
    "ApiError", "ChatRequest", "CompletionRequest", "Sampling", "Segment", "Delta", "Reply",
    "Usage", "ChatReply", "CompletionReply", "Event", "Emitted", "Listener",
    # the wire formats
    "parse_chat_request", "parse_completion_request", "parse_anthropic_request",
    "ChatExchange", "CompletionExchange", "MessagesExchange", "ResponsesExchange",
    "ResponseStore",
    # the engine
    "EngineApi", "Engine", "EngineConfig", "GenParams", "WasteError", "load_library", "Decoder",
    # chat formats and structured output
    "ChatFormat", "resolve_chat_format", "build_chat_segments", "Vocabulary", "compile_grammar",
    "Markup", "xtml_grammar",
    # the service and its snapshots
    "Service", "ServiceOptions", "PrefixCache", "Costs", "SnapshotPolicy", "ReplyMemory",
    "check_pixels", "Undecodable",
    # serve's own tokenizer
    "BpeTokenizer", "load_vocabulary",
]
