"""What Ollama's endpoints answer (serve/dialects/ollama.py says how), called as every endpoint
is (serve/http/endpoints.py): `endpoint(handler, method, rest)`.

A body's `model` picks the model that answers as on every endpoint, with or
without Ollama's `:latest` tag. A chat with no messages, or a generate with no
prompt, is Ollama's way of loading a model: it is answered at once, `done_reason:
"load"`, whatever its `keep_alive` (serve's models stay loaded while it runs, so
there is nothing to unload either).
"""
from __future__ import annotations

from serve.core.errors import ApiError
from serve.dialects import ollama, ollama_models
from serve.dialects.exchange import Exchange
from serve.dialects.ollama_request import loads_only, model_name
from serve.http.answering import Answering
from serve.http.job_start import generate
from serve.service.facade import Service
from serve.service.replies import ChatReply, CompletionReply

# The endpoints a 404 under /api/ names.
SERVED = "/api/version, /api/tags, /api/ps, /api/show, /api/chat and /api/generate"


def version(handler: Answering, method: str, rest: str) -> None:
    handler.send_json(200, ollama_models.version_body())


def tags(handler: Answering, method: str, rest: str) -> None:
    handler.send_json(200, ollama_models.tags(handler.server.models.services))


def running(handler: Answering, method: str, rest: str) -> None:
    handler.send_json(200, ollama_models.running(handler.server.models.services))


def show(handler: Answering, method: str, rest: str) -> None:
    body = handler.read_json()
    if "model" not in body and "name" in body:   # Ollama's older name for the field
        body["model"] = body["name"]
    handler.send_json(200, ollama_models.show(_named(handler, body)))


def api_chat(handler: Answering, method: str, rest: str) -> None:
    body = handler.read_json()
    service = _named(handler, body)
    if loads_only(body, "messages"):
        return _loaded(handler, service, {"message": {"role": "assistant", "content": ""}})
    exchange = ollama.OllamaChatExchange(body, service.options.model_id, service.engine.info.ctx_max)
    generate(handler, exchange, body)


def api_generate(handler: Answering, method: str, rest: str) -> None:
    body = handler.read_json()
    service = _named(handler, body)
    if loads_only(body, "prompt"):
        return _loaded(handler, service, {"response": ""})
    exchange = ollama.OllamaGenerateExchange(body, service.options.model_id,
                                       service.engine.info.ctx_max)
    # One exchange writes both replies; each call sees it as the one its reply needs.
    if exchange.raw:
        completion: Exchange[CompletionReply] = exchange
        generate(handler, completion, body)
    else:
        chat_reply: Exchange[ChatReply] = exchange
        generate(handler, chat_reply, body)


def elsewhere(handler: Answering, method: str, rest: str) -> None:
    """Ollama's other endpoints (pulling, creating, copying, embedding): one model is served,
    from its container, and none of them has a meaning here."""
    raise ApiError(404, f"/api/{rest} is not served: this server answers {SERVED}",
                   code="not_found")


def _named(handler: Answering, body: dict) -> Service:
    """The model `body` names (the main one for a name serve does not serve), noted as the
    handler's pick for the generation too."""
    name = ollama.model_id(model_name(body))
    handler.current.named_model = name
    return handler.server.models.named(name) or handler.server.models.main


def _loaded(handler: Answering, service: Service, reply: dict) -> None:
    handler.send_json(200, {"model": ollama.ollama_name(service.options.model_id),
                            "created_at": ollama.created_at(), **reply, "done": True,
                            "done_reason": "load"})
