"""logprobs, computed by serve from waste_eval's logits, checked against the same computation
done here straight from waste_eval; and the eval loop's stop on a vanished client."""
from __future__ import annotations

import math

import pytest

from scripted import assert_error, call, real_service, serving
from serve.dialects.openai_request import parse_chat_request
from serve.engine.decode import token_text
from serve.engine.binding import Engine, EngineConfig
from serve.service.journal import Emitted, Event

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Why is the sky blue?"}]
PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def service(lib_path, k3_container):
    with real_service(lib_path, k3_container, thinking=False) as svc:
        yield svc


@pytest.fixture(scope="module")
def k3(service):
    with serving(service) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(lib, k3_container):
    """(engine, token id by its logprobs name) for replaying a reply through waste_eval."""
    with Engine(lib, k3_container, EngineConfig()) as engine:
        n_vocab = len(engine.eval(engine.tokenize("x", add_bos=True)))
        engine.reset()
        names = {token_text(engine.detokenize([i])): i for i in range(n_vocab)}
        yield engine, names


def log_softmax(logits, temperature: float) -> list[float]:
    scaled = [x / (temperature or 1.0) for x in logits]
    top = max(scaled)
    total = math.log(sum(math.exp(x - top) for x in scaled)) + top
    return [x - total for x in scaled]


def replay(engine, prompt: list[int], tokens: list[int], temperature: float) -> list[list[float]]:
    """The log-softmax before each generated token, straight from waste_eval."""
    engine.reset()
    out, logits = [], engine.eval(prompt)
    for token in tokens:
        out.append(log_softmax(logits, temperature))
        logits = engine.eval([token])
    return out


def check_entries(entries: list[dict], expected: list[list[float]], names: dict, top: int) -> None:
    for entry, logprobs in zip(entries, expected, strict=True):
        token = names[entry["token"]]
        assert entry["logprob"] == pytest.approx(logprobs[token], abs=1e-4)
        best = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])[:top]
        assert [names[t["token"]] for t in entry["top_logprobs"]] == best
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [logprobs[i] for i in best], abs=1e-4)
        assert bytes(entry["bytes"]) == token_text_bytes(entry["token"], entry["bytes"])


def token_text_bytes(name: str, raw: list[int]) -> bytes:
    return name.encode() if not name.startswith("bytes:") else bytes(raw)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_logprobs_match_waste_eval(k3, service, reference, temperature):
    engine, names = reference
    body = {"messages": USER, "max_tokens": 8, "temperature": temperature, "seed": 9,
            "logprobs": True, "top_logprobs": 3}
    reply = call(k3.port, "POST", CHAT, body).json()
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) == reply["usage"]["completion_tokens"] == 8
    assert "".join(bytes(e["bytes"]).decode("utf-8", "replace") for e in entries) \
        == reply["choices"][0]["message"]["content"]
    req = parse_chat_request(body)
    fmt = service.chat_format
    prompt = engine.tokenize_segments(fmt.render(req.messages, thinking=False, add_generation_prompt=False).segments) \
        + engine.tokenize_segments(fmt.generation_prompt(False))
    tokens = [names[e["token"]] for e in entries]
    check_entries(entries, replay(engine, prompt, tokens, temperature), names, 3)
    # Streamed: the same entries, spread over the chunks beside the text they make.
    events = call(k3.port, "POST", CHAT, {**body, "stream": True}).events()
    streamed = [e for ev in events[:-1] if ev["choices"] and ev["choices"][0]["logprobs"]
                for e in ev["choices"][0]["logprobs"]["content"]]
    assert streamed == entries
    assert all(ev["choices"][0]["logprobs"]["refusal"] is None for ev in events[:-1]
               if ev["choices"] and ev["choices"][0]["logprobs"])


def test_completion_logprobs_match_waste_eval(k3, reference):
    engine, names = reference
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.7, "seed": 2, "logprobs": 2}
    reply = call(k3.port, "POST", "/v1/completions", body).json()
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens = [names[t] for t in lp["tokens"]]
    expected = replay(engine, engine.tokenize(PROMPT, add_bos=True), tokens, 0.7)
    for token, logprob, top, logprobs in zip(tokens, lp["token_logprobs"], lp["top_logprobs"], expected):
        assert logprob == pytest.approx(logprobs[token], abs=1e-4)
        best = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])[:2]
        # The top 2 and, always, the sampled token.
        assert {names[t] for t in top} == {*best, token}
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    events = call(k3.port, "POST", "/v1/completions", {**body, "stream": True}).events()
    chunks = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == lp["text_offset"]


def test_without_logprobs_the_field_is_null_and_the_engine_path_is_used(k3):
    reply = call(k3.port, "POST", CHAT, {"messages": USER, "max_tokens": 3, "seed": 1}).json()
    assert reply["choices"][0]["logprobs"] is None and reply["waste"]["constrained"] is False


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"logprobs": "yes"}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_fields_are_a_400(k3, path, body, param):
    base = {"messages": USER} if path == CHAT else {"prompt": PROMPT}
    assert_error(call(k3.port, "POST", path, {**base, "max_tokens": 2, **body}), 400, param=param)


class LeavesAfter:
    """A Listener whose client leaves after `n` deltas."""

    def __init__(self, n: int):
        self.n, self.deltas = n, []

    def take(self, event: Event) -> None:
        if isinstance(event, Emitted):
            self.deltas.append(event.delta)

    def client_left(self) -> bool:
        return len(self.deltas) >= self.n


@pytest.mark.parametrize("extra", [{"logprobs": True},
                                   {"response_format": {"type": "json_object"}}])
def test_the_eval_loop_stops_when_the_client_left(service, extra):
    req = parse_chat_request({"messages": USER, "max_tokens": 50, "temperature": 0, "seed": 1, **extra})
    sink = LeavesAfter(3)
    reply = service.chat(req, sink)
    # The token callback asks at most once a millisecond (ASK_EVERY_S), and the demo
    # model decodes several tokens in one: a few deltas may follow the third.
    assert reply.client_left and 3 <= len(sink.deltas) < 50
    assert reply.usage.completion_tokens < 50


def test_the_eval_loop_decodes_what_waste_generate_decodes(k3):
    """Greedy (or top_k 1 at any temperature) in serve's loop gives the engine's own answer."""
    ask = {"messages": USER, "max_tokens": 24, "seed": 3}
    engine_greedy = call(k3.port, "POST", CHAT, {**ask, "temperature": 0}).json()
    assert engine_greedy["waste"]["constrained"] is False
    for sampling in ({"temperature": 0}, {"temperature": 1.3, "top_k": 1}):
        ours = call(k3.port, "POST", CHAT, {**ask, **sampling, "logprobs": True}).json()
        assert ours["choices"][0]["message"] == engine_greedy["choices"][0]["message"]
        assert ours["choices"][0]["finish_reason"] == engine_greedy["choices"][0]["finish_reason"]
