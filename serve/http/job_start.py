"""How a generation request becomes a job (serve/service/jobs.py) and is answered from it: its
class, the model that answers it, the key under which identical requests share one job, and
the following of the job's events into the request's exchange.

Two requests are the same question when they name the same endpoint, carry the
same credentials and class header, and their parsed bodies are equal with keys
in any order (Codex resends its body with `client_metadata` reordered). Left
out of the comparison, because they change how a reply is framed and not what
is generated: `stream` and `stream_options` (a client may stream its first try
and block on the retry). The caller also leaves out what a dialect already keeps
out of the prompt (Claude Code's billing header, which changes on every request).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional

from serve.core.ids import new_id
from serve.core.request import CompletionRequest
from serve.core.work import CLASS_HEADER
from serve.dialects.exchange import R, Exchange
from serve.http.answering import Answering
from serve.http.sinks import ExchangeSink
from serve.service.facade import Service
from serve.service.jobs import Job
from serve.service.journal import Journal

FRAMING = ("stream", "stream_options")
_SLICE = 1 << 20   # characters of a text hashed at a time


def job_key(path: str, owner: str, work: str, body: dict) -> str:
    """A digest of everything that makes two requests the same question."""
    kept = {name: value for name, value in body.items() if name not in FRAMING}
    digest = hashlib.sha256()
    for part in (path, owner, work):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    _feed(digest, kept)
    return digest.hexdigest()


def _feed(digest: "hashlib._Hash", value: object) -> None:
    """Hash a parsed body canonically (object keys sorted) without writing it out: a body of
    tens of megabytes is not copied whole a second time. Each value is tagged and each text
    length-prefixed, so no two bodies feed the same bytes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            digest.update(b"{%d" % len(item))
            for name in sorted(item, reverse=True):   # popped in sorted order
                stack.append(item[name])
                stack.append(_Key(name))
        elif isinstance(item, list):
            digest.update(b"[%d" % len(item))
            stack.extend(reversed(item))
        elif isinstance(item, (str, _Key)):
            text = str(item)
            digest.update(b"k" if isinstance(item, _Key) else b"s")
            digest.update(b"%d:" % len(text))
            for at in range(0, len(text), _SLICE):
                digest.update(text[at:at + _SLICE].encode("utf-8", "surrogatepass"))
        else:   # numbers, booleans, null: their JSON
            digest.update(b"v" + json.dumps(item).encode() + b";")


class _Key(str):
    """An object's key, hashed apart from a string value."""


def generate(handler: Answering, exchange: Exchange[R], body: dict,
             headers: Optional[dict[str, str]] = None) -> None:
    """One generation, as a job (serve/service/jobs.py): blocking (one JSON body) or streamed,
    as the exchange's request says. The job is started (or attached to: an identical request,
    `body` as the job key reads it, whose reply never reached its client), its events are
    followed into the exchange (serve/http/sinks.py), and the answer goes out through the
    handler. `headers` go with the reply, not with an error in its place."""
    current = handler.current
    current.reply_headers = dict(headers or {})
    job, attached, reader = start_job(handler, exchange, body, handler.client_left)
    if attached:
        handler.server.log_line(f"{handler.request_id} attached to {job.id}, "
                                "the same request's job")
    answer = ExchangeSink(handler, exchange, job, reader, handler.client_left).follow()
    current.tokens, current.timing = answer.tokens, answer.timing
    if answer.body is not None:
        handler.send_json(answer.status, answer.body, current.reply_headers)
    else:
        current.status = answer.status


def start_job(handler: Answering, exchange: Exchange[R], body: Optional[dict],
              client_left: Callable[[], bool]) -> tuple[Job[R], bool, int]:
    """The request's job, new or attached to (`body` None: never attached), and the caller's
    reader number in it; its id goes with the reply (X-Serve-Job)."""
    server, current = handler.server, handler.current
    if exchange.left_out:
        server.log_line(f"{current.path}: tools left out (the server cannot run them): "
                        f"{', '.join(exchange.left_out)}")
    server.note_unread(current.path, exchange.ignored)
    # The one place the parsed request is completed, before the job sees it: what it leaves
    # behind is its sender's (never named by the key: serve/http/auth.py), and its class is
    # decided here, at the edge, from the neutral request and the header.
    request = exchange.request
    request.request_id = handler.request_id
    request.owner = current.principal.namespace
    decision = server.service.classifier.classify(request, handler.headers.get(CLASS_HEADER))
    request.work = decision.work
    if decision.why:
        server.log_line(f"{handler.request_id} {decision.work} ({decision.why})")
    service = server.models.pick(current.named_model, request)
    exchange.model = service.options.model_id   # the replies name the model that answers
    if len(server.models.services) > 1:
        current.answered_by = f" model={exchange.model}"
    key = job_key(current.path, handler.owner, decision.work, body) if body is not None \
        else new_id("unshared")
    job, attached, reader = server.models.jobs.start(
        key, handler.owner, exchange.model, service.new_journal(), _work(service, exchange),
        client_left)
    current.reply_headers["X-Serve-Job"] = job.id
    return job, attached, reader


def _work(service: Service, exchange: Exchange[R]) -> Callable[[Journal], R]:
    """What the job's thread runs: the service's chat or completion, as the parsed request
    is (looked up on the service when it runs: a test may replace it on the instance)."""
    request = exchange.request

    def work(journal: Journal) -> Any:   # the exchange's R: a completion's reply, or a chat's
        if isinstance(request, CompletionRequest):
            return service.complete(request, journal)
        return service.chat(request, journal)
    return work
