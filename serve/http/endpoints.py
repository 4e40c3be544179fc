"""What each endpoint answers, given the handler of its request (serve/http/server.py).

Each is called as `endpoint(handler, method, rest)`: `method` is the request's
(HEAD already GET), `rest` what its route matched (serve/http/routes.py: an id,
the path after a prefix, or ""). An endpoint sends one response through the
handler, or raises an ApiError the handler sends in its place; a generation
goes through the handler's `generate`.
"""
from __future__ import annotations

from typing import Any, Callable
from urllib.parse import parse_qsl

from serve.service import metrics
from serve.core.errors import ApiError
from serve.http.answering import Answering
from serve.dialects import anthropic, openai, responses
from serve.dialects.exchange import Exchange
from serve.dialects.input_items import listing
from serve.core.request import ChatRequest
from serve.service.facade import Service
from serve.service.quote import quote_chat
from serve.service.replies import ChatReply, CompletionReply
from serve.service.response_store import Stored
from serve.http.page import CONTENT_TYPE as PAGE_TYPE, chat_page



def health(handler: Answering, method: str, rest: str) -> None:
    # A warm is idle-time work and requests are served meanwhile, so the answer is 200; its
    # "warming" member tells a router to send this host no new conversations until it is done.
    handler.send_json(200, handler.server.models.health())


def page(handler: Answering, method: str, rest: str) -> None:
    body, policy = chat_page()
    handler.send(200, PAGE_TYPE, body, {"Content-Security-Policy": policy,
                                        "X-Content-Type-Options": "nosniff",
                                        "Referrer-Policy": "no-referrer",
                                        "Cache-Control": "no-cache"})


def metrics_text(handler: Answering, method: str, rest: str) -> None:
    handler.send(200, metrics.CONTENT_TYPE, handler.server.models.render_metrics())


def models(handler: Answering, method: str, rest: str) -> None:
    handler.send_json(200, {"object": "list", "data": handler.server.models.listing()})


def model(handler: Answering, method: str, model_id: str) -> None:
    found = handler.server.models.named(model_id)
    if found is None:
        raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                       code="model_not_found")
    handler.send_json(200, found.model())


# Each exchange is made naming the main model; the handler's generate names the one that
# answers (serve/service/models.py picks it).

def chat(handler: Answering, method: str, rest: str) -> None:
    main = handler.server.service.options.model_id
    handler.generate(openai.ChatExchange(handler.read_json(), main), _chat_on)


def complete(handler: Answering, method: str, rest: str) -> None:
    main = handler.server.service.options.model_id
    handler.generate(openai.CompletionExchange(handler.read_json(), main), _complete_on)


def messages(handler: Answering, method: str, rest: str) -> None:
    exchange = anthropic.Exchange(handler.read_json(), handler.server.service.options.model_id)
    if exchange.billing is not None:
        handler.server.log_once("billing", f"/v1/messages: {exchange.billing} is Claude Code's "
                                "billing header, which changes on every request: it is left out "
                                "of the prompt (logged once)")
    handler.generate(exchange, _chat_on)


def create_response(handler: Answering, method: str, rest: str) -> None:
    service = handler.server.service
    exchange = responses.Exchange(handler.read_json(), service.responses, service.options.model_id)
    # The id the reply is stored under, for a router to remember this host by: the
    # response's next turn and its retrieval find it only here (docs/serving-a-team.md).
    handler.generate(exchange, _chat_on,
                     {"X-Serve-Response-Id": exchange.id} if exchange.stored else {})


def count_tokens(handler: Answering, method: str, rest: str) -> None:
    translation = anthropic.parse_request(handler.read_json(), counting=True)
    translation.request.request_id = handler.request_id
    service = handler.server.models.pick(handler.current.named_model, translation.request)
    try:
        count = service.count_chat(translation.request, handler.hangup)
        found = quote_chat(service, translation.request)
    except ApiError as e:
        raise translation.error(e) from None
    # Anthropic's clients read input_tokens and ignore what they do not know
    handler.send_json(200, {"input_tokens": count, "waste": {**found.body(), "positions": count}})


QUOTED = ("chat", "messages", "responses")   # the dialects /v1/quote reads


def _quoted(dialect: str, body: dict, service: Service) -> Exchange[ChatReply]:
    main = service.options.model_id
    if dialect == "messages":
        return anthropic.Exchange(body, main)
    if dialect == "responses":
        return responses.Exchange(body, service.responses, main)
    return openai.ChatExchange(body, main)


def quote(handler: Answering, method: str, rest: str) -> None:
    """What a request body would cost before its first token, without the engine
    (serve/service/quote.py); `?dialect=` names the body's API (chat by default)."""
    dialect = dict(parse_qsl(handler.path.partition("?")[2])).get("dialect", "chat")
    if dialect not in QUOTED:
        raise ApiError(400, f"dialect must be one of {', '.join(QUOTED)}, not {dialect!r}",
                       param="dialect", code="invalid_value")
    exchange = _quoted(dialect, handler.read_json(), handler.server.service)
    request = exchange.request
    assert isinstance(request, ChatRequest)   # each of these dialects parses into a chat
    request.request_id = handler.request_id
    service = handler.server.models.pick(handler.current.named_model, request)
    try:
        found = quote_chat(service, request)
    except ApiError as e:
        raise exchange.error(e) from None
    handler.send_json(200, {"object": "quote", **found.body()})


def stored_response(handler: Answering, method: str, response_id: str) -> None:
    store = handler.server.service.responses
    stored = _stored(handler, response_id)
    if method == "DELETE" and not store.delete(response_id):
        raise _not_stored(response_id)
    handler.send_json(200, stored.response if method == "GET" else
                      {"id": response_id, "object": "response.deleted", "deleted": True})


def input_items(handler: Answering, method: str, response_id: str) -> None:
    items = _stored(handler, response_id).input_items
    handler.send_json(200, listing(items, dict(parse_qsl(handler.path.partition("?")[2],
                                                         keep_blank_values=True))))


def cancel(handler: Answering, method: str, response_id: str) -> None:
    _stored(handler, response_id)
    # As OpenAI answers for a response not made with background: true, the only kind
    # there is here (background is refused at creation).
    raise ApiError(400, "Cannot cancel a synchronous response: only responses created with "
                        "background: true can be cancelled, and this server runs none")


def _stored(handler: Answering, response_id: str) -> Stored:
    stored = handler.server.service.responses.get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return stored


def _chat_on(service: Service) -> Callable[[Any, Any], ChatReply]:
    return service.chat   # looked up on the service: a test may replace it on the instance


def _complete_on(service: Service) -> Callable[[Any, Any], CompletionReply]:
    return service.complete


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id {response_id!r}", param="response_id",
                    code="not_found")
