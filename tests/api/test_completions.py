"""POST /v1/completions over real sockets, scripted engine."""
from __future__ import annotations

import pytest

from scripted import assert_error, call, engine, scripted_service, server, serving

# ---- completions ------------------------------------------------------------

def test_completion_blocking_and_streaming(engine):
    engine.replies = [["Once", " upon", "[EOS]"]]
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", "/v1/completions", {"prompt": ["Tell me"], "max_tokens": 10}).json()
        events = call(srv.port, "POST", "/v1/completions", {"prompt": "Tell me", "stream": True,
                                                            "stream_options": {"include_usage": True}}
                      ).events()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0] == {"index": 0, "text": "Once upon", "logprobs": None,
                                  "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 3
    # Raw continuation: the prompt is ordinary text after a BOS, no template.
    assert engine.prompts[0] == [engine.specials["[BOS]"]] + list(b"Tell me")
    assert engine.params[0].stop_tokens == ()
    texts = [e["choices"][0]["text"] for e in events[:-3]]
    assert "".join(texts) == "Once upon" and all(texts)   # a token each, or gathered
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("prompt", [None, 5, ["a", "b"], [1, 2]])
def test_completion_prompt_is_validated(server, prompt):
    assert_error(call(server.port, "POST", "/v1/completions", {"prompt": prompt}), 400, param="prompt")


def test_echo_puts_the_prompt_first(engine):
    """echo (OpenAI's legacy completions, vLLM): the text begins with the prompt, blocking and
    streamed; the engine still sees the prompt once, and usage counts only what it generated."""
    engine.replies = [["Once", " upon", "[EOS]"], ["Once", " upon", "[EOS]"]]
    with serving(scripted_service(engine)) as srv:
        body = call(srv.port, "POST", "/v1/completions",
                    {"prompt": "Tell me", "echo": True, "max_tokens": 10}).json()
        events = call(srv.port, "POST", "/v1/completions",
                      {"prompt": "Tell me", "echo": True, "stream": True}).events()
        refused = call(srv.port, "POST", "/v1/completions",
                       {"prompt": "Tell me", "echo": True, "logprobs": 1})
        plain = call(srv.port, "POST", "/v1/completions", {"prompt": "Tell me", "echo": False})
    assert body["choices"][0]["text"] == "Tell meOnce upon"
    assert body["usage"]["completion_tokens"] == 3
    assert engine.prompts[0] == engine.prompts[1] == [engine.specials["[BOS]"]] + list(b"Tell me")
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    assert texts[0] == "Tell me" and "".join(texts[1:]) == "Once upon"   # the echo first, alone
    assert_error(refused, 400, param="echo")
    assert plain.status == 200 and not plain.json()["choices"][0]["text"].startswith("Tell me")


@pytest.mark.parametrize("field, value", [("echo", 1), ("echo", "yes"), ("echo", 0),
                                          ("best_of", "2"), ("best_of", True), ("best_of", 3),
                                          ("suffix", "end")])
def test_completion_options_it_cannot_honour_or_read_are_a_400(server, field, value):
    """echo 1 is not a boolean (it would pass unechoed); best_of must be an integer, 1."""
    resp = call(server.port, "POST", "/v1/completions", {"prompt": "Tell me", field: value})
    assert_error(resp, 400, param=field)
