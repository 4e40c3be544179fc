"""What each endpoint answers, given the handler of its request (serve/http/server.py).

Each is called as `endpoint(handler, method, rest)`: `method` is the request's
(HEAD already GET), `rest` what its route matched (serve/http/routes.py: an id,
the path after a prefix, or ""). An endpoint sends one response through the
handler, or raises an ApiError the handler sends in its place; a generation
goes through serve/http/job_start.py's `generate`.
"""
from __future__ import annotations

import threading
from typing import Optional
from urllib.parse import parse_qsl

from serve.service import metrics
from serve.core.errors import ApiError
from serve.http.answering import Answering
from serve.dialects import anthropic, openai, responses
from serve.dialects.exchange import Exchange
from serve.dialects.input_items import listing
from serve.dialects.framing import SSE
from serve.dialects.sse import sse_comment, sse_named
from serve.http.background import Keeper
from serve.service.background_records import Record
from serve.http.job_start import generate, start_job
from serve.service.jobs import Job
from serve.core.request import ChatRequest
from serve.service.quote import quote_chat
from serve.service.replies import ChatReply
from serve.service.response_store import OwnedResponses, Stored
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


# Each exchange is made naming the main model; job_start names the one that
# answers (serve/service/models.py picks it).

def chat_completions(handler: Answering, method: str, rest: str) -> None:
    main, body = handler.server.service.options.model_id, handler.read_json()
    generate(handler, openai.ChatExchange(body, main), body)


def completions(handler: Answering, method: str, rest: str) -> None:
    main, body = handler.server.service.options.model_id, handler.read_json()
    generate(handler, openai.CompletionExchange(body, main), body)


def messages(handler: Answering, method: str, rest: str) -> None:
    body = handler.read_json()
    exchange = anthropic.MessagesExchange(body, handler.server.service.options.model_id,
                                  handler.current.principal.namespace)
    if exchange.billing is not None:
        handler.server.log_once("billing", f"/v1/messages: {exchange.billing} is Claude Code's "
                                "billing header, which changes on every request: it is left out "
                                "of the prompt (logged once)")
    generate(handler, exchange, anthropic.without_billing(body))


def create_response(handler: Answering, method: str, rest: str) -> None:
    service = handler.server.service
    body = handler.read_json()
    exchange = responses.ResponsesExchange(body, _responses(handler), service.options.model_id)
    if exchange.background:
        return _background(handler, exchange)
    # The id the reply is stored under, for a router to remember this host by: the
    # response's next turn and its retrieval find it only here (docs/serving-a-team.md).
    generate(handler, exchange, body,
                     {"X-Serve-Response-Id": exchange.id} if exchange.stored else {})


def count_tokens(handler: Answering, method: str, rest: str) -> None:
    body = handler.read_json()
    translation = anthropic.parse_request(body, counting=True,
                                          owner=handler.current.principal.namespace)
    handler.server.note_unread(handler.current.path, anthropic.unread(body, counting=True))
    translation.request.request_id = handler.request_id
    service = handler.server.models.pick(handler.current.named_model, translation.request)
    try:
        count = service.count_chat(translation.request, handler.client_left)
        found = quote_chat(service, translation.request)
    except ApiError as e:
        raise translation.error(e) from None
    # Anthropic's clients read input_tokens and ignore what they do not know
    handler.send_json(200, {"input_tokens": count, "waste": {**found.body(), "positions": count}})


QUOTED = ("chat", "messages", "responses")   # the dialects /v1/quote reads


def _quoted(handler: Answering, dialect: str, body: dict) -> Exchange[ChatReply]:
    main, owner = handler.server.service.options.model_id, handler.current.principal.namespace
    if dialect == "messages":
        exchange: Exchange[ChatReply] = anthropic.MessagesExchange(body, main, owner)
    elif dialect == "responses":
        exchange = responses.ResponsesExchange(body, _responses(handler), main)
    else:
        exchange = openai.ChatExchange(body, main)
    exchange.request.owner = owner   # what is restorable is only what its owner left
    return exchange


def quote(handler: Answering, method: str, rest: str) -> None:
    """What a request body would cost before its first token, without the engine
    (serve/service/quote.py); `?dialect=` names the body's API (chat by default)."""
    dialect = dict(parse_qsl(handler.path.partition("?")[2])).get("dialect", "chat")
    if dialect not in QUOTED:
        raise ApiError(400, f"dialect must be one of {', '.join(QUOTED)}, not {dialect!r}",
                       param="dialect", code="invalid_value")
    exchange = _quoted(handler, dialect, handler.read_json())
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
    background = handler.server.background
    query = dict(parse_qsl(handler.path.partition("?")[2], keep_blank_values=True))
    if method == "DELETE":
        forgot = background.forget(response_id, handler.owner)   # its record, if it had one
        if not _responses(handler).delete(response_id) and not forgot:
            raise _not_stored(response_id)
        return handler.send_json(200, {"id": response_id, "object": "response.deleted",
                                       "deleted": True})
    # Kept here, else recorded on disk (ended long ago, or before a restart).
    found = background.get(response_id, handler.owner) or background.recorded(response_id,
                                                                               handler.owner)
    if found is not None:
        if query.get("stream") == "true":
            return _resume(handler, found, query.get("starting_after"))
        return handler.send_json(200, found.response if isinstance(found, Record)
                                 else found.response())
    stored = _stored(handler, response_id)
    if query.get("stream") == "true":
        raise ApiError(400, "only a background response's events can be streamed again",
                       param="stream")
    handler.send_json(200, stored.response)


