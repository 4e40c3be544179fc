"""`/tokenize` and `/detokenize` (and `/v1/tokenize`, `/v1/detokenize`): the ids a request
would be fed as, by the model that would answer it (serve/dialects/tokenize.py, the shapes;
serve/service/tokens.py, the ids). Nothing here waits for the engine when serve's own
tokenizer is in use."""
from __future__ import annotations

from serve.dialects import tokenize as shapes
from serve.http.answering import Answering
from serve.service import tokens


def tokenize(handler: Answering, method: str, rest: str) -> None:
    ask = shapes.parse_tokenize(handler.read_json())
    handler.server.note_unread(handler.current.path, list(ask.ignored))
    models = handler.server.models
    if ask.chat is not None:
        # As a generation is picked: a chore goes to the chores model, whose ids they are.
        request = ask.chat
        request.request_id = handler.request_id
        request.work = handler.server.service.classifier.classify(request, None).work
        service = models.pick(handler.current.named_model, request)
        ids = tokens.chat_ids(service, request, generation_prompt=ask.generation_prompt,
                              bos=ask.bos)
    else:
        assert ask.text is not None   # a form without messages carries its text
        service = models.named(handler.current.named_model) or models.main
        ids = tokens.text_ids(service, ask.text, param=ask.param, bos=ask.bos, markup=ask.markup)
    pieces = tokens.pieces(service, ids) if shapes.wants_pieces(ask) else []
    handler.send_json(200, shapes.tokenize_reply(ask, ids, pieces, service.engine.info.ctx_max))


def detokenize(handler: Answering, method: str, rest: str) -> None:
    ids, ignored = shapes.parse_detokenize(handler.read_json())
    handler.server.note_unread(handler.current.path, list(ignored))
    models = handler.server.models
    service = models.named(handler.current.named_model) or models.main
    text = b"".join(tokens.pieces(service, ids)).decode("utf-8", "replace")
    handler.send_json(200, shapes.detokenize_reply(text))
