"""The route table: which endpoint answers a path, with which methods, in which error shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from serve.core.errors import ApiError
from serve.http.answering import Answering
from serve.dialects import anthropic, ollama
from serve.http import endpoints, ollama_endpoints, tokens


ID = "{id}"


@dataclass(frozen=True)
class Route:
    path: str                                 # the whole path, ID standing for one segment;
    methods: tuple[str, ...]                  # with `prefix`, how paths begin
    answer: Callable[[Answering, str, str], None]   # (handler, method, what match() found)
    prefix: bool = False
    open: bool = False                        # no API key: it holds no data (the page asks for one)
    errors: Callable[[ApiError], dict] = ApiError.body   # the error shape its clients read
    label: str = ""                           # its endpoint in /metrics, when not the path

    def match(self, path: str) -> Optional[str]:
        """None if `path` is not this route's; else the ID segment, the path after a
        prefix, or "" for a plain path."""
        head, has_id, tail = self.path.partition(ID)
        if not has_id:
            if path == self.path:
                return ""
            return path[len(self.path):] if self.prefix and path.startswith(self.path) else None
        segment = path[len(head):len(path) - len(tail)]   # "" when head and tail overlap
        if path.startswith(head) and path.endswith(tail) and segment and "/" not in segment:
            return segment
        return None


MESSAGES = "/v1/messages"
METRICS = "/metrics"   # needs a key when keys are set, unless the server opens it (--metrics-open)
ROUTES = (
    Route("/health", ("GET",), endpoints.health, open=True),
    Route("/", ("GET",), endpoints.page, open=True),
    Route(METRICS, ("GET",), endpoints.metrics_text),
    Route("/v1/models", ("GET",), endpoints.models),
    Route("/v1/models/", ("GET",), endpoints.model, prefix=True, label="/v1/models/{model}"),
    Route("/v1/chat/completions", ("POST",), endpoints.chat_completions),
    Route("/v1/completions", ("POST",), endpoints.completions),
    Route(MESSAGES, ("POST",), endpoints.messages, errors=anthropic.error_body),
    Route(MESSAGES + "/count_tokens", ("POST",), endpoints.count_tokens, errors=anthropic.error_body),
    Route("/v1/quote", ("POST",), endpoints.quote),
    Route("/v1/responses", ("POST",), endpoints.create_response),
    Route(f"/v1/responses/{ID}", ("GET", "DELETE"), endpoints.stored_response),
    Route(f"/v1/responses/{ID}/input_items", ("GET",), endpoints.input_items),
    Route(f"/v1/responses/{ID}/cancel", ("POST",), endpoints.cancel),
    Route("/v1/jobs", ("GET",), endpoints.job_list),
    Route(f"/v1/jobs/{ID}", ("GET",), endpoints.jobs),
    Route(f"/v1/jobs/{ID}/stop", ("POST",), endpoints.stop_job),
    Route(f"/v1/jobs/{ID}/answer", ("POST",), endpoints.answer_job),
    # llama.cpp's and vLLM's paths, and SGLang's under /v1 (serve/dialects/tokenize.py)
    Route("/tokenize", ("POST",), tokens.tokenize),
    Route("/detokenize", ("POST",), tokens.detokenize),
    Route("/v1/tokenize", ("POST",), tokens.tokenize),
    Route("/v1/detokenize", ("POST",), tokens.detokenize),
    # Ollama's API: its own error shape on every path under /api/, served or not.
    *(Route(path, methods, answer, errors=ollama.error_body) for path, methods, answer in (
        ("/api/version", ("GET",), ollama_endpoints.version),
        ("/api/tags", ("GET",), ollama_endpoints.tags),
        ("/api/ps", ("GET",), ollama_endpoints.running),
        ("/api/show", ("POST",), ollama_endpoints.show),
        ("/api/chat", ("POST",), ollama_endpoints.api_chat),
        ("/api/generate", ("POST",), ollama_endpoints.api_generate))),
    Route("/api/", ("GET", "POST", "PUT", "PATCH", "DELETE"), ollama_endpoints.elsewhere,
          prefix=True, errors=ollama.error_body, label="/api/{other}"),
)
ROOT = next(r for r in ROUTES if r.path == "/")   # answers for a target that is no path


def find_route(path: str) -> Optional[Route]:
    return next((r for r in ROUTES if r.match(path) is not None), None)


def nearest_route(path: str) -> Route:
    """The route whose path begins this one most closely ("/" begins every path, and answers
    for one that is not a path at all)."""
    fitting = [r for r in ROUTES if path.startswith(r.path)]
    return max(fitting, key=lambda r: len(r.path)) if fitting else ROOT


def needs_key(route: Optional[Route], metrics_open: bool) -> bool:
    """Is a key needed to be answered (when keys are set)? Not for an open route, nor for
    /metrics opened by --metrics-open; always for a path no route answers."""
    return route is None or not (route.open or route.path == METRICS and metrics_open)


def endpoint_label(path: str) -> str:
    """The endpoint a path counts under in /metrics: a route, never a client's arbitrary path."""
    route = find_route(path)
    return "other" if route is None else route.label or route.path


def allowed(route: Route) -> str:
    """The Allow header of a route's 405 (RFC 9110 15.5.6: a 405 must say what is allowed)."""
    return ", ".join(route.methods + (("HEAD",) if "GET" in route.methods else ()))