def input_items(handler: Answering, method: str, response_id: str) -> None:
    items = _stored(handler, response_id).input_items
    handler.send_json(200, listing(items, dict(parse_qsl(handler.path.partition("?")[2],
                                                         keep_blank_values=True))))


def cancel(handler: Answering, method: str, response_id: str) -> None:
    keeper = handler.server.background.get(response_id, handler.owner)
    if keeper is not None:
        keeper.cancel()
        return handler.send_json(200, keeper.response())
    record = handler.server.background.recorded(response_id, handler.owner)
    if record is not None:   # it ended already (before a restart, say): nothing to stop
        return handler.send_json(200, record.response)
    _stored(handler, response_id)
    # As OpenAI answers for a response not made with background: true.
    raise ApiError(400, "Cannot cancel a synchronous response: only responses created with "
                        "background: true can be cancelled")


def _background(handler: Answering, exchange: responses.ResponsesExchange) -> None:
    """A background response: its job starts, and the answer is at once (its stream, when
    asked, follows it from its first event)."""
    job, _, reader = start_job(handler, exchange, None, lambda: False)
    keeper = Keeper(exchange, job, reader, handler.owner, handler.server.background.records)
    handler.server.background.add(keeper)
    if exchange.request.stream:
        return _resume(handler, keeper, None)
    handler.send_json(200, keeper.response(), {"X-Serve-Response-Id": exchange.id,
                                               **handler.current.reply_headers})


def _resume(handler: Answering, keeper: Keeper | Record, after: Optional[str]) -> None:
    """A background response's events numbered above `after` (all of them for None), then
    live until it ends; the client leaving ends only this stream."""
    try:
        start = -1 if after is None else int(after)
    except ValueError:
        raise ApiError(400, "starting_after must be an integer", param="starting_after") from None
    failed = threading.Event()
    writer = handler.open_stream(SSE.content_type, lambda: None, failed.set)
    try:
        for batch in keeper.events(start):
            if failed.is_set() or handler.client_left():
                handler.current.status = 499
                return
            # Not the exchange's in_progress heartbeat, which would take a sequence number.
            writer.put(sse_named(batch) if batch else sse_comment("keepalive"))
    finally:
        writer.close()


def job_list(handler: Answering, method: str, rest: str) -> None:
    """GET /v1/jobs: the caller's jobs still known, running and recently finished."""
    handler.send_json(200, {"object": "list", "data": [
        job.describe() for job in handler.server.models.jobs.owned(handler.owner)]})


def jobs(handler: Answering, method: str, job_id: str) -> None:
    """GET /v1/jobs/{id}: a job's state, prefill and output so far (its X-Serve-Job id)."""
    handler.send_json(200, _job(handler, job_id).describe())


def stop_job(handler: Answering, method: str, job_id: str) -> None:
    """POST /v1/jobs/{id}/stop: end the job at its next token or prefill chunk, as a normal
    finish with what it said so far (its readers get that finish)."""
    job = _job(handler, job_id)
    job.stop()
    handler.send_json(200, {**job.describe(), "stop_requested": True})


def answer_job(handler: Answering, method: str, job_id: str) -> None:
    """POST /v1/jobs/{id}/answer: "answer now". The job's think channel closes at its next
    token (serve/service/reasoning_budget.py) and the model answers, in the same stream;
    `answering` is false when there is no reasoning left to close."""
    job = _job(handler, job_id)
    budget = job.journal.reasoning
    handler.send_json(200, {**job.describe(),
                            "answering": budget is not None and budget.answer_now()})


def _job(handler: Answering, job_id: str) -> Job:
    job = handler.server.models.jobs.get(job_id, handler.owner)
    if job is None:
        raise ApiError(404, f"no job with id {job_id!r}", param="job_id", code="not_found")
    return job


def _responses(handler: Answering) -> OwnedResponses:
    """The stored responses of the request's sender: another's ids are not found."""
    return handler.server.service.responses.of(handler.current.principal.namespace)


def _stored(handler: Answering, response_id: str) -> Stored:
    stored = _responses(handler).get(response_id)
    if stored is None:
        raise _not_stored(response_id)
    return stored


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response with id {response_id!r}", param="response_id",
                    code="not_found")
