"""The HTTP surface over real sockets, scripted engine: routes, methods, one log line a request."""
from __future__ import annotations

import re
import time

from scripted import assert_error, call, engine, scripted_service, server, serving
from serve.dialects import anthropic
from serve.core.errors import ApiError
from serve.http.routes import ROUTES, endpoint_label, find_route, nearest_route

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# ---- discovery --------------------------------------------------------------

def test_health_and_models(server, engine):
    nothing = {"queue": 0, "longest_wait_s": 0.0, "waits": 0, "wait_s": 0.0, "engine_s": 0.0}
    assert call(server.port, "GET", "/health").json() == {
        "status": "ok", "warming": None, "idle": True, "busy": False, "queue": 0, "deferred": False,
        "work": {"running": None, "preemptions": 0, "interactive": nothing, "background": nothing}}
    models = call(server.port, "GET", "/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    model = models["data"][0]
    assert model["id"] == "scripted" and model["object"] == "model" and model["owned_by"] == "serve"
    assert isinstance(model["created"], int)
    assert model["waste"] == {"arch": "scripted", "n_layers": 4, "n_experts": 16, "top_k": 2,
                              "hidden": 64, "ctx": engine.info.ctx_max, "params_total": 1000,
                              "params_active": 300, "quant": "experts q8g32",
                              "chat_format": "xtml", "vision": False}
    assert call(server.port, "GET", "/v1/models/scripted").json() == model


def test_unknown_model_path_and_method(server):
    assert_error(call(server.port, "GET", "/v1/models/other"), 404, param="model",
                 code="model_not_found")
    assert_error(call(server.port, "GET", "/v1/nothing"), 404)
    assert_error(call(server.port, "GET", CHAT), 405)
    assert_error(call(server.port, "POST", "/health", b"{}"), 405)
    assert_error(call(server.port, "DELETE", "/v1/models"), 405)
    assert_error(call(server.port, "OPTIONS", CHAT), 405)


def test_each_request_logs_one_line(engine):
    lines = []
    with serving(scripted_service(engine), log=lines.append) as srv:
        call(srv.port, "GET", "/health")
        call(srv.port, "POST", CHAT, {"messages": USER})
        # The line is written once the reply is out, so the client can be first.
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    # Each handler thread logs after replying, so the two lines may land in either order.
    assert len(lines) == 2
    health, chat = sorted(lines, key=lambda line: "POST" in line)
    assert "GET /health 200" in health
    assert "POST /v1/chat/completions 200" in chat and "tokens=" in chat
    # A generation's line says where its time went; others have nothing to add.
    # The scripted engine reads 4,096 bytes of experts a token, half a millisecond's worth.
    assert re.search(r"id=req-\w+ \(engine at \d+ms, prompt [1-9]\d* \(0 restored\), "
                     r"first token at \d+ms, experts read \d+\.\d MB in \d+ms\)$", chat), chat
    assert "(" not in health.split("id=")[1]


def test_one_route_table_answers_dispatch_labels_and_error_shapes():
    assert endpoint_label("/v1/responses/resp_1") == "/v1/responses/{id}"
    assert find_route("/v1/responses/resp_1").match("/v1/responses/resp_1") == "resp_1"
    # An id is one path segment: what follows it is another endpoint, or none.
    assert endpoint_label("/v1/responses/resp_1/input_items") == "/v1/responses/{id}/input_items"
    assert find_route("/v1/responses/resp_1/other") is None and find_route("/v1/responses/") is None
    assert find_route("/v1/responses/cancel").path == "/v1/responses/{id}"
    assert endpoint_label("/v1/models/any") == "/v1/models/{model}"
    assert endpoint_label("/v1/chat/completions") == "/v1/chat/completions"
    assert find_route("/v1/nothing") is None and endpoint_label("/v1/nothing") == "other"
    # A path under an API's endpoint is answered in that API's error shape.
    assert nearest_route("/v1/messages/batches").errors is anthropic.error_body
    assert nearest_route("/v1/nothing").errors is ApiError.body
    # A target that is no path has a nearest route too (it raised, leaving a request in flight).
    assert nearest_route("*").path == nearest_route("http://x/health").path == "/"
    labels = [route.label or route.path for route in ROUTES]
    assert len(labels) == len(set(labels))


def test_the_handler_sets_only_the_attributes_its_contract_names(engine, monkeypatch):
    from serve.http.server import Handler
    seen: list[set[str]] = []
    finish = Handler.finish
    monkeypatch.setattr(Handler, "finish", lambda self: (seen.append(set(vars(self))), finish(self)))
    with serving(scripted_service(engine)) as srv:
        call(srv.port, "GET", "/health")
        call(srv.port, "POST", CHAT, {"messages": USER, "stream": True})
        call(srv.port, "BREW", "/nothing")
    # The standard library's own, then those the docstring of Handler names.
    standard = {"request", "client_address", "server", "connection", "rfile", "wfile",
                "raw_requestline", "requestline", "command", "path", "request_version", "headers",
                "close_connection", "_headers_buffer"}
    assert len(seen) == 3
    for names in seen:
        assert names - standard == {"timeout", "deadline", "current", "_refused", "_hangup"}
    assert all(f"`{name}`" in Handler.__doc__ for name in ("timeout", "rfile", "deadline", "current",
                                                            "_refused", "_hangup"))
