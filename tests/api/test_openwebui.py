"""Replays what Open-WebUI sends: a model probe, then a streamed chat with its extra fields."""
from __future__ import annotations

import pytest

from scripted import ScriptedEngine, call, real_service, scripted_service, serving, xtml_answer

# Open-WebUI always sends a bearer token, configured or not.
HEADERS = {"Authorization": "Bearer sk-openwebui", "User-Agent": "open-webui"}


def openwebui_chat(model: str, penalties: bool) -> dict:
    """A chat as Open-WebUI sends it; the penalties only when its user set them (serve's own
    decoder applies them: a script, which has no logits, would refuse them)."""
    body = {"model": model, "stream": True,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": "Why is the sky blue?"}],
            "user": "user-42", "stream_options": {"include_usage": True}, "max_tokens": 10,
            "temperature": 0.8, "metadata": {"chat_id": "abc"}}
    return {**body, "frequency_penalty": 0.2, "presence_penalty": 0.1} if penalties else body


def replay(port: int, penalties: bool = True) -> list:
    models = call(port, "GET", "/v1/models", headers=HEADERS)
    assert models.status == 200
    model = models.json()["data"][0]["id"]
    resp = call(port, "POST", "/v1/chat/completions", openwebui_chat(model, penalties),
                headers=HEADERS)
    assert resp.status == 200, resp.body
    assert resp.headers["content-type"] == "text/event-stream"
    return resp.events()


def test_scripted_reply_streams_reasoning_then_content():
    engine = ScriptedEngine([xtml_answer("Rayleigh", " scattering.", thinking=["Short ", "waves."])])
    with serving(scripted_service(engine)) as srv:
        events = replay(srv.port, penalties=False)
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Short waves."
    assert "".join(d.get("content", "") for d in deltas) == "Rayleigh scattering."
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] > 0
    assert events[-1] == "[DONE]"
    assert engine.params[0].temperature == pytest.approx(0.8)


def test_real_engine_with_configured_key(lib_path, k3_container):
    with real_service(lib_path, k3_container) as service, \
            serving(service, api_key="sk-openwebui") as srv:
        events = replay(srv.port)
        assert call(srv.port, "GET", "/v1/models").status == 401  # the key is really enforced
    finish = [e["choices"][0]["finish_reason"] for e in events if e != "[DONE]" and e["choices"]]
    assert finish[-1] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 10
